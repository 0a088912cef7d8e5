"""sparkrelay's AVX-512 kernels (models/cpu_kernels.py, csrc/cpu_linear.cpp): built by set-up on a CPU
that has the instructions; bf16 and int8, every row count from 1 to 8 and every shape class (N and K
odd, below and above a tile) equal to a float64 reference within the output's rounding; dispatch by rows, dtype and
SPARKRELAY_CPU_KERNELS; and the fallback on a machine without a compiler."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from sparkrelay.models import cpu_kernels
from sparkrelay.models.kernels import KERNEL_ROWS, AvxLinear, PackedLinear, fast_head, frozen_linear
from sparkrelay.models.quant import Int8Linear, kernel_rows, quantize_per_channel

HAS_CPU = not [f for f in cpu_kernels.NEEDED if f not in cpu_kernels.cpu_flags()]
needs_cpu = pytest.mark.skipif(not HAS_CPU, reason="this CPU lacks AVX-512 bf16")
HAS_ROWS = HAS_CPU or all(f in cpu_kernels.cpu_flags() for f in cpu_kernels.AVX2_NEEDED)
needs_rows = pytest.mark.skipif(not HAS_ROWS, reason="this CPU has neither AVX-512 bf16 nor AVX2")
# (N, K): odd, below and above a tile; K past 32 and 64 to reach the tile unit's one and two steps
SHAPES = [(1, 2), (31, 7), (32, 64), (33, 65), (100, 300), (1000, 96), (96, 1001), (64, 2048)]


@pytest.fixture(params=["avx512", "amx"])
def path(request):
    """The vector path, then the tile unit (skipped where the CPU or the OS has no AMX)."""
    ext = cpu_kernels.load()
    on = ext.use_amx(request.param == "amx")
    try:
        if request.param == "amx" and not on:
            pytest.skip("this CPU (or its OS) has no AMX")
        yield request.param
    finally:
        ext.use_amx(cpu_kernels.amx_on())


def operands(n: int, k: int, rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    return w, torch.randn(n, generator=g), x


def assert_near_float64(got: torch.Tensor, x, w, b) -> None:
    """Within the output's bfloat16 rounding (2^-8 relative) plus fp32 accumulation error."""
    ref = x.double() @ w.double().t() + (0 if b is None else b.double())
    bound = 2.0**-8 * ref.abs() + 1e-6 * (x.double().abs() @ w.double().abs().t()) + 1e-6
    err = (got.double() - ref).abs()
    assert bool((err <= bound).all()), f"max error {float(err.max()):.3g} over the bound"


@needs_cpu
def test_set_up_built_the_kernels():
    assert cpu_kernels.load() is not None, cpu_kernels.why_off()


@needs_cpu
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@torch.inference_mode()
def test_kernel_equals_float64_at_every_row_count(shape, bias, path):
    n, k = shape
    ext = cpu_kernels.load()
    packed = cpu_kernels.pack_bf16(operands(n, k, 1)[0])
    assert torch.equal(cpu_kernels.unpack_bf16(packed, n, k), operands(n, k, 1)[0])
    for rows in range(1, KERNEL_ROWS + 2):  # 9: a second row group
        w, b, x = operands(n, k, rows, seed=rows)
        packed = cpu_kernels.pack_bf16(w)
        tile_bias = None
        if bias:
            tile_bias = torch.zeros(-(-n // cpu_kernels.TILE) * cpu_kernels.TILE)
            tile_bias[:n] = b
        xk = F.pad(x, (0, k % 2)).contiguous()
        got = ext.linear_bf16(xk, packed, n, tile_bias)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        assert_near_float64(got, x, w, b if bias else None)


@needs_cpu
@pytest.mark.parametrize("shape", [(31, 64), (100, 300), (1000, 96)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_kernel_adds_base_into_out(shape, out_dtype, path):
    """linear_bf16 with base and out: out = x W^T + bias + base, summed in fp32 and rounded once to out's
    dtype, written into a strided out (a slot of the Markov head's [R, B, V] buffer), other slots left
    alone; rows 1 to 9."""
    n, k = shape
    ext = cpu_kernels.load()
    for rows in (1, 3, KERNEL_ROWS, KERNEL_ROWS + 1):
        w, b, x = operands(n, k, rows, seed=rows)
        base = (4 * torch.randn(rows, n + 3)).to(torch.bfloat16)[:, 1 : n + 1]  # rows ldb apart
        buffer = torch.full((rows, 3, n), 7.0, dtype=out_dtype)
        got = ext.linear_bf16(
            x, cpu_kernels.pack_bf16(w), n, cpu_kernels.pad_to_tile(b), base, buffer[:, 1]
        )
        ref = x.double() @ w.double().t() + b.double() + base.double()
        tol = 2.0**-8 if out_dtype == torch.bfloat16 else 2.0**-20
        bound = tol * ref.abs() + 1e-6 * (x.double().abs() @ w.double().abs().t()) + 1e-5
        assert got.data_ptr() == buffer[:, 1].data_ptr()
        assert bool(((buffer[:, 1].double() - ref).abs() <= bound).all())
        assert bool((buffer[:, 0] == 7).all() and (buffer[:, 2] == 7).all())


@needs_rows
@pytest.mark.parametrize(
    "shape", [(1, 1, 1024), (7, 1, 576), (3, 24, 128), (5, 1, 33), (300, 1, 64)]
)
@torch.inference_mode()
def test_rms_norm_kernel_equals_torch_bf16_formula(shape):
    """Bit for bit the bf16 RMSNorm of transformers (normalize in fp32, round, scale in bf16), for
    one weight or one per group row, rows of any width, a strided view (q/k heads inside q/k/v)."""
    g = torch.Generator().manual_seed(1)
    t, groups, d = shape
    x = (3 * torch.randn(t, groups + 1, d, generator=g)).to(torch.bfloat16)[:, :groups]
    w = (1 + 0.1 * torch.randn(groups, d, generator=g)).to(torch.bfloat16)
    ref = w * F.rms_norm(x.float(), (d,), None, 1e-6).to(torch.bfloat16)
    got = cpu_kernels.portable().rms_norm_bf16(x, w, 1e-6)
    assert got.shape == (t, groups, d) and got.is_contiguous()
    assert torch.equal(got, ref)


@needs_rows
@pytest.mark.parametrize("shape", [(1, 1536), (8, 3072), (300, 96), (5, 7)])
@torch.inference_mode()
def test_silu_mul_kernel_equals_torch(shape):
    """SwiGLU's bf16(bf16(silu(g)) * u), rows at any stride, widths odd or not a multiple of 16. Its
    e^x is not torch's, so a value may sit one bf16 step away where they round apart (none of the
    100,000 random values here did on the hosts it was written on); inf, -inf, NaN and saturating
    inputs as torch."""
    g = torch.Generator().manual_seed(2)
    t, inter = shape
    wide = (4 * torch.randn(t, 2 * inter + 3, generator=g)).to(torch.bfloat16)
    gate_up = wide[:, : 2 * inter]  # a strided view: rows 2 * inter + 3 apart
    special = torch.tensor(
        [-1e4, -90.0, -88.0, -1e-30, 0.0, 88.0, 1e4, float("inf"), float("-inf")]
    )
    gate_up[0, : special.numel()] = special.to(torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    got = cpu_kernels.portable().silu_mul_bf16(gate_up)
    assert got.shape == (t, inter) and got.is_contiguous()
    assert torch.equal(got.isnan(), ref.isnan())
    step = 2.0**-7 * ref.float().abs().clamp_min(2.0**-126)
    close = ((got.float() - ref.float()).abs() <= step) | ref.isnan() | (got == ref)
    assert bool(close.all())
    big = (4 * torch.randn(100, 2000, generator=g)).to(torch.bfloat16)
    gb, ub = big.chunk(2, dim=-1)
    differ = (cpu_kernels.portable().silu_mul_bf16(big) != F.silu(gb) * ub).sum()
    assert int(differ) <= 10  # of 100,000


@needs_rows
@pytest.mark.parametrize(
    "shape", [(1, 12, 64), (8, 24, 128), (100, 3, 64), (2, 1, 256), (3, 5, 32)]
)
@torch.inference_mode()
def test_rope_kernel_equals_torch_bit_for_bit(shape):
    """layers.apply_rope's three bf16 ops (x * cos + roll(x, D/2) * sin), each rounded, for a token's
    heads inside a fused q/k/v row (a strided view) and for contiguous heads."""
    from sparkrelay.models.layers import Rotary

    g = torch.Generator().manual_seed(3)
    t, heads, d = shape
    qkv = (3 * torch.randn(t, (heads + 2) * d, generator=g)).to(torch.bfloat16)
    x = qkv[:, : heads * d].view(t, heads, d)
    rotary = Rotary(d, 1e4, 4096, torch.device("cpu"))
    cos, sin = rotary.table(torch.randint(0, 4096, (t,), generator=g), torch.bfloat16)
    ref = x * cos + torch.roll(x, d // 2, dims=-1) * sin
    for heads_of in (x, x.contiguous()):
        got = cpu_kernels.portable().rope_bf16(heads_of, cos, sin)
        assert got.shape == (t, heads, d) and got.is_contiguous()
        assert torch.equal(got, ref)


@needs_rows
def test_rope_and_silu_mul_dispatch(monkeypatch):
    """apply_rope and silu_mul: the kernels for bf16 CPU tensors they can read (head dim a multiple
    of 32), torch's ops otherwise, with the same values."""
    from sparkrelay.models import layers

    calls = []
    real = cpu_kernels.portable()
    spy = type(
        "Spy",
        (),
        {
            "rope_bf16": lambda *a: calls.append("rope") or real.rope_bf16(*a),
            "silu_mul_bf16": lambda *a: calls.append("silu") or real.silu_mul_bf16(*a),
        },
    )
    monkeypatch.setattr(layers.cpu_kernels, "portable", lambda: spy)
    x, cos, sin = (torch.randn(2, 3, 64).to(torch.bfloat16) for _ in range(3))
    cos, sin = cos[:, :1], sin[:, :1]
    gate_up = torch.randn(2, 4, 96).to(torch.bfloat16)  # [R, B, 2 * inter]: any leading dims
    got = layers.apply_rope(x, cos, sin), layers.silu_mul(gate_up)
    assert calls == ["rope", "silu"]
    layers.apply_rope(x.float(), cos.float(), sin.float())
    layers.apply_rope(x[..., :48], cos[..., :48], sin[..., :48])  # D = 48: torch's ops
    layers.silu_mul(gate_up.float())
    assert calls == ["rope", "silu"]
    monkeypatch.setattr(layers.cpu_kernels, "portable", lambda: None)  # kernels off: torch's ops
    assert torch.equal(got[0], layers.apply_rope(x, cos, sin))
    assert torch.equal(got[1], layers.silu_mul(gate_up))


@needs_rows
@pytest.mark.parametrize(
    "shape", [(1, 16, 8, 128, 160), (3, 9, 3, 64, 37), (2, 4, 4, 34, 5), (1, 32, 4, 256, 700)]
)  # (B, H, n_kv, D, Lk): GQA groups of 2, 3, 1, 8; D below, at and above a 32-wide chunk
@torch.inference_mode()
def test_decode_attention_kernel_equals_float64(shape):
    """Each query against its own visible keys, read in place from a shuffled pool, within the
    output's bf16 rounding of the float64 softmax attention (the AVX-512 build or the AVX2 one)."""
    b, h, n_kv, d, lk = shape
    g = torch.Generator().manual_seed(sum(shape))
    q = torch.randn(b, h, d, generator=g).to(torch.bfloat16)
    pool = 2 * lk + 10
    k_pool, v_pool = (torch.randn(pool, n_kv, d, generator=g).to(torch.bfloat16) for _ in "kv")
    slots = torch.stack([torch.randperm(pool, generator=g)[:lk] for _ in range(b)])
    lengths = torch.randint(1, lk + 1, (b,), generator=g)
    lengths[0] = lk
    seq = torch.arange(b).flip(0).contiguous()  # query i reads the slots of row b - 1 - i
    slots_of = slots.flip(0).contiguous()
    out = cpu_kernels.portable().decode_attention_bf16(
        q, k_pool, v_pool, slots_of, seq, lengths, d**-0.5
    )
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    for i in range(b):
        keys = slots[i, : int(lengths[i])]
        k, v = k_pool[keys].double(), v_pool[keys].double()  # [L, n_kv, D]
        for head in range(h):
            kv_head = head // (h // n_kv)
            p = torch.softmax(k[:, kv_head] @ q[i, head].double() * d**-0.5, 0)
            ref = p @ v[:, kv_head]
            err = (out[i, head].double() - ref).abs()
            assert bool((err <= 2.0**-8 * ref.abs() + 1e-3).all()), float(err.max())


@needs_rows
@pytest.mark.parametrize("group, d", [(3, 64), (2, 128), (1, 34), (4, 70)])
@torch.inference_mode()
def test_decode_attention_kernel_serves_blocks_exactly_as_single_queries(group, d):
    """Blocks of 1 to 9 queries per sequence (chunks of four and their remainders, causal through
    each query's visible count, keys past a multiple of eight): each row within bf16 rounding of
    float64, and bit-equal to the same query run alone (a DSpark verify row equals its decode row)."""
    g = torch.Generator().manual_seed(group * d)
    n_kv, lk = 2, 41
    h, pool = group * n_kv, 3 * lk
    k_pool, v_pool = (torch.randn(pool, n_kv, d, generator=g).to(torch.bfloat16) for _ in "kv")
    slots = torch.stack([torch.randperm(pool, generator=g)[:lk] for _ in range(3)])
    blocks = [(0, 9, 41), (1, 1, 30), (2, 5, 23)]  # (sequence, queries, keys of its last query)
    seq = torch.tensor([b for b, n, _ in blocks for _ in range(n)])
    lengths = torch.tensor([last - n + 1 + i for _, n, last in blocks for i in range(n)])
    q = torch.randn(len(seq), h, d, generator=g).to(torch.bfloat16)
    ext = cpu_kernels.portable()
    out = ext.decode_attention_bf16(q, k_pool, v_pool, slots, seq, lengths, d**-0.5)
    for t in range(len(seq)):
        alone = ext.decode_attention_bf16(
            q[t : t + 1].contiguous(),
            k_pool,
            v_pool,
            slots,
            seq[t : t + 1],
            lengths[t : t + 1],
            d**-0.5,
        )
        assert torch.equal(out[t], alone[0])
        keys = slots[int(seq[t]), : int(lengths[t])]
        k, v = k_pool[keys].double(), v_pool[keys].double()
        for head in range(h):
            p = torch.softmax(k[:, head // group] @ q[t, head].double() * d**-0.5, 0)
            ref = p @ v[:, head // group]
            err = (out[t, head].double() - ref).abs()
            assert bool((err <= 2.0**-8 * ref.abs() + 1e-3).all()), float(err.max())


@needs_rows
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (1, 49152), (8, 49157), (2, 9, 37), (5, 16), (3, 7)])
def test_argmax_kernel_equals_torch(shape, dtype):
    """models/argmax, on the AVX-512 build or the AVX2 one: torch.argmax(x, -1) for every shape (V
    odd, below and above a vector), the first of tied maxima, the first NaN, rows of -inf, and
    strided rows."""
    from sparkrelay.models.argmax import argmax

    assert cpu_kernels.portable() is not None, cpu_kernels._state.get("avx2_why")
    g = torch.Generator().manual_seed(shape[-1])
    x = torch.randn(*shape, generator=g).to(dtype)
    assert torch.equal(argmax(x), x.argmax(-1))
    flat = x.view(-1, shape[-1])
    v = shape[-1]
    flat[0] = 0.5  # a tie across the whole row: index 0
    if flat.shape[0] > 1:
        flat[1] = float("-inf")
        flat[1, v // 2 :] = float("nan") if v > 1 else flat[1, v // 2 :]
    if flat.shape[0] > 2:
        flat[2, v - 1] = 100.0
        flat[2, max(v - 17, 0)] = 100.0  # tied maxima a vector apart: the first
    assert torch.equal(argmax(x), x.argmax(-1))
    wide = torch.randn(shape[0], 2 * shape[-1], generator=g).to(dtype)[:, ::2]  # stride 2
    assert torch.equal(argmax(wide), wide.argmax(-1))
    assert torch.equal(argmax(wide[:, :1].t()), wide[:, :1].t().argmax(-1))


def test_argmax_falls_back_to_torch(cpu_kernels_off):
    """Kernels off (or an int tensor): torch's argmax, same answer."""
    from sparkrelay.models.argmax import argmax

    assert cpu_kernels.load() is None
    x = torch.randn(3, 100)
    assert torch.equal(argmax(x), x.argmax(-1))
    assert torch.equal(argmax(torch.tensor([[1, 5, 5]])), torch.tensor([1]))


@needs_rows
@pytest.mark.parametrize(
    "starts, ends",
    [([9, 13], [10, 14]), ([12], [13]), ([6], [13]), ([4, 9], [9, 10])],
    ids=["decode batch", "one decode", "verify block", "block beside a decode"],
)
@torch.inference_mode()
def test_paged_attention_takes_the_kernel_and_matches_sdpa(monkeypatch, starts, ends):
    """models/attention: bf16 batches of up to KERNEL_QUERIES queries per sequence go to the kernel,
    longer blocks (a DSpark verify) to SDPA; the kernel called on the same block anyway, and torch's
    SDPA with the kernels off, give the same attention (to bf16 rounding) on the same metadata."""
    from sparkrelay.models import attention

    g = torch.Generator().manual_seed(3)
    page, tables = 4, [[5, 2, 7, 4], [1, 3, 0, 6]][: len(starts)]
    meta = attention.AttnMeta.build(starts, ends, tables, page, "cpu")
    t = sum(e - s for s, e in zip(starts, ends))
    q, k, v = (torch.randn(t, n, 64, generator=g).to(torch.bfloat16) for n in (8, 2, 2))
    pools = [torch.randn(32, 2, 64, generator=g).to(torch.bfloat16) for _ in "kv"]
    calls = []
    real = cpu_kernels.portable()
    spy = type(
        "Spy",
        (),
        {"decode_attention_bf16": lambda *a: calls.append(1) or real.decode_attention_bf16(*a)},
    )
    monkeypatch.setattr(attention.cpu_kernels, "portable", lambda: spy)
    got = attention.paged_attention(q, k, v, pools[0].clone(), pools[1].clone(), meta, 0.125)
    assert len(calls) == (1 if meta.max_q <= attention.KERNEL_QUERIES else 0)
    if not calls:  # the kernel takes blocks too (causal through each query's length)
        k_pool, v_pool = pools[0].clone(), pools[1].clone()
        attention.paged_attention(q, k, v, k_pool, v_pool, meta, 0.125)  # writes the block's K/V
        got = real.decode_attention_bf16(
            q, k_pool, v_pool, meta.kv_index, meta.query_seq(), meta.query_lengths(), 0.125
        )
    monkeypatch.setattr(attention.cpu_kernels, "portable", lambda: None)
    ref = attention.paged_attention(q, k, v, pools[0].clone(), pools[1].clone(), meta, 0.125)
    assert torch.allclose(got.float(), ref.float(), rtol=2e-2, atol=2e-2)


@needs_rows
def test_rms_norm_dispatch(monkeypatch):
    """layers.rms_norm: the kernel for bf16 CPU tensors, torch otherwise (float32, the env switch)."""
    from sparkrelay.models import layers

    x, w = torch.randn(2, 1, 64).to(torch.bfloat16), torch.ones(1, 64, dtype=torch.bfloat16)
    calls = []
    spy = type("Spy", (), {"rms_norm_bf16": lambda *a: calls.append(1) or x})
    monkeypatch.setattr(layers.cpu_kernels, "portable", lambda: spy)
    layers.rms_norm(x, w, 1e-6)
    layers.rms_norm(x.float(), w.float(), 1e-6)
    assert len(calls) == 1
    monkeypatch.setattr(layers.cpu_kernels, "portable", lambda: None)  # kernels off: torch's ops
    ref = w * F.rms_norm(x.float(), (64,), None, 1e-6).to(torch.bfloat16)
    assert torch.equal(layers.rms_norm(x, w, 1e-6), ref)


@needs_cpu
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 33])
@torch.inference_mode()
def test_avx_linear_dispatch(rows):
    """bf16 weights: AvxLinear, its kernel up to KERNEL_ROWS rows, oneDNN above (both near float64);
    [R, B, d] inputs keep their shape; float32 weights stay on oneDNN."""
    w, b, x = operands(300, 257, rows)
    layer = frozen_linear(w, b.to(torch.bfloat16))
    assert isinstance(layer, AvxLinear) and torch.equal(layer.weight, w)
    got = layer(x)
    assert_near_float64(got, x, w, b.to(torch.bfloat16))
    assert torch.equal(layer(x.view(1, rows, -1)), got.view(1, rows, -1))
    calls, real = [], layer.kernel
    layer.kernel = lambda *a: calls.append(1) or real(*a)
    layer(x)
    assert len(calls) == (1 if rows <= KERNEL_ROWS else 0)
    assert not isinstance(frozen_linear(w.float()), AvxLinear)
    assert isinstance(fast_head(w), AvxLinear)


@needs_cpu
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@torch.inference_mode()
def test_int8_kernel_equals_its_float64_reference(shape, dtype, path):
    """Exactly the float64 product of the per-row 16-bit activations and the int8 weight (to the
    output dtype's rounding), and weight-only in effect: float32 within 2e-4 relative RMS of x times
    the dequantized weight (8-bit activations were ~1e-2 off)."""
    n, k = shape
    ext = cpu_kernels.load()
    for rows in (1, 2, 5, KERNEL_ROWS, KERNEL_ROWS + 1):
        w, b, x = operands(n, k, rows, seed=rows)
        q, s = quantize_per_channel(w.float())
        got = ext.linear_int8(
            x.to(dtype).contiguous(),
            cpu_kernels.pack_int8(q),
            cpu_kernels.pad_to_tile(s),
            cpu_kernels.pad_to_tile(q.sum(1, dtype=torch.int32)),
            n,
            cpu_kernels.pad_to_tile(b),
        )
        assert got.dtype == dtype and got.shape == (rows, n)
        xf = x.to(dtype).float()  # the kernel's own quantization, in float32
        sx = xf.abs().amax(1, keepdim=True) / 32767
        sx = torch.where(sx > 0, sx, torch.ones_like(sx))
        xq = torch.round(xf * (1 / sx)).double()
        ref = (xq @ q.double().t()) * sx.double() * s.double() + b.double()
        ulp = 2.0**-8 if dtype == torch.bfloat16 else 1e-5
        bound = ulp * ref.abs() + 1e-4 * (ref.abs().max() + 1)
        assert bool(((got.double() - ref).abs() <= bound).all())
        dequantized = x.to(dtype).double() @ (q.double() * s.double()[:, None]).t() + b.double()
        near = 2.0**-8 if dtype == torch.bfloat16 else 2e-4  # bf16: the output's own rounding
        assert float((got.double() - dequantized).norm() / dequantized.norm()) < near
        exact = x.to(dtype).double() @ w.double().t() + b.double()
        if k >= 64:  # a few inputs: one rounding dominates
            assert float((got.double() - exact).norm() / exact.norm()) < 0.02


@needs_cpu
@pytest.mark.parametrize("rows", [1, 8, 9, 56, "last", "first above"])
@torch.inference_mode()
def test_int8_linear_dispatch(rows):
    """Int8Linear: the kernel below quant.kernel_rows() rows (any row count: a batch's verify or draft
    block, a prefill chunk), the dequantized weight from there."""
    limit = kernel_rows()
    rows = {"last": limit - 1, "first above": limit}.get(rows, rows)
    w, b, x = operands(96, 130, rows)
    layer = Int8Linear(w, b.to(torch.bfloat16), torch.bfloat16)
    calls, real = [], layer.kernel
    layer.kernel = lambda *a: calls.append(1) or real(*a)
    got = layer(x.view(1, rows, -1))
    assert got.shape == (1, rows, 96) and got.dtype == torch.bfloat16
    assert len(calls) == (1 if rows < limit else 0)
    exact = x.double() @ w.double().t() + b.to(torch.bfloat16).double()
    assert float((got[0].double() - exact).norm() / exact.norm()) < 0.02


@needs_cpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@torch.inference_mode()
def test_int8_rows_do_not_depend_on_the_rows_beside_them(dtype):
    """The int8 kernel's sums are exact int32 per row (tile unit or vector loop), so a row's output
    is bit-equal whatever call it is part of: a decode step, a batch's verify block, a prefill."""
    n = min(300, kernel_rows() - 1)  # one kernel call for all of them, on either path
    w, b, x = operands(200, 130, n)
    layer = Int8Linear(w, b.to(dtype), dtype)
    full = layer(x.to(dtype))
    for k in (1, 2, 8, 9, 40, n - 1):
        assert torch.equal(layer(x[:k].to(dtype)), full[:k]), k


@needs_cpu
def test_the_environment_turns_them_off(cpu_kernels_off):
    w, b, x = operands(64, 64, 1)
    assert isinstance(frozen_linear(w), PackedLinear)
    assert cpu_kernels.why_off() == "SPARKRELAY_CPU_KERNELS=0"


def test_no_compiler_means_the_fallback(tmp_path):
    """PATH without a compiler and an empty build folder: one warning names the compiler and the
    fallback (the AVX2 build's, on a CPU that has only AVX2), the bf16 linears are oneDNN's (a
    float32 copy where oneDNN has no bf16), and a bfloat16 model generates."""
    bin_dir = tmp_path / "bin"  # empty: no c++, no ninja (this interpreter is called by its path)
    bin_dir.mkdir()
    script = textwrap.dedent(f"""
        import logging, torch
        logging.basicConfig(level=logging.WARNING)
        from sparkrelay import LLM, SamplingParams
        from sparkrelay.models import cpu_kernels
        from sparkrelay.models.kernels import WideLinear, PackedLinear, frozen_linear, onednn_bf16
        assert cpu_kernels.load() is None
        print("WHY", cpu_kernels.why_off())
        kind = PackedLinear if onednn_bf16() else WideLinear
        assert isinstance(frozen_linear(torch.randn(64, 64).to(torch.bfloat16)), kind)
        llm = LLM({str(Path("models/tiny-qwen3").resolve())!r}, dtype="bfloat16", max_total_tokens=1024)
        out = llm.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))
        print("TOKENS", len(out[0]["output_ids"]))
    """)
    env = {k: v for k, v in os.environ.items() if k != "CXX"}
    env.update(PATH=str(bin_dir), SPARKRELAY_KERNEL_BUILD=str(tmp_path / "build"))
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    if HAS_CPU:
        assert "WHY no C++ compiler" in proc.stdout, proc.stdout
        assert proc.stderr.count("CPU kernels off: no C++ compiler") == 1, proc.stderr[-2000:]
        assert "the linears use oneDNN" in proc.stderr
    elif all(
        f in cpu_kernels.cpu_flags() for f in cpu_kernels.AVX2_NEEDED
    ):  # the AVX2 build's turn
        assert proc.stderr.count("AVX2 kernels off: no C++ compiler") == 1, proc.stderr[-2000:]
    assert "TOKENS 4" in proc.stdout


def load_in_subprocess(build, timeout: float = 120) -> subprocess.CompletedProcess:
    code = "from sparkrelay.models import cpu_kernels as k; m = k.load(); print('LOADED', m is not None, k.why_off())"
    env = dict(os.environ, SPARKRELAY_KERNEL_BUILD=str(build))
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.skipif(not HAS_CPU, reason="needs AVX-512 bf16 (the kernels' build)")
def test_a_build_lock_left_by_a_killed_process_never_blocks_a_load(tmp_path):
    """torch's lock file, as a builder killed inside torch's load() leaves it, made every later
    process wait forever (servers started after a SIGKILL in the e2e tests hung at their first
    request). Under the flock it is known stale and removed; a killed flock holder frees it."""
    build = tmp_path / "build"
    shutil.copytree(cpu_kernels.BUILD, build)  # a built copy: the load checks, never compiles
    (build / "lock").write_text("")
    proc = load_in_subprocess(build)
    assert proc.returncode == 0 and "LOADED True" in proc.stdout, proc.stderr[-2000:]
    assert not (build / "lock").exists()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from sparkrelay.models import cpu_kernels as k\n"
            "with k._build_lock(Path(sys.argv[1])):\n print('HELD', flush=True); time.sleep(600)",
            str(build / "build.flock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "HELD"
        holder.kill()  # SIGKILL while holding the lock
        holder.wait(timeout=30)
        proc = load_in_subprocess(build)
        assert proc.returncode == 0 and "LOADED True" in proc.stdout, proc.stderr[-2000:]
    finally:
        holder.kill()


@needs_rows
def test_loading_a_model_loads_the_kernels():
    """A float32 model has no bf16 linear to pack, so before, its first request ran the build check
    (~0.5 s of ninja) inside its TTFT; now loading the model does (of either build)."""
    code = (
        "from sparkrelay.models import cpu_kernels as k\n"
        "from sparkrelay.models.decoder import load_causal_lm\n"
        "assert 'module' not in k._state\n"
        f"load_causal_lm({str(Path('models/tiny-qwen3').resolve())!r})\n"
        "print('LOADED', (k._state.get('module') or k._state.get('avx2')) is not None)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "LOADED True" in proc.stdout, proc.stderr[-2000:]


@needs_cpu
def test_forced_off_builds_and_runs_the_fallbacks_then_restores():
    """Inside forced_off() a bf16 weight gets oneDNN's layer and the norm takes torch's ops, as
    with SPARKRELAY_CPU_KERNELS=0; after it the kernels serve again (the roofline's interleaved
    kernels-off engine)."""
    from sparkrelay.models.layers import rms_norm

    w = torch.randn(64, 32).to(torch.bfloat16)
    x = torch.randn(3, 1, 32).to(torch.bfloat16)
    g = torch.randn(1, 32).to(torch.bfloat16)
    with cpu_kernels.forced_off():
        assert cpu_kernels.load() is None
        off = frozen_linear(w)
        assert isinstance(off, PackedLinear) and not isinstance(off, AvxLinear)
        ref = g * F.rms_norm(x.float(), (32,), None, 1e-6).to(torch.bfloat16)
        assert torch.equal(rms_norm(x, g, 1e-6), ref)
    assert cpu_kernels.load() is not None
    assert isinstance(frozen_linear(w), AvxLinear)
