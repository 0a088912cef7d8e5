"""Every send and receive of the pipeline (docs/pd_protocol.md, failure modes 18, 31).

Topology: rank k sends descriptors and payloads to rank k+1; the last rank sends the sampled tokens
to rank 0.

    rank 0 --(descriptor, payload)--> rank 1 --> ... --> rank N-1 --(tokens + logprobs float64 [B + E, W])--> rank 0

Per micro-batch, two messages (shapes: pipeline/descriptor.py and pipeline/capture.py):
    header int64 [8]
    frame  uint8 [N] (N > 0): body int64 [L] (L > 0), floats float64 [B, 6] (B > 0), and for a STEP with rows
           hidden [T, d], taps [T, k_prev*d], partial [T, d] (those the capture mode sends), each padded to 8 bytes
One frame, not a message per tensor: each message costs the receiving thread a wake-up, which adds up over a hop
(speed notes of docs/architecture.md). Each rank does all its sends and receives on one thread, each message
posted exactly once; the receiver learns every size from the header first (and the widths from its PayloadShape),
so the sizes on both ends always agree, and messages between a pair of ranks arrive in posting order.

Two wires carry them (`connect`):
- `SocketWire`, on CPU and whenever the stages share memory (CUDA stages on one GPU stage through
  the host): ZMQ PUSH/PULL on ipc:// files in a private folder; each rank binds one PULL socket, its
  only sender being the rank before it (rank 0's: the last rank). A send is copied into ZMQ's queue
  and flows at once, eagerly. Not gloo: it moves a message only after a rendezvous between both
  processes' network threads, so a stage sat idle between chunks whose payload had long been sent
  (speed notes of docs/architecture.md).
- `GroupWire`: NCCL's point-to-point ops when every stage has its own GPU (cuda:rank), on a process
  group built directly on the TCPStore (not torch.distributed's global default group), so an engine
  process can hold several pipelines over its life (tests do).
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch
import torch.distributed as dist
import zmq

from sparkrelay.pipeline.capture import PayloadShape, StagePayload
from sparkrelay.pipeline.descriptor import (
    FLOAT_FIELDS,
    HEADER_LEN,
    STEP,
    MicroBatch,
    decode,
    encode,
    sizes,
)
from sparkrelay.pipeline.launch import LOOPBACK_IFNAME
from sparkrelay.transfer.protocol import AuthError
from sparkrelay.transfer.wire import FrameAuth, RejectLog, recv_with_peer, tcp_endpoint

logger = logging.getLogger(__name__)
PIPELINE_TAG_LABEL = b"sparkrelay-pipeline-frame-v1"

# rank 0 gives up on a step's reply after this (a hung, live peer)
STEP_TIMEOUT = datetime.timedelta(seconds=600)
POLL_S = 0.1  # a wait on a SocketWire checks the pipeline's health this often


class PeerLost(RuntimeError):
    """A send or receive failed: a rank is gone (or hung past STEP_TIMEOUT). The pipeline cannot go
    on."""


class Wire(Protocol):
    def send(self, tensor: torch.Tensor, peer: int) -> Optional[dist.Work]:
        """Post `tensor` (contiguous, on the wire's device) to `peer`; a Work to wait on while it is
        still read."""

    def recv(
        self, buf: torch.Tensor, peer: int, health: Callable[[], None], deadline: Optional[float]
    ) -> None:
        """Fill `buf` with `peer`'s next message (exactly its size); raise PeerLost when `health`
        raises or when time.monotonic() passes `deadline` (None: wait as long as it takes, e.g. an
        idle stage)."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class WirePlan:
    """Where each rank's inbox is. A rank binds one PULL socket, whose only sender is the rank before it (rank
    0's: the last rank): an ipc:// file in its node's private folder when that sender runs on the same host, else
    tcp://HOST:base_port + 1 + rank on its node's host, with every frame authenticated (a peer on the network
    cannot inject activations). One host: node_of all 0, every inbox ipc://."""

    world: int
    ipc_dir: str
    node_of: tuple[int, ...] = ()  # per rank: its node (empty: all on this host)
    hosts: tuple[str, ...] = ()  # per node: the address its pipeline sockets bind
    base_port: int = 0

    def node(self, rank: int) -> int:
        return self.node_of[rank] if self.node_of else 0

    def remote_inbox(self, rank: int) -> bool:
        """True when `rank`'s sender runs on another host (its inbox is tcp://)."""
        sender = rank - 1 if rank else self.world - 1
        return self.node(sender) != self.node(rank)

    def inbox(self, rank: int) -> str:
        if self.remote_inbox(rank):
            return tcp_endpoint(self.hosts[self.node(rank)], self.base_port + 1 + rank)
        return f"ipc://{self.ipc_dir}/rank{rank}"

    def to_dict(self) -> dict:
        return {
            "node_of": list(self.node_of),
            "hosts": list(self.hosts),
            "base_port": self.base_port,
        }

    @classmethod
    def from_dict(cls, world: int, ipc_dir: str, d: dict) -> "WirePlan":
        return cls(world, ipc_dir, tuple(d["node_of"]), tuple(d["hosts"]), d["base_port"])


def connect(
    store: dist.Store, rank: int, backend: str, plan: WirePlan, token: Optional[str] = None
) -> Wire:
    """This rank's wire (module docstring): `backend` "nccl" -> GroupWire (blocks until all ranks have joined),
    "ipc" -> SocketWire by `plan` (token: the shared secret of its tcp:// links)."""
    if backend == "nccl":
        # NCCL's bootstrap and socket transport listen on the interface it picks (not the loopback)
        # unless told
        os.environ.setdefault("NCCL_SOCKET_IFNAME", LOOPBACK_IFNAME)
        return GroupWire(
            dist.ProcessGroupNCCL(dist.PrefixStore("sparkrelay-pp", store), rank, plan.world)
        )
    return SocketWire(plan, rank, token)


class SocketWire:
    """ZMQ PUSH/PULL by a WirePlan. On a tcp:// link every message is three frames, [bytes, seq u64be, tag]: the
    tag (FrameAuth, the transfer layer's token) covers the bytes and the sender's message count, so a frame from a
    stranger, or one replayed, is dropped and logged, never taken for a step."""

    def __init__(self, plan: WirePlan, rank: int, token: Optional[str] = None) -> None:
        self._ctx = zmq.Context(1)
        self._auth = FrameAuth(token, PIPELINE_TAG_LABEL)
        self._rejects = RejectLog(logger)
        self._inbox = self._ctx.socket(zmq.PULL)
        self._tagged_in = plan.remote_inbox(rank)
        self._bind(plan.inbox(rank))
        self._seen = 0  # messages accepted on a tcp:// inbox
        peers = {rank + 1} if rank + 1 < plan.world else set()
        if rank == plan.world - 1:
            peers.add(0)  # the last rank's replies
        self._out: dict[int, zmq.Socket] = {}
        self._sent: dict[int, int] = {}  # per tcp:// peer: messages sent
        for peer in peers:
            sock = self._ctx.socket(zmq.PUSH)
            # never blocks: a dead peer is found by the receiver's health checks
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 1000)  # the shutdown descriptor still leaves
            sock.connect(plan.inbox(peer))
            self._out[peer] = sock
            if plan.remote_inbox(peer):
                self._sent[peer] = 0

    def _bind(self, address: str) -> None:
        try:
            self._inbox.bind(address)
        except zmq.ZMQError as e:
            self._ctx.destroy(linger=0)
            raise OSError(f"pipeline inbox {address}: cannot bind ({e})") from None

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        # copied now: the tensor may change once this returns
        if peer not in self._sent:
            self._out[peer].send(_bytes_of(tensor), copy=True)
            return
        self._sent[peer] += 1
        frames = [bytes(_bytes_of(tensor)), self._sent[peer].to_bytes(8, "big")]
        self._out[peer].send_multipart(self._auth.seal(frames), copy=True)

    def recv(
        self, buf: torch.Tensor, peer: int, health: Callable[[], None], deadline: Optional[float]
    ) -> None:
        while True:
            self._wait(peer, health, deadline)
            if not self._tagged_in:
                got = self._recv_into(buf)
                break
            got = self._recv_tagged(buf, peer)
            if got is not None:
                break
        want = buf.numel() * buf.element_size()
        if got != want:
            raise PeerLost(f"rank {peer} sent {got} bytes where {want} were due")

    def _wait(self, peer: int, health: Callable[[], None], deadline: Optional[float]) -> None:
        while not self._inbox.poll(POLL_S * 1000):
            try:
                health()
            except RuntimeError as e:
                raise PeerLost(str(e)) from e
            if deadline is not None and time.monotonic() > deadline:
                raise PeerLost(
                    f"no message from rank {peer} in {STEP_TIMEOUT.total_seconds():.0f} s"
                )

    def _recv_into(self, buf: torch.Tensor) -> int:
        want = buf.numel() * buf.element_size()
        return self._inbox.recv_into(_bytes_of(buf)) if want else len(self._inbox.recv())

    def _recv_tagged(self, buf: torch.Tensor, peer: int) -> Optional[int]:
        """One tcp:// message into `buf`: its size, or None when it was dropped (no valid tag, or not the next
        message of the sender's count: a replay)."""
        frames, sender = recv_with_peer(self._inbox)
        try:
            data, seq = self._auth.open(frames)
        except (AuthError, ValueError) as e:
            self._rejects.note(
                "auth",
                "pipeline inbox: dropped a message on rank %d's link: %s",
                peer,
                e,
                peer=sender,
            )
            return None
        if len(seq) != 8 or int.from_bytes(seq, "big") != self._seen + 1:
            self._rejects.note(
                "replay",
                "pipeline inbox: dropped a message out of sequence (a replay?)",
                peer=sender,
            )
            return None
        self._seen += 1
        mine = _bytes_of(buf)
        if len(data) == len(mine):
            mine[:] = data
        return len(data)

    def close(self) -> None:
        self._ctx.destroy(linger=1000)


class GroupWire:
    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def send(self, tensor: torch.Tensor, peer: int) -> dist.Work:
        return _post(self.group.send, tensor, peer)

    def recv(
        self, buf: torch.Tensor, peer: int, health: Callable[[], None], deadline: Optional[float]
    ) -> None:
        work = _post(self.group.recv, buf, peer)
        # NCCL would wait forever on a dead peer: poll the watchdog instead
        while not work.is_completed():
            try:
                health()
            except RuntimeError as e:
                raise PeerLost(str(e)) from e
            time.sleep(50e-6)

    def close(self) -> None:
        pass


def _post(op: Callable, tensor: torch.Tensor, peer: int) -> dist.Work:
    """group.send / group.recv of one tensor, tag 0."""
    try:
        return op([tensor], peer, 0)
    except RuntimeError as e:
        raise PeerLost(f"posting to rank {peer} failed: {e}") from e


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, shared (no copy)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class Channel:
    """One rank's end of the pipeline, over `wire` (connect). `shape_in`: the payload this rank
    receives (None on rank 0); `health` raises RuntimeError when the pipeline is down (every wait
    polls it: rank 0's is the watchdog; a worker's default never raises, its parent-watch ends it
    when rank 0 is gone)."""

    def __init__(
        self,
        wire: Wire,
        rank: int,
        world: int,
        backend: str,
        device: torch.device,
        shape_in: Optional[PayloadShape] = None,
        health: Callable[[], None] = lambda: None,
    ) -> None:
        self.rank, self.world, self.backend = rank, world, backend
        self.device, self.shape_in, self.health, self._wire = device, shape_in, health, wire
        self.wire = device if backend == "nccl" else torch.device("cpu")
        self.next, self.prev, self.last = rank + 1, rank - 1, world - 1
        self._pending: list[
            tuple[Optional[dist.Work], torch.Tensor]
        ] = []  # posted sends, the tensors they read

    def close(self) -> None:
        self._wire.close()

    # -- rank k -> rank k+1 ------------------------------------------------------------------------
    def send_step(self, mb: MicroBatch, payload: Optional[StagePayload]) -> None:
        """Post the descriptor and (STEP) the payload to the next rank, as a header and one frame;
        `flush` waits for them."""
        header, body, floats = encode(mb)
        parts = [body, floats]
        if mb.kind == STEP and payload is not None and mb.num_tokens:
            parts += [t for t in (payload.hidden, payload.taps, payload.partial) if t is not None]
        frame = _frame([t.to(self.wire) for t in parts if t.numel()])  # uint8 [N], contiguous
        for t in [header.to(self.wire)] + ([frame] if frame.numel() else []):
            self._pending.append((self._wire.send(t, self.next), t))

    def flush(self) -> None:
        """Wait for every posted send."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            self._wait(work)

    def recv_step(self) -> tuple[MicroBatch, Optional[StagePayload]]:
        """The previous rank's next descriptor and, for a STEP with rows, its payload."""
        header = self._recv(torch.empty(HEADER_LEN, dtype=torch.int64), idle=True)
        length, b, t = sizes(header)
        with_rows = int(header[0]) == STEP and t > 0
        shape = self.shape_in
        layout = [(torch.int64, (length,)), (torch.float64, (b, FLOAT_FIELDS))]
        if with_rows:
            layout += [
                (shape.dtype, (t, shape.hidden)),
                (shape.dtype, (t, shape.taps)),
                (torch.float32, (t, shape.partial)),
            ]
        nbytes = sum(_padded(dtype, dims) for dtype, dims in layout)
        frame = torch.empty(nbytes, dtype=torch.uint8)
        frame = self._recv(frame, True) if nbytes else frame
        # body, floats: the CPU; rows: the stage's device
        body, floats, *rows = _unframe(frame, layout)
        mb = decode(header, body.cpu(), floats.cpu())
        if not with_rows:
            return mb, None
        # [T, d], [T, k_prev*d], [T, d]
        hidden, taps, partial = (r if r.numel() else None for r in rows)
        return mb, StagePayload(hidden, taps, partial)

    # -- last rank -> rank 0 -----------------------------------------------------------------------
    def send_tokens(self, rows: torch.Tensor) -> None:
        """Last rank: the micro-batch's reply, float64 [B + E, W] (descriptor.reply_shape): per
        sequence column 0 the token (-1: no sample) then its logprobs; then E rows of scored prompt
        positions (zero-cost: E = 0 and W = 1 unless some sequence asked for logprobs). Posted, not
        waited for: rank 0 posts its receives only once it has fed the step's last micro-batch, and
        meanwhile this stage goes on with the next one (a blocking send here would serialise the
        chunks of a pipelined prefill); sends that completed are dropped, `flush` waits."""
        t = rows.to(torch.float64).to(self.wire).contiguous()
        self._pending = [
            (w, buf) for w, buf in self._pending if w is not None and not w.is_completed()
        ]
        self._pending.append((self._wire.send(t, 0), t))

    def recv_tokens(self, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Rank 0: each micro-batch's reply ([B_i + E_i, W_i] float64, descriptor.reply_shape of its
        descriptor), in micro-batch order."""
        bufs = [torch.empty(b, w, dtype=torch.float64, device=self.wire) for b, w in shapes]
        deadline = time.monotonic() + STEP_TIMEOUT.total_seconds()
        for b in bufs:
            self._wire.recv(b, self.last, self.health, deadline)
        return [b.cpu() for b in bufs]

    # -- helpers -----------------------------------------------------------------------------------
    def _recv(self, buf: torch.Tensor, on_device: bool = False, idle: bool = False) -> torch.Tensor:
        """Receive into `buf` from the previous rank -> the stage's device (payload) or the CPU (descriptor).
        idle: the next descriptor, which may be long in coming (an idle server); else within
        STEP_TIMEOUT."""
        buf = buf.to(self.wire)
        deadline = None if idle else time.monotonic() + STEP_TIMEOUT.total_seconds()
        self._wire.recv(buf, self.prev, self.health, deadline)
        return buf.to(self.device) if on_device else buf.cpu()

    def _wait(self, work: Optional[dist.Work]) -> None:
        """A posted send: done once it returns (SocketWire's are done when posted)."""
        while work is not None and not work.is_completed():
            try:
                self.health()
            except RuntimeError as e:
                raise PeerLost(str(e)) from e
            time.sleep(50e-6)


def _nbytes(dtype: torch.dtype, dims: tuple[int, ...]) -> int:
    return math.prod(dims) * dtype.itemsize


def _padded(dtype: torch.dtype, dims: tuple[int, ...]) -> int:
    """Bytes a tensor of `dtype` and shape `dims` takes in a frame: rounded up to 8, so every part
    starts aligned."""
    return -(-_nbytes(dtype, dims) // 8) * 8


def _frame(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Tensors (one device) -> uint8 [N]: their bytes in order, each padded to 8 bytes."""
    parts = []
    for t in tensors:
        raw = t.contiguous().view(-1).view(torch.uint8)
        pad = _padded(t.dtype, tuple(t.shape)) - raw.numel()
        parts += [raw, torch.zeros(pad, dtype=torch.uint8, device=raw.device)] if pad else [raw]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def _unframe(
    frame: torch.Tensor, layout: list[tuple[torch.dtype, tuple[int, ...]]]
) -> list[torch.Tensor]:
    """The inverse of `_frame`: views of `frame` (uint8 [N]) with each layout entry's dtype and
    shape."""
    out, at = [], 0
    for dtype, dims in layout:
        out.append(frame[at : at + _nbytes(dtype, dims)].view(dtype).view(dims))
        at += _padded(dtype, dims)
    assert at == frame.numel(), f"a frame of {frame.numel()} bytes for a layout of {at}"
    return out
