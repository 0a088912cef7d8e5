"""Every send and receive of the pipeline (docs/pd_protocol.md, failure modes 18, 31).

Topology: rank k sends descriptors and payloads to rank k+1; the last rank sends the sampled tokens to rank 0.

    rank 0 --(descriptor, payload)--> rank 1 --> ... --> rank N-1 --(tokens + logprobs float64 [B + E, W])--> rank 0

Per micro-batch, two messages (shapes: pipeline/descriptor.py and pipeline/capture.py):
    header int64 [8]
    frame  uint8 [N] (N > 0): body int64 [L] (L > 0), floats float64 [B, 6] (B > 0), and for a STEP with rows
           hidden [T, d], taps [T, k_prev*d], partial [T, d] (those the capture mode sends), each padded to 8 bytes
One frame, not a message per tensor: each message costs the receiving thread a wake-up (measured ~2 ms a hop with
six). Each rank does all its sends and receives on one thread, each message posted exactly once; the receiver
learns every size from the header first (and the widths from its PayloadShape), so the sizes on both ends always
agree. Everything goes on tag 0: point-to-point messages between a pair of ranks match in posting order.

The process group is built directly on a TCPStore (not torch.distributed's global default group), so an engine
process can hold several pipelines over its life (tests do). gloo on CPU, and on CUDA when the stages share a
GPU (tensors staged through host memory); NCCL when every stage has its own GPU (cuda:rank).
"""

from __future__ import annotations

import datetime
import math
import os
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from sparkrelay.pipeline.capture import PayloadShape, StagePayload
from sparkrelay.pipeline.descriptor import FLOAT_FIELDS, HEADER_LEN, STEP, MicroBatch, decode, encode, sizes
from sparkrelay.pipeline.launch import LOOPBACK_IFNAME, RENDEZVOUS_HOST

STEP_TIMEOUT = datetime.timedelta(seconds=600)  # gloo gives up on one message after this (a hung, live peer)


class PeerLost(RuntimeError):
    """A send or receive failed: a rank is gone (or hung past STEP_TIMEOUT). The pipeline cannot go on."""


def make_group(store: dist.Store, rank: int, world: int, backend: str) -> dist.ProcessGroup:
    """The pipeline's process group on `store` (blocks until all `world` ranks have joined)."""
    store = dist.PrefixStore("sparkrelay-pp", store)
    if backend == "nccl":
        # NCCL's bootstrap and socket transport listen on the interface it picks (not the loopback) unless told
        os.environ.setdefault("NCCL_SOCKET_IFNAME", LOOPBACK_IFNAME)
        return dist.ProcessGroupNCCL(store, rank, world)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=RENDEZVOUS_HOST)]  # pair listeners bind it
    opts._timeout = STEP_TIMEOUT
    return dist.ProcessGroupGloo(store, rank, world, opts)


class Channel:
    """One rank's end of the pipeline. `shape_in`: the payload this rank receives (None on rank 0); `health`
    raises when the pipeline is down (NCCL waits poll it; gloo waits raise by themselves when a peer dies)."""

    def __init__(self, group: dist.ProcessGroup, rank: int, world: int, backend: str, device: torch.device,
                 shape_in: Optional[PayloadShape] = None, health: Callable[[], None] = lambda: None) -> None:
        self.group, self.rank, self.world, self.backend = group, rank, world, backend
        self.device, self.shape_in, self.health = device, shape_in, health
        self.wire = device if backend == "nccl" else torch.device("cpu")
        self.next, self.prev, self.last = rank + 1, rank - 1, world - 1
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []  # posted sends and the tensors they read

    # -- rank k -> rank k+1 ---------------------------------------------------------------------------------
    def send_step(self, mb: MicroBatch, payload: Optional[StagePayload]) -> None:
        """Post the descriptor and (STEP) the payload to the next rank, as a header and one frame; `flush` waits
        for them."""
        header, body, floats = encode(mb)
        parts = [body, floats]
        if mb.kind == STEP and payload is not None and mb.num_tokens:
            parts += [t for t in (payload.hidden, payload.taps, payload.partial) if t is not None]
        frame = _frame([t.to(self.wire) for t in parts if t.numel()])  # uint8 [N], contiguous
        for t in [header.to(self.wire)] + ([frame] if frame.numel() else []):
            self._pending.append((self._post(self.group.send, t, self.next), t))

    def flush(self) -> None:
        """Wait for every posted send."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            self._wait(work)

    def recv_step(self) -> tuple[MicroBatch, Optional[StagePayload]]:
        """The previous rank's next descriptor and, for a STEP with rows, its payload."""
        header = self._recv(torch.empty(HEADER_LEN, dtype=torch.int64))
        length, b, t = sizes(header)
        with_rows = int(header[0]) == STEP and t > 0
        shape = self.shape_in
        layout = [(torch.int64, (length,)), (torch.float64, (b, FLOAT_FIELDS))]
        if with_rows:
            layout += [(shape.dtype, (t, shape.hidden)), (shape.dtype, (t, shape.taps)),
                       (torch.float32, (t, shape.partial))]
        nbytes = sum(_padded(dtype, dims) for dtype, dims in layout)
        frame = torch.empty(nbytes, dtype=torch.uint8)
        frame = self._recv(frame, True) if nbytes else frame
        body, floats, *rows = _unframe(frame, layout)  # body, floats: the CPU; rows: the stage's device
        mb = decode(header, body.cpu(), floats.cpu())
        if not with_rows:
            return mb, None
        hidden, taps, partial = (r if r.numel() else None for r in rows)  # [T, d], [T, k_prev*d], [T, d]
        return mb, StagePayload(hidden, taps, partial)

    # -- last rank -> rank 0 ----------------------------------------------------------------------------------
    def send_tokens(self, rows: torch.Tensor) -> None:
        """Last rank: the micro-batch's reply, float64 [B + E, W] (descriptor.reply_shape): per sequence column 0
        the token (-1: no sample) then its logprobs; then E rows of scored prompt positions (zero-cost: E = 0 and
        W = 1 unless some sequence asked for logprobs). Posted, not waited for: rank 0 posts its receives only once
        it has fed the step's last micro-batch, and meanwhile this stage goes on with the next one (a blocking send
        here would serialise the chunks of a pipelined prefill); sends that completed are dropped, `flush` waits."""
        t = rows.to(torch.float64).to(self.wire).contiguous()
        self._pending = [(w, buf) for w, buf in self._pending if not w.is_completed()]
        self._pending.append((self._post(self.group.send, t, 0), t))

    def recv_tokens(self, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Rank 0: each micro-batch's reply ([B_i + E_i, W_i] float64, descriptor.reply_shape of its descriptor),
        in micro-batch order."""
        bufs = [torch.empty(b, w, dtype=torch.float64, device=self.wire) for b, w in shapes]
        works = [self._post(self.group.recv, b, self.last) for b in bufs]
        for w in works:
            self._wait(w)
        return [b.cpu() for b in bufs]

    # -- helpers -------------------------------------------------------------------------------------------------
    def _recv(self, buf: torch.Tensor, on_device: bool = False) -> torch.Tensor:
        """Receive into `buf` from the previous rank -> the stage's device (payload) or the CPU (descriptor)."""
        buf = buf.to(self.wire)
        self._wait(self._post(self.group.recv, buf, self.prev))
        return buf.to(self.device) if on_device else buf.cpu()

    @staticmethod
    def _post(op: Callable, tensor: torch.Tensor, peer: int) -> dist.Work:
        """group.send / group.recv of one tensor, tag 0."""
        try:
            return op([tensor], peer, 0)
        except RuntimeError as e:
            raise PeerLost(f"posting to rank {peer} failed: {e}") from e

    def _wait(self, work: dist.Work) -> None:
        try:
            if self.backend != "nccl":
                work.wait()  # gloo: raises "Connection closed by peer" when the other end dies
                return
            while not work.is_completed():  # NCCL would wait forever on a dead peer: poll the watchdog instead
                self.health()
                time.sleep(50e-6)
        except RuntimeError as e:
            raise PeerLost(str(e)) from e


def _nbytes(dtype: torch.dtype, dims: tuple[int, ...]) -> int:
    return math.prod(dims) * dtype.itemsize


def _padded(dtype: torch.dtype, dims: tuple[int, ...]) -> int:
    """Bytes a tensor of `dtype` and shape `dims` takes in a frame: rounded up to 8, so every part starts aligned."""
    return -(-_nbytes(dtype, dims) // 8) * 8


def _frame(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Tensors (one device) -> uint8 [N]: their bytes in order, each padded to 8 bytes."""
    parts = []
    for t in tensors:
        raw = t.contiguous().view(-1).view(torch.uint8)
        pad = _padded(t.dtype, tuple(t.shape)) - raw.numel()
        parts += [raw, torch.zeros(pad, dtype=torch.uint8, device=raw.device)] if pad else [raw]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def _unframe(frame: torch.Tensor, layout: list[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
    """The inverse of `_frame`: views of `frame` (uint8 [N]) with each layout entry's dtype and shape."""
    out, at = [], 0
    for dtype, dims in layout:
        out.append(frame[at : at + _nbytes(dtype, dims)].view(dtype).view(dims))
        at += _padded(dtype, dims)
    assert at == frame.numel(), f"a frame of {frame.numel()} bytes for a layout of {at}"
    return out
