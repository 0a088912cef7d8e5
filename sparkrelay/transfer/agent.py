"""Agent: the skeleton both sides of a transfer share, whatever moves the bytes.

    engine thread: start / poll / abort / clear / close  ──lock──  room table (PrefillRooms | DecodeRooms)
    listener thread: Inbox (PULL) ─> FrameAuth.open ─> _receive(frames)      (a subclass reads its typed messages)
    sender thread:   jobs queue ─> _run_job(outbox, job)  ─> Outbox (one PUSH queue per destination, never blocks)
    more threads:    _more_threads() (the decode's monitor and bootstrap workers)

Two subclasses, one per side (prefill_agent.py, decode_agent.py), each composed with a carrier
(frames.py, onesided.py) that moves the parts' bytes. A subclass says who it is (`who`,
`thread_name`), how large a message it takes, how long a destination may take nothing, and
implements _receive / _bad_message / _run_job (its jobs are frozen dataclasses). A bad message is
counted and logged (rate limited), never raised out of a thread; an exception in any loop is logged
and the loop goes on.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from typing import Any, Callable, Optional

import zmq

from sparkrelay.transfer.base import KVPoll, PollResult
from sparkrelay.transfer.protocol import AuthError, FrameError
from sparkrelay.transfer.wire import (
    MAX_QUEUED,
    FrameAuth,
    Inbox,
    Outbox,
    RejectLog,
    warn_if_exposed,
)

logger = logging.getLogger(__name__)

MAX_JOBS = 4 << 16


def start_loop(
    name: str,
    stop: threading.Event,
    step: Callable[[], None],
    on_exit: Optional[Callable[[], None]] = None,
) -> threading.Thread:
    """A daemon thread running step() until `stop` is set; an exception is logged and the loop goes
    on."""

    def run() -> None:
        while not stop.is_set():
            try:
                step()
            except Exception:
                logger.exception("%s: iteration failed (the thread keeps running)", name)
                stop.wait(0.05)
        if on_exit is not None:
            try:
                on_exit()
            except Exception:
                logger.exception("%s: cleanup failed", name)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


class Agent:
    """The shared skeleton. Subclasses set `who` (log prefix), `thread_name`, `close_timeout_s` and
    `_table` (an object with `rooms: dict[int, record]` and `clear(room, now)`; each record has
    `result()`)."""

    who = "agent"
    thread_name = "agent"
    close_timeout_s = 5.0  # all threads together, on close()
    max_queued = MAX_QUEUED  # messages waiting per destination in the outbox
    _table: Any

    def __init__(
        self, schema: dict, bind_host: str, auth_token: Optional[str], log: logging.Logger
    ) -> None:
        self._schema = json.loads(json.dumps(schema))  # the form the peer sees: tuples become lists
        self.bind_host = bind_host
        self._token, self._auth = auth_token or None, FrameAuth(auth_token)
        self._log, self._rejects = log, RejectLog(log)
        self.port: Optional[int] = None
        self._lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue(MAX_JOBS)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._ctx: Optional[zmq.Context] = None
        self._closed = False

    # ---- lifecycle ----

    def start(self) -> None:
        """Bind the control socket, start the listener, the sender and _more_threads(), then
        _started()."""
        self._ctx = zmq.Context()
        name = self.thread_name
        inbox = Inbox(self._ctx, self.bind_host, self._max_msg_size(), name, self._rejects)
        self.port = inbox.port
        warn_if_exposed(self.bind_host, self._auth.enabled, self._socket_name())
        out = Outbox(self._ctx, self._send_timeout_s(), self._auth, max_queued=self.max_queued)
        self._threads = [
            start_loop(
                f"{name}-listener", self._stop, lambda: self._listen_step(inbox), inbox.close
            ),
            start_loop(f"{name}-sender", self._stop, lambda: self._send_step(out), out.close),
            *self._more_threads(),
        ]
        self._started()

    def close(self) -> None:
        """Stop every thread (close_timeout_s in all) and the zmq context; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        deadline = time.monotonic() + self.close_timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if self._ctx is None:
            return
        if any(t.is_alive() for t in self._threads):
            self._ctx.destroy(linger=0)  # a stuck thread still holds a socket: do not wait on it
        else:
            self._ctx.term()

    def threads_alive(self) -> bool:
        """Every agent thread is running (False before start() and after close())."""
        return bool(self._threads) and not self._closed and all(t.is_alive() for t in self._threads)

    def rejected(self) -> dict[str, int]:
        """Messages and connections refused so far, by kind (auth, protocol, replay, overflow,
        connection)."""
        return self._rejects.counts()

    # ---- the room table ----

    def poll(self, room: int) -> PollResult:
        with self._lock:
            rec = self._table.rooms.get(room)
            return PollResult(KVPoll.Failed, self._unknown(room)) if rec is None else rec.result()

    def clear(self, room: int) -> None:
        """Forget the room; later messages for it are dropped."""
        with self._lock:
            self._table.clear(room, time.monotonic())

    def _current(self, room: int, rec: object) -> bool:
        with self._lock:
            return self._table.rooms.get(room) is rec

    # ---- listener thread ----

    def _listen_step(self, inbox: Inbox) -> None:
        for msg, peer in inbox.poll(50):
            try:
                self._receive(self._auth.open(msg))
            except AuthError as e:  # never names a room; one line per stranger
                self._rejects.note(
                    "auth", "%s: dropped a message: %s", self.who, e.reason, peer=peer
                )
            except FrameError as e:
                self._bad_message(e, "protocol")
            except Exception:
                self._log.exception(
                    "%s: error while handling a message (the listener keeps running)", self.who
                )
        self._tick(time.monotonic())

    # ---- sender thread ----

    def _enqueue(self, job: object) -> bool:
        """Hand a job (a frozen dataclass of the subclass's) to the sender thread; False when the
        queue is full."""
        try:
            self._jobs.put_nowait(job)
            return True
        except queue.Full:
            self._log.error("%s: send queue full, dropped a %s job", self.who, type(job).__name__)
            return False

    def _send_step(self, out: Outbox) -> None:
        """Let queued messages go out, then hand new jobs to the outbox: nothing here waits on one
        peer."""
        self._pumped(out, out.pump(2))
        try:
            job = self._jobs.get(timeout=0.0 if out.queues else 0.05)
        except queue.Empty:
            return
        for _ in range(256):
            self._run_job(out, job)
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
        self._pumped(out, [])

    # ---- what a subclass provides ----

    def _max_msg_size(self) -> int:
        raise NotImplementedError

    def _send_timeout_s(self) -> float:
        """A destination that takes none of its queued messages for this long loses them
        (Outbox.pump)."""
        raise NotImplementedError

    def _socket_name(self) -> str:
        raise NotImplementedError

    def _more_threads(self) -> list[threading.Thread]:
        return []

    def _started(self) -> None:
        self._log.info("%s: transfer agent on %s:%d", self.who, self.bind_host, self.port)

    def _unknown(self, room: int) -> str:
        return f"room {room} is not known to {self.who}"

    def _receive(self, frames: list) -> None:
        """One authenticated message: read it (FrameError if it breaks the protocol) and apply
        it."""
        raise NotImplementedError

    def _bad_message(self, e: FrameError, kind: str) -> None:
        """Count and log a refused message; fail the room it names, when it may."""
        raise NotImplementedError

    def _tick(self, now: float) -> None:
        """After each listener poll (about every 50 ms): timeouts."""

    def _run_job(self, out: Outbox, job: Any) -> None:
        raise NotImplementedError

    def _pumped(self, out: Outbox, expired: list) -> None:
        """After the outbox ran: `expired` is (dest, tag) of every message it gave up."""
