"""The scheduler process: the Engine built and stepped on one thread of its own process, behind the HTTP server.

    HTTP process (uvicorn, tokenizer, EngineProcess)          scheduler process (engine_main)
    ------------------------------------------------          -------------------------------
    cmd  PUSH  --AddItems / AbortRequest / Shutdown-->  PULL   receiver thread -> EngineLoop.put (wakes the engine)
    out  PULL  <--Ready | StartFailed, Added, Progress, Fatal-- PUSH   EngineLoop.run on the main thread

Why a process: the thread that builds the engine is the one that steps it, so PyTorch runs one OpenMP team; an engine
built on one thread and stepped on another ran two, and libgomp then cut its spin-waiting (served decode was
0.67-0.79x the offline engine's). The HTTP process does no tensor work at all.

Why fork: the HTTP process needs transformers for its tokenizer, which imports torch; a spawned scheduler process
imported them all again, ~2.5 s of CPU at every start on top of the model (a 2-core host restarting a server
beside busy ones felt it). It is forked once torch, transformers and the model code are imported and the tokenizer
is loaded, before this process has any thread, ZMQ context or OpenMP team (torch starts its threads at the first
parallel op), and it closes the HTTP socket it inherits. Sockets are ipc:// files in a private
folder (0700); frames are msgpack (engine_messages.py), never pickles. The scheduler process ends when told to, or
when the HTTP process is gone (its sentinel); the HTTP process shuts down when the scheduler process dies.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
from typing import Optional

import zmq

from sparkrelay.config import Config
from sparkrelay.server.async_engine import EngineClient, EngineStopped
from sparkrelay.server.engine_loop import EngineLoop
from sparkrelay.server.engine_messages import (AddItems, EngineInfo, Fatal, MessageError, Ready, Shutdown,
                                               StartFailed, decode, encode)

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 1800.0  # a real-size checkpoint read from a slow disk
STOP_TIMEOUT_S = 15.0  # the engine closes its pipeline stages and transfer agents in this time, or is killed


class EngineStartError(RuntimeError):
    """The scheduler process could not build its engine; the message is the engine's own error."""


class EngineProcess(EngineClient):
    """The client side of the scheduler process. `launch` blocks until the engine is built (or failed)."""

    def __init__(self, proc, folder: str, ctx: zmq.Context, cmd: zmq.Socket, out: zmq.Socket, info: EngineInfo,
                 tokenizer):
        super().__init__(info, tokenizer)
        self._proc, self._folder, self._ctx, self._cmd, self._out = proc, folder, ctx, cmd, out
        self._out_fd: int = out.getsockopt(zmq.FD)
        self._reading = False  # the event loop watches the out socket and the process's sentinel
        self._stopping = threading.Event()

    @classmethod
    def launch(cls, config: Config, inherited: tuple[int, ...] = ()) -> "EngineProcess":
        """Fork the scheduler process and wait for its engine. `inherited`: file descriptors of this process the
        scheduler process must not keep open (the HTTP socket)."""
        import sparkrelay.engine.engine  # noqa: F401  torch and the model code, imported once for both processes
        from sparkrelay.engine.setup import load_tokenizer

        tokenizer = load_tokenizer(config.model.tokenizer_path or config.model.model_path)
        folder = tempfile.mkdtemp(prefix="sparkrelay-engine-")  # 0700: only this user reaches the sockets
        addrs = (f"ipc://{folder}/cmd", f"ipc://{folder}/out")
        proc = multiprocessing.get_context("fork").Process(  # see the module docstring: why fork, and when
            target=engine_main, name="sparkrelay-scheduler", daemon=True, args=(config, *addrs, inherited))
        proc.start()
        ctx = zmq.Context()  # after the fork: a context's I/O threads do not survive one
        cmd, out = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        cmd.setsockopt(zmq.LINGER, 0)
        cmd.setsockopt(zmq.SNDHWM, 0)  # no limit on queued commands: a send fails only when nobody is connected
        try:
            cmd.bind(addrs[0])
            out.bind(addrs[1])
            info = _wait_ready(proc, out)
        except BaseException:
            _end(proc, 0.0)
            ctx.destroy(linger=0)
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return cls(proc, folder, ctx, cmd, out, info, tokenizer)

    def _start_transport(self) -> None:
        """Engine messages are read on the event loop itself: a reader thread's hand-off (a wake-up and a
        call_soon_threadsafe per message) cost the HTTP process about a third of its CPU per streamed token."""
        if self._reading:
            return
        self._reading = True
        self._loop.add_reader(self._out_fd, self._receive_all)
        self._loop.add_reader(self._proc.sentinel, self._scheduler_exited)
        self._receive_all()  # the socket's FD is edge-triggered: what arrived before the reader was added
    def _send(self, cmd) -> None:
        """On the event loop thread only. Never blocks: with the scheduler process gone (or going) there is no peer
        to queue for; an add then fails with 503, an abort or a shutdown has nothing left to do."""
        try:
            self._cmd.send(encode(cmd), zmq.NOBLOCK)
        except zmq.Again:
            if isinstance(cmd, AddItems):
                raise EngineStopped("the scheduler process is not running") from None

    def _transport_alive(self) -> bool:
        return self._proc.is_alive()

    def _receive_all(self) -> None:
        """Every queued engine message to its handler (on the event loop). ZMQ's FD only says that the socket's
        state changed, so the queue is drained until ZMQ itself says it is empty."""
        while self._out.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frame = self._out.recv(zmq.NOBLOCK)
            try:
                msg = decode(frame)
            except MessageError:
                logger.exception("dropped a bad frame from the scheduler process")
                continue
            self._on_message(msg)

    def _scheduler_exited(self) -> None:
        """The process ended: what it sent last first, then (unless it was told to stop) a Fatal."""
        self._receive_all()
        self._stop_reading()
        if not self._stopping.is_set():
            self._on_message(Fatal(f"the scheduler process exited with code {self._proc.exitcode}"))

    def _stop_reading(self) -> None:
        if self._reading and self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._out_fd)
            self._loop.remove_reader(self._proc.sentinel)
        self._reading = False

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Shutdown to the scheduler process (its live requests end with 503), then wait for it to close its
        engine; idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self._proc.is_alive():
            self._send(Shutdown())
        _end(self._proc, timeout)
        self._stop_reading()
        self._ctx.destroy(linger=0)
        shutil.rmtree(self._folder, ignore_errors=True)


def _wait_ready(proc, out: zmq.Socket) -> EngineInfo:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if out.poll(100):
            msg = decode(out.recv())
            if isinstance(msg, Ready):
                return msg.info
            if isinstance(msg, StartFailed):
                raise EngineStartError(msg.error)
        elif not proc.is_alive():
            raise EngineStartError(f"the scheduler process exited with code {proc.exitcode} while loading")
    raise EngineStartError(f"the engine was not built after {START_TIMEOUT_S:.0f} s")


def _end(proc, timeout: float) -> None:
    proc.join(timeout)
    if proc.is_alive():
        logger.warning("the scheduler process did not stop in %.0f s; killing it", timeout)
        proc.kill()
        proc.join(5.0)


# ---------------------------------------------------------------- the scheduler process

def engine_main(config: Config, cmd_addr: str, out_addr: str, inherited: tuple[int, ...]) -> None:
    """The scheduler process's entry point: build the engine here, then serve the loop on this (main) thread."""
    for fd in inherited:
        os.close(fd)
    _name_process(b"sparkrelay-sched")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C reaches the HTTP process, which sends Shutdown
    ctx = zmq.Context()
    out, cmd = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    out.setsockopt(zmq.LINGER, 2000)  # the last outputs (503 aborts at shutdown) still leave
    out.connect(out_addr)
    cmd.connect(cmd_addr)
    from sparkrelay.engine.engine import build_engine

    try:
        engine = build_engine(config)
    except BaseException as e:
        out.send(encode(StartFailed(_start_error(e))))
        ctx.destroy(linger=2000)
        raise SystemExit(1)
    done, loop = threading.Event(), EngineLoop(engine, emit=lambda msg: out.send(encode(msg)))
    inbox = threading.Thread(target=_receive, args=(cmd, loop, done), name="sparkrelay-engine-inbox", daemon=True)
    # SIGTERM (a process group's stop): shut down as if told to; a thread queues it, because the handler may run
    # while this thread holds the inbox's lock
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=loop.put, args=(Shutdown("SIGTERM"),)).start())
    try:
        out.send(encode(Ready(EngineInfo.of(engine))))
        inbox.start()
        loop.run()
    finally:
        done.set()
        engine.close()  # pipeline stages, bootstrap server, transfer agents
        inbox.join(1.0)  # it closes its own socket
        out.close(linger=2000)
        ctx.term()


def _name_process(name: bytes) -> None:
    """The name `ps -o comm`, top and /proc/PID/comm show (the command line stays the server's)."""
    try:
        ctypes.CDLL(None).prctl(15, name, 0, 0, 0)  # PR_SET_NAME, 15 bytes at most
    except (OSError, AttributeError):
        pass


def _start_error(e: BaseException) -> str:
    from sparkrelay.config import ConfigError

    if isinstance(e, (ConfigError, FileNotFoundError, OSError, ValueError)):
        return str(e)
    logger.error("building the engine failed", exc_info=e)
    return f"{type(e).__name__}: {e}"


def _receive(cmd: zmq.Socket, loop: EngineLoop, done: threading.Event) -> None:
    """Commands to the loop until `done`; the HTTP process's end (its sentinel) is a Shutdown."""
    parent = multiprocessing.parent_process()
    poller = zmq.Poller()
    poller.register(cmd, zmq.POLLIN)
    if parent is not None:
        poller.register(parent.sentinel, zmq.POLLIN)
    while not done.is_set():
        ready = dict(poller.poll(100))
        if cmd in ready:
            try:
                loop.put(decode(cmd.recv()))
            except MessageError:
                logger.exception("dropped a bad frame from the HTTP process")
        elif ready:
            logger.warning("the HTTP process (pid %s) is gone; stopping", parent.pid if parent else "?")
            loop.put(Shutdown("the HTTP server exited"))
            break
    cmd.close(linger=0)
