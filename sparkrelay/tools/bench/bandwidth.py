"""The decode roofline: the machine's measured read bandwidth and the bytes a decode step must read.

Bandwidth (`measure_read_bandwidth`): the fastest of several one-pass reads of a 1 GiB tensor (every
byte read once, one number written): `torch.sum` and `torch.amax` over float32, `torch.sum` over
bfloat16 (READS); each after one untimed pass, its median over the repeats, in GB/s (10^9 bytes/s).
The fastest is the physical limit a decode kernel can approach: on a 2-core EPYC the float32 sum
read ~34 GB/s where the bfloat16 one read ~48 GB/s (and 27.6 against 31.4 in a later run), so any
one read alone may understate the limit.

Bytes of one decode step at batch b with L context positions per sequence (`step_bytes`):
    bytes(b) = W + b * KV(L)
    W        = every linear weight the step reads: per layer q, k, v, o, gate, up, down, plus the LM head (read
               even when tied to the embedding); the embedding lookup (b rows) and the norms are left out
    KV(L)    = 2 * layers * kv_heads * head_dim * L * kv_bytes   (K and V of the L positions, every layer)
Widths (`WIDTHS`): float32 4 bytes, bfloat16 2; int8wo 1 byte per weight plus one bf16 scale per output channel,
its LM head bf16 unless counted as int8 (int8wo may leave it unquantized), its KV bf16.
Roofline (`roofline_tok_s`): tok/s(b) = b * bandwidth / bytes(b), the memory-bound ceiling (at a large batch the
step may become compute-bound first, so a large batch's fraction is an upper-bound reading).

DSpark (`predicted_speedup`): one round costs a draft block and a verify of 1 + B tokens and commits tau tokens on
average (the acceptance length), where plain decoding commits 1 per step, so
    speedup = tau / (t_verify / t_decode + t_draft / t_decode)
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class Width:
    """Bytes per element of the weights, the per-output-channel scales, the LM head and the KV
    cache."""

    weight: float
    scale: float
    lm_head: float
    kv: float


WIDTHS = {
    "float32": Width(4, 0, 4, 4),
    "bfloat16": Width(2, 0, 2, 2),
    "float16": Width(2, 0, 2, 2),
    "int8wo": Width(1, 2, 2, 2),
}


@dataclass(frozen=True)
class Shape:
    """The dimensions of a Qwen3 decoder that fix its bytes per step (from a Hugging Face
    config.json)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def from_hf(cls, cfg: dict) -> "Shape":
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(
            hidden,
            int(cfg["num_hidden_layers"]),
            heads,
            int(cfg.get("num_key_value_heads", heads)),
            int(cfg.get("head_dim") or hidden // heads),
            int(cfg["intermediate_size"]),
            int(cfg["vocab_size"]),
        )

    def layer_weights(self) -> int:
        """Weights of one decoder layer's linears: q, k, v, o, gate, up, down."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h + 3 * h * self.intermediate

    def layer_channels(self) -> int:
        """Output channels of one layer's linears (one int8 scale each)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return q + 2 * kv + self.hidden + 2 * self.intermediate + self.hidden

    def lm_head_weights(self) -> int:
        return self.vocab * self.hidden


def weight_bytes(shape: Shape, dtype: str, int8_lm_head: bool = False) -> float:
    """W: the bytes of every linear weight (and int8 scale) one decode step reads."""
    w = WIDTHS[dtype]
    body = shape.layers * (shape.layer_weights() * w.weight + shape.layer_channels() * w.scale)
    if int8_lm_head and w.scale:
        head = shape.lm_head_weights() * w.weight + shape.vocab * w.scale
    else:
        head = shape.lm_head_weights() * w.lm_head
    return float(body + head)


def kv_bytes(shape: Shape, dtype: str, context: float) -> float:
    """KV(L): the K and V bytes one sequence's decode step reads at `context` positions."""
    return float(2 * shape.layers * shape.kv_heads * shape.head_dim * context * WIDTHS[dtype].kv)


def step_bytes(
    shape: Shape, dtype: str, batch: int, context: float, int8_lm_head: bool = False
) -> float:
    """bytes(b) = W + b * KV(L)."""
    return weight_bytes(shape, dtype, int8_lm_head) + batch * kv_bytes(shape, dtype, context)


def roofline_tok_s(bandwidth_gb_s: float, nbytes: float, batch: int) -> float:
    """tok/s(b) = b * bandwidth / bytes(b)."""
    return batch * bandwidth_gb_s * GB / nbytes


def fraction(measured: float | None, ceiling: float) -> float | None:
    """measured / ceiling (None when either is missing)."""
    if measured is None or not ceiling:
        return None
    return measured / ceiling


def predicted_speedup(tau: float, verify_ratio: float, draft_ratio: float) -> float:
    """tau / (t_verify / t_decode + t_draft / t_decode)."""
    return tau / (verify_ratio + draft_ratio)


def bandwidth_gb_s(nbytes: int, seconds: list[float]) -> float:
    """nbytes read once per pass / the median pass time, in GB/s."""
    return nbytes / statistics.median(seconds) / GB


READS = (("float32", "sum"), ("float32", "amax"), ("bfloat16", "sum"))  # (dtype, torch reduction)


def measure_read_bandwidth(nbytes: int = 1 << 30, repeats: int = 7, device: str = "cpu") -> dict:
    """The read bandwidth: the fastest median of the READS, each one pass over `nbytes` (module
    docstring)."""
    import torch

    reads = {
        f"{kind} {dtype}": _time_read(getattr(torch, dtype), kind, nbytes, repeats, device)
        for dtype, kind in READS
    }
    best = max(reads, key=lambda k: bandwidth_gb_s(nbytes, reads[k]))
    return {
        "gb_s": bandwidth_gb_s(nbytes, reads[best]),
        "bytes": nbytes,
        "seconds": reads[best],
        "reads_gb_s": {k: bandwidth_gb_s(nbytes, v) for k, v in reads.items()},
        "method": f"fastest of torch.{', torch.'.join(reads)} over a {nbytes / 2**30:g} GiB tensor on {device} "
        f"with {torch.get_num_threads()} threads (here torch.{best}), median of {repeats} passes "
        "after one untimed pass",
    }


def _time_read(dtype, kind: str, nbytes: int, repeats: int, device: str) -> list[float]:
    """Seconds of each timed pass of torch.<kind> over an `nbytes` tensor of `dtype`."""
    import torch

    from sparkrelay.tools.bench.common import sync

    # written once: every page resident
    x = torch.ones(nbytes // dtype.itemsize, dtype=dtype, device=device)
    read = getattr(x, kind)
    read()  # untimed pass
    seconds = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        read()
        sync(device)
        seconds.append(time.perf_counter() - start)
    del x
    return seconds
