"""Outbox: non-blocking PUSH sends with one queue per destination, for the decode agent's sender thread.

    put(dest, frames, tag) --> zmq takes it now (NOBLOCK)          --> gone to the peer's pipe
                           `-> zmq cannot (no connection yet, or   --> waits in dest's own queue; pump() polls
                               the peer's SNDHWM reached)              POLLOUT and sends it in order, or gives the
                                                                       queue up once dest took nothing for
                                                                       timeout_s (returned as expired)
    drop(dest)             --> socket closed with linger 0, its queued messages returned (a forgotten peer)

A peer that is dead or stalled therefore only delays its own messages, never another peer's: there is no
blocking send. Sockets use IMMEDIATE, so zmq queues nothing for a peer it never reached: such messages wait
here, where they are counted and expire. Owned by one thread (zmq sockets are not thread safe).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

import zmq

from sparkrelay.transfer.frames import FrameAuth, tcp_endpoint

Dest = tuple[str, int]
SNDHWM = 64  # messages zmq buffers per connected peer before we queue them here
MAX_QUEUED = 1024  # per destination: more than this and put() refuses


@dataclass
class Queued:
    frames: list
    tag: Any  # the caller's, returned with an expired or dropped message


class Outbox:
    def __init__(self, ctx: zmq.Context, timeout_s: float, auth: FrameAuth, limit: int = 1024) -> None:
        self.ctx, self.timeout_s, self.auth, self.limit = ctx, timeout_s, auth, limit
        self.socks: OrderedDict[Dest, zmq.Socket] = OrderedDict()  # least recently used first
        self.queues: dict[Dest, deque[Queued]] = {}  # only destinations with something waiting
        self.progress: dict[Dest, float] = {}  # when each queue was made or last sent something (monotonic)
        self.poller = zmq.Poller()

    def pending(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def put(self, dest: Dest, frames: list, tag: Any = None) -> bool:
        """Send now if zmq takes the message, else queue it behind dest's earlier ones. False (nothing sent or
        queued) when dest already has MAX_QUEUED messages waiting."""
        frames = self.auth.seal(frames)
        sock = self._socket(dest)
        q = self.queues.get(dest)
        if q is None and self._try_send(sock, frames):
            return True
        if q is None:
            q = self.queues[dest] = deque()
            self.progress[dest] = time.monotonic()
            self.poller.register(sock, zmq.POLLOUT)
        if len(q) >= MAX_QUEUED:
            return False
        q.append(Queued(frames, tag))
        return True

    def pump(self, timeout_ms: int) -> list[tuple[Dest, Any]]:
        """Waits up to timeout_ms for any queue's peer to take messages, sends what it can in order, and returns
        (dest, tag) of every message given up: a destination that took nothing for timeout_s loses its queue."""
        if not self.queues:
            return []
        ready = {s for s, _ in self.poller.poll(timeout_ms)}
        expired, now = [], time.monotonic()
        for dest in list(self.queues):
            sock, q = self.socks[dest], self.queues[dest]
            while q and sock in ready and self._try_send(sock, q[0].frames):
                q.popleft()
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
        sock.setsockopt(zmq.LINGER, 1000)  # close() on shutdown: queued control messages get a second
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # nothing queued inside zmq for a peer never reached
        if ":" in dest[0]:
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(tcp_endpoint(*dest))
        self.socks[dest] = sock
        idle = [d for d in self.socks if d not in self.queues]
        while len(self.socks) > self.limit and idle:  # least recently used socket with nothing waiting
            self.drop(idle.pop(0))
        return sock
