"""Frozen linear kernels: packed bfloat16 (oneDNN, the fallback of sparkrelay's own kernels:
test_cpu_kernels.py) and weight-only int8 against F.linear; whole models with them."""

import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sparkrelay import LLM, SamplingParams
from sparkrelay.config import ConfigError
from sparkrelay.kvcache.pool import KVPool
from sparkrelay.models import kernels
from sparkrelay.models.attention import AttnMeta
from sparkrelay.models.decoder import load_causal_lm
from sparkrelay.models.kernels import (
    AvxLinear,
    PackedLinear,
    SmallLinear,
    WideLinear,
    fast_head,
    frozen_linear,
)
from sparkrelay.models.layers import fuse_linears
from sparkrelay.models.quant import (
    DEQUANT_ROWS,
    Int8Linear,
    apply_torchao_config,
    quantize_per_channel,
)
from testkit.models import PROMPT_SOURCE, code_prompts, make_random_qwen3

BF16 = dict(rtol=1.6e-2, atol=2e-2)  # a bfloat16 ulp is 2^-8 relative; outputs here are O(1)
ROWS = (1, 8, 33)
# a bfloat16 weight's layer with the kernels off: oneDNN's where it runs bfloat16, else aten's
BF16_OFF = PackedLinear if kernels.onednn_bf16() else WideLinear


def weights(
    out: int, inp: int, bias: bool, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    # outputs O(1) for x ~ N(0, 1)
    w = (torch.randn(out, inp, generator=g) / inp**0.5).to(torch.bfloat16)
    return w, (torch.randn(out, generator=g).to(torch.bfloat16) if bias else None)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(384, 256), (256, 768), (1000, 96)])
@torch.inference_mode()
def test_packed_bf16_equals_f_linear(rows, bias, shape, cpu_kernels_off, bf16_fallback):
    w, b = weights(*shape, bias)
    layer = frozen_linear(w, b)
    assert isinstance(layer, bf16_fallback)
    x = torch.randn(rows, shape[1]).to(torch.bfloat16)
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, shape[0])
    torch.testing.assert_close(got, F.linear(x, w, b), **BF16)
    # [R, B, d] inputs (the drafter)
    torch.testing.assert_close(layer(x.view(1, rows, -1)), got.view(1, rows, -1))
    assert torch.equal(layer.weight, w)  # the packed layout holds the weight exactly


@pytest.mark.parametrize("rows", ROWS)
@torch.inference_mode()
def test_float32_layouts(rows, cpu_kernels_off):
    """float32 on CPU: a small weight keeps both layouts (one row: MKL, several: oneDNN), a large
    one is packed."""
    g = torch.Generator().manual_seed(4)
    small, large = (
        torch.randn(64, 32, generator=g),
        torch.randn(kernels.PACK_MIN_FP32 // 256, 256, generator=g),
    )
    b = torch.randn(64, generator=g)
    assert isinstance(frozen_linear(small, b), SmallLinear) and isinstance(
        frozen_linear(large), PackedLinear
    )
    for w, bias in ((small, b), (large, None)):
        x = torch.randn(rows, w.shape[1], generator=g)
        layer = frozen_linear(w, bias)
        torch.testing.assert_close(layer(x), F.linear(x, w, bias), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(
            layer(x.view(1, rows, -1)), layer(x).view(1, rows, -1), rtol=1e-5, atol=1e-5
        )
    # CPU heads get a packed copy
    assert isinstance(fast_head(torch.randn(100_000, 64)), PackedLinear)
    assert isinstance(fast_head(torch.randn(1000, 64).to(torch.bfloat16)), BF16_OFF)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bias", [False, True])
@torch.inference_mode()
def test_fused_qkv_packed_equals_separate_products(rows, bias, cpu_kernels_off):
    lins = [nn.Linear(128, n, bias=bias).to(torch.bfloat16) for n in (256, 64, 64)]
    fused = fuse_linears(*lins)
    assert isinstance(fused, BF16_OFF)
    x = torch.randn(rows, 128).to(torch.bfloat16)
    want = torch.cat([F.linear(x, l.weight, l.bias) for l in lins], dim=-1)  # [T, 384]
    torch.testing.assert_close(fused(x), want, **BF16)


@pytest.mark.parametrize("rows", ROWS + (DEQUANT_ROWS + 3,))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@torch.inference_mode()
def test_int8wo_linear(rows, dtype, cpu_kernels_off):
    w, b = weights(512, 256, True, seed=1)
    layer = Int8Linear(w, b, dtype)
    x = torch.randn(rows, 256).to(dtype)
    got = layer(x).float()
    q, scales = quantize_per_channel(w)
    # each row's largest weight maps to ±127
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    exact = F.linear(x.float(), q.float() * scales.to(dtype).float()[:, None], b.to(dtype).float())
    torch.testing.assert_close(got, exact, **BF16)  # the kernel computes the dequantized product
    ref = F.linear(x.float(), w.float(), b.float())
    rel = (got - ref).norm() / ref.norm()
    assert rel < 0.02, (
        f"int8 weight-only product is {rel:.4f} away from the bfloat16 one (relative RMS)"
    )
    torch.testing.assert_close(layer(x.view(1, rows, -1)).float(), got.view(1, rows, -1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@torch.inference_mode()
def test_int8wo_replaces_every_layer_linear_and_the_head(random_model_dir, dtype):
    model = load_causal_lm(str(random_model_dir), dtype=dtype)
    before = model.model.layers["0"].mlp.down_proj.weight.clone()
    apply_torchao_config(model, "int8wo")
    layer = model.model.layers["0"]
    for lin in (
        layer.self_attn.qkv,
        layer.self_attn.o_proj,
        layer.mlp.gate_up,
        layer.mlp.down_proj,
    ):
        assert isinstance(lin, Int8Linear)
    assert model.head is None or isinstance(model.head, Int8Linear)  # the LM head's fast copy
    assert isinstance(model.model.embed_tokens, nn.Embedding) and isinstance(
        model.lm_head, nn.Linear
    )
    # [d, inter] weights from either layout (TLinear's is a transposed view)
    down = layer.mlp.down_proj
    x = torch.randn(2, down.in_features).to(dtype)
    torch.testing.assert_close(
        down(x).float(), F.linear(x.float(), before.float()), rtol=0.05, atol=0.05
    )
    with pytest.raises(ConfigError, match="int4wo"):
        apply_torchao_config(model, "int4wo")


def greedy(folder, prompts, **settings) -> list[list[int]]:
    llm = LLM(str(folder), **{"page_size": 4, "max_total_tokens": 2048, **settings})
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True))
    return [o["output_ids"] for o in outs]


@pytest.mark.parametrize("tied", [False, True])
def test_packed_model_greedy_equals_unpacked(tmp_path, monkeypatch, tied):
    from transformers import AutoTokenizer

    folder = make_random_qwen3(tmp_path / "m", seed=3, tie_word_embeddings=tied)
    prompts = code_prompts(AutoTokenizer.from_pretrained(folder), 6, PROMPT_SOURCE)
    packed = greedy(folder, prompts, dtype="bfloat16")
    # every layer on the transposed-matmul path
    monkeypatch.setattr(kernels, "can_pack", lambda w: False)
    assert greedy(folder, prompts, dtype="bfloat16") == packed


@torch.inference_mode()
def held_out_loss(
    model, ids: torch.Tensor, dtype: torch.dtype, seq: int = 48
) -> tuple[float, torch.Tensor]:
    """Mean next-token loss over windows of `ids`, and the argmax token at every position (windows
    shorter than quant.kernel_rows(): the int8 kernel runs)."""
    losses, top = [], []
    for window in (w for w in ids.split(seq) if w.numel() == seq):
        pool = KVPool(
            range(model.spec.num_layers),
            -(-seq // 16),
            16,
            model.spec.num_kv_heads,
            model.spec.head_dim,
            dtype,
            "cpu",
        )
        logits = model(
            AttnMeta.build([0], [seq], [list(range(-(-seq // 16)))], 16, "cpu"),
            pool.layers,
            input_ids=window,
        ).logits.float()
        losses.append(F.cross_entropy(logits[:-1], window[1:]).item())
        top.append(logits.argmax(-1))
    return sum(losses) / len(losses), torch.cat(top)


def test_int8wo_bundled_model_quality(bundled_model_dir):
    """Loose sanity bounds only; the measured figures (all held-out windows, greedy agreement) are
    in benchmarks/results/quality/quality.md (python -m sparkrelay.tools.bench.quality)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bundled_model_dir)
    ids = torch.tensor(tok.encode(PROMPT_SOURCE)[: 24 * 48])
    bf16 = load_causal_lm(str(bundled_model_dir), dtype=torch.bfloat16)
    int8 = load_causal_lm(str(bundled_model_dir), dtype=torch.bfloat16)
    apply_torchao_config(int8, "int8wo")
    loss_bf16, top_bf16 = held_out_loss(bf16, ids, torch.bfloat16)
    loss_int8, top_int8 = held_out_loss(int8, ids, torch.bfloat16)
    agreement = (top_bf16 == top_int8).float().mean().item()
    print(
        f"held-out loss bf16 {loss_bf16:.4f}, int8wo {loss_int8:.4f}; top-1 agreement {agreement:.4f}"
    )
    assert loss_int8 < loss_bf16 + 0.1, (loss_bf16, loss_int8)
    assert agreement > 0.9, agreement


@pytest.mark.parametrize("tao", ["", "int8wo"])
def test_dspark_bf16_drafter_is_packed_and_accepts(bundled_model_dir, bundled_drafter_dir, tao):
    """bfloat16 DSpark: the drafter's products are packed (or int8), its drafts are accepted, and
    its greedy outputs follow plain decoding of the same target (up to bfloat16 rounding between row
    counts)."""
    from transformers import AutoTokenizer

    prompts = code_prompts(AutoTokenizer.from_pretrained(bundled_model_dir), 6, PROMPT_SOURCE)
    settings = dict(dtype="bfloat16", torchao_config=tao, page_size=4, max_total_tokens=4096)
    plain = greedy(bundled_model_dir, prompts, **settings)
    llm = LLM(
        str(bundled_model_dir),
        speculative_algorithm="DSPARK",
        speculative_draft_model_path=str(bundled_drafter_dir),
        **settings,
    )
    drafter = llm.engine.proposer.drafter
    kind = Int8Linear if tao else (BF16_OFF, AvxLinear)  # AvxLinear: sparkrelay's kernels
    assert all(
        isinstance(m, kind) for l in drafter.layers for m in (l.self_attn.qkv, l.mlp.down_proj)
    )
    assert isinstance(drafter.context.product, kind)  # every layer's context k/v
    # fc stays in --dtype under int8wo: a draft-kv prefill sums its column blocks in --dtype
    assert isinstance(drafter.fc, (BF16_OFF, AvxLinear))
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True))
    same = sum(a["output_ids"] == b for a, b in zip(outs, plain))
    print(
        f"DSpark {tao or 'bf16'}: {same}/{len(prompts)} outputs equal plain; stats {llm.engine.stats()}"
    )
    assert llm.engine.stats()["spec_accept_length"] > 1.5
    # a verify multiplies 1 + B rows at once: bf16 rounding may flip a near-tie
    assert same >= len(prompts) // 2


@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("cc") is None,
    reason="inductor needs a C++ compiler",
)
@pytest.mark.parametrize("kind", ["packed", "int8wo"])
@torch.inference_mode()
def test_layers_compile(kind):
    """--enable-torch-compile: inductor takes both layers (the packed weight through an opaque
    op)."""
    w, b = weights(256, 128, True, seed=2)
    layer = BF16_OFF(w, b) if kind == "packed" else Int8Linear(w, b, torch.bfloat16)
    compiled = torch.compile(layer.forward, dynamic=True)
    for rows in (1, 5):
        x = torch.randn(rows, 128).to(torch.bfloat16)
        torch.testing.assert_close(compiled(x), layer(x), **BF16)


SWEEP = """
import torch
from sparkrelay.models.kernels import PackedLinear
def rss(): return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) // 1024
layers = [PackedLinear(torch.randn(1024, 256), None), PackedLinear(torch.randn(256, 1024), None)]
x = {256: torch.randn(1, 256), 1024: torch.randn(1, 1024)}
for n in range(200, 440):  # 240 row counts of about one size: each a new shape for oneDNN
    for layer in layers:
        layer(x[layer.in_features].expand(n, -1).contiguous())
    if n == 280:  # 81 row counts x 2 weights: both caps (ONEDNN_CACHE_ENTRIES) reached
        base = rss()
print(rss() - base)
"""


def test_onednn_shape_caches_are_bounded():
    """Every new row count makes oneDNN build and cache a kernel; kernels.py caps both of its
    caches, so a server that sees every prompt length stops growing (uncapped, the last 160 row
    counts of this sweep add ~190 MiB)."""
    import subprocess
    import sys

    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
    }
    out = subprocess.run(
        [sys.executable, "-c", SWEEP], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) < 60, (
        f"RSS grew by {out.stdout.split()[-1]} MiB over 160 new row counts"
    )
