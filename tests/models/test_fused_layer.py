"""The decoder layer's one-call C++ forward (csrc/cpu_decode_layer.cpp) against the Python layer on
the same kernels: logits, hidden states and the K/V written are bit-equal (torch.equal) for bf16 and
int8 weights, with and without QK norm and biases, at 1 to 8 rows of one or several sequences and
for a DSpark draft block; it is never taken where the Python path would leave the kernels. Either
build (AVX-512, or AVX2 for bf16 weights)."""

import pytest
import torch

from sparkrelay import LLM, SamplingParams
from sparkrelay.models import cpu_kernels
from sparkrelay.models.attention import AttnMeta
from sparkrelay.models.decoder import DecoderLayer, load_causal_lm, unfused
from sparkrelay.models.quant import apply_torchao_config
from testkit.families import make_random
from testkit.models import BUNDLED, BUNDLED_DRAFTER

pytestmark = pytest.mark.skipif(
    cpu_kernels.portable() is None, reason="needs the CPU kernels (set-up builds them)"
)
# the int8 product is in the AVX-512 build alone: on an AVX2 CPU an int8 layer stays in Python
needs_int8 = pytest.mark.skipif(cpu_kernels.load() is None, reason="the int8 kernel needs AVX-512")
PAGE = 16


@pytest.fixture(scope="module", params=["qwen3-qk-norm", "llama-bias"])
def folder(request, tmp_path_factory):
    if request.param == "qwen3-qk-norm":
        return BUNDLED
    # head_dim 32: the RoPE kernel's multiple; biases on q/k/v/o and the MLP
    return make_random(
        tmp_path_factory.mktemp("llama") / "m",
        "llama-bias-tied",
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    )


def pools(model, seed: int) -> dict:
    """Random bf16 K/V for 40 cached positions of every layer (and room for the fed ones)."""
    s, g = model.spec, torch.Generator().manual_seed(seed)
    shape = (512, s.num_kv_heads, s.head_dim)
    return {
        i: (torch.randn(shape, generator=g).bfloat16(), torch.randn(shape, generator=g).bfloat16())
        for i in range(model.start, model.end)
    }


def fused_layers(layers) -> int:
    """How many of `layers` built their C++ layer (on their first call that could take it)."""
    return sum(layer._few_rows[0] is not None for layer in layers)


def metas() -> dict:
    """Row layouts a step feeds: one decode row, a verify block, a full block, two sequences' decode
    rows, two sequences' ragged chunks."""
    tables = [list(range(0, 8)), list(range(10, 18))]
    return {
        "T1": AttnMeta.build([40], [41], tables[:1], PAGE, "cpu"),
        "T3": AttnMeta.build([40], [43], tables[:1], PAGE, "cpu"),
        "T8": AttnMeta.build([33], [41], tables[:1], PAGE, "cpu"),
        "B2": AttnMeta.build([40, 21], [41, 22], tables, PAGE, "cpu"),
        "B2-ragged": AttnMeta.build([40, 21], [43, 23], tables, PAGE, "cpu"),
    }


@pytest.mark.parametrize("quant", ["", pytest.param("int8wo", marks=needs_int8)])
@torch.inference_mode()
def test_fused_layer_is_bit_equal_to_the_python_layer(folder, quant):
    model = load_causal_lm(str(folder), dtype=torch.bfloat16)
    apply_torchao_config(model, quant)
    for name, meta in metas().items():
        ids = torch.randint(0, 4000, (meta.positions.numel(),), generator=torch.Generator())
        fused_kv, python_kv = pools(model, 1), pools(model, 1)
        fused = model.forward(meta, fused_kv, input_ids=ids)
        assert fused_layers(model.model.layers.values()) == len(model.model.layers), name
        with unfused(model):
            ref = model.forward(meta, python_kv, input_ids=ids)
        assert torch.equal(fused.logits, ref.logits) and torch.equal(fused.hidden, ref.hidden), name
        for i in fused_kv:
            assert torch.equal(fused_kv[i][0], python_kv[i][0]), (name, i)
            assert torch.equal(fused_kv[i][1], python_kv[i][1]), (name, i)
    assert not any("few_rows" in vars(layer) for layer in model.model.layers.values())


@needs_int8
@torch.inference_mode()
def test_fused_layer_is_rebuilt_when_the_products_change():
    """--torchao-config replaces the products after the first forward: the old C++ layer, holding
    the bf16 weights, must not serve the int8 model."""
    model = load_causal_lm(str(BUNDLED), dtype=torch.bfloat16)
    meta = AttnMeta.build([40], [41], [list(range(8))], PAGE, "cpu")
    model.forward(meta, pools(model, 2), input_ids=torch.tensor([5]))
    before = [layer._few_rows[0] for layer in model.model.layers.values()]
    apply_torchao_config(model, "int8wo")
    fused_kv, python_kv = pools(model, 2), pools(model, 2)
    fused = model.forward(meta, fused_kv, input_ids=torch.tensor([5]))
    after = [layer._few_rows[0] for layer in model.model.layers.values()]
    assert all(a is not None and a is not b for a, b in zip(after, before))
    with unfused(model):
        ref = model.forward(meta, python_kv, input_ids=torch.tensor([5]))
    assert torch.equal(fused.logits, ref.logits)


@torch.inference_mode()
def test_fused_layer_is_not_taken_off_the_kernels():
    """float32, more than KERNEL_ROWS rows, or an engine built with the kernels off: the Python
    path, whose own fallbacks apply."""
    meta_9 = AttnMeta.build([30], [39], [list(range(8))], PAGE, "cpu")
    bf16 = load_causal_lm(str(BUNDLED), dtype=torch.bfloat16)
    bf16.forward(meta_9, pools(bf16, 3), input_ids=torch.arange(9))
    assert fused_layers(bf16.model.layers.values()) == 0
    f32 = load_causal_lm(str(BUNDLED), dtype=torch.float32)
    layer = next(iter(f32.model.layers.values()))
    assert layer.few_rows(torch.zeros(1, 256), torch.zeros(4, 4, 32)) is None
    with cpu_kernels.forced_off():
        off = load_causal_lm(str(BUNDLED), dtype=torch.bfloat16)
        layer = next(iter(off.model.layers.values()))
        h = torch.zeros(1, 256, dtype=torch.bfloat16)
        assert layer.few_rows(h, torch.zeros(4, 4, 32, dtype=torch.bfloat16)) is None


def test_dspark_draft_blocks_take_it_and_stay_bit_equal(monkeypatch):
    """The drafter's layers (DraftLayer, a DecoderLayer) take the fused forward for their blocks of
    7 rows: bf16 DSpark commits the same tokens with the same acceptance either way."""
    greedy = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    prompts = [list(range(5, 5 + n)) for n in (9, 30, 17)]

    def run():
        llm = LLM(
            str(BUNDLED),
            dtype="bfloat16",
            speculative_algorithm="DSPARK",
            speculative_draft_model_path=str(BUNDLED_DRAFTER),
        )
        out = [o["output_ids"] for o in llm.generate(prompts, greedy)]
        return llm, out, llm.engine.stats()["spec_accept_length"]

    llm, fused, accept = run()
    drafter = llm.engine.proposer.drafter
    assert fused_layers(drafter.layers) == len(drafter.layers) > 0
    with monkeypatch.context() as m:  # every layer the engines build runs its Python forward
        m.setattr(DecoderLayer, "few_rows", lambda self, h, k_pool: None)
        _, python, python_accept = run()
    assert fused == python and accept == python_accept
