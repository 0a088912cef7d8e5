"""Weight-only int8 (`--torchao-config int8wo`, SGLang's flag): each frozen linear keeps int8
weights with one scale per output channel, and multiplies activations in their own dtype by them
without a dequantized copy.

    w [out, in] ≈ q [out, in] int8 * s [out],  s = max |w[o, :]| / 127 (symmetric, round to nearest)
    y = x @ wᵀ ≈ (x @ qᵀ) * s                  torch.ops.aten._weight_int8pack_mm(x [T, in], q, s) -> [T, out]

torchao's own int8 weight-only (0.18.0) dequantizes per call and was slower than bfloat16 F.linear,
so on a CPU with AVX-512 VNNI sparkrelay's int8 kernel (models/cpu_kernels.py: activations as
16-bit integers per row, weight-only in effect; exact int32 sums, fp32 epilogue) takes every call of
fewer than `kernel_rows()` rows: a decode step, a DSpark verify or draft block of a whole batch, a
prefill chunk (on the tile unit where the CPU has AMX). Above, dequantizing the weight for the call
(a temporary) and F.linear is faster. Without the kernel, torch's int8 product runs below
DEQUANT_ROWS rows: it reads half the bytes of bfloat16 and wins at one row, but its cost grows fast
with the rows (figures: docs/cpu_kernels.md, Dispatch). The LM head's fast copy is quantized too (a decode step
reads it whole: at 0.6B it is a quarter of the weights), with one scale per vocabulary row; the
embedding table stays in the model dtype (a lookup reads one row).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparkrelay.config import ConfigError
from sparkrelay.models import cpu_kernels
from sparkrelay.models.kernels import frozen_kinds

TORCHAO_CONFIGS = ("", "int8wo")
# without the kernel: rows from which dequantize + F.linear beats torch's int8 product
DEQUANT_ROWS = 64
# rows from which dequantize + F.linear beats the kernel, on the tile unit or the vector loop (bf16
# activations; float32 ones favour the kernel further): docs/architecture.md, speed notes
KERNEL_INT8_ROWS = {"amx": 1024, "vector": 96}


def kernel_rows() -> int:
    """After cpu_kernels.load(): calls of fewer rows than this go through the int8 kernel."""
    return KERNEL_INT8_ROWS["amx" if cpu_kernels.amx_on() else "vector"]


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (q [out, in] int8, scales [out] float32), symmetric per output channel."""
    # a TLinear's weight is a transposed view; the kernel wants rows
    w = weight.detach().float().contiguous()
    scales = w.abs().amax(dim=1).clamp_min(1e-12) / 127  # [out]
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


class Int8Linear(nn.Module):
    """A frozen linear with int8 weights and per-output-channel scales; x [..., in] -> [..., out] in `dtype`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        q, scales = quantize_per_channel(weight)
        self.out_features, self.in_features = q.shape
        self.register_buffer("qweight", q, persistent=False)  # [out, in] int8
        # [out], the activation dtype
        self.register_buffer("scales", scales.to(dtype), persistent=False)
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        )
        ext = cpu_kernels.load() if q.device.type == "cpu" else None
        # sparkrelay's kernel (csrc/cpu_decode_layer.cpp's KernelLinear, shared with the fused
        # decoder layer): its own packed copy, fp32 epilogue terms
        self.kernel, self.kernel_rows = None, 0
        if ext is not None:
            self.kernel_rows = kernel_rows()
            self.register_buffer("tiles", cpu_kernels.pack_int8(q), persistent=False)
            self.register_buffer(
                "tile_scale", cpu_kernels.pad_to_tile(scales.float()), persistent=False
            )
            qsum = q.sum(dim=1, dtype=torch.int32)
            self.register_buffer("tile_qsum", cpu_kernels.pad_to_tile(qsum), persistent=False)
            tile_bias = None if bias is None else cpu_kernels.pad_to_tile(bias.detach().float())
            self.register_buffer("tile_bias", tile_bias, persistent=False)
            self.kernel = ext.KernelLinear(
                self.tiles,
                self.out_features,
                self.in_features,
                self.tile_bias,
                self.tile_scale,
                self.tile_qsum,
            )

    @property
    def weight(self) -> torch.Tensor:
        """[out, in] dequantized (a copy, for code that reads the weight once)."""
        return self.qweight.to(self.scales.dtype) * self.scales[:, None]

    @property
    def dtype(self) -> torch.dtype:
        return self.scales.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [T, in]: the kernels take 2-D inputs only
        if (
            self.kernel is not None
            and rows.shape[0] < self.kernel_rows
            and not torch.compiler.is_compiling()
        ):
            y = self.kernel(rows)  # [T, out], bias included
            return y.view(*x.shape[:-1], self.out_features)
        # torch's int8 product needs K a multiple of 16 (it crashes otherwise): dequantize then
        if self.kernel is not None or rows.shape[0] >= DEQUANT_ROWS or self.in_features % 16:
            y = F.linear(rows, self.weight)
        else:
            # [T, out]
            y = torch.ops.aten._weight_int8pack_mm(rows.contiguous(), self.qweight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


def quantize_int8wo(model: nn.Module, keep: tuple[str, ...] = ()) -> int:
    """Replace every frozen linear of `model` (after `fuse`: the layers' q/k/v, o, gate/up, down, the
    LM head's fast copy; a drafter's context K/V and Markov W2), but those named in `keep` (module
    paths, e.g. a drafter's "fc"), by an Int8Linear. -> how many."""
    found = [
        (parent, name, child)
        for path, parent in model.named_modules()
        for name, child in parent.named_children()
        if isinstance(child, frozen_kinds())
        and not isinstance(parent, frozen_kinds())  # a layout kept inside one (AvxLinear's oneDNN)
        and f"{path}.{name}".lstrip(".") not in keep
    ]
    count = len(found)
    while found:  # each bf16 layer freed as soon as its int8 one replaces it (peak memory)
        parent, name, child = found.pop()
        setattr(parent, name, Int8Linear(child.weight, child.bias, child.dtype))
        del parent, child
    return count


def apply_torchao_config(model: nn.Module, config: str, keep: tuple[str, ...] = ()) -> None:
    """`--torchao-config` on a loaded, fused model: "" leaves it as it is; "int8wo" quantizes its
    linears (cpu) but those named in `keep` (quantize_int8wo)."""
    if config not in TORCHAO_CONFIGS:
        raise ConfigError(f"--torchao-config {config!r} is not one of {TORCHAO_CONFIGS}")
    if not config:
        return
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ConfigError(
            f"--torchao-config {config}: torch's int8 weight-packed product runs on cpu only, "
            f"not on {device}"
        )
    if not quantize_int8wo(model, keep):
        raise ConfigError(
            f"--torchao-config {config}: the model has no fused linear layers to quantize"
        )
