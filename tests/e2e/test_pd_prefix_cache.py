"""PD with the prefix cache on both sides (PP=2 prefill without a drafter, DSpark decode, the
router): multi-turn conversations over a shared system part. The prefill computes only what its
cache lacks and can hand off any position's drafter context (kept beside its cached pages; `tail`
rows always computed); the decode names the prefix it holds and receives only the pieces after it.
Every mode gives the aggregated tokens, `hidden` / `draft-kv` the aggregated acceptance per request,
and a turn the decode holds most of costs fewer handoff bytes (docs/prefix_cache.md). The default
run does hidden over zmq. Marked slow, for the default run's time: draft-kv over zmq (its context in
its own pool), hidden over NIXL (a one-sided backend: the landed context is read back from the
prefix on), `tail` (the scheduler's computed tail is unit-tested in test_radix_cache.py) and
Mooncake."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from sparkrelay.llm import LLM
from sparkrelay.scheduler.request import SamplingParams
from sparkrelay.tools.cluster import PDSettings, start_pd
from testkit.pd import DRAFTER, MAX_NEW, MODEL, generate


def state(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url + "/server_info").read())["internal_states"][0]


def turns(tok, text: str, generate_fn) -> list[dict]:
    """Two conversations x 2 turns over one 300-token system part; each turn's prompt is the
    previous prompt, its answer and a new message. Returns every answer, in order."""
    ids = tok.encode(text)
    system, out = ids[:300], []
    for c in range(2):
        history = list(system)
        for t in range(2):
            msg = ids[300 + 100 * (2 * c + t) : 300 + 100 * (2 * c + t) + 40 + 17 * t]
            answer = generate_fn(history + msg)
            out.append(answer)
            history = history + msg + answer["output_ids"]
    return out


@pytest.fixture(scope="module")
def text() -> str:
    return (
        open("sparkrelay/scheduler/scheduler.py").read()
        + open("sparkrelay/engine/engine.py").read()
    )


@pytest.fixture(scope="module")
def reference(text) -> list[dict]:
    """Aggregated DSpark without the cache: what every mode must give."""
    llm = LLM(
        MODEL,
        speculative_algorithm="DSPARK",
        speculative_draft_model_path=DRAFTER,
        disable_radix_cache=True,
    )
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
    out = turns(llm.tokenizer, text, lambda ids: llm.generate(ids, params))
    llm.engine.close()
    return out


@pytest.mark.parametrize(
    "backend, mode",
    [
        ("zmq", "hidden"),
        pytest.param("zmq", "draft-kv", marks=pytest.mark.slow),
        pytest.param("nixl", "hidden", marks=pytest.mark.slow),  # ~38 s
        pytest.param("zmq", "tail", marks=pytest.mark.slow),
        pytest.param("mooncake", "draft-kv", marks=pytest.mark.slow),
    ],
)
def test_pd_with_the_cache_on_both_sides_equals_aggregated(
    tmp_path, text, reference, backend, mode
):
    from transformers import AutoTokenizer

    flags = ["--disaggregation-transfer-backend", backend]
    cluster = start_pd(
        PDSettings(
            model=MODEL,
            drafter=DRAFTER,
            pp_size=2,
            handoff=mode,
            router="sparkrelay",
            prefill_args=["--chunked-prefill-size", "128", *flags],
            decode_args=flags,
        ),
        str(tmp_path),
    )
    try:
        deadline = time.monotonic() + 30

        sent = []  # handoff bytes the decode received per request

        def one(ids):
            before = state(cluster.decode.url)["handoff_bytes_total"]
            status, out = generate(cluster.url, ids, retries_until=deadline)
            assert status == 200, (status, out, cluster.prefill.log_tail())
            sent.append(state(cluster.decode.url)["handoff_bytes_total"] - before)
            return out

        results = turns(AutoTokenizer.from_pretrained(MODEL), text, one)
        info, decode = state(cluster.prefill.url), state(cluster.decode.url)
    finally:
        cluster.stop()
    assert [r["output_ids"] for r in results] == [r["output_ids"] for r in reference]
    if mode != "tail":
        assert [
            (r["meta_info"]["spec_verify_ct"], r["meta_info"]["spec_accept_length"])
            for r in results
        ] == [
            (r["meta_info"]["spec_verify_ct"], r["meta_info"]["spec_accept_length"])
            for r in reference
        ]
    # turn 2 of each conversation and conversation 2's turn 1 (the system part) were found in the
    # prefill's cache
    assert info["prefix_cache"] == "on" and info["cache_hit_tokens"] >= 288 + 2 * 320, info
    # the decode held 256 of each second turn's ~430 tokens and of conversation 2's first 340 (the
    # system part): whole 128-token pieces; those requests' handoffs carried only the rest
    assert decode["prefix_cache"] == "on" and decode["cache_hit_tokens"] == 3 * 256, decode
    assert [r["meta_info"]["cached_tokens"] for r in results] == [0, 256, 256, 256]
    assert sent[1] < 0.55 * sent[0] and sent[3] < 0.55 * sent[0] and sent[2] < 0.3 * sent[0], sent
