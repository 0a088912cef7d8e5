"""The prefix cache in the engine, on the bundled pair with DSpark: multi-turn conversations over a
shared system part give the same tokens and the same per-request acceptance with the cache as
without (the cached pages carry the drafter's context); under memory pressure, with aborts, the
engine keeps serving, evicting, and is consistent when idle."""

import random

import pytest

from sparkrelay.llm import LLM
from sparkrelay.scheduler.request import SamplingParams

DSPARK = {
    "speculative_algorithm": "DSPARK",
    "speculative_draft_model_path": "models/tiny-qwen3-dspark",
}
GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def texts():
    import inspect
    import json

    src = inspect.getsource(json.decoder) + inspect.getsource(json.encoder)
    return [src[i : i + 400] for i in range(0, 4000, 400)]


def conversations(llm: LLM, texts: list[str], turns: int = 3) -> list[dict]:
    """Two conversations over one system part, turns in order, the two conversations' turns batched
    together."""
    system = llm.tokenizer.encode(texts[0] + texts[1])
    history = [system, list(system)]
    out = []
    for t in range(turns):
        prompts = [h + llm.tokenizer.encode(texts[2 + 2 * t + c]) for c, h in enumerate(history)]
        results = llm.generate(prompts, GREEDY)
        history = [p + r["output_ids"] for p, r in zip(prompts, results)]
        out += results
    return out


def test_multi_turn_tokens_and_acceptance_equal_the_uncached_run(texts):
    cached, plain = (
        LLM("models/tiny-qwen3", **DSPARK),
        LLM("models/tiny-qwen3", disable_radix_cache=True, **DSPARK),
    )
    a, b = conversations(cached, texts), conversations(plain, texts)
    assert [r["output_ids"] for r in a] == [r["output_ids"] for r in b]
    accept = [(r["meta_info"]["spec_verify_ct"], r["meta_info"]["spec_accept_length"]) for r in a]
    assert accept == [
        (r["meta_info"]["spec_verify_ct"], r["meta_info"]["spec_accept_length"]) for r in b
    ]
    hits = [r["meta_info"]["cached_tokens"] for r in a]
    # turn 1 of both in one step; later turns hit
    assert hits[:2] == [0, 0] and all(h > 0 for h in hits[2:])
    assert all(r["meta_info"]["cached_tokens"] == 0 for r in b)
    for llm in (cached, plain):
        llm.engine.check()
        assert llm.engine.blocks.num_used == 0


def test_under_memory_pressure_with_aborts_the_cache_evicts_and_stays_consistent(texts):
    """A KV cache of 40 pages against 12 requests of ~9-20 pages sharing a 4-page prefix:
    preemption, eviction and aborts all happen; every finished request equals its uncached run, and
    idle means no page in use."""
    rng = random.Random(0)
    small = dict(
        page_size=16,
        max_total_tokens=640,
        chunked_prefill_size=64,
        max_running_requests=8,
        **DSPARK,
    )
    llm = LLM("models/tiny-qwen3", **small)
    ref = LLM("models/tiny-qwen3", disable_radix_cache=True, **small)
    system = llm.tokenizer.encode(texts[0])[:64]
    prompts = [
        system + llm.tokenizer.encode(texts[1 + i % 8])[: rng.randrange(40, 200)] for i in range(12)
    ]
    eng = llm.engine
    rids = [f"r{i}" for i in range(12)]
    for rid, p in zip(rids, prompts):
        eng.add_request(rid, p, GREEDY)
    done, aborted, steps = {}, {"r3", "r7"}, 0
    while len(done) + len(aborted) < len(rids):
        for o in eng.step():
            if o.finished:
                done[o.rid] = o.output_ids
        steps += 1
        if steps == 6:
            for rid in aborted:
                eng.abort(rid)
        eng.check()
    assert eng.scheduler.num_preemptions > 0 and eng.scheduler.cache_hit_tokens > 0
    expected = ref.generate([p for rid, p in zip(rids, prompts) if rid not in aborted], GREEDY)
    assert [done[r] for r in rids if r not in aborted] == [e["output_ids"] for e in expected]
    eng.check()
    assert (
        eng.blocks.num_used == 0
        and eng.blocks.num_free + eng.blocks.num_evictable == eng.blocks.num_blocks
    )
    assert eng.flush_cache() and eng.blocks.num_free == eng.blocks.num_blocks
