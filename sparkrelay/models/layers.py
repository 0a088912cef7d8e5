"""Building blocks shared by the target (qwen3.py) and, later, the DSpark drafter."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalize in float32, scale in the input dtype (as transformers does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, inter, bias=False)
        self.up_proj = nn.Linear(dim, inter, bias=False)
        self.down_proj = nn.Linear(inter, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Rotary:
    """Default (unscaled) RoPE with a precomputed cos/sin table, indexed by absolute position."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, device: torch.device) -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
        pos = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.cos, self.sin = emb.cos(), emb.sin()
        self.max_positions = max_positions

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `positions` [T] -> each [T, 1, D] (broadcast over heads)."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated at each token's position."""
    return x * cos + rotate_half(x) * sin


def rope_theta(hf_config: dict) -> float:
    """The RoPE base from `rope_theta` or `rope_parameters`; scaled RoPE variants are refused by name."""
    params = hf_config.get("rope_parameters") or {}
    scaling = hf_config.get("rope_scaling") or {}
    for kind in (params.get("rope_type"), scaling.get("rope_type"), scaling.get("type")):
        if kind not in (None, "default"):
            raise NotImplementedError(f"rope_type {kind!r} is not supported (only 'default')")
    theta = params.get("rope_theta", hf_config.get("rope_theta"))
    if theta is None:
        raise ValueError("config.json has neither rope_theta nor rope_parameters.rope_theta")
    return float(theta)
