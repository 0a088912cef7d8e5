"""A prefill stage's report to rank 0 that its part of a room's transfer ended: a typed message on a local socket.

Every stage's sink (disagg/prefill_sink.py) owns a `StageReportOutbox`; the prefill role on rank 0 owns the one
`StageReportInbox` and learns from it when every stage has sent its part (or one failed). The messages cross a
process boundary, so they are msgpack maps checked field by field on receipt, never pickles.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import msgpack
import zmq

from sparkrelay.transfer.base import KVPoll

logger = logging.getLogger(__name__)

TERMINAL = (KVPoll.Success, KVPoll.Failed)


@dataclass(frozen=True)
class StageReport:
    room: int
    stage: int
    state: KVPoll  # Success or Failed
    reason: str = ""

    def encode(self) -> bytes:
        return msgpack.packb({"room": self.room, "stage": self.stage, "state": int(self.state), "reason": self.reason})

    @classmethod
    def decode(cls, data: bytes) -> "StageReport":
        """Raise ValueError on anything but a well-formed report."""
        try:
            m = msgpack.unpackb(data)
        except Exception as e:
            raise ValueError(f"not msgpack: {e}") from None
        if not isinstance(m, dict) or set(m) != {"room", "stage", "state", "reason"}:
            raise ValueError(f"fields {sorted(m) if isinstance(m, dict) else type(m).__name__}")
        room, stage, state, reason = m["room"], m["stage"], m["state"], m["reason"]
        if not all(type(v) is int for v in (room, stage, state)) or not isinstance(reason, str):
            raise ValueError("room, stage and state must be integers and reason a string")
        if state not in [int(s) for s in TERMINAL] or stage < 0:
            raise ValueError(f"state {state} / stage {stage}")
        return cls(room, stage, KVPoll(state), reason)


class StageReportInbox:
    """Rank 0's end: a PULL socket on a random loopback port (`address` goes to every stage), also bound to an
    in-process address on which `wake()` posts an empty message, so a wait ends at once when a request arrives."""

    def __init__(self) -> None:
        ctx = zmq.Context.instance()
        self._sock = ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        wake_address = f"inproc://sparkrelay-stage-reports-{port}"
        self._sock.bind(wake_address)
        self._waker = ctx.socket(zmq.PUSH)
        self._waker.setsockopt(zmq.LINGER, 0)
        self._waker.setsockopt(zmq.SNDHWM, 1)  # one pending wake-up is enough
        self._waker.connect(wake_address)
        self._wake_lock = threading.Lock()  # wake() comes from any thread; a zmq socket is not thread safe

    def wait(self, timeout_s: float) -> bool:
        """True once a report or a wake-up is waiting (at most `timeout_s`)."""
        return bool(self._sock.poll(timeout_s * 1000))

    def wake(self) -> None:
        with self._wake_lock:
            try:
                self._waker.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # a wake-up is already pending (or the inbox is closed)

    def drain(self) -> list[StageReport]:
        out = []
        while True:
            try:
                data = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            if not data:
                continue  # a wake-up
            try:
                out.append(StageReport.decode(data))
            except ValueError as e:
                logger.error("dropped a malformed stage report (%d bytes): %s", len(data), e)

    def close(self) -> None:
        with self._wake_lock:
            self._waker.close(0)
        self._sock.close(0)


class StageReportOutbox:
    """A stage's end: a PUSH socket connected to rank 0's inbox."""

    def __init__(self, address: str) -> None:
        self._sock = zmq.Context.instance().socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.connect(address)

    def send(self, report: StageReport) -> None:
        self._sock.send(report.encode())

    def close(self) -> None:
        self._sock.close(0)
