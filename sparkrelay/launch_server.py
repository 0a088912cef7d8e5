"""`python -m sparkrelay.launch_server --model-path DIR [--port N ...]`: build the engine and serve
HTTP.

Flags are generated from sparkrelay.config (grouped by config section, with their defaults); the
environment variables come from sparkrelay.envs. A bad flag or setting, and a port another process
holds, print a message naming the flag and exit 2, before the model loads. The HTTP socket is bound
before the model loads too, so no other process can take the port meanwhile.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import socket
import sys
from typing import Optional

from sparkrelay.config import Config, ConfigError, add_cli_args, config_from_args
from sparkrelay.envs import env_help

PROG = "python -m sparkrelay.launch_server"
EPILOG = f"""\
environment variables (PD disaggregation; the SPARKRELAY_ name wins when both it and its SGLANG_ alias are set):
{env_help()}
other variables:
  SPARKRELAY_TRACE=DIR
      every process (servers, pipeline stages, router) appends per-request timeline events to DIR/*.jsonl
      (sparkrelay/trace/timeline.py; bench_pd's TTFT breakdown reads them)
  GOMP_SPINCOUNT, OMP_WAIT_POLICY (libgomp's; unset: 1000 spins on a PD server or with --pp-size > 1, whose
      processes share the host's cores, libgomp's default otherwise; launch_server.openmp_policy says why)
  ONEDNN_PRIMITIVE_CACHE_CAPACITY, LRU_CACHE_CAPACITY (default 64 each)
      oneDNN's kernel caches, one entry per input shape (sparkrelay/models/kernels.py)
  SPARKRELAY_CPU_KERNELS=0
      bfloat16 linears on oneDNN instead of sparkrelay's AVX-512 (or AVX2) kernels (docs/cpu_kernels.md);
      SPARKRELAY_KERNEL_BUILD=DIR: where set-up builds them (default build/cpu_kernels);
      SPARKRELAY_CPU_AMX=0: the kernels' products on the vector path, not on AMX

docs: README.md (quick start), docs/dspark_pd.md (PD + DSpark: how to run, every PD flag, the handoff modes),
docs/reliability.md (failures, bind address, auth token), docs/architecture.md (code map). Model folders are
local: nothing is downloaded (`huggingface-cli download ORG/NAME --local-dir DIR`, then --model-path DIR).
"""


class StartupError(RuntimeError):
    """The server could not start (the engine's own build error, or uvicorn's)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} [--model-path DIR] [--port N] [options]",
        description="Serve a model over HTTP (SGLang-native and OpenAI APIs).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_cli_args(parser)
    return parser


def parse_config(argv: Optional[list[str]] = None) -> Config:
    parser = build_parser()
    args = parser.parse_args(argv)  # unknown flag or bad value: argparse names it and exits 2
    try:
        config = config_from_args(args)
        check_ports(config)
        check_addresses(config)
    except ConfigError as e:
        parser.error(str(e))  # exits 2
    return config


def listened_ports(config: Config) -> list[tuple[str, str, str, int]]:
    """(port flag, host flag, host, port) of every fixed port this server listens on (the rest are
    picked free)."""
    if config.parallel.node_rank > 0:
        return []  # a stages-only node listens only where node 0 tells it to (pipeline/comm.py WirePlan)
    out = [("--port", "--host", config.server.host, config.server.port)]
    dc, pc = config.disagg, config.parallel
    if dc.disaggregation_mode == "prefill":
        out.append(
            (
                "--disaggregation-bootstrap-port",
                "--disaggregation-bootstrap-host",
                dc.disaggregation_bootstrap_host,
                dc.disaggregation_bootstrap_port,
            )
        )
    if pc.pp_size > 1 and pc.dist_init_port is not None:
        # imports torch: only when there is a pipeline
        from sparkrelay.pipeline.launch import (
            RENDEZVOUS_HOST,
        )

        out.append(("--dist-init-port", "", RENDEZVOUS_HOST, pc.dist_init_port))
    if pc.nnodes > 1 and pc.node_rank == 0:
        out.append(("--dist-init-addr", "--dist-init-addr", *pc.init_host_port()))
    return out


def check_addresses(config: Config) -> None:
    """A PD server must be able to tell its peers where it is (docs/pd_across_hosts.md): a wildcard
    --disaggregation-bootstrap-host needs SPARKRELAY_HOST_IP; a ConfigError naming both before any port is
    bound."""
    if config.disagg.disaggregation_mode == "null":
        return
    from sparkrelay.envs import DisaggEnv
    from sparkrelay.transfer.wire import check_advertised

    check_advertised(config.disagg.disaggregation_bootstrap_host, DisaggEnv.read().host_ip)


def bind(flag: str, host_flag: str, host: str, port: int) -> socket.socket:
    """A TCP socket bound (not yet listening) to host:port; ConfigError naming the flag at fault
    otherwise."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ConfigError(f"{host_flag} {host!r}: cannot resolve it ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    # as the servers do: TIME_WAIT does not count
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # accepted connections inherit it (asyncio sets it
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # only when the socket's proto is IPPROTO_TCP; without it a reply's body waits for the delayed
    # ACK of its headers)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"{flag} {port}: {host}:{port} is already in use (is another server running?); "
                f"choose another {flag}"
            ) from None
        raise ConfigError(
            f"{flag} {port}: cannot bind {host}:{port} ({e.strerror}); check {host_flag or flag}"
        ) from None
    return sock


def check_ports(config: Config) -> None:
    """Every fixed port is free and used by one flag only (ConfigError naming the flag
    otherwise)."""
    seen: dict[int, str] = {}
    for flag, host_flag, host, port in listened_ports(config):
        if port in seen:
            raise ConfigError(f"{flag} {port} is also {seen[port]}; give each its own port")
        seen[port] = flag
        bind(flag, host_flag, host, port).close()


def _uvicorn_server(app, config: Config):
    """uvicorn's Server, serving the socket bound before the model loaded; with a given socket
    uvicorn logs no "Uvicorn running on" line (the one users wait for), so this one does, once
    listening."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                host = config.server.host
                url = (
                    f"http://[{host}]:{config.server.port}"
                    if ":" in host
                    else f"http://{host}:{config.server.port}"
                )
                logging.getLogger("uvicorn.error").info(
                    "Uvicorn running on %s (Press CTRL+C to quit)", url
                )

    return Server(
        uvicorn.Config(
            app,
            host=config.server.host,
            port=config.server.port,
            log_level=config.server.log_level,
            timeout_graceful_shutdown=5,
        )
    )  # a dying server does not wait on silent clients


def serve(config: Config) -> None:
    """The engine in its scheduler process (manager/process.py), uvicorn in this one."""
    from sparkrelay import host
    from sparkrelay.manager.process import EngineProcess
    from sparkrelay.server.http_server import build_app

    # held while the model loads
    sock = bind("--port", "--host", config.server.host, config.server.port)
    try:
        engine = EngineProcess.launch(config, inherited=(sock.fileno(),))
    except BaseException:
        sock.close()
        raise
    cores = host.plan(config)
    if cores is not None:  # after the fork: the scheduler process keeps every core
        host.pin_process(cores[1])
    try:
        app = build_app(engine, config)
        server = _uvicorn_server(app, config)
        server.run(sockets=[sock])
        if not server.started:
            raise StartupError("the HTTP server did not start (its error is logged above)")
    finally:
        sock.close()
        engine.stop()  # the scheduler process closes the pipeline stages, bootstrap server, transfer agents


SHARED_CORES_SPIN = "1000"  # libgomp's own figure for a process with more OpenMP threads than cores


def openmp_policy(config: Config) -> Optional[str]:
    """How long an idle OpenMP thread spins before it sleeps, set before torch loads libgomp (which
    reads it once). A PD server or a pipeline's stages share a host's cores with other engine
    processes by design; libgomp's default (300,000 spins) then keeps each idle process's threads on
    cores the busy ones need: a prefill restarting beside a serving prefill + decode pair multiplied
    the other pair's p95 latency (speed notes of docs/architecture.md). An aggregated server keeps
    the default: alone, it decodes faster spinning. A user's GOMP_SPINCOUNT or OMP_WAIT_POLICY
    always wins. Returns the value set, if any."""
    shared = config.disagg.disaggregation_mode != "null" or config.parallel.pp_size > 1
    if not shared or "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return None
    if "torch" in sys.modules:  # too late: libgomp has read its environment
        logging.getLogger(__name__).warning(
            "torch was imported before the OpenMP policy was set; not applied"
        )
        return None
    os.environ["GOMP_SPINCOUNT"] = (
        SHARED_CORES_SPIN  # the scheduler process and the stages inherit it
    )
    return SHARED_CORES_SPIN


def serve_node(config: Config) -> int:
    """--node-rank R > 0: no HTTP server and no scheduler; this host's pipeline stages, joined to node 0
    (pipeline/nodes.py). Its exit code: 0 when node 0 stopped the pipeline, non-zero when it was lost."""
    from sparkrelay.pipeline.nodes import serve_node as run_node

    return run_node(config)


def main(argv: Optional[list[str]] = None) -> int:
    config = parse_config(argv)
    logging.basicConfig(
        level=config.server.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    openmp_policy(config)
    from sparkrelay.manager.process import EngineStartError

    try:
        if config.parallel.node_rank > 0:
            return serve_node(config)
        serve(config)
    except (
        ConfigError,
        FileNotFoundError,
        OSError,
        ValueError,
        StartupError,
        EngineStartError,
    ) as e:
        print(f"error: cannot start the server: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
