"""The AVX2 build of the bf16 product (csrc/cpu_linear_avx2.cpp, models/cpu_kernels.py `portable()`):
on a CPU with avx2 and fma but not AVX-512 bf16, set-up builds it and every bf16 weight becomes an
AvxLinear over it; equal to a float64 reference within the output's rounding for every row count
and shape class, with bias and base; dispatch by rows (the float32 copy above 8), by
SPARKRELAY_CPU_KERNELS and inside forced_off(); a bf16 model's logits and greedy tokens as with the
kernel off. On a CPU with the AVX-512 build that one serves (tests/models/test_cpu_kernels.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparkrelay.models import cpu_kernels
from sparkrelay.models.kernels import (
    KERNEL_ROWS,
    AvxLinear,
    WideLinear,
    add_linear,
    fast_head,
    frozen_linear,
    onednn_bf16,
)

FLAGS = cpu_kernels.cpu_flags()
AVX2_ONLY = all(f in FLAGS for f in cpu_kernels.AVX2_NEEDED) and not all(
    f in FLAGS for f in cpu_kernels.NEEDED
)
needs_avx2 = pytest.mark.skipif(
    not AVX2_ONLY, reason="the AVX2 build serves CPUs with avx2 and fma but not AVX-512 bf16"
)
# (N, K): odd, below and above a tile, K past the prefetch distance, the head's shape class
SHAPES = [(1, 2), (31, 7), (32, 64), (33, 65), (100, 300), (1000, 96), (96, 1001), (64, 2048)]
TINY = Path("models/tiny-qwen3").resolve()


def operands(n: int, k: int, rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    return w, torch.randn(n, generator=g), x


def float64_bound(x, w, ref, out_dtype) -> torch.Tensor:
    """The output's rounding (bf16: 2^-8 relative) plus fp32 accumulation error."""
    rounding = 2.0**-8 * ref.abs() if out_dtype == torch.bfloat16 else 1e-7 * ref.abs()
    return rounding + 1e-6 * (x.double().abs() @ w.double().abs().t()) + 1e-6


def test_each_build_compiles_its_own_sources_once():
    """The two builds share the ISA-free entry points; each compiles its own inner loops (an AVX2
    file in the AVX-512 build, or an AVX-512 one in the AVX2 build, would not compile or link)."""
    for sources in (cpu_kernels.SOURCES, cpu_kernels.AVX2_SOURCES):
        assert len(set(sources)) == len(sources) and all(p.exists() for p in sources)
    assert not [p.name for p in cpu_kernels.SOURCES if p.stem.endswith("_avx2")]
    avx2_only = {p.name for p in cpu_kernels.AVX2_SOURCES} - {p.name for p in cpu_kernels.SOURCES}
    assert avx2_only == {"cpu_linear_avx2.cpp", "cpu_rows_avx2.cpp", "cpu_attention_heads_avx2.cpp"}


@needs_avx2
def test_set_up_built_the_avx2_kernel():
    module = cpu_kernels.portable()
    assert module is not None, cpu_kernels._state.get("avx2_why")
    assert module.__name__ == "sparkrelay_cpu_kernels_avx2"
    assert hasattr(module, "argmax_rows") and hasattr(module, "markov_greedy")
    assert not hasattr(module, "linear_int8")  # the int8 product needs avx512_vnni


@needs_avx2
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@torch.inference_mode()
def test_avx2_product_equals_float64_at_every_row_count(shape, out_dtype):
    """linear_bf16 with bias and base into out, rows 1 to 9 (9: two row groups)."""
    n, k = shape
    k += k % 2  # the product reads pairs (KernelLinear pads an odd K: the dispatch test)
    ext = cpu_kernels.portable()
    for rows in range(1, KERNEL_ROWS + 2):
        w, b, x = operands(n, k, rows, seed=rows)
        base = torch.randn(rows, n).to(torch.bfloat16)
        out = torch.empty(rows, n, dtype=out_dtype)
        ext.linear_bf16(x, cpu_kernels.pack_bf16(w), n, cpu_kernels.pad_to_tile(b), base, out)
        ref = x.double() @ w.double().t() + b.double() + base.double()
        err = (out.double() - ref).abs()
        assert bool((err <= float64_bound(x, w, ref, out_dtype)).all()), (rows, float(err.max()))


@needs_avx2
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 33])
@torch.inference_mode()
def test_avx2_linear_dispatch(rows):
    """A bf16 weight: AvxLinear, the kernel up to KERNEL_ROWS rows (an odd K padded), the float32
    copy above (oneDNN has no bf16 product here); the head too; add_linear through the kernel."""
    w, b, x = operands(300, 257, rows)
    layer = frozen_linear(w, b.to(torch.bfloat16))
    assert isinstance(layer, AvxLinear) and torch.equal(layer.weight, w)
    assert isinstance(layer.wide, WideLinear if not onednn_bf16() else torch.nn.Module)
    ref = x.double() @ w.double().t() + b.to(torch.bfloat16).double()
    got = layer(x)
    assert bool(((got.double() - ref).abs() <= float64_bound(x, w, ref, torch.bfloat16)).all())
    calls, real = [], layer.kernel
    layer.kernel = lambda *a: calls.append(1) or real(*a)
    layer(x)
    assert len(calls) == (1 if rows <= KERNEL_ROWS else 0)
    assert isinstance(fast_head(w), AvxLinear)
    even = frozen_linear(w[:, :256].contiguous())
    base, out = torch.randn(rows, 300).to(torch.bfloat16), torch.empty(rows, 300)
    add_linear(even, x[:, :256], base, out)
    ref = x[:, :256].double() @ w[:, :256].double().t() + base.double()
    assert bool(((out.double() - ref).abs() <= float64_bound(x, w, ref, torch.float32)).all())


@needs_avx2
def test_avx2_kernel_off_by_environment_and_forced_off(cpu_kernels_off):
    w = torch.randn(64, 64).to(torch.bfloat16)
    assert cpu_kernels.portable() is None
    assert not isinstance(frozen_linear(w), AvxLinear)


@needs_avx2
def test_forced_off_restores_the_avx2_kernel():
    w = torch.randn(64, 64).to(torch.bfloat16)
    with cpu_kernels.forced_off():
        assert cpu_kernels.portable() is None
        assert isinstance(frozen_linear(w), WideLinear)
    assert isinstance(frozen_linear(w), AvxLinear)


@needs_avx2
def test_bf16_model_on_the_avx2_kernel_matches_the_kernel_off():
    """The bundled model in bf16, greedy, 24 tokens from three prompts (batch 3: the kernel's
    3-row pass): the same tokens with the kernel and without it, and a fresh process builds no
    AvxLinear with SPARKRELAY_CPU_KERNELS=0."""
    code = (
        "import torch, sys\n"
        "from sparkrelay import LLM, SamplingParams\n"
        "from sparkrelay.models.kernels import AvxLinear\n"
        f"llm = LLM({str(TINY)!r}, dtype='bfloat16', max_total_tokens=1024)\n"
        "kinds = {type(m).__name__ for m in llm.engine.runner.model.modules()}\n"
        "p = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)\n"
        "out = llm.generate([[5, 6, 7], [9, 10, 11, 12], [40, 41]], p)\n"
        "print('AVX', 'AvxLinear' in kinds, [o['output_ids'] for o in out])\n"
    )
    runs = {}
    for env in ("1", "0"):
        proc = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, cpu_kernels.ENV: env},
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        line = next(x for x in proc.stdout.splitlines() if x.startswith("AVX"))
        runs[env] = line.split(" ", 2)[1:]
    assert runs["1"][0] == "True" and runs["0"][0] == "False"
    assert runs["1"][1] == runs["0"][1]
