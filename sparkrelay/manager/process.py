"""The scheduler process: the Engine built and stepped on one thread of its own process, behind the
HTTP server.

    HTTP process (uvicorn, tokenizer, EngineProcess)          scheduler process (engine_main)
    ------------------------------------------------          -------------------------------
    cmd  ZMQ PUSH  --AddItems / AbortRequest / Shutdown-->  PULL  receiver thread -> EngineLoop.put (wakes it)
    out  socketpair end  <--Ready | StartFailed, Added, Progress, Fatal--  the other end: EngineLoop.run on the main
         (read on the event loop)                                          thread writes each message as it comes

Why a process: the thread that builds the engine is the one that steps it, so PyTorch runs one
OpenMP team; an engine built on one thread and stepped on another ran two, and libgomp then cut its
spin-waiting, which slowed served decode well below the offline engine's (speed notes of
docs/architecture.md). The HTTP process does no tensor work.

Why fork: the HTTP process needs transformers for its tokenizer, which imports torch; a spawned
scheduler process imported them all again at every start, on top of the model (a small host
restarting a server beside busy ones felt it). It is forked once torch, transformers and the model
code are imported and the tokenizer is loaded, before this process has any thread, ZMQ context or
OpenMP team (torch starts its threads at the first parallel op), and it closes the HTTP socket it
inherits. The command socket is an ipc:// file in a private folder (0700); frames are msgpack
(messages.py), never pickles. The scheduler process ends when told to, or when the HTTP process is
gone (its sentinel); the HTTP process shuts down when the scheduler process dies.

Why the outputs take a socketpair, not ZMQ: they cross once per decode step, and the engine's two
OpenMP threads fill both cores of a small host. Through ZMQ each message woke four threads (the
sender's ZMQ I/O thread, the receiver's, then the event loop), and the engine's send was preempted
by its own I/O thread. Written to a Unix socket it wakes the HTTP process's event loop and nothing
else.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import select
import shutil
import signal
import socket
import threading
import time

import zmq

from sparkrelay import host
from sparkrelay.config import Config
from sparkrelay.host import socket_folder
from sparkrelay.manager.client import EngineClient, EngineStopped
from sparkrelay.manager.loop import EngineLoop
from sparkrelay.manager.messages import (
    AddItems,
    EngineInfo,
    Fatal,
    FrameReader,
    MessageError,
    Ready,
    Shutdown,
    StartFailed,
    decode,
    encode,
    framed,
)

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 1800.0  # a real-size checkpoint read from a slow disk
STOP_TIMEOUT_S = (
    15.0  # the engine closes its pipeline stages and transfer agents in this time, or is killed
)
READ_BYTES = 1 << 20  # one read of the outputs socket


class EngineStartError(RuntimeError):
    """The scheduler process could not build its engine; the message is the engine's own error."""


class EngineProcess(EngineClient):
    """The client side of the scheduler process. `launch` blocks until the engine is built (or
    failed)."""

    def __init__(
        self,
        proc,
        folder: str,
        ctx: zmq.Context,
        cmd: zmq.Socket,
        out: socket.socket,
        frames: FrameReader,
        early: list,
        info: EngineInfo,
        tokenizer,
    ):
        super().__init__(info, tokenizer)
        self._proc, self._folder, self._ctx, self._cmd, self._out = proc, folder, ctx, cmd, out
        self._frames, self._early = (
            frames,
            early,
        )  # early: messages read with Ready, handled once the loop runs
        self._reading = (
            False  # the event loop watches the outputs socket and the process's sentinel
        )
        # each read lands here: a fresh 1 MiB bytes per read would
        self._chunk = memoryview(bytearray(READ_BYTES))
        # cost an mmap, an mremap and a munmap per streamed token
        self._stopping = threading.Event()

    @classmethod
    def launch(cls, config: Config, inherited: tuple[int, ...] = ()) -> "EngineProcess":
        """Fork the scheduler process and wait for its engine. `inherited`: file descriptors of this
        process the scheduler process must not keep open (the HTTP socket)."""
        import sparkrelay.engine.engine  # noqa: F401  torch and the model code, imported once for both processes
        from sparkrelay.engine.setup import load_tokenizer

        mc = config.model
        tokenizer = load_tokenizer(mc.tokenizer_path or mc.model_path, mc.chat_template)
        # 0700: only this user reaches the socket
        folder = socket_folder("sparkrelay-engine-", "cmd")
        cmd_addr = f"ipc://{folder}/cmd"
        out, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # see the module docstring: why fork, and when
        proc = multiprocessing.get_context("fork").Process(
            target=engine_main,
            name="sparkrelay-scheduler",
            daemon=True,
            args=(config, cmd_addr, theirs, (*inherited, out.fileno())),
        )
        proc.start()
        theirs.close()
        out.setblocking(False)
        ctx = zmq.Context()  # after the fork: a context's I/O threads do not survive one
        cmd = ctx.socket(zmq.PUSH)
        cmd.setsockopt(zmq.LINGER, 0)
        # no limit on queued commands: a send fails only when nobody is connected
        cmd.setsockopt(zmq.SNDHWM, 0)
        frames = FrameReader()
        try:
            cmd.bind(cmd_addr)
            info, early = _wait_ready(proc, out, frames)
        except BaseException:
            _end(proc, 0.0)
            ctx.destroy(linger=0)
            out.close()
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return cls(proc, folder, ctx, cmd, out, frames, early, info, tokenizer)

    def _start_transport(self) -> None:
        """Engine messages are read on the event loop itself: a reader thread's hand-off (a wake-up
        and a call_soon_threadsafe per message) cost the HTTP process about a third of its CPU per
        streamed token."""
        if self._reading:
            return
        self._reading = True
        for msg in self._early:
            self._on_message(msg)
        self._early = []
        self._loop.add_reader(self._out.fileno(), self._receive)
        self._loop.add_reader(self._proc.sentinel, self._scheduler_exited)

    def _send(self, cmd) -> None:
        """On the event loop thread only. Never blocks: with the scheduler process gone (or going)
        there is no peer to queue for; an add then fails with 503, an abort or a shutdown has
        nothing left to do."""
        try:
            self._cmd.send(encode(cmd), zmq.NOBLOCK)
        except zmq.Again:
            if isinstance(cmd, AddItems):
                raise EngineStopped("the scheduler process is not running") from None

    def _transport_alive(self) -> bool:
        return self._proc.is_alive()

    def _receive(self) -> bool:
        """One read of the outputs socket (the loop calls again while it stays readable); every
        message it completes to its handler. False when there was nothing to read, or nothing more
        can come."""
        try:
            n = self._out.recv_into(self._chunk)
        except BlockingIOError:
            return False
        except OSError:
            n = 0
        if not n:
            # end of stream: readable for ever; the sentinel follows
            self._loop.remove_reader(self._out.fileno())
            return False
        for msg in _messages(self._frames.feed(self._chunk[:n])):
            self._on_message(msg)
        return True

    def _scheduler_exited(self) -> None:
        """The process ended: what it sent last first, then (unless it was told to stop) a Fatal."""
        while self._receive():
            pass
        self._stop_reading()
        if not self._stopping.is_set():
            self._on_message(Fatal(f"the scheduler process exited with code {self._proc.exitcode}"))

    def _stop_reading(self) -> None:
        if self._reading and self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._out.fileno())
            self._loop.remove_reader(self._proc.sentinel)
        self._reading = False

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Shutdown to the scheduler process (its live requests end with 503), then wait for it to
        close its engine; idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self._proc.is_alive():
            self._send(Shutdown())
        _end(self._proc, timeout)
        self._stop_reading()
        self._ctx.destroy(linger=0)
        self._out.close()
        shutil.rmtree(self._folder, ignore_errors=True)


def _wait_ready(proc, out: socket.socket, frames: FrameReader) -> tuple[EngineInfo, list]:
    """-> the engine's info, and the messages read with it (the loop's first stats may share its read)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if select.select([out], [], [], 0.1)[0]:
            data = out.recv(READ_BYTES)
            msgs = _messages(frames.feed(data))
            for i, msg in enumerate(msgs):
                if isinstance(msg, Ready):
                    return msg.info, msgs[i + 1 :]
                if isinstance(msg, StartFailed):
                    raise EngineStartError(msg.error)
            if data:
                continue
        if not proc.is_alive():
            raise EngineStartError(
                f"the scheduler process exited with code {proc.exitcode} while loading"
            )
    raise EngineStartError(f"the engine was not built after {START_TIMEOUT_S:.0f} s")


def _messages(frames: list[bytes]) -> list:
    out = []
    for frame in frames:
        try:
            out.append(decode(frame))
        except MessageError:
            logger.exception("dropped a bad frame from the scheduler process")
    return out


def _end(proc, timeout: float) -> None:
    proc.join(timeout)
    if proc.is_alive():
        logger.warning("the scheduler process did not stop in %.0f s; killing it", timeout)
        proc.kill()
        proc.join(5.0)


# ---------------------------------------------------------------- the scheduler process


def engine_main(
    config: Config, cmd_addr: str, out: socket.socket, inherited: tuple[int, ...]
) -> None:
    """The scheduler process's entry point: build the engine here, then serve the loop on this
    (main) thread.
    out: this process's end of the outputs socketpair."""
    for fd in inherited:
        os.close(fd)
    _name_process(b"sparkrelay-sched")
    # Ctrl+C reaches the HTTP process, which sends Shutdown
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    cmd = ctx.socket(zmq.PULL)
    cmd.connect(cmd_addr)
    emit = _emitter(out)
    from sparkrelay.engine.engine import build_engine

    try:
        engine = build_engine(config)
    except BaseException as e:
        emit(StartFailed(_start_error(e)))
        ctx.destroy(linger=0)
        raise SystemExit(1)
    done, loop = threading.Event(), EngineLoop(engine, emit=emit)
    inbox = threading.Thread(
        target=_receive, args=(cmd, loop, done), name="sparkrelay-engine-inbox", daemon=True
    )
    # SIGTERM (a process group's stop): shut down as if told to; a thread queues it, because the
    # handler may run while this thread holds the inbox's lock
    signal.signal(
        signal.SIGTERM,
        lambda *_: threading.Thread(target=loop.put, args=(Shutdown("SIGTERM"),)).start(),
    )
    try:
        emit(Ready(EngineInfo.of(engine)))
        inbox.start()
        cores = host.plan(config)
        if cores is not None:  # after the inbox thread starts: it stays free
            host.pin_engine_thread(cores[0])
        loop.run()
    finally:
        done.set()
        engine.close()  # pipeline stages, bootstrap server, transfer agents
        inbox.join(1.0)  # it closes its own socket
        out.close()  # what was written stays readable after this process ends
        ctx.term()


def _emitter(out: socket.socket):
    """Writes each message to the outputs socket, blocking while its buffer is full (as a ZMQ PUSH
    socket blocks at its high-water mark): the HTTP process reads as fast as it can. Its end gone,
    nothing is listening: dropped."""
    lost = threading.Event()

    def emit(msg) -> None:
        if lost.is_set():
            return
        try:
            out.sendall(framed(msg))
        except OSError as e:
            lost.set()
            logger.warning(
                "the HTTP process stopped reading engine outputs (%s); the rest are dropped", e
            )

    return emit


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
            logger.warning(
                "the HTTP process (pid %s) is gone; stopping", parent.pid if parent else "?"
            )
            loop.put(Shutdown("the HTTP server exited"))
            break
    cmd.close(linger=0)
