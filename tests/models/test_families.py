"""The Llama, Mistral and Qwen2 families against transformers at small random configs: float32
logits to 1e-4 in prefill and paged decode, a pipeline split equal to the whole model, and greedy
tokens alike at PP 1 and 2."""

import pytest
import torch

from sparkrelay import LLM, SamplingParams
from sparkrelay.models.decoder import load_causal_lm
from sparkrelay.models.loader import CheckpointError
from testkit.families import CASES, make_random, pool_for, run
from testkit.hf import hf_greedy, load_hf


@pytest.fixture(scope="module", params=list(CASES))
def family_dir(request, tmp_path_factory):
    return make_random(tmp_path_factory.mktemp(request.param), request.param)


@torch.inference_mode()
def test_logits_match_transformers(family_dir):
    hf, ours = load_hf(family_dir), load_causal_lm(str(family_dir))
    ids = torch.randint(0, 4096, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = hf(torch.tensor([ids])).logits[0]  # [150, V]: past llama3's 64-token original context
    pool, table = pool_for(ours), list(range(63, 0, -1))
    torch.testing.assert_close(
        run(ours, pool, ids[:140], 0, table).logits, ref[:140], atol=1e-4, rtol=0
    )
    for p in range(140, 150):
        torch.testing.assert_close(
            run(ours, pool, ids[p : p + 1], p, table).logits[0], ref[p], atol=1e-4, rtol=0
        )


@torch.inference_mode()
def test_stage_split_equals_whole(family_dir):
    whole, first, last = (load_causal_lm(str(family_dir), *r) for r in ((0, 4), (0, 2), (2, 4)))
    ids, table = list(range(5, 30)), list(range(8))
    h = run(first, pool_for(first), ids, 0, table).hidden
    torch.testing.assert_close(
        run(last, pool_for(last), ids, 0, table, hidden=h).logits,
        run(whole, pool_for(whole), ids, 0, table).logits,
        atol=1e-5,
        rtol=0,
    )


def test_pp2_greedy_equals_pp1_and_transformers(tmp_path):
    folder = make_random(tmp_path / "llama", "llama-bias-tied")
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 40)]
    greedy = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    settings = dict(page_size=4, chunked_prefill_size=16, max_total_tokens=1024)
    pp1 = [o["output_ids"] for o in LLM(str(folder), **settings).generate(prompts, greedy)]
    pp = LLM(str(folder), pp_size=2, **settings)
    try:  # its stage process ends with it, not with the test session
        pp2 = [o["output_ids"] for o in pp.generate(prompts, greedy)]
    finally:
        pp.engine.close()
    hf = load_hf(folder)
    assert pp1 == pp2 == [hf_greedy(hf, p, 12) for p in prompts]


def test_unserved_architecture_and_window_are_refused(tmp_path):
    folder = make_random(tmp_path / "m", "mistral")
    cfg_path = folder / "config.json"
    text = cfg_path.read_text()
    cfg_path.write_text(text.replace('"MistralForCausalLM"', '"GPT2LMHeadModel"'))
    with pytest.raises(
        CheckpointError, match="GPT2LMHeadModel.*supported: Qwen3ForCausalLM, LlamaForCausalLM"
    ):
        load_causal_lm(str(folder))
    cfg_path.write_text(text.replace('"sliding_window": null', '"sliding_window": 128'))
    with pytest.raises(CheckpointError, match="sliding_window 128"):
        load_causal_lm(str(folder))


@torch.inference_mode()
def test_logprobs_prefix_cache_and_penalties_on_llama(tmp_path):
    """What the engine adds on top of the forward is family-blind: output logprobs equal
    transformers' log-softmax, a repeated prompt is served from the prefix cache with the same
    tokens, and greedy decoding with a repetition penalty equals transformers' generate with the
    same penalty."""
    folder = make_random(tmp_path / "llama", "llama-tied")
    llm = LLM(str(folder), page_size=4, max_total_tokens=1024)
    hf = load_hf(folder)
    prompt = list(range(10, 42))
    params = SamplingParams(
        max_new_tokens=8, temperature=0, ignore_eos=True, return_logprob=True, top_logprobs_num=2
    )
    first = llm.generate(prompt, params)
    ids = first["output_ids"]
    ref = hf(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].log_softmax(-1)  # [8, V]
    got = torch.tensor([lp for lp, _, _ in first["meta_info"]["output_token_logprobs"]])
    torch.testing.assert_close(
        got, ref.gather(1, torch.tensor(ids)[:, None])[:, 0], atol=1e-4, rtol=0
    )
    again = llm.generate(prompt, params)
    assert again["output_ids"] == ids and again["meta_info"]["cached_tokens"] >= 28
    penalized = llm.generate(
        prompt,
        SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, repetition_penalty=1.5),
    )["output_ids"]
    expect = hf.generate(
        torch.tensor([prompt]),
        max_new_tokens=12,
        do_sample=False,
        repetition_penalty=1.5,
        min_new_tokens=12,
    )[0, len(prompt) :].tolist()
    assert penalized == expect
