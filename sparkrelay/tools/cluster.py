"""Start and stop a local PD deployment (router + prefill + decode, or an aggregated server) as
subprocesses on 127.0.0.1, for the demo, the benchmarks and the end-to-end tests. Each server is the
real entry point (`python -m sparkrelay.launch_server`, `python -m sparkrelay.launch_router`, or
sglang-router's)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

_HANDED_OUT: set[int] = set()
# ports handed out by any process of this user on this host, with when: a server binds its port
# seconds after it is chosen, and another process (a second deployment, a parallel test worker)
# must not be given it meanwhile
LEDGER = Path("/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir()) / (
    f"sparkrelay-ports-{os.getuid()}"
)
LEDGER_S = 600.0  # an entry older than this is forgotten: its server has bound the port, or failed
FIRST_PORT = 10000  # chosen below the kernel's ephemeral range: a bind to port 0 never takes one


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port free now, never handed out before by this process, nor in the last LEDGER_S by any
    process of this user on this host (the ledger file, under a lock), and outside the kernel's
    ephemeral range (a process binding port 0 or connecting cannot take it before its server binds
    it)."""
    end = _ephemeral_start()
    with open(LEDGER, "a+", encoding="ascii") as ledger:
        fcntl.flock(ledger, fcntl.LOCK_EX)  # released when the file is closed
        ledger.seek(0)
        now, taken = time.time(), {}
        for line in ledger.read().split():
            port, _, when = line.partition("@")
            with contextlib.suppress(ValueError):
                if now - float(when) < LEDGER_S:
                    taken[int(port)] = float(when)
        for _ in range(1000):
            port = random.randrange(FIRST_PORT, end) if end > FIRST_PORT + 1000 else _kernel_port()
            if port not in taken and port not in _HANDED_OUT and _bindable(port):
                break
        else:
            raise RuntimeError(f"no free port found in [{FIRST_PORT}, {end}) (ledger {LEDGER})")
        _HANDED_OUT.add(port)
        taken[port] = now
        ledger.seek(0)
        ledger.truncate()
        ledger.write("".join(f"{p}@{w:.3f}\n" for p, w in taken.items()))
    return port


def _kernel_port() -> int:
    """A port the kernel picks (hosts whose ephemeral range leaves no room below it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    name: str
    url: str
    proc: subprocess.Popen
    log_path: str

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def wait_for_log(self, text: str, timeout: float = 10.0, n: int = 2000) -> bool:
        """True once `text` is in the last `n` lines of the log: a peer's message may land after the
        reply."""
        deadline = time.monotonic() + timeout
        while text not in self.log_tail(n):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def stop(self, timeout: float = 15.0) -> None:
        ports = _listening_ports(self.proc.pid)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        _wait_gone(self.proc.pid, ports, 10.0)

    def kill(self) -> None:
        """SIGKILL the whole process group (the server, its scheduler process and its pipeline
        stages): a crash, not a shutdown. Returns once none of them runs and the ports they listened
        on are free."""
        ports = _listening_ports(self.proc.pid)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        _wait_gone(self.proc.pid, ports, 10.0)


def _group(pgid: int) -> list[int]:
    """The running processes of group `pgid` (zombies do not count)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, _ppid, group = f.read().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(group) == pgid and state != "Z":
            pids.append(int(entry))
    return pids


def _listens() -> list[tuple[int, str]]:
    """(port, socket inode) of every TCP socket in LISTEN state on this host, IPv4 and IPv6."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A":  # LISTEN
                    out.append((int(cols[1].rsplit(":", 1)[1], 16), cols[9]))
    return out


def _listening_ports(pgid: int) -> set[int]:
    """The TCP ports the group's processes listen on (their socket inodes looked up in
    /proc/net/tcp and tcp6)."""
    inodes = set()
    for pid in _group(pgid):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
    return {port for port, inode in _listens() if inode in inodes}


def _wait_gone(pgid: int, ports: set[int], timeout: float) -> None:
    """Until no process of the group runs and no socket listens on the ports it listened on: a
    killed process's sockets are closed after it stops running, not always before its parent reaps
    it. (Not until each port can be bound again: a transfer library's port, bound without
    SO_REUSEADDR, stays unbindable for the kernel's FIN timeout while its peers hold connections
    to it; sparkrelay's own servers bind with SO_REUSEADDR.)"""
    deadline = time.monotonic() + timeout
    while _group(pgid) or ports & {port for port, _ in _listens()}:
        if time.monotonic() > deadline:
            return
        time.sleep(0.02)


def healthy(url: str, path: str = "/health") -> bool:
    try:
        with urllib.request.urlopen(url + path, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def launch(
    name: str, argv: list[str], port: int, log_dir: str, env: Optional[dict] = None
) -> Server:
    """Run `argv` in its own process group, its output in log_dir/NAME.log; does not wait."""
    log = open(os.path.join(log_dir, f"{name}.log"), "w")
    proc = subprocess.Popen(
        argv,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
        start_new_session=True,
        stdin=subprocess.DEVNULL,
    )
    return Server(name, f"http://127.0.0.1:{port}", proc, log.name)


def wait_healthy(server: Server, timeout: float = 180.0, health: str = "/health") -> Server:
    """Until GET url+health answers 200; a server that exits or stays unhealthy past `timeout` is
    stopped and raises with its log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(
                f"{server.name} exited with code {server.proc.returncode}:\n{server.log_tail()}"
            )
        if healthy(server.url, health):
            return server
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(
        f"{server.name} did not become healthy within {timeout:.0f} s:\n{server.log_tail()}"
    )


def start(
    name: str,
    argv: list[str],
    port: int,
    log_dir: str,
    env: Optional[dict] = None,
    timeout: float = 180.0,
    health: str = "/health",
) -> Server:
    """launch, then wait_healthy."""
    return wait_healthy(launch(name, argv, port, log_dir, env), timeout, health)


@dataclass
class PDSettings:
    model: str = "models/tiny-qwen3"
    drafter: Optional[str] = "models/tiny-qwen3-dspark"
    pp_size: int = 2
    handoff: str = "hidden"
    router: str = "sparkrelay"  # sparkrelay | sglang | none
    prefill_args: list[str] = field(default_factory=list)
    decode_args: list[str] = field(default_factory=list)
    env: dict = field(default_factory=dict)  # both servers
    prefill_env: dict = field(default_factory=dict)
    decode_env: dict = field(default_factory=dict)
    router_args: list[str] = field(default_factory=list)  # appended to the router's command line


@dataclass
class PDCluster:
    prefill: Server
    decode: Server
    router: Optional[Server]
    bootstrap_port: int

    @property
    def url(self) -> str:
        return self.router.url if self.router else self.decode.url

    def servers(self) -> list[Server]:
        return [s for s in (self.router, self.decode, self.prefill) if s is not None]

    def stop(self) -> None:
        for s in self.servers():
            s.stop()


def server_argv(model: str, port: int, extra: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "sparkrelay.launch_server",
        "--model-path",
        model,
        "--port",
        str(port),
        "--log-level",
        "warning",
        *extra,
    ]


def _role_flags(s: PDSettings, role: str, boot: int) -> list[str]:
    """launch_server flags of the prefill or decode server of `s` (after the model and port)."""
    draft = ["--speculative-draft-model-path", s.drafter] if s.drafter else []
    common = ["--disaggregation-mode", role, "--disaggregation-bootstrap-port", str(boot)]
    handoff = ["--dspark-pd-handoff", s.handoff]
    if role == "prefill":
        return [*common, "--pp-size", str(s.pp_size), *draft, *handoff, *s.prefill_args]
    spec = ["--speculative-algorithm", "DSPARK", *draft] if s.drafter else []
    return [*common, *spec, *handoff, *s.decode_args]


def start_pd(s: PDSettings, log_dir: str) -> PDCluster:
    """Prefill (--pp-size, no drafter: it reads only the drafter's config, or its context weights
    for draft-kv), decode (DSpark when a drafter is given), and a router in front unless s.router ==
    'none'."""
    boot, pport, dport = free_port(), free_port(), free_port()
    # both start at once (neither needs the other to come up): their imports and model loads
    # overlap, which about halves a PD deployment's start on two cores
    prefill_argv = server_argv(s.model, pport, _role_flags(s, "prefill", boot))
    prefill = launch("prefill", prefill_argv, pport, log_dir, {**s.env, **s.prefill_env})
    decode: Optional[Server] = None
    try:
        decode_argv = server_argv(s.model, dport, _role_flags(s, "decode", boot))
        decode = launch("decode", decode_argv, dport, log_dir, {**s.env, **s.decode_env})
        wait_healthy(prefill)
        wait_healthy(decode)
    except BaseException:
        for server in (prefill, decode):
            if server is not None:
                server.stop()
        raise
    cluster = PDCluster(prefill, decode, None, boot)
    if s.router != "none":
        try:
            cluster.router = start_router(
                s.router, prefill.url, boot, decode.url, log_dir, s.router_args
            )
        except BaseException:
            cluster.stop()
            raise
    return cluster


def start_router(
    kind: str,
    prefill_url: str,
    boot: int,
    decode_url: str,
    log_dir: str,
    extra: Optional[list[str]] = None,
) -> Server:
    port = free_port()
    module = "sglang_router.launch_router" if kind == "sglang" else "sparkrelay.launch_router"
    argv = [
        sys.executable,
        "-m",
        module,
        "--pd-disaggregation",
        "--prefill",
        prefill_url,
        str(boot),
    ]
    argv += ["--decode", decode_url, "--host", "127.0.0.1", "--port", str(port)]
    if kind == "sglang":  # its metrics server binds 0.0.0.0 and a fixed port otherwise
        argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    return start(f"router-{kind}", argv + list(extra or []), port, log_dir)


def stream_generate(url: str, ids: list[int], max_new: int, ignore_eos: bool = True) -> dict:
    """One streamed greedy /generate: TTFT (first chunk), total time, tokens, acceptance."""
    body = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {
            "max_new_tokens": max_new,
            "temperature": 0.0,
            "ignore_eos": ignore_eos,
        },
    }
    req = urllib.request.Request(
        url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    start, ttft, last = time.perf_counter(), None, None
    t_send = time.monotonic()  # the clock of trace/timeline.py, for the TTFT breakdown
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            if ttft is None:
                ttft, t_first = time.perf_counter() - start, time.monotonic()
            last = json.loads(line[5:])
    total = time.perf_counter() - start
    if last is None or "error" in last:
        raise RuntimeError(f"request failed: {last}")
    meta = last["meta_info"]
    n = meta["completion_tokens"]
    return {
        "ttft_s": ttft,
        "t_send": t_send,
        "t_first": t_first,
        "total_s": total,
        "tokens": n,
        "decode_tok_s": (n - 1) / max(total - ttft, 1e-9),
        "accept_length": meta.get("spec_accept_length"),
        "output_ids": last.get("output_ids"),
    }


def generate_ids(url: str, ids: list[int], max_new: int, timeout: float = 600.0) -> dict:
    """One greedy /generate that stops at EOS: {"ids": output ids, "rounds": verify rounds (0
    without DSpark)}."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0}}
    req = urllib.request.Request(
        url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out = json.loads(r.read())
    return {"ids": out["output_ids"], "rounds": out["meta_info"].get("spec_verify_ct", 0)}


def handoff_bytes(decode_url: str) -> tuple[int, int]:
    """(all bytes the decode received from prefills, of which DSpark context + metadata rows), since
    it started."""
    with urllib.request.urlopen(decode_url + "/server_info", timeout=10) as r:
        state = json.loads(r.read())["internal_states"][0]
    return int(state.get("handoff_bytes_total", 0)), int(state.get("context_bytes_total", 0))
