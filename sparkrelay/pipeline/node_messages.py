"""The typed messages between pipeline nodes (pipeline/nodes.py) and their authenticated link.

Every frame is a codec message (sparkrelay/codec.py) sealed with a FrameAuth tag under the transfer layer's
token; each carries its sender's message count (`seq`), and a receiver takes only counts above the last it took
from that node, so a recorded frame replayed later is dropped.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import zmq

from sparkrelay.codec import FrameError, Message, int_in, read_message, str_max
from sparkrelay.transfer.protocol import AuthError
from sparkrelay.transfer.wire import FrameAuth, RejectLog, recv_with_peer

logger = logging.getLogger(__name__)

NODE_TAG_LABEL = b"sparkrelay-pipeline-node-v1"
MAX_NODE_BYTES = 4 << 20  # a launch record: the flat config, the partition, the capture
SEQ_MAX = (1 << 63) - 1
JOIN_FRESH_S = (
    300.0  # a NodeJoin stamped further from node 0's clock is a replay (or a broken clock)
)


def _seconds(name: str, v: Any, key: Optional[int]) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v < 1e11:
        raise FrameError(f"{name} must be seconds since the epoch, got {v!r}"[:200], key)
    return float(v)


_NODE = ("node", int_in(0, 1 << 12))
_SEQ = ("seq", int_in(1, SEQ_MAX))
_SESSION = ("session", int_in(0, SEQ_MAX))


@dataclass(frozen=True)
class NodeJoin(Message):
    """node R -> node 0: R's stages may start; `host` is the address its pipeline sockets bind."""

    TYPE: ClassVar[str] = "NODE_JOIN"
    KEY: ClassVar[str] = "node"
    RULES: ClassVar[tuple] = (
        _NODE,
        _SEQ,
        ("host", str_max(255)),
        ("pid", int_in(1, 1 << 31)),
        ("sent_at", _seconds),
    )
    node: int
    seq: int
    host: str
    pid: int
    sent_at: float


@dataclass(frozen=True)
class NodeLaunch(Message):
    """node 0 -> node R: the launch record of its stages (JSON, no secrets) and the session id every later
    message names."""

    TYPE: ClassVar[str] = "NODE_LAUNCH"
    KEY: ClassVar[str] = "node"
    MAX_BYTES: ClassVar[int] = MAX_NODE_BYTES
    RULES: ClassVar[tuple] = (_NODE, _SEQ, _SESSION, ("record", str_max(MAX_NODE_BYTES)))
    node: int
    seq: int
    session: int
    record: str


@dataclass(frozen=True)
class NodeStatus(Message):
    """Either way, once launched: `state` "ready" (R's stages loaded), "beat" (alive), "failed" (R's stage
    died or failed to load: `reason`), "stop" (node 0 shuts the pipeline down)."""

    TYPE: ClassVar[str] = "NODE_STATUS"
    KEY: ClassVar[str] = "node"
    STATES: ClassVar[tuple] = ("ready", "beat", "failed", "stop")
    RULES: ClassVar[tuple] = (
        _NODE,
        _SEQ,
        _SESSION,
        ("state", str_max(16)),
        ("reason", str_max(4096)),
    )
    node: int
    seq: int
    session: int
    state: str
    reason: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.state not in self.STATES:
            raise FrameError(f"state must be one of {self.STATES}, got {self.state!r}"[:200])


KINDS = {m.TYPE: m for m in (NodeJoin, NodeLaunch, NodeStatus)}


class NodeLink:
    """One ZMQ socket of the node channel (node 0: a ROUTER, node R: a DEALER), used by one thread at a time:
    `send` seals and counts, `recv` checks the tag and the count before the message is parsed."""

    def __init__(self, sock: zmq.Socket, token: Optional[str]) -> None:
        self.sock, self._auth = sock, FrameAuth(token, NODE_TAG_LABEL)
        self._sent, self._seen = 0, {}  # messages sent; per node, the last count taken
        self._rejects = RejectLog(logger)
        self.router = sock.type == zmq.ROUTER

    def send(self, make, to: Optional[bytes] = None) -> None:
        """`make(seq)` builds the message; `to`: the peer's ROUTER identity (node 0)."""
        self._sent += 1
        frames = self._auth.seal(make(self._sent).encode())
        self.sock.send_multipart(([to] if self.router else []) + frames)

    def recv(self, timeout_s: float) -> Optional[tuple[Optional[bytes], Message]]:
        """(the sender's identity on a ROUTER, the message), or None when nothing valid came in time."""
        deadline = time.monotonic() + timeout_s
        while self.sock.poll(max(0.0, deadline - time.monotonic()) * 1000):
            frames, sender = recv_with_peer(self.sock)
            ident = frames.pop(0) if self.router else None
            msg = self._open(frames, sender)
            if msg is not None:
                return ident, msg
        return None

    def _open(self, frames: list, sender: Optional[str] = None) -> Optional[Message]:
        try:
            msg = read_message(self._auth.open(frames), KINDS, MAX_NODE_BYTES, 4096)
        except (AuthError, FrameError) as e:
            self._rejects.note(
                "node-frame", "pipeline node link: dropped a message: %s", e, peer=sender
            )
            return None
        if msg.seq <= self._seen.get(msg.node, 0):
            self._rejects.note(
                "replay", "pipeline node link: dropped a replayed message", peer=sender
            )
            return None
        if isinstance(msg, NodeJoin) and abs(msg.sent_at - time.time()) > JOIN_FRESH_S:
            self._rejects.note("stale", "pipeline node link: dropped a stale NodeJoin", peer=sender)
            return None
        self._seen[msg.node] = msg.seq
        return msg

    def close(self) -> None:
        self.sock.close(linger=500)
