"""Frozen linear layers for a loaded model: each keeps its weight in the layout its fastest product
reads.

Decoding multiplies a few activation rows by every weight matrix once per step, so a step costs
about the bytes of the weights divided by the read bandwidth, if the kernel streams the weight at
that bandwidth. Of the CPU layouts measured (MKL's `x @ weight_t`, F.linear, MKL packed, oneDNN
packed, inductor's CPP GEMM), oneDNN's packed one streams weights the fastest, in float32 and
bfloat16, at one row and at several (figures: speed notes of docs/architecture.md).

Where one of sparkrelay's kernels is built (models/cpu_kernels.py `portable()`: AVX-512 bf16, or
AVX2 + FMA), a bfloat16 weight is an AvxLinear: that kernel for the few rows of a decode step, oneDNN
for more. Elsewhere, and for float32, every large weight is reordered once into oneDNN's blocked
layout (PackedLinear, an opaque mkldnn tensor that `_linear_pointwise` reads as it is, for any row
count), but a bfloat16 one on a CPU whose oneDNN has no bfloat16 product (AVX2 only), which is
widened once to float32 (WideLinear; inside an AvxLinear, for its many-row products). A
small float32 weight (<
PACK_MIN_FP32
elements: the bundled tiny model's) keeps both layouts (SmallLinear, a few MB at most): one row goes
to MKL, whose `x @ weight_t` dispatches faster for a small weight, several rows (a DSpark verify or
draft block) to oneDNN. `frozen_linear` picks one. Nothing here converts or copies a weight per
call. An LM head is kept besides its nn.Linear (tied, that is the embedding the lookup reads):
`fast_head` gives it a second, packed copy on CPU, a faster one-row product for the memory of a
second head (311 MB for a bfloat16 [151936, 1024] head; a float32 head of that shape costs 622 MB
more).

oneDNN keeps what it built for each input shape in two caches, ideep's (LRU_CACHE_CAPACITY) and its
own primitive cache (ONEDNN_PRIMITIVE_CACHE_CAPACITY), 1,024 entries each by default. A server sees
a new row count with every new prompt length and batch, so its memory grew with them without bound
in sight. Importing this module caps both at ONEDNN_CACHE_ENTRIES unless the user set them, which
bounds the memory at a small cost in speed when batch sizes keep changing (figures: speed notes of
docs/architecture.md). Both are read when oneDNN first builds something, so this must run before the
first product (it does: every layer comes from here).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import nn

from sparkrelay.models import cpu_kernels

# float32 weights from this many elements up are packed only (module docstring)
PACK_MIN_FP32 = 1 << 19
KERNEL_ROWS = 8  # AvxLinear: rows from 1 to this through sparkrelay's kernel, more through oneDNN
ONEDNN_CACHE_ENTRIES = 64  # per oneDNN shape cache (module docstring)
for _var in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
    # inherited by the pipeline stages' processes too
    os.environ.setdefault(_var, str(ONEDNN_CACHE_ENTRIES))


class TLinear(nn.Module):
    """A loaded, frozen Linear that keeps its weight transposed, [in, out]: `x @ weight_t` is faster
    than `F.linear(x, weight)` for the one-row products of decoding (measured with MKL:
    docs/architecture.md)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        # [in, out]
        self.weight_t = nn.Parameter(weight.detach().t().contiguous(), requires_grad=False)
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        )

    @property
    def weight(self) -> torch.Tensor:
        return self.weight_t.t()  # [out, in] view, for code that reads the weight

    @property
    def dtype(self) -> torch.dtype:
        return self.weight_t.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.matmul(x, self.weight_t)
        return y if self.bias is None else y + self.bias


class SmallLinear(TLinear):
    """A small frozen float32 Linear on CPU: one row through `x @ weight_t`, several through a
    packed copy."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(weight, bias)
        self.register_buffer(
            "packed",
            torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 8),
            persistent=False,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == x.shape[-1] or torch.compiler.is_compiling():
            return super().forward(x)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class PackedLinear(nn.Module):
    """A loaded, frozen Linear whose weight oneDNN reordered once (for one-row products; larger batches read the same
    layout). x [..., in] -> [..., out], in the weight's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        w = weight.detach().contiguous()  # [out, in]
        self.out_features, self.in_features = w.shape
        self.register_buffer(
            "packed", torch.ops.mkldnn._reorder_linear_weight(w, 1), persistent=False
        )
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        )

    @property
    def weight(self) -> torch.Tensor:
        """[out, in], a dense copy (for code that reads the weight once, never on a hot path)."""
        return self.packed.to_dense()

    @property
    def dtype(self) -> torch.dtype:
        return self.packed.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # inductor lowers this op only for weights it packed itself (freezing)
        if torch.compiler.is_compiling():
            return packed_linear(x, self.packed, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


@torch.library.custom_op("sparkrelay::packed_linear", mutates_args=())
def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    """PackedLinear's product as one opaque op for torch.compile (eager calls skip its dispatch
    cost)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], packed.shape[0])  # [..., out]


class AvxLinear(nn.Module):
    """A frozen bfloat16 Linear where one of sparkrelay's kernels is built: up to KERNEL_ROWS rows (a
    decode step, a DSpark verify) through the kernel on its own packed layout (models/cpu_kernels.py),
    more rows (prefill) through `wide` (oneDNN's packed copy, or WideLinear's float32 one where
    oneDNN has no bf16), which is faster there. Both layouts are kept: the kernel's bytes beside
    oneDNN's for the fastest product at every row count. x [..., in] -> [..., out]."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, module, wide: nn.Module
    ) -> None:
        super().__init__()
        self._ext = module
        self.out_features, self.in_features = weight.shape
        self.register_buffer("tiles", cpu_kernels.pack_bf16(weight), persistent=False)
        padded = None
        if bias is not None:  # fp32, N padded to the kernel's tile
            padded = torch.zeros(-(-self.out_features // cpu_kernels.TILE) * cpu_kernels.TILE)
            padded[: self.out_features] = bias.detach().float()
        self.register_buffer("tile_bias", padded, persistent=False)
        # the kernel's call (csrc/cpu_decode_layer.cpp), shared with the fused decoder layer
        self.kernel = module.KernelLinear(
            self.tiles, self.out_features, self.in_features, self.tile_bias
        )
        self.wide = wide

    @property
    def weight(self) -> torch.Tensor:
        """[out, in], a dense copy (for code that reads the weight once)."""
        return cpu_kernels.unpack_bf16(self.tiles, self.out_features, self.in_features)

    @property
    def bias(self) -> torch.Tensor | None:
        return self.wide.bias

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows > KERNEL_ROWS or x.dtype != torch.bfloat16 or torch.compiler.is_compiling():
            return self.wide(x)
        y = self.kernel(x.reshape(rows, self.in_features))  # [rows, out]
        return y.view(*x.shape[:-1], self.out_features)


def add_linear(
    layer: nn.Module, x: torch.Tensor, base: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """out [R, N] = base [R, N] + layer(x [R, in]): through the layer's kernel where it serves
    (`KernelLinear.add_into`: bf16 weights in one pass, the sum rounded once to out's dtype; int8 as
    below), else as out = base, out += layer(x). The DSpark Markov head's logits, Z_k = U_k + W2 m_k:
    one read of U, one write of Z per slot; csrc/cpu_markov.cpp makes the same call."""
    kernel = getattr(layer, "kernel", None)  # AvxLinear, Int8Linear on the kernels
    served = (
        kernel is not None
        and x.shape[0] <= KERNEL_ROWS
        and x.dtype == base.dtype == torch.bfloat16
        and base.stride(-1) == 1
        and out.stride(-1) == 1
        and not torch.compiler.is_compiling()
    )
    if served:
        kernel.add_into(x, base, out)
        return out
    out.copy_(base)
    inner = layer.wide if isinstance(layer, AvxLinear) else layer
    if isinstance(inner, WideLinear):  # its float32 product, rounded once in the sum
        return out.add_(inner.product(x))
    return out.add_(layer.forward(x))


def onednn_bf16() -> bool:
    """Whether oneDNN runs bfloat16 products on this CPU (avx512bw/vl/dq or avx_ne_convert): without
    them it refuses to reorder a bfloat16 weight."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def can_pack(weight: torch.Tensor) -> bool:
    """oneDNN's packed product is the fast one for bfloat16 and float32 weights on CPU (module
    docstring), bfloat16 only where oneDNN runs it."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and onednn_bf16())


class WideLinear(nn.Module):
    """A frozen bfloat16 Linear on a CPU where oneDNN has no bfloat16 product: the weight widened once
    to float32 in oneDNN's packed layout, x widened per call, the result rounded to x's dtype. aten's
    bfloat16 product there is scalar code, several times slower from 8 rows up (figures:
    docs/cpu_kernels.md), so twice the weight's memory buys DSpark's verify and prefill their speed.
    x [..., in] -> [..., out]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.wide = frozen_linear(weight.float(), None if bias is None else bias.float())

    @property
    def weight(self) -> torch.Tensor:
        """[out, in] in bfloat16 (exact: widened from it)."""
        return self.wide.weight.to(torch.bfloat16)

    @property
    def bias(self) -> torch.Tensor | None:
        b = self.wide.bias
        return None if b is None else b.to(torch.bfloat16)

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> float32 [..., out], never rounded to bfloat16."""
        return self.wide(x.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x).to(x.dtype)


def frozen_kinds() -> tuple[type[nn.Module], ...]:
    """Every layer frozen_linear may return (what int8wo quantization and the roofline's step
    profile look for)."""
    return (TLinear, WideLinear, PackedLinear, AvxLinear)


def frozen_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
    """weight [out, in] (+ bias [out]) -> the fastest frozen layer for its dtype and device (module docstring)."""
    if weight.device.type == "cpu" and weight.dtype == torch.bfloat16:
        many = PackedLinear(weight, bias) if can_pack(weight) else WideLinear(weight, bias)
        module = cpu_kernels.portable()
        return many if module is None else AvxLinear(weight, bias, module, many)
    if not can_pack(weight):
        return TLinear(weight, bias)
    small = weight.dtype == torch.float32 and weight.numel() < PACK_MIN_FP32
    return SmallLinear(weight, bias) if small else PackedLinear(weight, bias)


def fast_head(weight: torch.Tensor) -> nn.Module | None:
    """A frozen copy of the LM head `weight` [V, d] for the logits, or None off CPU (F.linear on it
    is as fast)."""
    return frozen_linear(weight) if weight.device.type == "cpu" else None
