"""The Llama, Mistral and Qwen2 families against transformers at small random configs: float32 logits to 1e-4 in
prefill and paged decode, a pipeline split equal to the whole model, and greedy tokens alike at PP 1 and 2."""

import shutil

import pytest
import torch

from sparkrelay import LLM, SamplingParams
from sparkrelay.kvcache.pool import KVPool
from sparkrelay.models.attention import AttnMeta
from sparkrelay.models.decoder import load_causal_lm
from sparkrelay.models.loader import CheckpointError
from testkit.hf import hf_greedy, load_hf
from testkit.models import TOKENIZER_FILES, tokenizer_source

SMALL = dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, rope_theta=10000.0,
             tie_word_embeddings=False)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 10000.0}
CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),  # SmolLM2's layout
    "llama-bias-tied": ("LlamaConfig", "LlamaForCausalLM",
                        dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True)),
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=LLAMA3_ROPE)),
    "llama-linear-rope": ("LlamaConfig", "LlamaForCausalLM",
                          dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
}


def make_random(folder, case: str, seed: int = 0):
    import transformers

    cfg_name, model_name, extra = CASES[case]
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(getattr(transformers, cfg_name)(**{**SMALL, **extra})).eval()
    if "bias" in case or case == "qwen2":
        with torch.no_grad():  # transformers starts biases at zero: make them count
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_source() / name, folder / name)
    return folder


@pytest.fixture(scope="module", params=list(CASES))
def family_dir(request, tmp_path_factory):
    return make_random(tmp_path_factory.mktemp(request.param), request.param)


def run(model, pool, ids, start, table, hidden=None):
    meta = AttnMeta.build([start], [start + len(ids)], [table], 4, "cpu")
    return model(meta, pool.layers, input_ids=None if hidden is not None else torch.tensor(ids), hidden=hidden)


def pool_for(model):
    s = model.spec
    return KVPool(range(model.start, model.end), 64, 4, s.num_kv_heads, s.head_dim, torch.float32, "cpu")


@torch.inference_mode()
def test_logits_match_transformers(family_dir):
    hf, ours = load_hf(family_dir), load_causal_lm(str(family_dir))
    ids = torch.randint(0, 4096, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = hf(torch.tensor([ids])).logits[0]  # [150, V]: past llama3's 64-token original context
    pool, table = pool_for(ours), list(range(63, 0, -1))
    torch.testing.assert_close(run(ours, pool, ids[:140], 0, table).logits, ref[:140], atol=1e-4, rtol=0)
    for p in range(140, 150):
        torch.testing.assert_close(run(ours, pool, ids[p: p + 1], p, table).logits[0], ref[p], atol=1e-4, rtol=0)


@torch.inference_mode()
def test_stage_split_equals_whole(family_dir):
    whole, first, last = (load_causal_lm(str(family_dir), *r) for r in ((0, 4), (0, 2), (2, 4)))
    ids, table = list(range(5, 30)), list(range(8))
    h = run(first, pool_for(first), ids, 0, table).hidden
    torch.testing.assert_close(run(last, pool_for(last), ids, 0, table, hidden=h).logits,
                               run(whole, pool_for(whole), ids, 0, table).logits, atol=1e-5, rtol=0)


def test_pp2_greedy_equals_pp1_and_transformers(tmp_path):
    folder = make_random(tmp_path / "llama", "llama-bias-tied")
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 40)]
    greedy = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    settings = dict(page_size=4, chunked_prefill_size=16, max_total_tokens=1024)
    pp1 = [o["output_ids"] for o in LLM(str(folder), **settings).generate(prompts, greedy)]
    pp2 = [o["output_ids"] for o in LLM(str(folder), pp_size=2, **settings).generate(prompts, greedy)]
    hf = load_hf(folder)
    assert pp1 == pp2 == [hf_greedy(hf, p, 12) for p in prompts]


def test_unserved_architecture_and_window_are_refused(tmp_path):
    folder = make_random(tmp_path / "m", "mistral")
    cfg_path = folder / "config.json"
    text = cfg_path.read_text()
    cfg_path.write_text(text.replace('"MistralForCausalLM"', '"GPT2LMHeadModel"'))
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel.*supported: Qwen3ForCausalLM, LlamaForCausalLM"):
        load_causal_lm(str(folder))
    cfg_path.write_text(text.replace('"sliding_window": null', '"sliding_window": 128'))
    with pytest.raises(CheckpointError, match="sliding_window 128"):
        load_causal_lm(str(folder))


@torch.inference_mode()
def test_logprobs_prefix_cache_and_penalties_on_llama(tmp_path):
    """What the engine adds on top of the forward is family-blind: output logprobs equal transformers'
    log-softmax, a repeated prompt is served from the prefix cache with the same tokens, and greedy decoding with
    a repetition penalty equals transformers' generate with the same penalty."""
    folder = make_random(tmp_path / "llama", "llama-tied")
    llm = LLM(str(folder), page_size=4, max_total_tokens=1024)
    hf = load_hf(folder)
    prompt = list(range(10, 42))
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True, return_logprob=True, top_logprobs_num=2)
    first = llm.generate(prompt, params)
    ids = first["output_ids"]
    ref = hf(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1: -1].log_softmax(-1)  # [8, V]
    got = torch.tensor([lp for lp, _, _ in first["meta_info"]["output_token_logprobs"]])
    torch.testing.assert_close(got, ref.gather(1, torch.tensor(ids)[:, None])[:, 0], atol=1e-4, rtol=0)
    again = llm.generate(prompt, params)
    assert again["output_ids"] == ids and again["meta_info"]["cached_tokens"] >= 28
    penalized = llm.generate(prompt, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True,
                                                    repetition_penalty=1.5))["output_ids"]
    expect = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, repetition_penalty=1.5,
                         min_new_tokens=12)[0, len(prompt):].tolist()
    assert penalized == expect
