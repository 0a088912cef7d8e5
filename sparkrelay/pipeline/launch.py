"""Starting, watching and stopping the processes of stages 1..N-1 (stage 0 runs in the engine's own
process).

    rank 0: TCPStore server on 127.0.0.1:PORT (rendezvous_store) -> spawn `python -m sparkrelay.pipeline.worker
            --rank r ...` for r = 1..N-1 -> wait for `ready/r` in the store (a load error arrives as `error/r`; a
            process that exits is noticed too) -> join the process group -> start the watchdog
    worker: see pipeline/worker.py

The launch record (config, dtype, partition, KV blocks, capture, sink factory, backend, threads,
parent pid) goes in the SPARKRELAY_PP_LAUNCH environment variable as JSON, not on argv, so the
config's api_key is not shown by `ps`. Every stage runs on this host, so every socket of the
pipeline binds the loopback (RENDEZVOUS_HOST): the store's listening socket (torch's TCPStore server
would listen on every interface whatever host it is given, so rank 0 binds the socket itself and
hands it over) and NCCL's bootstrap (NCCL_SOCKET_IFNAME defaults to the loopback interface); without
NCCL the stages' sockets are ipc:// files in a private folder (pipeline/comm.py). The watchdog polls
the processes; when one exits unasked it records "pipeline stage r (pid N) exited with code X" and
kills the others, so every blocked send or receive on every rank fails at once instead of hanging.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

LAUNCH_ENV = "SPARKRELAY_PP_LAUNCH"
LOAD_TIMEOUT_S = 300.0  # a stage that has not loaded its layers by then fails the engine start
STOP_TIMEOUT_S = (
    10.0  # close(): a worker still alive this long after the shutdown descriptor is killed
)
PEER_LOST_EXIT = (
    3  # a worker's exit code when it stops because another rank went away (not a root cause)
)


RENDEZVOUS_HOST = "127.0.0.1"  # the store listens here, and only here
LOOPBACK_IFNAME = "lo"  # its interface, for NCCL (NCCL_SOCKET_IFNAME, when the user has not set it)


def rendezvous_store(port: Optional[int], world: int) -> dist.TCPStore:
    """Rank 0's TCPStore server on RENDEZVOUS_HOST:port (port None or 0: a free one; `store.port`
    says which).

    The listening socket is bound here and handed to the store (`master_listen_fd`, which then owns
    and closes it): given only a host, TCPStore listens on every interface. OSError naming
    --dist-init-port if it is taken."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # as TCPStore does: a TIME_WAIT port is free
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((RENDEZVOUS_HOST, port or 0))
        sock.listen(socket.SOMAXCONN)
    except OSError as e:
        sock.close()
        what = f"--dist-init-port {port}" if port else "the pipeline rendezvous"
        raise OSError(
            e.errno,
            f"{what}: cannot listen on {RENDEZVOUS_HOST}:{port or 0} ({e.strerror}); "
            "is another server using it?",
        ) from None
    bound = sock.getsockname()[1]
    return dist.TCPStore(
        RENDEZVOUS_HOST,
        bound,
        world,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=LOAD_TIMEOUT_S),
        master_listen_fd=sock.detach(),
    )


def worker_env(launch_json: str) -> dict[str, str]:
    """The parent's environment, its import path (so workers import the same code), and the launch
    record."""
    env = dict(os.environ)
    paths = [os.path.abspath(p or os.curdir) for p in sys.path]
    env["PYTHONPATH"] = os.pathsep.join(
        paths + [env["PYTHONPATH"]] if env.get("PYTHONPATH") else paths
    )
    env[LAUNCH_ENV] = launch_json
    return env


class Workers:
    def __init__(self, world: int, port: int, launch_json: str) -> None:
        self.world, self.port = world, port
        env = worker_env(launch_json)
        self.procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "sparkrelay.pipeline.worker",
                    "--rank",
                    str(r),
                    "--world-size",
                    str(world),
                    "--port",
                    str(port),
                ],
                env=env,
                stdin=subprocess.DEVNULL,
            )
            for r in range(1, world)
        ]
        self.failure: Optional[str] = None
        self._stopping = threading.Event()
        self._watchdog: Optional[threading.Thread] = None

    @property
    def pids(self) -> list[int]:
        """pids[r - 1] is stage r's process."""
        return [p.pid for p in self.procs]

    def wait_ready(self, store: dist.Store, timeout: float = LOAD_TIMEOUT_S) -> None:
        """Block until every stage has loaded; raise RuntimeError naming the first stage that
        failed."""
        deadline, waiting = time.monotonic() + timeout, set(range(1, self.world))
        while waiting:
            for r in sorted(waiting):
                proc = self.procs[r - 1]
                if store.check([f"error/{r}"]):
                    msg = store.get(f"error/{r}").decode()
                    raise RuntimeError(f"pipeline stage {r} (pid {proc.pid}) failed to load: {msg}")
                if store.check([f"ready/{r}"]):
                    waiting.discard(r)
                elif proc.poll() is not None:
                    raise RuntimeError(
                        f"pipeline stage {r} (pid {proc.pid}) exited with code {proc.returncode} "
                        "while loading"
                    )
            if waiting and time.monotonic() > deadline:
                raise RuntimeError(
                    f"pipeline stage(s) {sorted(waiting)} not loaded after {timeout:.0f} s"
                )
            time.sleep(0.02)

    def watch(self) -> None:
        self._watchdog = threading.Thread(
            target=self._watch, name="sparkrelay-pp-watchdog", daemon=True
        )
        self._watchdog.start()

    def _watch(self) -> None:
        while not self._stopping.wait(0.05):
            dead = [(r, p) for r, p in enumerate(self.procs, start=1) if p.poll() is not None]
            if dead and not self._stopping.is_set():
                # neighbours of a dead stage follow it out with PEER_LOST_EXIT: name the root cause
                r, proc = next(((r, p) for r, p in dead if p.returncode != PEER_LOST_EXIT), dead[0])
                self.failure = (
                    f"pipeline stage {r} (pid {proc.pid}) exited with code {proc.returncode}"
                )
                self.kill()
                return

    def check(self) -> None:
        """Raise RuntimeError when a stage has died (NCCL waits poll this)."""
        if self.failure is not None:
            raise RuntimeError(self.failure)

    def down_message(self, error: BaseException, wait_s: float = 2.0) -> str:
        """After a failed send/receive: the dead stage, once the watchdog has seen it exit (up to
        `wait_s`)."""
        deadline = time.monotonic() + wait_s
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(0.02)
        self.kill()
        return self.failure or f"pipeline communication failed: {error}"

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Wait for the workers to exit (after a shutdown descriptor), kill what remains, reap
        everything."""
        self._stopping.set()
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._watchdog is not None:
            self._watchdog.join()
