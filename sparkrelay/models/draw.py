"""One random token per row: the one way sparkrelay draws from a distribution (the sampler, DSpark's
Markov head, the verify round's correction token), and the per-row uniforms it and the acceptance
test use.

A draw is the inverse CDF: the first index whose running sum of the row's weights exceeds u * the
row's total, u one uniform from the row's generator, sums in double (csrc/cpu_draw.cpp, or torch's
float64 cumsum where the kernel is not built). It replaced the exponential race (argmax of p / E,
E ~ Exp(1)), whose one exponential per vocabulary entry was the slowest part of a sampled step
(figures: docs/architecture.md, speed notes). A
request with its own seed takes its uniform from its own generator, so its draws do not depend on
the batch it shares; a zero weight is never drawn.
"""

from __future__ import annotations

from typing import Optional

import torch

from sparkrelay.models import cpu_kernels


def row_uniforms(
    generators: list[Optional[torch.Generator]],
    shared: Optional[torch.Generator],
    width: int = 1,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """U[0, 1) [R, width]: every row from `shared`, then a row with its own generator redrawn from
    it."""
    out = torch.empty(len(generators), width, dtype=dtype, device=device).uniform_(generator=shared)
    for r, gen in enumerate(generators):
        if gen is not None:
            out[r].uniform_(generator=gen)
    return out


def draw_rows(
    weights: torch.Tensor,
    generators: list[Optional[torch.Generator]],
    shared: Optional[torch.Generator],
) -> torch.Tensor:
    """weights [R, V] (>= 0, any scale; a row's probabilities or a residual) -> int64 [R], each
    index drawn with probability weight / row total."""
    u = row_uniforms(generators, shared, 1, torch.float64, weights.device).view(-1)  # [R]
    ext = cpu_kernels.portable() if weights.device.type == "cpu" else None
    if ext is not None and weights.dtype == torch.float32 and weights.stride(-1) == 1:
        return ext.draw_rows(weights, u)
    cdf = weights.to(torch.float64).cumsum(-1)  # [R, V]
    target = (u * cdf[:, -1]).unsqueeze(1)  # [R, 1]
    picked = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # a target that rounding put past the last sum takes the last token with weight
    last = (weights > 0).long().cumsum(-1).argmax(-1)
    return torch.minimum(picked, last)
