"""Constrained decoding through the engines, on the bundled pair: every output validates against its
schema; DSpark greedy equals plain greedy under the grammar (batched, both backends) and PP = 2 equals
PP = 1; DSpark's sampled tokens follow the constrained target distribution (chi-square, the test the
unconstrained path passes in tests/runner/test_penalties.py)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from sparkrelay import LLM, SamplingParams
from sparkrelay.grammar import bitmask as bm
from sparkrelay.grammar.backends import Grammar, backend_class
from sparkrelay.runner.sampler import SamplingBatch, filter_probs
from sparkrelay.tools.bench.schemas import SCHEMAS, request_text
from testkit.models import BUNDLED, BUNDLED_DRAFTER, PROMPT_SOURCE, code_prompts
from testkit.stats import assert_follows, second_token_counts

PICKED = [SCHEMAS[i] for i in (0, 3, 8, 9, 13, 19)]  # enums, bounds, a pattern, nested arrays


def _spec(**kw) -> LLM:
    return LLM(
        str(BUNDLED),
        speculative_algorithm="DSPARK",
        speculative_draft_model_path=str(BUNDLED_DRAFTER),
        **kw,
    )


@pytest.fixture(scope="module")
def prompts(plain) -> list[list[int]]:
    tok = plain.tokenizer
    return [tok.encode(request_text(what)) for what, _ in PICKED]


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(str(BUNDLED), page_size=4)


def _params(schema: dict) -> SamplingParams:
    return SamplingParams(max_new_tokens=160, temperature=0, json_schema=json.dumps(schema))


def _check(outs: list[dict]) -> list[list[int]]:
    for o, (what, schema) in zip(outs, PICKED):
        assert o["meta_info"]["finish_reason"]["type"] == "stop", (what, o["text"])
        jsonschema.validate(json.loads(o["text"]), schema)
    return [o["output_ids"] for o in outs]


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_outputs_validate_and_dspark_equals_plain(backend, prompts):
    plain = LLM(str(BUNDLED), grammar_backend=backend)
    spec = _spec(grammar_backend=backend)
    params = [_params(s) for _, s in PICKED]
    want = _check(plain.generate(prompts, params))
    got = spec.generate(prompts, params)
    assert _check(got) == want
    assert any(o["meta_info"]["spec_accept_length"] > 1 for o in got), "no draft was ever accepted"
    # one at a time too (batch 1)
    assert [spec.generate(p, q)["output_ids"] for p, q in zip(prompts, params)] == want


def test_pp2_equals_pp1(plain, prompts):
    params = [_params(s) for _, s in PICKED]
    want = _check(plain.generate(prompts, params))
    pp2 = LLM(str(BUNDLED), page_size=4, pp_size=2)
    try:
        assert _check(pp2.generate(prompts, params)) == want
    finally:
        pp2.engine.close()


def test_mixed_batch_leaves_unconstrained_requests_alone(plain, prompts):
    free = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    alone = plain.generate(prompts[:3], free)
    mixed = plain.generate(
        prompts[:3] + prompts[:3], [free] * 3 + [_params(s) for _, s in PICKED[:3]]
    )
    assert [o["output_ids"] for o in mixed[:3]] == [o["output_ids"] for o in alone]


REGEX = "[a-z_]{1,6}[.(][a-z_]{1,6}"  # identifier-like text: no newlines, spaces or digits


def test_sampling_under_a_grammar_stays_lossless(plain):
    """Chi-square of the second generated token under a regex (the first one a verify round
    commits), over many draws of each engine, against the exact constrained target distribution."""
    spec = _spec()
    prompt = code_prompts(plain.tokenizer, 4, PROMPT_SOURCE)[1]
    samples = 1500
    params = [SamplingParams(max_new_tokens=2, temperature=1.0, top_k=8, regex=REGEX)] * samples
    first = plain.generate(prompt, SamplingParams(max_new_tokens=1, temperature=0, regex=REGEX))
    first = first["output_ids"]
    probs, unconstrained = constrained_target(plain, prompt, first)
    assert not torch.equal(probs > 0, unconstrained > 0), "the grammar removes nothing: a weak test"
    engines = {"plain": plain, "spec": spec}
    counts = second_token_counts(engines, prompt, params, first[0], probs.shape[0])
    assert_follows(counts, probs, "grammar's top-k")


def constrained_target(
    llm: LLM, prompt: list[int], first: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' logits after prompt + first, masked by the regex's state after `first`, then
    temperature 1 and top-k 8 -> probs [V]; and the same without the mask."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(BUNDLED), dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + first])).logits[0, -1:].float()  # [1, V]
    vocab = logits.shape[1]
    backend = backend_class("llguidance")(llm.tokenizer, vocab, llm.engine.eos_token_ids)
    m = backend.matcher(backend.compile(Grammar("regex", REGEX)))
    assert m.consume(first[0])
    mask = bm.allowing_all(1, vocab)
    m.fill(mask, 0)
    sb = SamplingBatch(
        torch.tensor([1.0]),
        torch.tensor([8]),
        torch.tensor([1.0]),
        torch.tensor([0.0]),
        torch.tensor([False]),
        [None],
    )
    return filter_probs(bm.constrain(logits, mask), sb)[0], filter_probs(logits, sb)[0]


def test_a_grammar_the_engine_cannot_compile_fails_only_its_request(plain):
    """The offline API skips the HTTP layer's check: the engine's compiler refuses the grammar, the
    request ends with a 400-style abort naming the field, and the others are served."""
    outs = plain.generate(
        [[5, 6, 7], [5, 6, 7]],
        [
            SamplingParams(max_new_tokens=4, regex="(ab"),
            SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True),
        ],
    )
    reason = outs[0]["meta_info"]["finish_reason"]
    assert (
        reason["type"] == "abort"
        and reason["status_code"] == 400
        and "`regex`" in reason["message"]
    )
    assert len(outs[1]["output_ids"]) == 4


def test_aborting_while_the_grammar_compiles_leaves_nothing_behind(plain):
    engine = plain.engine
    schema = json.dumps({"type": "object", "properties": {"k": {"type": "string"}}})
    engine.add_request("compiling", [5, 6, 7], SamplingParams(max_new_tokens=8, json_schema=schema))
    engine.abort("compiling")
    for _ in range(50):
        engine.step()
        if not engine.has_work():
            break
    assert not engine.has_work() and "compiling" not in engine.requests
    engine.check()
