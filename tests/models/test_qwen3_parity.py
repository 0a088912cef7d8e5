"""The target model against transformers' Qwen3ForCausalLM: logits, taps, layer ranges, loading
checks."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from sparkrelay.kvcache.pool import KVPool
from sparkrelay.models.attention import AttnMeta
from sparkrelay.models.decoder import load_causal_lm
from sparkrelay.models.loader import CheckpointError
from testkit.hf import load_hf
from testkit.models import make_random_qwen3


def run_stage(model, pool, ids, start, end, table, page, hidden=None, taps=()):
    meta = AttnMeta.build([start], [end], [table], page, "cpu")
    x = None if hidden is not None else torch.tensor(ids)
    return model(meta, pool.layers, input_ids=x, hidden=hidden, taps=taps)


def fresh_pool(model, page=4, blocks=256):
    s = model.spec
    return KVPool(
        range(model.start, model.end),
        blocks,
        page,
        s.num_kv_heads,
        s.head_dim,
        torch.float32,
        "cpu",
    )


@pytest.fixture(params=["random", "bundled"])
def model_dir(request, random_model_dir):
    return (
        random_model_dir
        if request.param == "random"
        else request.getfixturevalue("bundled_model_dir")
    )


@torch.inference_mode()
def test_prefill_and_decode_logits_match_transformers(model_dir):
    hf = load_hf(model_dir)
    ours = load_causal_lm(str(model_dir))
    pool, table = fresh_pool(ours), list(range(40, 0, -1))  # a scrambled block table
    ids = torch.randint(
        0, ours.spec.vocab_size, (37,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    ref = hf(torch.tensor([ids])).logits[0]  # [37, V]
    out = run_stage(ours, pool, ids[:30], 0, 30, table, 4)
    torch.testing.assert_close(out.logits, ref[:30], atol=1e-4, rtol=0)
    for p in range(30, 37):  # incremental decode through the paged cache
        out = run_stage(ours, pool, ids[p : p + 1], p, p + 1, table, 4)
        torch.testing.assert_close(out.logits[0], ref[p], atol=1e-4, rtol=0)


@torch.inference_mode()
def test_taps_equal_hidden_states(model_dir):
    hf = load_hf(model_dir)
    ours = load_causal_lm(str(model_dir))
    n = ours.spec.num_layers
    ids = list(range(3, 23))
    ref = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    # transformers' last hidden state is after the final norm; never a tap
    taps = tuple(range(-1, n - 1))
    out = run_stage(ours, fresh_pool(ours), ids, 0, len(ids), list(range(8)), 4, taps=taps)
    for i in taps:
        # float32 rounding: the residual stream reaches ~15 on the bundled model, where a float32 ulp
        # is ~1e-6 and the CPU's reduction order (AVX-512 or AVX2 oneDNN) moves a value by a few
        torch.testing.assert_close(out.taps[i], ref[i + 1][0], atol=1e-5, rtol=2e-6, msg=f"tap {i}")


@torch.inference_mode()
def test_layer_ranges_compose(random_model_dir):
    whole = load_causal_lm(str(random_model_dir))
    first = load_causal_lm(str(random_model_dir), 0, 1)
    mid = load_causal_lm(str(random_model_dir), 1, 3)
    last = load_causal_lm(str(random_model_dir), 3, 4)
    ids = list(range(5, 17))
    ref = run_stage(whole, fresh_pool(whole), ids, 0, 12, [0, 1, 2], 4)
    h = run_stage(first, fresh_pool(first), ids, 0, 12, [0, 1, 2], 4, taps=(-1, 0)).hidden
    out_mid = run_stage(mid, fresh_pool(mid), ids, 0, 12, [0, 1, 2], 4, hidden=h, taps=(2,))
    out = run_stage(
        last, fresh_pool(last), ids, 0, 12, [0, 1, 2], 4, hidden=out_mid.hidden, taps=(3, 2)
    )
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-5, rtol=0)
    assert set(out_mid.taps) == {2} and set(out.taps) == {
        3
    }  # a stage captures only the taps it owns
    assert first.owns_tap(-1) and not mid.owns_tap(-1) and last.owns_tap(3)


def test_rope_parameters_and_tied_layout(tmp_path):
    folder = make_random_qwen3(tmp_path / "m", tie_word_embeddings=True, num_hidden_layers=2)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("rope_theta", None)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    (folder / "config.json").write_text(json.dumps(cfg))
    hf, ours = load_hf(folder), load_causal_lm(str(folder))
    assert ours.lm_head.weight is ours.model.embed_tokens.weight  # one copy
    # a last stage without the embedding gets it as its LM head
    last = load_causal_lm(str(folder), 1, 2)
    torch.testing.assert_close(last.lm_head.weight, hf.lm_head.weight)
    with torch.inference_mode():
        ids = list(range(9))
        torch.testing.assert_close(
            run_stage(ours, fresh_pool(ours), ids, 0, 9, [0, 1, 2], 4).logits,
            hf(torch.tensor([ids])).logits[0],
            atol=1e-4,
            rtol=0,
        )


def _corrupt(folder, tmp_path, edit):
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    (weights_file,) = bad.glob("*.safetensors")
    tensors = load_file(str(weights_file))
    edit(tensors)
    save_file(tensors, str(weights_file))
    return bad


def test_loader_names_missing_unexpected_and_misshaped(random_model_dir, tmp_path):
    key = "model.layers.1.mlp.up_proj.weight"
    bad = _corrupt(random_model_dir, tmp_path, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match=f"missing tensors: {key}"):
        load_causal_lm(str(bad))
    load_causal_lm(str(bad), 2, 4)  # a stage that does not own layer 1 does not need it
    shutil.rmtree(bad)
    bad = _corrupt(
        random_model_dir, tmp_path, lambda t: t.update({"model.extra.weight": torch.zeros(2)})
    )
    with pytest.raises(CheckpointError, match="unexpected tensors: model.extra.weight"):
        load_causal_lm(str(bad))
    shutil.rmtree(bad)
    bad = _corrupt(random_model_dir, tmp_path, lambda t: t.update({key: torch.zeros(3, 3)}))
    with pytest.raises(
        CheckpointError, match=r"shape mismatch: model.layers.1.mlp.up_proj.weight \(3, 3\)"
    ):
        load_causal_lm(str(bad))


def test_scaled_rope_is_refused(random_model_dir, tmp_path):
    folder = tmp_path / "yarn"
    shutil.copytree(random_model_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(NotImplementedError, match="yarn"):
        load_causal_lm(str(folder))
