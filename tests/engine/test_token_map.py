"""The draft vocabulary (`--speculative-token-map`, FR-Spec): the drafter's LM head and Markov head keep
the map's rows; drafts are map tokens, q is zero off the map, and DSpark stays lossless (greedy equal
to plain token for token; sampling follows the target distribution even where its likeliest tokens
are off the map); rounds under a grammar draft over every token; bad files are start-up errors
naming the flag; the map tool ranks the target's answer tokens."""

import gzip
import json

import pytest
import torch

from sparkrelay import LLM, SamplingParams
from sparkrelay.config import ConfigError
from sparkrelay.engine.setup import read_token_map
from sparkrelay.models.decoder import DecoderSpec, load_causal_lm
from sparkrelay.models.dspark_checkpoint import load_dspark
from sparkrelay.models.loader import read_config
from sparkrelay.spec.proposer import DSparkProposer
from sparkrelay.tools.train import token_map
from testkit.models import BUNDLED, PROMPT_SOURCE, code_prompts
from testkit.stats import assert_follows, second_token_counts, target_distribution

GREEDY = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)


def write_map(path, ids) -> str:
    path.write_text(json.dumps([int(i) for i in ids]))
    return str(path)


def vocab_size() -> int:
    return DecoderSpec.from_hf(read_config(BUNDLED)).vocab_size


@pytest.fixture(scope="module")
def plain():
    return LLM(str(BUNDLED))


@pytest.fixture(scope="module")
def prompts(plain):
    return code_prompts(plain.tokenizer, 16, PROMPT_SOURCE)


def spec_llm(drafter, token_map_path, **kw):
    return LLM(
        str(BUNDLED),
        speculative_algorithm="DSPARK",
        speculative_draft_model_path=str(drafter),
        speculative_token_map=token_map_path,
        **kw,
    )


def test_greedy_with_a_token_map_equals_plain(plain, prompts, bundled_drafter_dir, tmp_path):
    """Half the vocabulary (every even id, so some of the target's tokens are never drafted): the
    outputs equal plain greedy at batch 1 and 8, drafts still get accepted, and the drafter's
    heads hold the map's rows only."""
    path = write_map(tmp_path / "map.json", range(0, vocab_size(), 2))
    llm = spec_llm(bundled_drafter_dir, path)
    drafter = llm.engine.proposer.drafter
    assert drafter.vocab.numel() == -(-vocab_size() // 2)
    assert drafter.vocab_head.out_features == drafter.vocab.numel()
    expected = [o["output_ids"] for o in plain.generate(prompts, GREEDY)]
    got = [o["output_ids"] for o in llm.generate(prompts[:1], GREEDY)]
    got += [o["output_ids"] for o in llm.generate(prompts[1:9], GREEDY)]
    got += [o["output_ids"] for o in llm.generate(prompts[9:], GREEDY)]
    assert got == expected
    assert llm.engine.stats()["spec_accept_length"] > 1.0
    llm.engine.check()


@torch.inference_mode()
def test_proposals_are_map_tokens_and_q_is_zero_off_the_map(bundled_drafter_dir):
    """The proposer with a map: greedy drafts are the argmax over the map's columns of the full
    drafter's Z (the same Z there), sampled q rows sum to 1 with nothing off the map."""
    target = load_causal_lm(str(BUNDLED))
    share = dict(
        share_embedding_from=target.model.embed_tokens.weight,
        share_lm_head_from=target.lm_head.weight,
    )
    full = load_dspark(bundled_drafter_dir, target.spec, **share)
    mapped = load_dspark(bundled_drafter_dir, target.spec, **share)
    ids = torch.arange(1, target.spec.vocab_size, 3)
    mapped.restrict_vocab(ids)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 7, target.spec.hidden_size, generator=g)
    anchors, greedy = torch.tensor([3, 40]), torch.ones(2, dtype=torch.bool)
    u_full, u_map = full.base_logits(h), mapped.vocab_head.forward(h)
    torch.testing.assert_close(u_map, u_full[..., ids], atol=1e-5, rtol=1e-5)
    drafts, z = mapped.markov_sample(u_map, anchors, torch.zeros(2), greedy, in_vocab=True)
    assert bool(torch.isin(drafts, ids).all())
    prev = torch.cat([anchors[:, None], drafts[:, :-1]], 1)
    z_full = u_full + full.markov_bias(h, prev)  # the full drafter's Z after the same tokens
    torch.testing.assert_close(z, z_full[..., ids], atol=1e-4, rtol=1e-5)
    assert torch.equal(drafts, ids[z_full[..., ids].argmax(-1)])
    # the proposer: sampled q over the whole vocabulary, zero off the map
    prop = DSparkProposer(mapped, 4, 16, torch.device("cpu"), 7, 0.0, max_rows=2)
    ctx = torch.randn(5, len(mapped.spec.target_layer_ids) * target.spec.hidden_size)
    prop.write_features(ctx, torch.arange(5), torch.arange(5))
    out = prop.propose(
        [3],
        [5],
        [[0, 1, 2, 3]],
        [7],
        torch.ones(1),
        torch.zeros(1, dtype=torch.bool),
        [None],
        torch.Generator().manual_seed(1),
    )
    off = torch.ones(target.spec.vocab_size, dtype=torch.bool)
    off[ids] = False
    assert out.draft_probs.shape == (1, 7, target.spec.vocab_size)
    assert not out.draft_probs[..., off].any()
    torch.testing.assert_close(out.draft_probs.sum(-1), torch.ones(1, 7))
    assert bool(torch.isin(out.drafts, ids).all())


def test_sampling_with_a_token_map_follows_the_target(
    plain, prompts, bundled_drafter_dir, tmp_path
):
    """Chi-square of the second token (the first a verify round commits) at temperature 1, top-k 8,
    with the target's two likeliest tokens there kept off the map: DSpark still samples the exact
    target distribution (they come from the residual)."""
    prompt, samples = prompts[2], 1500
    params = [SamplingParams(max_new_tokens=2, temperature=1.0, top_k=8, ignore_eos=True)] * samples
    first = plain.generate(prompt, SamplingParams(max_new_tokens=1, temperature=0))["output_ids"]
    probs = target_distribution(plain, prompt, first, params[0])
    keep = torch.ones(vocab_size(), dtype=torch.bool)
    keep[probs.topk(2).indices] = False
    llm = spec_llm(bundled_drafter_dir, write_map(tmp_path / "map.json", keep.nonzero()[:, 0]))
    counts = second_token_counts({"map": llm}, prompt, params, first[0], probs.shape[0])
    assert_follows(counts, probs, "top-k with its head off the map")


def test_a_grammar_round_drafts_over_every_token(plain, bundled_drafter_dir, tmp_path):
    """A regex the map cannot spell (its only tokens are off the map): the constrained output equals
    plain decoding's, and drafts were proposed over the whole vocabulary."""
    params = SamplingParams(max_new_tokens=12, temperature=0, regex="(ab|cd){1,6}")
    prompt = plain.tokenizer.encode("x = '")
    expected = plain.generate(prompt, params)["output_ids"]
    banned = set(expected)
    path = write_map(tmp_path / "map.json", [i for i in range(vocab_size()) if i not in banned])
    llm = spec_llm(bundled_drafter_dir, path, grammar_backend="llguidance")
    assert llm.generate(prompt, params)["output_ids"] == expected


@pytest.mark.parametrize(
    "content, words",
    [
        ("not json", "not a JSON list"),
        ("[]", "non-empty JSON list"),
        ("[1.5, 2]", "integer token ids"),
        ('{"ids": [1]}', "integer token ids"),
        ("[true]", "integer token ids"),
        ("[1, 99999999]", "token id 99999999 is outside"),
        ("[3, 3]", "repeat"),
    ],
)
def test_bad_token_maps_name_the_flag(tmp_path, content, words):
    path = tmp_path / "map.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=rf"--speculative-token-map .*{words}"):
        read_token_map(str(path), vocab_size())


def test_token_map_flag_checks(bundled_drafter_dir, tmp_path):
    with pytest.raises(ConfigError, match="--speculative-token-map .*no such file"):
        spec_llm(bundled_drafter_dir, str(tmp_path / "missing.json"))
    path = write_map(tmp_path / "map.json", range(10))
    with pytest.raises(ConfigError, match="--speculative-token-map needs --speculative-algorithm"):
        LLM(str(BUNDLED), speculative_token_map=path)
    assert torch.equal(
        read_token_map(write_map(tmp_path / "m.json", [9, 0, 4]), 10), torch.tensor([0, 4, 9])
    )


def test_the_map_tool_ranks_answer_tokens(tmp_path):
    rows = [{"answer_ids": [7, 7, 7, 5, 5, 9]}, {"answer_ids": [9, 9, 9, 9, 1]}]
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps({"vocab_size": 20, "eos_token_id": 2}))
    out = tmp_path / "map.json"
    token_map.main(
        ["--target", str(tmp_path / "t"), "--answers", str(tmp_path / "a.jsonl.gz")]
        + ["--size", "5", "--out", str(out)]
    )
    # EOS, then 9 (5 uses), 7 (3), 5 (2), 1 (1): full before any filler id
    assert json.loads(out.read_text()) == [1, 2, 5, 7, 9]
    token_map.main(
        ["--target", str(tmp_path / "t"), "--answers", str(tmp_path / "a.jsonl.gz")]
        + ["--size", "7", "--out", str(out)]
    )
    assert json.loads(out.read_text()) == [0, 1, 2, 3, 5, 7, 9]  # then the lowest ids left
