"""The engine on a CUDA device (skipped without one): DSpark greedy equals plain greedy in float32 at
batch 1 and 8, with and without a token map (the draft block's paged attention and the Markov head
through the generic paths: the CPU kernels never serve CUDA tensors), and sampling with a token map
is reproducible under a seed; bf16 serves (its verify rows may round otherwise than decode rows)."""

import json

import pytest
import torch

from sparkrelay import LLM, SamplingParams
from testkit.models import BUNDLED, BUNDLED_DRAFTER, PROMPT_SOURCE, code_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
GREEDY = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)


def engine(dtype: str, **kw) -> LLM:
    return LLM(str(BUNDLED), device="cuda", dtype=dtype, grammar_backend="none", **kw)


def dspark(dtype: str, **kw) -> LLM:
    kw.update(speculative_algorithm="DSPARK", speculative_draft_model_path=str(BUNDLED_DRAFTER))
    return engine(dtype, **kw)


def ids(llm: LLM, prompts, batch: int) -> list[list[int]]:
    out = []
    for i in range(0, len(prompts), batch):
        out += [o["output_ids"] for o in llm.generate(prompts[i : i + batch], GREEDY)]
    return out


@pytest.fixture(scope="module")
def reference():
    plain = engine("float32")
    prompts = code_prompts(plain.tokenizer, 16, PROMPT_SOURCE)
    return prompts, ids(plain, prompts, 8)


@pytest.fixture(scope="module")
def token_map(tmp_path_factory) -> str:
    vocab = json.loads((BUNDLED / "config.json").read_text())["vocab_size"]
    path = tmp_path_factory.mktemp("map") / "map.json"
    path.write_text(json.dumps(list(range(0, vocab, 2))))
    return str(path)


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("mapped", [False, True])
def test_dspark_equals_plain_on_cuda(reference, token_map, batch, mapped):
    prompts, expected = reference
    llm = dspark("float32", speculative_token_map=token_map if mapped else None)
    assert next(llm.engine.proposer.drafter.parameters()).device.type == "cuda"
    assert ids(llm, prompts, batch) == expected
    assert llm.engine.stats()["spec_accept_length"] > 1.0


def test_sampling_with_a_token_map_on_cuda_is_seeded(reference, token_map):
    prompts, _ = reference
    llm = dspark("float32", speculative_token_map=token_map)
    p = SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.95, seed=5, ignore_eos=True)
    a = [o["output_ids"] for o in llm.generate(prompts[:4], p)]
    assert a == [o["output_ids"] for o in llm.generate(prompts[:4], p)]
    assert all(len(x) == 24 for x in a)


def test_bf16_dspark_serves_on_cuda(reference):
    prompts, _ = reference
    plain, spec = engine("bfloat16"), dspark("bfloat16")
    want, got = ids(plain, prompts, 8), ids(spec, prompts, 8)
    same = sum(w == g for w, g in zip(want, got))
    print(f"\nbf16 on CUDA: DSpark = plain on {same}/{len(want)} prompts")
    assert all(len(g) == 32 for g in got) and same >= len(want) // 2
