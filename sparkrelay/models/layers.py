"""Building blocks shared by the target (decoder.py) and the DSpark drafter."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from sparkrelay.models import cpu_kernels
from sparkrelay.models.kernels import frozen_linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, G, D] normalized over D, scaled by weight [G, D] (G = 1: one weight for every row).
    float32: torch's fused kernel. bfloat16: normalized in float32, rounded, then scaled in bf16,
    as transformers does; on CPU with the kernels, one pass (csrc/cpu_elementwise.cpp) instead of eight ops."""
    if x.dtype == torch.float32:  # one fused kernel
        if weight.shape[0] == 1:
            return F.rms_norm(x, (x.shape[-1],), weight[0], eps)
        return F.rms_norm(x, (x.shape[-1],), None, eps) * weight
    ext = _norm_kernel(x, weight)
    if ext is not None:
        return ext.rms_norm_bf16(x, weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def _bf16_kernels(*tensors: torch.Tensor):
    """The extension when every tensor is bfloat16 on CPU and no trace is running, else None."""
    if any(t.device.type != "cpu" or t.dtype != torch.bfloat16 for t in tensors):
        return None
    return None if torch.compiler.is_compiling() else cpu_kernels.portable()


def _heads_contiguous(x: torch.Tensor) -> bool:
    """x [T, G, D]: D contiguous and a token's G rows D apart (tokens at any stride)."""
    return x.stride(-1) == 1 and (x.shape[1] == 1 or x.stride(1) == x.shape[-1])


def _norm_kernel(x: torch.Tensor, weight: torch.Tensor):
    """The extension when it can take (x, weight), else None."""
    return _bf16_kernels(x, weight) if _heads_contiguous(x) else None


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalize in float32, scale in the input dtype (as transformers does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1]
        return rms_norm(x.reshape(-1, 1, d), self.weight.view(1, d), self.eps).view(x.shape)


class SwiGLU(nn.Module):
    """gate_proj / up_proj as in the checkpoint; `fuse()` merges them into one [2 * inter, dim]
    matmul after loading."""

    def __init__(self, dim: int, inter: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, inter, bias=bias)
        self.up_proj = nn.Linear(dim, inter, bias=bias)
        self.down_proj = nn.Linear(inter, dim, bias=bias)
        self.gate_up: nn.Module | None = None

    def fuse(self) -> None:
        self.gate_up = fuse_linears(self.gate_proj, self.up_proj)
        self.down_proj = transposed(self.down_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj.forward(silu_mul(self.gate_up.forward(x)))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2 * inter] (gate, then up) -> silu(gate) * up [..., inter], rounded per op in
    bf16 as transformers does; bf16 on CPU in one pass (csrc/cpu_elementwise.cpp) instead of three
    ops."""
    ext = _bf16_kernels(gate_up)
    if ext is None or gate_up.stride(-1) != 1:
        gate, up = gate_up.chunk(2, dim=-1)  # 2 x [..., inter]
        return F.silu(gate) * up
    two = gate_up.shape[-1]
    # [N, 2 * inter] -> [N, inter] -> [..., inter]
    return ext.silu_mul_bf16(gate_up.reshape(-1, two)).view(*gate_up.shape[:-1], two // 2)


def transposed(linear: nn.Linear) -> nn.Module:
    """The loaded `linear` as a frozen layer in its fastest layout (kernels.frozen_linear)."""
    return frozen_linear(linear.weight, linear.bias)


def fuse_linears(*linears: nn.Linear) -> nn.Module:
    """One frozen layer whose output is the concatenation of the given ones' outputs (fewer, larger
    kernels)."""
    weight = torch.cat([lin.weight for lin in linears], dim=0)
    bias = torch.cat([lin.bias for lin in linears], dim=0) if linears[0].bias is not None else None
    return frozen_linear(weight, bias)


class Rotary:
    """RoPE with a precomputed cos/sin table, indexed by absolute position; `scaling`
    (rope_scaling's result) rescales the frequencies (linear, Llama 3), as transformers' rope init
    functions do."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        max_positions: int,
        device: torch.device,
        scaling: tuple | None = None,
    ) -> None:
        inv_freq = 1.0 / (
            theta
            ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)
        )
        inv_freq = scaled_inv_freq(inv_freq, scaling)
        pos = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.cos = emb.cos()
        # rotate_half(x) * sin == roll(x, D/2) * sin_signed, with the first half of sin negated
        sin = emb.sin()
        self.sin = torch.cat((-sin[:, : head_dim // 2], sin[:, head_dim // 2 :]), dim=-1)
        self.max_positions = max_positions
        self.by_dtype: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {
            torch.float32: (self.cos, self.sin)
        }

    def table(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `positions` [T] -> each [T, 1, D] (broadcast over heads), read from a table already in
        `dtype` (converted once, on first use: no conversion per step)."""
        if dtype not in self.by_dtype:
            self.by_dtype[dtype] = (self.cos.to(dtype), self.sin.to(dtype))
        cos, sin = self.by_dtype[dtype]
        return cos.index_select(0, positions).unsqueeze(1), sin.index_select(
            0, positions
        ).unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated at each token's position (cos, sin_signed [T, 1, D] from
    `Rotary.table`); bf16 on CPU in one pass, bit-equal to the three torch ops (csrc/cpu_elementwise.cpp)."""
    ext = _bf16_kernels(x, cos, sin_signed)
    if ext is not None and x.dim() == 3 and x.shape[-1] % 32 == 0 and _heads_contiguous(x):
        return ext.rope_bf16(x, cos, sin_signed)
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed


def rope_theta(hf_config: dict) -> float:
    """The RoPE base from `rope_theta` or `rope_parameters`."""
    params = hf_config.get("rope_parameters") or {}
    theta = params.get("rope_theta", hf_config.get("rope_theta"))
    if theta is None:
        raise ValueError("config.json has neither rope_theta nor rope_parameters.rope_theta")
    return float(theta)


ROPE_KINDS = ("default", "linear", "llama3")


def rope_scaling(hf_config: dict) -> tuple | None:
    """(kind, sorted (name, value) pairs) from `rope_scaling` or `rope_parameters`, None for plain
    RoPE; a kind outside ROPE_KINDS is refused by name."""
    params = dict(hf_config.get("rope_scaling") or {}) or dict(
        hf_config.get("rope_parameters") or {}
    )
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    if kind not in ROPE_KINDS:
        raise NotImplementedError(
            f"rope_type {kind!r} is not supported (supported: {', '.join(ROPE_KINDS)})"
        )
    if kind == "default":
        return None
    params.pop("rope_theta", None)
    return kind, tuple(
        sorted((k, float(v)) for k, v in params.items() if isinstance(v, (int, float)))
    )


def scaled_inv_freq(inv_freq: torch.Tensor, scaling: tuple | None) -> torch.Tensor:
    """inv_freq [D/2] under `scaling`: linear divides every frequency by `factor`; Llama 3 divides
    the low ones (wavelength beyond original_max_position_embeddings / low_freq_factor), keeps the
    high ones and blends between."""
    if scaling is None:
        return inv_freq
    kind, p = scaling[0], dict(scaling[1])
    if kind == "linear":
        return inv_freq / p["factor"]
    factor, low, high, old = (
        p["factor"],
        p["low_freq_factor"],
        p["high_freq_factor"],
        p["original_max_position_embeddings"],
    )
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, blended, scaled)
