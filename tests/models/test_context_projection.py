"""The drafter's context projection split across pipeline stages (models/dspark_context.py) equals
the drafter's own.

Σ over stages of `partial` == drafter.fc(concat(taps)) for PP = 1, 2, 4 partitions, and `finish` ==
the drafter's context K/V, with taps on stage boundaries and tap -1 included; only the
context-projection tensors are read.
"""

import pytest
import torch

import sparkrelay.models.loader as loader
from sparkrelay.models.decoder import DecoderSpec
from sparkrelay.models.dspark_checkpoint import load_dspark, write_random_checkpoint
from sparkrelay.models.dspark_context import load_context_projector
from sparkrelay.models.loader import read_config
from sparkrelay.pipeline.partition import pp_partition, stage_taps

# 8 target layers; PP=2 cuts at 4 (taps 3 | 4 on either side), PP=4 at 2, 4, 6 (taps 1 | -, 3 | 4, -
# | 6)
TAPS = [-1, 1, 3, 4, 6]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, bundled_model_dir):
    folder = write_random_checkpoint(
        tmp_path_factory.mktemp("drafter"),
        bundled_model_dir,
        seed=3,
        weight_dtype=torch.float32,
        target_layer_ids=TAPS,
    )
    spec = DecoderSpec.from_hf(read_config(bundled_model_dir))
    drafter = load_dspark(folder, spec, torch.float32, fuse=False)
    return folder, spec, drafter


def taps_and_positions(spec, n=13):
    gen = torch.Generator().manual_seed(0)
    feats = torch.randn(n, len(TAPS) * spec.hidden_size, generator=gen)  # [N, k*d], TAPS order
    return feats, torch.arange(100, 100 + n)  # absolute positions, not starting at 0


def columns(feats, ids, d):
    """The columns of tap ids in feats [N, k*d] -> [N, len(ids)*d]."""
    return torch.cat([feats[:, TAPS.index(i) * d : (TAPS.index(i) + 1) * d] for i in ids], dim=1)


@pytest.mark.parametrize("pp", [1, 2, 4])
def test_partial_sums_equal_fc_and_finish_equals_context_kv(setup, pp):
    folder, spec, drafter = setup
    proj = load_context_projector(folder, spec, torch.float32)
    feats, pos = taps_and_positions(spec)
    partition = pp_partition(spec.num_layers, pp)
    owned = [stage_taps(tuple(TAPS), partition, s) for s in range(pp)]
    assert sorted(i for ids in owned for i in ids) == TAPS
    total = torch.zeros(feats.shape[0], spec.hidden_size)  # [N, d_draft] float32, pre-norm
    for ids in owned:
        if ids:
            total = total + proj.partial(columns(feats, ids, spec.hidden_size), ids)
    with torch.no_grad():
        assert torch.allclose(total, drafter.fc(feats), atol=1e-5)
        ref = drafter.context_kv(drafter.project_context(feats), pos)
    got = proj.finish(total, pos)
    assert len(got) == len(ref) == drafter.spec.body.num_layers
    for (k, v), (rk, rv) in zip(got, ref):
        assert k.shape == rk.shape and v.shape == rv.shape
        assert torch.allclose(k, rk, atol=1e-5) and torch.allclose(v, rv, atol=1e-5)


def test_stage_slice_locates_columns_by_tap_index(setup):
    folder, spec, drafter = setup
    proj = load_context_projector(folder, spec, torch.float32)
    d, w = spec.hidden_size, drafter.fc.weight
    got = proj.stage_slice((4, -1))
    assert got.shape == (d, 2 * d)
    assert torch.equal(got, torch.cat([w[:, 3 * d : 4 * d], w[:, 0:d]], dim=1))
    with pytest.raises(ValueError, match="not among"):
        proj.stage_slice((2,))


def test_reads_only_context_projection_tensors(setup, monkeypatch):
    folder, spec, _ = setup
    read: list[str] = []
    real = loader.safe_open

    class Spy:
        def __init__(self, *a, **k):
            self.f = real(*a, **k)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, key):
            read.append(key)
            return self.inner.get_tensor(key)

    monkeypatch.setattr(loader, "safe_open", Spy)
    load_context_projector(folder, spec, torch.float32)
    assert "fc.weight" in read and "hidden_norm.weight" in read
    assert "layers.1.self_attn.k_norm.weight" in read and "layers.0.self_attn.v_proj.weight" in read
    banned = (
        "embed_tokens",
        "lm_head",
        "markov",
        "confidence",
        "q_proj",
        "o_proj",
        "mlp",
        "norm.weight",
    )
    bad = [
        k
        for k in read
        if any(b in k for b in banned)
        and k not in ("hidden_norm.weight",)
        and not k.endswith("k_norm.weight")
    ]
    assert not bad, f"read tensors outside the context projection: {bad}"
