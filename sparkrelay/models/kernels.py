"""Frozen linear layers for a loaded model: each keeps its weight in the layout its fastest product reads.

Decoding multiplies a few activation rows by every weight matrix once per step, so a step costs about the bytes
of the weights divided by the read bandwidth, if the kernel streams the weight at that bandwidth. Measured on a
2-core avx512_bf16 CPU without AMX, over the 113 matrices of Qwen3-0.6B's shape, one input row (best of 7):
bfloat16 `F.linear` ~68 ms and `x @ weight_t` ~85 ms per sweep, oneDNN with the weight pre-packed ~50 ms
(~24 GB/s, the measured bandwidth); float32 `x @ weight_t` runs near bandwidth already. So:

    float32 (or not on CPU)  TLinear       weight transposed once, [in, out]; `x @ weight_t` (MKL)
    bfloat16 on CPU          PackedLinear  weight reordered once into oneDNN's blocked layout (an opaque mkldnn
                                           tensor); `_linear_pointwise` reads it as it is, for any row count

`frozen_linear` picks one. Nothing here converts or copies a weight per call. An LM head is kept besides its
nn.Linear (tied, that is the embedding the lookup reads): `fast_head` gives it a second copy where that pays, always
packed in bfloat16 (a [151936, 1024] head: ~25 ms instead of ~45 ms per one-row product, for 311 MB), transposed in
float32 only while small (HEAD_COPY_BYTES; a large float32 head reads at bandwidth through F.linear already).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

HEAD_COPY_BYTES = 64 << 20  # largest float32 LM head given a transposed CPU copy


class TLinear(nn.Module):
    """A loaded, frozen Linear that keeps its weight transposed, [in, out]: `x @ weight_t` is about a third faster
    than `F.linear(x, weight)` for the one-row products of decoding on CPU (measured with MKL, fp32)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(weight.detach().t().contiguous(), requires_grad=False)  # [in, out]
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        return self.weight_t.t()  # [out, in] view, for code that reads the weight

    @property
    def dtype(self) -> torch.dtype:
        return self.weight_t.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.matmul(x, self.weight_t)
        return y if self.bias is None else y + self.bias


class PackedLinear(nn.Module):
    """A loaded, frozen Linear whose weight oneDNN reordered once (for one-row products; larger batches read the same
    layout). x [..., in] -> [..., out], in the weight's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        w = weight.detach().contiguous()  # [out, in]
        self.out_features, self.in_features = w.shape
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(w, 1), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """[out, in], a dense copy (for code that reads the weight once, never on a hot path)."""
        return self.packed.to_dense()

    @property
    def dtype(self) -> torch.dtype:
        return self.packed.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # inductor lowers this op only for weights it packed itself (freezing)
            return packed_linear(x, self.packed, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


@torch.library.custom_op("sparkrelay::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """PackedLinear's product as one opaque op for torch.compile (eager calls skip its ~50 us dispatch)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], packed.shape[0])  # [..., out]


def can_pack(weight: torch.Tensor) -> bool:
    """oneDNN's packed product is the fast one for bfloat16 weights on CPU (float32 stays on MKL's, see above)."""
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()


def frozen_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
    """weight [out, in] (+ bias [out]) -> the fastest frozen layer for its dtype and device (module docstring)."""
    return PackedLinear(weight, bias) if can_pack(weight) else TLinear(weight, bias)


def fast_head(weight: torch.Tensor) -> nn.Module | None:
    """A frozen copy of the LM head `weight` [V, d] for the logits, or None where F.linear on it is as fast."""
    small = weight.device.type == "cpu" and weight.numel() * weight.element_size() <= HEAD_COPY_BYTES
    return frozen_linear(weight) if can_pack(weight) or small else None
