"""Starting, watching and stopping the stage processes of this host (stage 0 runs in the engine's own
process; with --nnodes > 1, pipeline/nodes.py runs this on every node for its stages).

    launcher: a LoadBoard on an ipc:// file in the pipeline's private folder (and, for NCCL stages only, a
              TCPStore on 127.0.0.1:PORT, rendezvous_store) -> spawn `python -m sparkrelay.pipeline.worker
              --rank r ...` for each of its ranks -> wait for each stage's StageLoaded (a load error names the
              stage; a process that exits is noticed too) -> the wire (pipeline/comm.py) -> the watchdog
    worker: see pipeline/worker.py

The launch record (config, dtype, partition, KV blocks, capture, sink factory, backend, wire plan, threads,
parent pid, token) goes in the SPARKRELAY_PP_LAUNCH environment variable as JSON, not on argv, so the
config's api_key is not shown by `ps`. CPU stages on one host listen on no TCP port at all: the load reports
and the stage wire are ipc:// files in a 0700 folder. NCCL stages need torch's TCPStore: its listening socket is
bound on the loopback (RENDEZVOUS_HOST) here and handed over (torch's TCPStore server would listen on every
interface whatever host it is given), and NCCL's bootstrap uses the loopback interface (NCCL_SOCKET_IFNAME).
The watchdog polls the processes; when one exits unasked it records "pipeline stage r (pid N) exited with code
X" and kills the others, so every blocked send or receive on every rank fails at once instead of hanging.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import ClassVar, Optional

import torch.distributed as dist
import zmq

from sparkrelay.codec import FrameError, Message, int_in, str_max

logger = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class StageLoaded(Message):
    """stage -> its launcher: the stage loaded its layers (error "") or why it could not."""

    TYPE: ClassVar[str] = "STAGE_LOADED"
    KEY: ClassVar[str] = "rank"
    RULES: ClassVar[tuple] = (("rank", int_in(1, 1 << 16)), ("error", str_max(8192)))
    rank: int
    error: str = ""


def board_address(ipc_dir: str) -> str:
    return f"ipc://{ipc_dir}/loaded"


class LoadBoard:
    """Where the stage processes of this host report their load (StageLoaded): a PULL socket on an ipc:// file
    in the pipeline's private folder, so the pipeline listens on no TCP port for it."""

    def __init__(self, ipc_dir: str) -> None:
        self._sock = zmq.Context.instance().socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(board_address(ipc_dir))

    def take(self, timeout_s: float) -> list[StageLoaded]:
        out = []
        while self._sock.poll(timeout_s * 1000 if not out else 0):
            frames = self._sock.recv_multipart()
            try:
                out.append(StageLoaded.decode(frames))
            except FrameError as e:
                logger.error("dropped a malformed stage load report: %s", e)
        return out

    def close(self) -> None:
        self._sock.close(0)


def report_loaded(ipc_dir: str, rank: int, error: str = "") -> None:
    """A stage's one report to its launcher's LoadBoard (sent before this returns)."""
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 5000)
    sock.connect(board_address(ipc_dir))
    sock.send_multipart(StageLoaded(rank, error[:8192]).encode())
    sock.close()


class Workers:
    """The stage processes of this host: `ranks` (rank 0's host: 1..k-1; node R's: its k stages)."""

    def __init__(self, ranks: list[int], world: int, port: Optional[int], launch_json: str) -> None:
        """port: the NCCL stages' TCPStore (None: CPU stages, which meet over ipc:// only)."""
        self.ranks, self.world, self.port = ranks, world, port
        env = worker_env(launch_json)
        self.procs = {
            r: subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "sparkrelay.pipeline.worker",
                    "--rank",
                    str(r),
                    "--world-size",
                    str(world),
                    *(["--port", str(port)] if port is not None else []),
                ],
                env=env,
                stdin=subprocess.DEVNULL,
            )
            for r in ranks
        }
        self.failure: Optional[str] = None
        self._stopping = threading.Event()
        self._watchdog: Optional[threading.Thread] = None

    @property
    def pids(self) -> list[int]:
        """The stages' pids in rank order."""
        return [self.procs[r].pid for r in self.ranks]

    def wait_ready(self, board: "LoadBoard", timeout: float = LOAD_TIMEOUT_S) -> None:
        """Block until every stage has loaded; raise RuntimeError naming the first stage that
        failed."""
        deadline, waiting = time.monotonic() + timeout, set(self.ranks)
        while waiting:
            for msg in board.take(0.02):
                if msg.error:
                    pid = self.procs[msg.rank].pid if msg.rank in self.procs else "?"
                    raise RuntimeError(
                        f"pipeline stage {msg.rank} (pid {pid}) failed to load: {msg.error}"
                    )
                waiting.discard(msg.rank)
            for r in sorted(waiting):
                proc = self.procs[r]
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"pipeline stage {r} (pid {proc.pid}) exited with code {proc.returncode} "
                        "while loading"
                    )
            if waiting and time.monotonic() > deadline:
                raise RuntimeError(
                    f"pipeline stage(s) {sorted(waiting)} not loaded after {timeout:.0f} s"
                )

    def watch(self) -> None:
        self._watchdog = threading.Thread(
            target=self._watch, name="sparkrelay-pp-watchdog", daemon=True
        )
        self._watchdog.start()

    def _watch(self) -> None:
        while not self._stopping.wait(0.05):
            # code 0 is a stage that passed a shutdown descriptor on: not a failure
            dead = [(r, p) for r, p in self.procs.items() if p.poll() not in (None, 0)]
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
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Wait for the workers to exit (after a shutdown descriptor), kill what remains, reap
        everything."""
        self._stopping.set()
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._watchdog is not None:
            self._watchdog.join()
