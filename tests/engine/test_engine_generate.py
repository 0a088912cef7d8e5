"""Greedy generation through the engine equals transformers token for token (batched, chunked,
preempted)."""

import pytest

from sparkrelay import LLM, SamplingParams
from testkit.hf import hf_greedy, load_hf

NUM_PROMPTS, NEW_TOKENS = 20, 24


def code_prompts(tokenizer, n=NUM_PROMPTS):
    """Varied-length prompts cut from this test file's own source."""
    ids = tokenizer.encode(open(__file__).read())
    return [ids[7 * i : 7 * i + 3 + (i * 11) % 60] for i in range(n)]


@pytest.fixture(scope="module", params=["random", "bundled"])
def setup(request, random_model_dir):
    folder = (
        random_model_dir
        if request.param == "random"
        else request.getfixturevalue("bundled_model_dir")
    )
    hf = load_hf(folder)
    llm = LLM(str(folder), page_size=4, chunked_prefill_size=32, max_total_tokens=4096)
    prompts = code_prompts(llm.tokenizer)
    refs = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    return folder, llm, prompts, refs


GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def test_batched_greedy_matches_transformers(setup):
    _, llm, prompts, refs = setup
    outs = llm.generate(prompts, GREEDY)
    assert [o["output_ids"] for o in outs] == refs
    llm.engine.check()


def test_one_at_a_time_matches(setup):
    _, llm, prompts, refs = setup
    for p, ref in list(zip(prompts, refs))[:5]:
        assert llm.generate(p, GREEDY)["output_ids"] == ref


def test_chunked_prefill_and_preemption_match(setup):
    folder, _, prompts, refs = setup
    # tiny budget and a KV cache too small for all 20 requests at once: chunking and preemption both
    # happen
    small = LLM(
        str(folder),
        page_size=4,
        chunked_prefill_size=8,
        max_total_tokens=320,
        max_running_requests=12,
    )
    outs = small.generate(prompts, GREEDY)
    assert [o["output_ids"] for o in outs] == refs
    assert small.engine.scheduler.num_preemptions > 0
    small.engine.check()
    # idle: every block free or held by the prefix cache alone
    assert small.engine.blocks.num_used == 0


def test_stop_conditions(setup):
    _, llm, prompts, refs = setup
    ref = refs[3]
    out = llm.generate(
        prompts[3],
        SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, stop_token_ids=(ref[5],)),
    )
    cut = ref.index(ref[5]) + 1
    assert out["output_ids"] == ref[:cut]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ref[5]}
    full_text = llm.tokenizer.decode(ref)
    stop = full_text[10:13]
    if stop.strip():
        out = llm.generate(
            prompts[3],
            SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, stop=stop, ignore_eos=True),
        )
        assert out["text"] == full_text[: full_text.index(stop)]
        assert out["meta_info"]["finish_reason"]["matched"] == stop
    out = llm.generate(prompts[3], SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))
    assert out["output_ids"] == ref[:4] and out["meta_info"]["finish_reason"] == {
        "type": "length",
        "length": 4,
    }


def test_sampling_is_seeded_and_valid(setup):
    _, llm, prompts, _ = setup
    p = SamplingParams(
        max_new_tokens=12,
        temperature=0.9,
        top_p=0.9,
        top_k=50,
        min_p=0.02,
        seed=123,
        ignore_eos=True,
    )
    a = llm.generate([prompts[0], prompts[1]], p)
    b = llm.generate([prompts[1], prompts[0]], p)  # another batch composition: same tokens per seed
    assert a[0]["output_ids"] == b[1]["output_ids"] and a[1]["output_ids"] == b[0]["output_ids"]
    assert all(0 <= t < llm.engine.vocab_size for o in a for t in o["output_ids"])
