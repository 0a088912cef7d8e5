"""`--load-format dummy` (models/dummy.py): deterministic random weights at a config's shapes, the
same in every load, stage split, dtype and module that holds the tensor; every parameter
initialized; clear errors; the shipped real-shape folders of models/configs/
(tools/make_configs.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from sparkrelay.config import SGLANG_ONLY_FLAGS, Config, ConfigError, add_cli_args, config_from_args
from sparkrelay.engine import setup
from sparkrelay.kvcache.pool import KVPool
from sparkrelay.models.attention import AttnMeta
from sparkrelay.models.decoder import CausalLM, DecoderSpec, load_causal_lm
from sparkrelay.models.dspark import DSparkSpec, Qwen3DSparkModel
from sparkrelay.models.dspark_checkpoint import load_dspark
from sparkrelay.models.dspark_context import load_context_projector
from sparkrelay.models.dummy import fill_dummy
from sparkrelay.models.loader import CheckpointError
from sparkrelay.tools import make_configs

CONFIGS = Path("models/configs")
SMALL = dict(
    num_hidden_layers=4,
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=1000,
    max_position_embeddings=512,
)


def small_pair(folder: Path, **overrides) -> tuple[Path, Path]:
    """A small Qwen3-shaped target (config only, no weights) and its DSpark drafter config."""
    cfg = make_configs.target_config("qwen3-0.6b", **{**SMALL, **overrides})
    draft = make_configs.drafter_config(cfg, 2, [0, 2])
    draft["mask_token_id"] = 999
    (folder / "t").mkdir(parents=True)
    (folder / "t" / "config.json").write_text(json.dumps(cfg))
    make_configs.write_drafter(folder / "d", draft)
    return folder / "t", folder / "d"


@pytest.fixture
def unfused(monkeypatch):
    """load_causal_lm / load_dspark without the post-load fusion: parameters keep their checkpoint
    names."""
    monkeypatch.setattr(CausalLM, "fuse", lambda self: None)


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters()}


def forward(model, ids: list[int], hidden=None):
    s = model.spec
    pool = KVPool(
        range(model.start, model.end),
        8,
        4,
        s.num_kv_heads,
        s.head_dim,
        next(model.parameters()).dtype,
        "cpu",
    )
    meta = AttnMeta.build([0], [len(ids)], [list(range(8))], 4, "cpu")
    return model(
        meta,
        pool.layers,
        input_ids=None if hidden is not None else torch.tensor(ids),
        hidden=hidden,
    )


@pytest.mark.parametrize("tied", [True, False])
def test_same_weights_in_every_load_and_stage_split(tmp_path, unfused, tied):
    target, _ = small_pair(tmp_path, tie_word_embeddings=tied)
    whole = params(load_causal_lm(str(target), load_format="dummy"))
    assert all(
        torch.equal(p, whole[n])
        for n, p in params(load_causal_lm(str(target), load_format="dummy")).items()
    )
    first, last = (
        params(load_causal_lm(str(target), a, b, load_format="dummy")) for a, b in ((0, 2), (2, 4))
    )
    assert set(first) | set(last) == set(whole) | ({"lm_head.weight"} if tied else set())
    for name, p in {**first, **last}.items():
        ref = (
            whole["model.embed_tokens.weight"] if tied and name == "lm_head.weight" else whole[name]
        )
        # a tied last stage without the embedding gets it as its LM head
        assert torch.equal(p, ref), name
    assert not torch.equal(
        whole["model.layers.0.mlp.up_proj.weight"], whole["model.layers.1.mlp.up_proj.weight"]
    )


@torch.inference_mode()
def test_stages_compose_to_the_whole_model(tmp_path):
    target, _ = small_pair(tmp_path)
    whole = load_causal_lm(str(target), load_format="dummy")
    first, last = (
        load_causal_lm(str(target), a, b, load_format="dummy") for a, b in ((0, 2), (2, 4))
    )
    ids = list(range(5, 17))
    ref = forward(whole, ids).logits
    out = forward(last, ids, hidden=forward(first, ids).hidden).logits
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    assert ref.isfinite().all() and ref.std() > 0


def test_bfloat16_is_the_float32_values_rounded(tmp_path, unfused):
    target, _ = small_pair(tmp_path)
    f32 = params(load_causal_lm(str(target), load_format="dummy"))
    for name, p in params(
        load_causal_lm(str(target), dtype=torch.bfloat16, load_format="dummy")
    ).items():
        assert p.dtype == torch.bfloat16 and torch.equal(p, f32[name].to(torch.bfloat16)), name


def test_every_parameter_initialized(tmp_path):
    """Parameters start as NaN; after the fill, matrices are normal(0, initializer_range), norms
    ones, biases 0."""
    target, draft = small_pair(tmp_path, attention_bias=True, initializer_range=0.05)
    hf = json.loads((draft / "config.json").read_text())
    spec = DSparkSpec.from_hf(
        {**hf, "markov_head_type": "gated", "attention_bias": True},
        DecoderSpec.from_hf(json.loads((target / "config.json").read_text())),
    )
    model = Qwen3DSparkModel(spec)
    for p in model.parameters():
        p.data.fill_(float("nan"))
    fill_dummy(model, 0.05)
    for name, p in model.named_parameters():
        assert p.isfinite().all(), name
        if name.endswith(".bias"):
            assert (p == 0).all(), name
        elif name.endswith("norm.weight"):
            assert (p == 1).all(), name
        elif p.numel() >= 4096:
            assert abs(p.std().item() - 0.05) < 0.005 and abs(p.mean().item()) < 0.005, name


@torch.inference_mode()
def test_deep_bfloat16_logits_stay_finite(tmp_path):
    """36 layers (the 4B's depth) in bf16: the init keeps the residual stream and the logits
    finite."""
    target, _ = small_pair(tmp_path, num_hidden_layers=36, max_window_layers=36)
    out = forward(
        load_causal_lm(str(target), dtype=torch.bfloat16, load_format="dummy"), list(range(3, 30))
    )
    assert (
        out.logits.isfinite().all() and out.hidden.isfinite().all() and out.logits.float().std() > 0
    )


def test_drafter_shares_the_target_tensors_and_the_context_projection_matches(tmp_path):
    target_dir, draft = small_pair(tmp_path)
    target = load_causal_lm(str(target_dir), load_format="dummy")
    drafter = load_dspark(
        draft,
        target.spec,
        fuse=False,
        load_format="dummy",
        share_embedding_from=target.model.embed_tokens.weight,
        share_lm_head_from=target.lm_head.weight,
    )
    assert drafter.shared_with_target == (
        "embed_tokens",
        "lm_head",
    )  # frozen copies of the target's, as released
    # nothing to share: drawn, equal
    alone = load_dspark(draft, target.spec, fuse=False, load_format="dummy")
    assert alone.shared_with_target == () and torch.equal(
        alone.embed_tokens.weight, target.model.embed_tokens.weight
    )
    assert torch.equal(alone.lm_head.weight, target.lm_head.weight)
    mine = params(drafter)
    projector = load_context_projector(draft, target.spec, load_format="dummy")
    # the prefill's draft-kv projection: the decode drafter's tensors
    for name, p in params(projector).items():
        # context.product: every layer's k_proj and v_proj fused after loading, all compared here
        if not name.startswith("context.product."):
            assert torch.equal(p, mine[name]), name
    assert drafter.markov_head is not None and drafter.confidence_head is not None


def test_offline_llm_plain_and_dspark_agree(tmp_path):
    from sparkrelay.llm import LLM
    from sparkrelay.scheduler.request import SamplingParams

    target, draft = small_pair(tmp_path)
    make_configs.write_target(
        target, json.loads((target / "config.json").read_text()), CONFIGS / "qwen3-0.6b"
    )
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    plain = LLM(str(target), load_format="dummy", max_total_tokens=1024)
    spec = LLM(
        str(target),
        load_format="dummy",
        max_total_tokens=1024,
        speculative_algorithm="DSPARK",
        speculative_draft_model_path=str(draft),
    )
    ref = [o["output_ids"] for o in plain.generate(prompts, greedy)]
    assert [o["output_ids"] for o in spec.generate(prompts, greedy)] == ref
    assert all(len(r) == 6 and max(r) < 1000 for r in ref)


def test_missing_config_field_is_named(tmp_path):
    target, draft = small_pair(tmp_path)
    cfg = json.loads((target / "config.json").read_text())
    del cfg["hidden_size"]
    (target / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"lacks the field\(s\) \['hidden_size'\]"):
        load_causal_lm(str(target), load_format="dummy")
    hf = json.loads((draft / "config.json").read_text())
    del hf["block_size"]
    (draft / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="block_size"):
        load_dspark(draft, DecoderSpec.from_hf({**cfg, "hidden_size": 128}), load_format="dummy")


def test_no_config_json_names_the_flag(tmp_path, capsys):
    from sparkrelay.launch_server import main

    with pytest.raises(CheckpointError, match="--load-format dummy: .*config.json not found"):
        load_causal_lm(str(tmp_path), load_format="dummy")
    with pytest.raises(
        ConfigError, match="--load-format dummy: --model-path .* has no config.json"
    ):
        Config().replace(model_path=str(tmp_path), load_format="dummy").validate()
    with pytest.raises(SystemExit) as e:
        main(["--model-path", str(tmp_path), "--load-format", "dummy"])
    assert e.value.code == 2 and "--load-format dummy: --model-path" in capsys.readouterr().err
    # a config without weights, the default format: the hint names dummy
    target, _ = small_pair(tmp_path / "x")
    with pytest.raises(CheckpointError, match="no \\*.safetensors files .*--load-format dummy"):
        load_causal_lm(str(target))


def test_the_flag_on_the_command_line():
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    assert config_from_args(parser.parse_args([])).model.load_format == "auto"
    args = parser.parse_args(["--model-path", "models/tiny-qwen3", "--load-format", "dummy"])
    assert (
        config_from_args(args).model.load_format == "dummy"
        and "--load-format" not in SGLANG_ONLY_FLAGS
    )
    with pytest.raises(ConfigError, match="--load-format 'pt'"):
        Config().replace(load_format="pt").validate()


@pytest.mark.parametrize(
    "name,shape",
    [
        ("qwen3-0.6b", (28, 1024, 16, 8, 128, 3072)),
        ("qwen3-1.7b", (28, 2048, 16, 8, 128, 6144)),
        ("qwen3-4b", (36, 2560, 32, 8, 128, 9728)),
    ],
)
def test_shipped_real_shape_folders(name, shape, tmp_path):
    from transformers import AutoTokenizer

    spec = DecoderSpec.from_hf(json.loads((CONFIGS / name / "config.json").read_text()))
    assert (
        spec.num_layers,
        spec.hidden_size,
        spec.num_heads,
        spec.num_kv_heads,
        spec.head_dim,
        spec.intermediate_size,
    ) == shape
    assert (
        spec.vocab_size,
        spec.tie_word_embeddings,
        spec.max_position_embeddings,
        spec.rope_theta,
    ) == (151936, True, 40960, 1e6)
    draft = DSparkSpec.from_hf(
        json.loads((CONFIGS / f"{name}-dspark" / "config.json").read_text()), spec
    )
    assert (
        draft.block_size,
        draft.body.num_layers,
        draft.markov_head_type,
        draft.enable_confidence_head,
    ) == (7, 5, "vanilla", True)
    assert draft.target_layer_ids == ((1, 9, 17, 25, 33) if shape[0] == 36 else (1, 7, 13, 19, 25))
    tok = AutoTokenizer.from_pretrained(CONFIGS / name)
    assert len(tok) == spec.vocab_size and tok.eos_token_id == 151645
    # every id detokenizes
    assert all(tok.decode([i]) for i in (0, 4095, 4096, 151643, 151669, 151935))
    make_configs.main(["--out", str(tmp_path)])  # the committed files are what the tool writes
    for f in sorted((CONFIGS / name).iterdir()) + sorted((CONFIGS / f"{name}-dspark").iterdir()):
        assert f.read_bytes() == (tmp_path / f.parent.name / f.name).read_bytes(), f


def test_default_kv_pool_fits_4_gib_on_cpu():
    spec = DecoderSpec.from_hf(json.loads((CONFIGS / "qwen3-0.6b" / "config.json").read_text()))
    per_token = KVPool.bytes_per_token(
        spec.num_layers, spec.num_kv_heads, spec.head_dim, torch.bfloat16
    )
    config = Config()
    tokens = setup.kv_capacity(config, spec.max_position_embeddings, per_token)
    assert tokens * per_token <= 4 << 30 < (tokens + config.cache.page_size) * per_token
    assert setup.kv_capacity(config.replace(max_total_tokens=4096), 40960, per_token) == 4096
    # small models: the token default, unchanged
    assert setup.kv_capacity(config, 256, 1) == 64 * 256
