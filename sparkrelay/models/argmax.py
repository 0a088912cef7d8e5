"""The index of the largest value along the last dimension, as `torch.argmax(x, -1)` answers it (first of equal
maxima, first NaN), through the CPU kernel (csrc/cpu_argmax.cpp) where it is built: torch's own walks a row of
logits several times slower, and greedy decoding and every DSpark round take one per slot."""

from __future__ import annotations

import torch

from sparkrelay.models import cpu_kernels


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x [..., V] float32 or bfloat16 -> int64 [...]; any other dtype or device goes to torch."""
    ext = cpu_kernels.portable() if x.device.type == "cpu" and x.numel() > 0 else None
    if ext is None or x.dtype not in (torch.float32, torch.bfloat16) or x.dim() == 0:
        return x.argmax(-1)
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return ext.argmax_rows(rows).view(x.shape[:-1])
