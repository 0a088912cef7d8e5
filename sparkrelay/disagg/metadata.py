"""The per-request metadata row (docs/pd_protocol.md, the metadata row): a fixed byte layout derived
from the schema on both sides.

Fields, in row order:
    output_ids        int32 [16]       [0] = the first token sampled by the prefill
    cached_tokens     int32 [16]       [0] = prompt tokens the prefill reused (0: no prefix cache)
    first_logprob     float32 [1]      the first token's logprob (raw target logits; 0 unless the request asked)
    top_logprobs      float32 [20]     its top logprobs, most likely first (as many as asked, zeros after)
    top_ids           int32 [20]       their token ids (the decode reads as many as the request asked: the
                                       prefill and the decode get the same request body)
    last_hidden       dtype [W]        tail mode: the last prompt position's aux row (= tail_hidden[-1]; the decode
                                       checks that they agree)
    tail_hidden       dtype [tail, W]  tail mode: the last `tail` aux rows, right-aligned
    tail_valid        bool  [tail]     tail mode: which tail rows are real (a short prompt leaves leading rows 0)
    bootstrap_room    int64 [8]        [0] = the room; packed last, checked first (0 = not landed)
W = len(target_layer_ids) * hidden_size. The tail fields have zero size unless the handoff mode is `tail`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sparkrelay.disagg.schema import HandoffSchema
from sparkrelay.scheduler.request import MAX_TOP_LOGPROBS

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class MetadataLayout:
    fields: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]

    @classmethod
    def of(cls, schema: HandoffSchema) -> "MetadataLayout":
        w, tail, dt = schema.hidden_width, schema.tail_tokens, TORCH_DTYPES[schema.dtype]
        tail_on = schema.handoff == "tail"
        return cls(
            (
                ("output_ids", torch.int32, (16,)),
                ("cached_tokens", torch.int32, (16,)),
                ("first_logprob", torch.float32, (1,)),
                ("top_logprobs", torch.float32, (MAX_TOP_LOGPROBS,)),
                ("top_ids", torch.int32, (MAX_TOP_LOGPROBS,)),
                ("last_hidden", dt, (w if tail_on else 0,)),
                ("tail_hidden", dt, (tail if tail_on else 0, w)),
                ("tail_valid", torch.bool, (tail if tail_on else 0,)),
                ("bootstrap_room", torch.int64, (8,)),
            )
        )

    @staticmethod
    def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
        n = 1
        for s in shape:
            n *= s
        return n * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        return sum(self._nbytes(dt, shape) for _, dt, shape in self.fields)


@dataclass
class MetadataRow:
    first_token: int
    room: int
    last_hidden: torch.Tensor  # [W] (empty unless tail)
    tail_hidden: torch.Tensor  # [tail, W]
    tail_valid: torch.Tensor  # [tail] bool
    cached_tokens: int = 0
    first_logprob: float = 0.0
    # up to MAX_TOP_LOGPROBS (logprob, id)
    top_logprobs: list[tuple[float, int]] = field(default_factory=list)


def _padded(values: list, dtype: torch.dtype) -> torch.Tensor:
    """[MAX_TOP_LOGPROBS]: the values, zeros after (ValueError when there are more)."""
    if len(values) > MAX_TOP_LOGPROBS:
        raise ValueError(
            f"metadata field top_logprobs: {len(values)} entries; the row holds {MAX_TOP_LOGPROBS}"
        )
    return torch.tensor(list(values) + [0] * (MAX_TOP_LOGPROBS - len(values)), dtype=dtype)


def build_tail(rows: torch.Tensor, tail: int) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [n, W] (every prompt position's aux row) -> (tail_hidden [tail, W] right-aligned, valid [tail])."""
    n, w = rows.shape
    k = min(n, tail)
    out = rows.new_zeros(tail, w)
    valid = torch.zeros(tail, dtype=torch.bool)
    if k:
        out[tail - k :] = rows[n - k :]
        valid[tail - k :] = True
    return out, valid


class TailRows:
    """The last `tail` aux rows of an n-row prompt, filled chunk by chunk at absolute positions;
    rows before n - tail are never kept, so a prompt of any length costs [tail, W]. rows / valid are
    build_tail's right-aligned layout."""

    def __init__(self, n: int, tail: int, width: int, dtype: torch.dtype) -> None:
        # the absolute position of rows[0] (negative: the prompt is shorter than the tail)
        self.first = n - tail
        self.rows = torch.zeros(tail, width, dtype=dtype)  # [tail, W]
        self.valid = torch.zeros(tail, dtype=torch.bool)  # [tail]

    def write(self, start: int, aux: torch.Tensor) -> None:
        """aux [t, W]: the rows of positions [start, start + t); only those at or after n - tail are
        kept."""
        end = start + aux.shape[0]
        lo = max(start, self.first)
        if lo >= end:
            return
        self.rows[lo - self.first : end - self.first] = aux[lo - start :]
        self.valid[lo - self.first : end - self.first] = True


def pack(layout: MetadataLayout, row: MetadataRow) -> bytes:
    """The row's bytes in layout order; the room is written last (a reader that sees it sees the
    rest)."""
    values = {
        "output_ids": torch.tensor([row.first_token] + [0] * 15, dtype=torch.int32),
        "cached_tokens": torch.tensor([row.cached_tokens] + [0] * 15, dtype=torch.int32),
        "last_hidden": row.last_hidden,
        "tail_hidden": row.tail_hidden,
        "tail_valid": row.tail_valid,
        "first_logprob": torch.tensor([row.first_logprob], dtype=torch.float32),
        "top_logprobs": _padded([v for v, _ in row.top_logprobs], torch.float32),
        "top_ids": _padded([t for _, t in row.top_logprobs], torch.int32),
    }
    chunks = []
    for name, dtype, shape in layout.fields[:-1]:
        t = values[name].to(dtype).contiguous().cpu()
        if tuple(t.shape) != shape:
            raise ValueError(
                f"metadata field {name}: shape {tuple(t.shape)} is not the schema's {shape}"
            )
        chunks.append(t.view(-1).view(torch.uint8).numpy().tobytes())
    chunks.append(
        torch.tensor([row.room] + [0] * 7, dtype=torch.int64).view(torch.uint8).numpy().tobytes()
    )
    return b"".join(chunks)


def unpack(layout: MetadataLayout, data: bytes) -> MetadataRow:
    """Inverse of pack; ValueError when the byte count is not the layout's."""
    if len(data) != layout.nbytes:
        raise ValueError(
            f"metadata row has {len(data)} bytes; the schema's layout has {layout.nbytes}"
        )
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out, offset = {}, 0
    for name, dtype, shape in layout.fields:
        size = MetadataLayout._nbytes(dtype, shape)
        # clone: aligned for the view
        out[name] = buf[offset : offset + size].clone().view(dtype).view(shape)
        offset += size
    return MetadataRow(
        first_token=int(out["output_ids"][0]),
        room=int(out["bootstrap_room"][0]),
        last_hidden=out["last_hidden"],
        tail_hidden=out["tail_hidden"],
        tail_valid=out["tail_valid"].clone(),
        cached_tokens=int(out["cached_tokens"][0]),
        first_logprob=float(out["first_logprob"][0]),
        top_logprobs=list(zip(out["top_logprobs"].tolist(), out["top_ids"].tolist())),
    )
