"""Outbox: non-blocking PUSH sends with one queue per destination, for both agents' sender threads.

    put(dest, frames, tag) --> zmq takes it now (NOBLOCK)          --> gone to the peer's pipe
                           `-> zmq cannot (no connection yet, or   --> waits in dest's own queue; pump() polls
                               the peer's SNDHWM reached)              POLLOUT and sends it in order, or gives the
                                                                       queue up once dest took nothing for
                                                                       timeout_s (returned as expired)
    put(..., notify=True)  --> its tag lands in take_sent() once zmq took the message (a room's last frame)
    discard(dest, match)   --> queued messages whose tag matches are removed unsent (an aborted room)
    drop(dest)             --> socket closed with linger 0, its queued messages returned (a forgotten peer)

A peer that is dead or stalled therefore only delays its own messages, never another peer's: there
is no blocking send. Sockets use IMMEDIATE, so zmq queues nothing for a peer it never reached: such
messages wait here, where they are counted and expire. Frames are queued as given (zmq sends them
with copy=False), so a slow peer holds references to buffers its sender already owns, never copies.
Owned by one thread (zmq sockets are not thread safe).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable

import zmq

from sparkrelay.transfer.base import Dest
from sparkrelay.transfer.wire.auth import FrameAuth
from sparkrelay.transfer.wire.inbox import tcp_endpoint

SNDHWM = 64  # messages zmq buffers per connected peer before we queue them here
MAX_QUEUED = 1024  # per destination: more than this and put() refuses


@dataclass
class Queued:
    frames: list
    tag: Any  # the caller's, returned with an expired or dropped message
    notify: bool = False  # report the tag through take_sent() once zmq takes the message


class Outbox:
    def __init__(
        self,
        ctx: zmq.Context,
        timeout_s: float,
        auth: FrameAuth,
        limit: int = 1024,
        max_queued: int = MAX_QUEUED,
    ) -> None:
        self.ctx, self.timeout_s, self.auth, self.limit, self.max_queued = (
            ctx,
            timeout_s,
            auth,
            limit,
            max_queued,
        )
        self.sent: list[Any] = []  # tags of notify=True messages zmq has taken, until take_sent()
        self.socks: OrderedDict[Dest, zmq.Socket] = OrderedDict()  # least recently used first
        self.queues: dict[Dest, deque[Queued]] = {}  # only destinations with something waiting
        self.progress: dict[
            Dest, float
        ] = {}  # when each queue was made or last sent something (monotonic)
        self.poller = zmq.Poller()

    def pending(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def put(self, dest: Dest, frames: list, tag: Any = None, notify: bool = False) -> bool:
        """Send now if zmq takes the message, else queue it behind dest's earlier ones. False
        (nothing sent or queued) when dest already has max_queued messages waiting."""
        frames = self.auth.seal(frames)
        sock = self._socket(dest)
        q = self.queues.get(dest)
        if q is None and self._try_send(sock, frames):
            self._sent(Queued(frames, tag, notify))
            return True
        if q is None:
            q = self.queues[dest] = deque()
            self.progress[dest] = time.monotonic()
            self.poller.register(sock, zmq.POLLOUT)
        if len(q) >= self.max_queued:
            return False
        q.append(Queued(frames, tag, notify))
        return True

    def take_sent(self) -> list[Any]:
        """Tags of the notify=True messages zmq took since the last call, in the order they went."""
        sent, self.sent = self.sent, []
        return sent

    def discard(self, dest: Dest, match: Callable[[Any], bool]) -> int:
        """Remove dest's queued messages whose tag matches, unsent; how many."""
        q = self.queues.get(dest)
        if not q:
            return 0
        keep = deque(m for m in q if not match(m.tag))
        gone = len(q) - len(keep)
        q.clear()
        q.extend(keep)
        if not q:
            self._unqueue(dest)
        return gone

    def pump(self, timeout_ms: int) -> list[tuple[Dest, Any]]:
        """Waits up to timeout_ms for any queue's peer to take messages, sends what it can in order,
        and returns (dest, tag) of every message given up: a destination that took nothing for
        timeout_s loses its queue."""
        if not self.queues:
            return []
        ready = {s for s, _ in self.poller.poll(timeout_ms)}
        expired, now = [], time.monotonic()
        for dest in list(self.queues):
            sock, q = self.socks[dest], self.queues[dest]
            while q and sock in ready and self._try_send(sock, q[0].frames):
                self._sent(q.popleft())
                self.progress[dest] = now
            if q and now - self.progress[dest] > self.timeout_s:
                expired += [(dest, m.tag) for m in q]
                q.clear()
            if not q:
                self._unqueue(dest)
        return expired

    def drop(self, dest: Dest) -> list[Any]:
        """Close dest's socket at once (linger 0); the tags of the messages still queued for it."""
        q = self._unqueue(dest)
        sock = self.socks.pop(dest, None)
        if sock is not None:
            sock.close(linger=0)
        return [m.tag for m in q]

    def close(self) -> None:
        """Shutdown: each socket gets its linger (1 s) to flush what zmq already took."""
        for sock in self.socks.values():
            sock.close()
        self.socks.clear()
        self.queues.clear()
        self.progress.clear()
        self.sent.clear()

    def _sent(self, m: Queued) -> None:
        if m.notify:
            self.sent.append(m.tag)

    def _try_send(self, sock: zmq.Socket, frames: list) -> bool:
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False

    def _unqueue(self, dest: Dest) -> deque:
        q = self.queues.pop(dest, None)
        self.progress.pop(dest, None)
        if q is None:
            return deque()
        self.poller.unregister(self.socks[dest])
        return q

    def _socket(self, dest: Dest) -> zmq.Socket:
        sock = self.socks.get(dest)
        if sock is not None:
            self.socks.move_to_end(dest)
            return sock
        sock = self.ctx.socket(zmq.PUSH)
        # close() on shutdown: queued control messages get a second
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # nothing queued inside zmq for a peer never reached
        if ":" in dest[0]:
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(tcp_endpoint(*dest))
        self.socks[dest] = sock
        idle = [d for d in self.socks if d not in self.queues]
        # least recently used socket with nothing waiting
        while len(self.socks) > self.limit and idle:
            self.drop(idle.pop(0))
        return sock
