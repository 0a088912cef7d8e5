"""A prefill stage's report to rank 0 that its part of a room's transfer ended: a typed message on a
local socket.

Every stage's sink (disagg/prefill_sink.py) owns a `StageReportOutbox`; the prefill role on rank 0
owns the one `StageReportInbox` and learns from it when every stage has sent its part (or one
failed). The messages cross a process boundary, so they are codec messages (sparkrelay/codec.py):
msgpack maps checked field by field on receipt, never pickles.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import zmq

from sparkrelay.codec import FrameError, Message, int_in, str_max
from sparkrelay.transfer.base import KVPoll
from sparkrelay.transfer.protocol import AuthError, room_field
from sparkrelay.transfer.wire import FrameAuth, RejectLog
from sparkrelay.transfer.wire.inbox import bind_pull, tcp_endpoint

logger = logging.getLogger(__name__)

TERMINAL = (KVPoll.Success, KVPoll.Failed)
LOOPBACK = "127.0.0.1"  # the stages of one server share its host
REPORT_TAG_LABEL = b"sparkrelay-stage-report-v1"
MAX_REPORT_BYTES = 1 << 16  # a report is a room, a stage, a state and a reason of at most 4 KiB


def _terminal(name: str, v: Any, key: Optional[int]) -> KVPoll:
    if type(v) is not int and not isinstance(v, KVPoll) or v not in [int(s) for s in TERMINAL]:
        raise FrameError(
            f"{name} must be {int(KVPoll.Success)} (Success) or {int(KVPoll.Failed)} (Failed), "
            f"got {v!r}"[:300],
            key,
        )
    return KVPoll(v)


@dataclass(frozen=True)
class StageReport(Message):
    """stage -> rank 0: the stage's part of a room's transfer ended (Success or Failed, and why)."""

    TYPE: ClassVar[str] = "STAGE_REPORT"
    RULES: ClassVar[tuple] = (
        ("room", room_field),
        ("stage", int_in(0, 1 << 16)),
        ("state", _terminal),
        ("reason", str_max(4096)),
    )
    room: int
    stage: int
    state: KVPoll  # Success or Failed
    reason: str = ""

    def head(self) -> dict:
        return {**super().head(), "state": int(self.state)}


class StageReportInbox:
    """Rank 0's end: a PULL socket on a random port of `host` (loopback: the stages share this host; across
    hosts, node 0's pipeline address, and every report then carries a FrameAuth tag under `token`), whose
    `address` goes to every stage; also bound to an in-process address on which `wake()` posts an empty
    message, so a wait ends at once when a request arrives."""

    def __init__(self, host: str = LOOPBACK, token: Optional[str] = None) -> None:
        ctx = zmq.Context.instance()
        self._auth, self._rejects = FrameAuth(token, REPORT_TAG_LABEL), RejectLog(logger)
        # the control channel's PULL socket
        self._sock, port = bind_pull(ctx, host, MAX_REPORT_BYTES)
        self.address = tcp_endpoint(host, port)
        wake_address = f"inproc://sparkrelay-stage-reports-{port}"
        self._sock.bind(wake_address)
        self._waker = ctx.socket(zmq.PUSH)
        self._waker.setsockopt(zmq.LINGER, 0)
        self._waker.setsockopt(zmq.SNDHWM, 1)  # one pending wake-up is enough
        self._waker.connect(wake_address)
        # wake() comes from any thread; a zmq socket is not thread safe
        self._wake_lock = threading.Lock()

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
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            if frames == [b""]:
                continue  # a wake-up
            try:
                out.append(StageReport.decode(self._auth.open(frames)))
            except (AuthError, FrameError) as e:
                self._rejects.note(
                    "report", "dropped a stage report (%d frames): %s", len(frames), e
                )

    def close(self) -> None:
        with self._wake_lock:
            self._waker.close(0)
        self._sock.close(0)


class StageReportOutbox:
    """A stage's end: a PUSH socket connected to rank 0's inbox."""

    def __init__(self, address: str, token: Optional[str] = None) -> None:
        """token: tag every report when the inbox is on another host's address (StageReportInbox)."""
        self._auth = FrameAuth(
            token if not address.startswith(f"tcp://{LOOPBACK}:") else None, REPORT_TAG_LABEL
        )
        self._sock = zmq.Context.instance().socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.connect(address)

    def send(self, report: StageReport) -> None:
        self._sock.send_multipart(self._auth.seal(report.encode()))

    def close(self) -> None:
        self._sock.close(0)
