"""Unit tests of the PD handoff pieces: the metadata row, the layer partition and tap ownership, the
schema record and its comparison, the parts the decode expects, the env knobs and their SGLang
aliases, and the injection positions of each mode."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sparkrelay.config import Config, ConfigError
from sparkrelay.disagg.handoff import (
    HandoffError,
    build_schema,
    expected_parts,
    inject_context,
    part_of,
    resolve_layer_ids,
    write_kv,
)
from sparkrelay.disagg.metadata import MetadataLayout, MetadataRow, build_tail, pack, unpack
from sparkrelay.disagg.schema import HandoffSchema, compare
from sparkrelay.envs import DisaggEnv
from sparkrelay.kvcache.pool import KVPool
from sparkrelay.models.decoder import DecoderSpec
from sparkrelay.pipeline.partition import check_layer_ids, pp_partition, stage_taps, tap_owner


def schema(
    handoff="tail", tail=8, ids=(1, 3, 5, 6), partition=((0, 4), (4, 8)), hidden=16, stream=4
) -> HandoffSchema:
    return HandoffSchema(
        1,
        "zmq",
        "m",
        "float32",
        "unquant",
        16,
        8,
        2,
        4,
        hidden,
        partition,
        ids,
        len(ids) * hidden,
        handoff,
        tail if handoff == "tail" else 0,
        "off",
        (2, 2, 4) if handoff == "draft-kv" else None,
        stream,
    )


# ---------------------------------------------------------------- metadata row


@pytest.mark.parametrize("tail", [1, 3, 8])
@pytest.mark.parametrize("n", [1, 3, 8, 20])
def test_metadata_round_trip_and_tail_mask(n, tail):
    s = schema(tail=tail)
    layout = MetadataLayout.of(s)
    logprobs = 4 + 20 * 4 + 20 * 4  # the first token's logprob, its top 20 logprobs and ids
    # odd tails: unaligned
    assert layout.nbytes == 16 * 4 + 16 * 4 + logprobs + 64 * 4 + tail * 64 * 4 + tail + 8 * 8
    rows = torch.randn(n, 64)
    tail_rows, valid = build_tail(rows, tail)
    data = pack(
        layout,
        MetadataRow(
            first_token=77,
            room=(1 << 63) - 1,
            last_hidden=rows[-1],
            tail_hidden=tail_rows,
            tail_valid=valid,
            first_logprob=-0.5,
            top_logprobs=[(-0.5, 77), (-1.25, 3)],
        ),
    )
    assert len(data) == layout.nbytes
    row = unpack(layout, data)
    assert (row.first_token, row.room) == (77, (1 << 63) - 1)
    assert row.first_logprob == -0.5 and row.top_logprobs[:3] == [(-0.5, 77), (-1.25, 3), (0.0, 0)]
    k = min(n, tail)
    assert row.tail_valid.tolist() == [False] * (tail - k) + [True] * k  # right-aligned
    assert torch.equal(row.tail_hidden[tail - k :], rows[n - k :])
    assert not row.tail_hidden[
        : tail - k
    ].any()  # a prompt shorter than the tail: leading rows zero
    assert torch.equal(row.last_hidden, rows[-1])
    # the room is the row's last field
    assert bytes(data[-64:-56]) == ((1 << 63) - 1).to_bytes(8, "little")


def test_metadata_sizes_follow_the_schema():
    no_tail = MetadataLayout.of(schema(handoff="hidden"))
    # no tail fields outside tail mode
    assert no_tail.nbytes == 16 * 4 * 2 + (4 + 20 * 4 + 20 * 4) + 8 * 8
    with pytest.raises(ValueError, match="bytes"):
        unpack(
            MetadataLayout.of(schema(tail=4)),
            pack(
                MetadataLayout.of(schema(tail=8)),
                MetadataRow(
                    1, 5, torch.zeros(64), torch.zeros(8, 64), torch.zeros(8, dtype=torch.bool)
                ),
            ),
        )
    with pytest.raises(ValueError, match="tail_hidden"):
        pack(
            MetadataLayout.of(schema(tail=8)),
            MetadataRow(
                1, 5, torch.zeros(64), torch.zeros(4, 64), torch.zeros(8, dtype=torch.bool)
            ),
        )


# ---------------------------------------------------------------- partition and taps


def test_partition_and_tap_owners():
    assert pp_partition(8, 1) == [(0, 8)]
    assert pp_partition(8, 2) == [(0, 4), (4, 8)]
    assert pp_partition(8, 3) == [(0, 3), (3, 6), (6, 8)]
    assert pp_partition(7, 4) == [(0, 2), (2, 4), (4, 6), (6, 7)]
    part = pp_partition(8, 2)
    assert tap_owner(-1, part) == 0  # the embedding output belongs to stage 0
    # the output of layer 3 (the boundary) belongs to the stage that ran layer 3
    assert tap_owner(3, part) == 0
    assert tap_owner(4, part) == 1
    ids = (-1, 3, 4, 6)
    assert stage_taps(ids, part, 0) == (-1, 3) and stage_taps(ids, part, 1) == (4, 6)
    four = pp_partition(8, 4)
    assert [stage_taps((1, 3, 5, 6), four, s) for s in range(4)] == [(1,), (3,), (5,), (6,)]
    with pytest.raises(ValueError, match="--pp-size 9"):
        pp_partition(8, 9)


def test_layer_id_checks():
    check_layer_ids((-1, 0, 6), 8)
    with pytest.raises(ValueError, match="last layer"):
        check_layer_ids((1, 7), 8)
    with pytest.raises(ValueError, match="outside"):
        check_layer_ids((-2,), 8)
    with pytest.raises(ValueError, match="repeat"):
        check_layer_ids((1, 1), 8)


def test_layer_id_resolution_env_and_alias(monkeypatch):
    draft = {"target_layer_ids": [1, 3, 5, 6]}
    assert resolve_layer_ids(DisaggEnv.read(), draft, 8, decode=False) == (1, 3, 5, 6)
    monkeypatch.setenv("SGLANG_DSPARK_PD_TARGET_LAYER_IDS", "-1,3")
    assert resolve_layer_ids(DisaggEnv.read(), None, 8, decode=False) == (-1, 3)
    monkeypatch.setenv("SPARKRELAY_DSPARK_PD_TARGET_LAYER_IDS", "2,4")  # the SPARKRELAY_ name wins
    assert resolve_layer_ids(DisaggEnv.read(), None, 8, decode=False) == (2, 4)
    with pytest.raises(ConfigError, match="differs from the drafter"):
        resolve_layer_ids(DisaggEnv.read(), draft, 8, decode=True)
    monkeypatch.setenv("SPARKRELAY_DSPARK_PD_TARGET_LAYER_IDS", "1,7")
    with pytest.raises(ConfigError, match="last layer"):
        resolve_layer_ids(DisaggEnv.read(), None, 8, decode=False)
    monkeypatch.setenv("SPARKRELAY_DSPARK_PD_TARGET_LAYER_IDS", "1,x")
    with pytest.raises(ConfigError, match="SPARKRELAY_DSPARK_PD_TARGET_LAYER_IDS"):
        DisaggEnv.read()
    monkeypatch.delenv("SPARKRELAY_DSPARK_PD_TARGET_LAYER_IDS")
    monkeypatch.delenv("SGLANG_DSPARK_PD_TARGET_LAYER_IDS")
    monkeypatch.setenv("SPARKRELAY_DSPARK_PD_ENABLE_PREFILL_CAPTURE", "0")
    assert resolve_layer_ids(DisaggEnv.read(), draft, 8, decode=False) == ()
    assert DisaggEnv.read().tail_tokens == 8  # 0 / unset means the fixed default


# ---------------------------------------------------------------- schema


def test_schema_round_trip_and_compare():
    s = schema()
    assert HandoffSchema.from_dict(s.to_dict()) == s
    other = dataclasses.replace(
        s, tail_tokens=4, target_layer_ids=(1, 3, 5), layer_partition=((0, 8),)
    )
    diffs = compare(s.to_dict(), other.to_dict())
    assert diffs == [
        "target_layer_ids: prefill=[1, 3, 5, 6] decode=[1, 3, 5]",
        "tail_tokens: prefill=8 decode=4",
    ]
    bad = s.to_dict() | {"extra": 1}
    with pytest.raises(ValueError, match="fields"):
        HandoffSchema.from_dict(bad)
    with pytest.raises(ValueError, match="malformed"):
        HandoffSchema.from_dict(s.to_dict() | {"layer_partition": [[0, "x"]]})


def test_build_schema_from_config(bundled_model_dir, bundled_drafter_dir):
    spec = DecoderSpec.from_hf(
        __import__("json").loads((bundled_model_dir / "config.json").read_text())
    )
    base = Config().replace(
        model_path=str(bundled_model_dir), speculative_draft_model_path=str(bundled_drafter_dir)
    )
    prefill = build_schema(
        base.replace(disaggregation_mode="prefill", pp_size=2),
        spec,
        torch.float32,
        DisaggEnv.read(),
    )
    decode = build_schema(
        base.replace(disaggregation_mode="decode", speculative_algorithm="DSPARK"),
        spec,
        torch.float32,
        DisaggEnv.read(),
    )
    assert compare(prefill.to_dict(), decode.to_dict()) == []
    assert prefill.layer_partition == ((0, 4), (4, 8)) and prefill.handoff == "hidden"
    plain = build_schema(
        Config().replace(model_path=str(bundled_model_dir), disaggregation_mode="prefill"),
        spec,
        torch.float32,
        DisaggEnv.read(),
    )
    # would start the drafter cold
    assert plain.handoff == "none" and compare(plain.to_dict(), decode.to_dict())


# ---------------------------------------------------------------- expected parts, KV pairing,
# injection


def test_expected_parts_per_stage():
    # pieces of 4 positions: 0-3, 4-7, 8-9
    parts = expected_parts(schema(handoff="hidden").to_dict(), 10)
    assert [p.name for p in parts[0]] == ["kv@0", "kv@4", "kv@8"] and parts[0][0].layer_ids == (
        0,
        1,
        2,
        3,
    )
    assert [p.name for p in parts[1]] == [
        "kv@0",
        "kv@4",
        "kv@8",
        "hidden@0",
        "hidden@4",
        "hidden@8",
        "meta",
    ]
    assert parts[1][0].shape == (4, 2, 4, 2, 4) and parts[1][2].shape == (4, 2, 2, 2, 4)
    assert parts[1][3].shape == (4, 64) and parts[1][5].shape == (2, 64)
    dkv = expected_parts(schema(handoff="draft-kv").to_dict(), 10)
    assert dkv[1][-2].name == "draft_kv@8" and dkv[1][-2].shape == (2, 2, 2, 2, 4)
    assert [p.name for p in expected_parts(schema(stream=128).to_dict(), 10)[0]] == ["kv@0"]
    with pytest.raises(ValueError, match="split layers differently"):
        expected_parts(schema(partition=((0, 5), (5, 8))).to_dict(), 10)


def test_expected_parts_after_a_cached_prefix():
    """A decode holding the first 4 positions (its prefix cache) expects the pieces from there, and
    the row."""
    parts = expected_parts(schema(handoff="hidden").to_dict(), 10, prefix=4)
    assert [p.name for p in parts[0]] == ["kv@4", "kv@8"]
    assert [p.name for p in parts[1]] == ["kv@4", "kv@8", "hidden@4", "hidden@8", "meta"]
    for bad in (2, 10, 12):  # not a whole number of pieces, or not below the prompt length
        with pytest.raises(ValueError, match="cached prefix"):
            expected_parts(schema(handoff="hidden").to_dict(), 10, prefix=bad)


def test_kv_pairs_by_global_layer_id_piece_by_piece():
    pool = KVPool(range(8), 4, 4, 2, 4, torch.float32, "cpu")
    slots = torch.tensor([5, 6, 7])
    kv0, kv1 = torch.randn(4, 2, 3, 2, 4), torch.randn(4, 2, 3, 2, 4)
    parts = {
        1: {
            "kv@0": part_of("kv@0", (4, 5, 6, 7), kv1[:, :, :2]),
            "kv@2": part_of("kv@2", (4, 5, 6, 7), kv1[:, :, 2:]),
        },
        0: {"kv@0": part_of("kv@0", (0, 1, 2, 3), kv0)},
    }
    write_kv(pool, parts, slots)
    assert torch.equal(pool.layers[2][0][slots], kv0[2, 0]) and torch.equal(
        pool.layers[7][1][slots], kv1[3, 1]
    )
    assert torch.equal(pool.layers[5][0][slots], kv1[1, 0])
    with pytest.raises(HandoffError, match="layers"):
        write_kv(pool, {0: parts[0]}, slots)


class _Recorder:
    """Stands in for the proposer: records where features are written."""

    def __init__(self):
        self.calls = []
        self.pool = KVPool(range(2), 4, 4, 2, 4, torch.float32, "cpu")

    def write_features(self, features, positions, slots):
        self.calls.append((features.clone(), positions.tolist(), slots.tolist()))


@pytest.mark.parametrize("n", [3, 12])
def test_tail_injection_uses_absolute_positions(n):
    s = schema(handoff="tail", tail=8)
    rows = torch.randn(n, 64)
    tail, valid = build_tail(rows, 8)
    row = MetadataRow(1, 9, rows[-1], tail, valid)
    rec = _Recorder()
    slots = torch.arange(100, 100 + n)
    start = inject_context(rec, s, {1: {}}, row, slots)
    k = min(n, 8)
    assert start == n - k
    features, positions, written = rec.calls[0]
    assert positions == list(range(n - k, n)) and written == list(range(100 + n - k, 100 + n))
    assert torch.equal(features, rows[n - k :])
    row.tail_valid[:] = False
    with pytest.raises(HandoffError, match="valid mask"):
        inject_context(rec, s, {1: {}}, row, slots)


def test_hidden_and_draft_kv_injection_piece_by_piece_and_cold_drafter():
    rec, n = _Recorder(), 5
    slots = torch.arange(10, 10 + n)
    hidden = torch.randn(n, 64)
    s = schema(handoff="hidden")
    ids = s.target_layer_ids
    pieces = {
        "hidden@4": part_of("hidden@4", ids, hidden[4:]),
        "hidden@0": part_of("hidden@0", ids, hidden[:4]),
    }
    assert inject_context(rec, s, {1: pieces}, None, slots) == 0
    assert [c[1] for c in rec.calls] == [[0, 1, 2, 3], [4]] and [c[2] for c in rec.calls] == [
        [10, 11, 12, 13],
        [14],
    ]
    assert torch.equal(torch.cat([c[0] for c in rec.calls]), hidden)
    bad = hidden.clone()
    bad[2, 3] = float("nan")
    with pytest.raises(HandoffError, match="NaN"):
        inject_context(rec, s, {1: {"hidden@0": part_of("hidden@0", ids, bad)}}, None, slots)
    with pytest.raises(HandoffError, match="no hidden rows"):
        inject_context(rec, s, {1: {}}, None, slots)
    d = schema(handoff="draft-kv")
    dkv = torch.randn(2, 2, n, 2, 4)
    inject_context(
        rec,
        d,
        {
            1: {
                "draft_kv@0": part_of("draft_kv@0", (0, 1), dkv[:, :, :3]),
                "draft_kv@3": part_of("draft_kv@3", (0, 1), dkv[:, :, 3:]),
            }
        },
        None,
        slots,
    )
    assert torch.equal(rec.pool.layers[1][1][slots], dkv[1, 1]) and torch.equal(
        rec.pool.layers[0][0][slots], dkv[0, 0]
    )
    with pytest.raises(HandoffError, match="cold"):
        inject_context(rec, dataclasses.replace(s, handoff="none"), {1: {}}, None, slots)


def test_draft_context_start_hides_earlier_positions(bundled_model_dir, bundled_drafter_dir):
    """A `tail` handoff: the drafter attends only to positions >= draft_ctx_start; what lies before
    is unseen."""
    from sparkrelay.llm import LLM

    llm = LLM(
        str(bundled_model_dir),
        speculative_algorithm="DSPARK",
        speculative_draft_model_path=str(bundled_drafter_dir),
        max_total_tokens=256,
    )
    prop = llm.engine.proposer
    width = len(prop.taps) * llm.engine.model.spec.hidden_size
    torch.manual_seed(0)
    prop.write_features(torch.randn(20, width), torch.arange(20), torch.arange(20))
    args = dict(
        anchors=[5],
        starts=[20],
        block_tables=[[0, 1]],
        caps=[7],
        temperature=torch.tensor([0.0]),
        greedy=torch.tensor([True]),
        generators=[None],
        shared=torch.Generator(),
    )
    full = prop.propose(**args)
    assert torch.equal(prop.propose(**args, ctx_starts=[0]).draft_probs, full.draft_probs)
    tail = prop.propose(**args, ctx_starts=[12])
    # rewrite what tail hides
    prop.write_features(torch.randn(12, width), torch.arange(12), torch.arange(12))
    again = prop.propose(**args, ctx_starts=[12])
    assert torch.equal(tail.draft_probs, again.draft_probs) and torch.equal(
        tail.drafts, again.drafts
    )
    assert not torch.equal(tail.draft_probs, full.draft_probs)


def test_bootstrap_fields_per_item():
    """Batch requests carry arrays with one room per element (docs/pd_protocol.md, failure mode 7);
    OpenAI routes too."""
    from sparkrelay.manager.messages import GenerationItem
    from sparkrelay.scheduler.request import RequestError
    from sparkrelay.server import protocol as P

    items = [GenerationItem(f"r{i}", [1, 2], P.SamplingParams()) for i in range(2)]
    req = P.GenerateRequest(
        input_ids=[[1, 2], [3]],
        bootstrap_host=["h", "h"],
        bootstrap_port=[None, 9],
        bootstrap_room=[5, 6],
    )
    out = P.with_bootstrap(req, items)
    assert [(b.host, b.port, b.room) for b in (it.bootstrap for it in out)] == [
        ("h", None, 5),
        ("h", 9, 6),
    ]
    with pytest.raises(RequestError, match="one room per sequence"):
        P.with_bootstrap(
            P.GenerateRequest(input_ids=[[1], [2]], bootstrap_host="h", bootstrap_room=5), items
        )
    with pytest.raises(RequestError, match="repeats"):
        P.with_bootstrap(
            P.GenerateRequest(input_ids=[[1], [2]], bootstrap_host="h", bootstrap_room=[5, 5]),
            items,
        )
    with pytest.raises(RequestError, match="entries"):
        P.with_bootstrap(
            P.GenerateRequest(input_ids=[[1], [2]], bootstrap_host="h", bootstrap_room=[5]), items
        )
    chat = P.ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}],
        bootstrap_host="h",
        bootstrap_port=8998,
        bootstrap_room=7,
    )
    assert P.with_bootstrap(chat, items[:1])[0].bootstrap.room == 7
    # aggregated: nothing attached
    assert P.with_bootstrap(P.GenerateRequest(text="x"), items) == items
