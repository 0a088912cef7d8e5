"""Token bitmasks: one int32 word per 32 tokens (token t is bit t % 32 of word t // 32), the layout
both backends write. `constrain` puts -inf on every banned token of the rows that carry a grammar,
through sparkrelay's kernel on a CPU that has it (torch's unpack-and-fill otherwise)."""

from __future__ import annotations

from typing import Optional

import torch

from sparkrelay.models import cpu_kernels

_BITS = torch.arange(32, dtype=torch.int32)


def words(vocab: int) -> int:
    return (vocab + 31) // 32


def allowing_all(rows: int, vocab: int) -> torch.Tensor:
    """int32 [rows, W], every bit set: a row nobody constrains."""
    return torch.full((rows, words(vocab)), -1, dtype=torch.int32)


def _apply_torch(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    # [R, W, 32] -> [R, V] keep flags
    keep = ((bitmask.unsqueeze(-1) >> _BITS) & 1).bool().view(bitmask.shape[0], -1)
    logits.masked_fill_(~keep[:, : logits.shape[1]], float("-inf"))


def constrain(
    logits: torch.Tensor, bitmask: Optional[torch.Tensor], rows: Optional[list[int]] = None
) -> torch.Tensor:
    """logits [R, V] -> float32 logits [R, V] with -inf on each banned token of `rows` (every row when
    None; bitmask int32 [R, W] on the CPU). `logits` itself is never written: the raw logits also
    feed logprobs."""
    if bitmask is None or (rows is not None and not rows):
        return logits
    out = logits.to(torch.float32, copy=True)  # [R, V]
    ban_(out, bitmask, rows)
    return out


def ban_(logits: torch.Tensor, bitmask: torch.Tensor, rows: Optional[list[int]] = None) -> None:
    """In place: -inf on each banned token of `rows` (every row when None) of logits float32 [R, V]
    (rows at any stride, V contiguous; bitmask int32 [R, W]): for a buffer the caller owns, such as
    the drafter's slot logits, which need no copy."""
    if rows is None or len(rows) == logits.shape[0]:
        _apply(logits, bitmask.contiguous())
        return
    for r in rows:
        _apply(logits[r : r + 1], bitmask[r : r + 1].contiguous())


def _apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits float32 [M, V], bitmask int32 [M, W]."""
    ext = cpu_kernels.portable() if logits.device.type == "cpu" else None
    if ext is not None:
        ext.apply_token_bitmask(logits, bitmask)
    else:
        _apply_torch(logits, bitmask.to(logits.device))
