"""DSpark decoding through the engine: greedy outputs equal plain greedy decoding token for token
(batch sizes 1 and 8, with and without the confidence threshold, every Markov head type), and the
metrics are reported."""

import pytest

from sparkrelay import LLM, SamplingParams
from sparkrelay.models.dspark_checkpoint import write_random_checkpoint
from testkit.models import BUNDLED, BUNDLED_DRAFTER, PROMPT_SOURCE, code_prompts

NUM_PROMPTS, NEW_TOKENS = 50, 32
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
SOURCE = PROMPT_SOURCE  # a fixed text: the prompts (and the margins tuned on them) never change with the code


@pytest.fixture(scope="module")
def reference():
    plain = LLM(str(BUNDLED))
    prompts = code_prompts(plain.tokenizer, NUM_PROMPTS, SOURCE)
    return prompts, [o["output_ids"] for o in plain.generate(prompts, GREEDY)]


def spec_llm(folder, threshold=0.0, **kw):
    return LLM(
        str(BUNDLED),
        speculative_algorithm="DSPARK",
        speculative_draft_model_path=str(folder),
        speculative_dspark_confidence_threshold=threshold,
        **kw,
    )


def generate_in_batches(llm, prompts, batch):
    out = []
    for i in range(0, len(prompts), batch):
        out += [o["output_ids"] for o in llm.generate(prompts[i : i + batch], GREEDY)]
    return out


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("threshold", [0.0, 0.6])
def test_bundled_drafter_is_lossless(reference, bundled_drafter_dir, batch, threshold):
    prompts, expected = reference
    llm = spec_llm(bundled_drafter_dir, threshold)
    assert generate_in_batches(llm, prompts, batch) == expected
    stats = llm.engine.stats()
    # drafts do get accepted: the multi-token commit path ran
    assert stats["spec_accept_length"] > 1.0
    if threshold > 0:
        # the threshold truncated blocks
        assert stats["spec_mean_proposal"] < llm.engine.proposer.max_drafts
    llm.engine.check()
    # idle: every block free or held by the prefix cache alone
    assert llm.engine.blocks.num_used == 0


@pytest.fixture(scope="module")
def random_drafter(tmp_path_factory):
    """kind -> the folder of a random drafter with that Markov head, written once per module."""
    folders = {}

    def get(kind):
        if kind not in folders:
            folder = tmp_path_factory.mktemp(f"draft_{kind}") / "d"
            folders[kind] = write_random_checkpoint(
                folder, BUNDLED, markov_head_type=kind, target_layer_ids=[-1, 2, 6]
            )
        return folders[kind]

    return get


# The default run covers each head once and each threshold (~15 s a case); the other combinations,
# and batch 1 (~25 s a case), run with -m slow. The bundled drafter (vanilla) runs both thresholds.
DEFAULT_CASES = {("vanilla", 0.5, 8), ("gated", 0.0, 8), ("rnn", 0.5, 8)}
HEAD_CASES = [
    pytest.param(
        kind,
        threshold,
        batch,
        marks=() if (kind, threshold, batch) in DEFAULT_CASES else pytest.mark.slow,
        id=f"{kind}-{threshold}-{batch}",
    )
    for kind in ("vanilla", "gated", "rnn")
    for threshold in (0.0, 0.5)
    for batch in (1, 8)
]


@pytest.mark.parametrize("kind,threshold,batch", HEAD_CASES)
def test_random_drafters_of_every_head_type_are_lossless(
    reference, random_drafter, kind, threshold, batch
):
    prompts, expected = reference
    llm = spec_llm(random_drafter(kind), threshold=threshold)
    assert generate_in_batches(llm, prompts, batch) == expected


def test_meta_info_and_stop_inside_accepted_drafts(reference, bundled_drafter_dir):
    prompts, expected = reference
    llm = spec_llm(bundled_drafter_dir)
    out = llm.generate(prompts[0], GREEDY)
    meta = out["meta_info"]
    assert (
        meta["spec_verify_ct"] >= 1
        and meta["spec_accept_length"] == NEW_TOKENS / meta["spec_verify_ct"]
        or meta["spec_accept_length"] == pytest.approx((NEW_TOKENS - 1) / meta["spec_verify_ct"])
    )
    # stop on a token that lands in the middle of a round; nothing past it is returned
    ref = expected[0]
    stop = ref[10]
    cut = ref.index(stop) + 1
    out = llm.generate(
        prompts[0], SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, stop_token_ids=(stop,))
    )
    assert out["output_ids"] == ref[:cut]
    out = llm.generate(prompts[0], SamplingParams(max_new_tokens=7, temperature=0, ignore_eos=True))
    assert out["output_ids"] == ref[:7]


def test_sampling_with_dspark_is_seeded(reference, bundled_drafter_dir):
    prompts, _ = reference
    llm = spec_llm(bundled_drafter_dir)
    p = SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.95, seed=5, ignore_eos=True)
    a = llm.generate(prompts[:3], p)
    b = llm.generate(prompts[:3], p)
    assert [o["output_ids"] for o in a] == [o["output_ids"] for o in b]
    assert all(len(o["output_ids"]) == 24 for o in a)


def test_chunked_prefill_and_preemption_with_dspark(reference, bundled_drafter_dir):
    prompts, expected = reference
    llm = spec_llm(
        bundled_drafter_dir,
        page_size=4,
        chunked_prefill_size=16,
        max_total_tokens=512,
        max_running_requests=12,
    )
    assert generate_in_batches(llm, prompts[:24], 24) == expected[:24]
    assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.check()


def test_bad_drafter_is_refused_at_start_up(tmp_path):
    import json

    from sparkrelay.config import ConfigError

    folder = write_random_checkpoint(tmp_path / "d", BUNDLED, target_layer_ids=[1, 6])
    cfg = json.loads((folder / "config.json").read_text())
    cfg["target_layer_ids"] = [1, 7]  # 7: the target's last layer
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ConfigError, match=r"--speculative-draft-model-path .*target_layer_ids \[1, 7\]"
    ):
        spec_llm(folder)


def test_disable_by_batch_size_steps_plainly_then_drafts_on_that_context(
    reference, bundled_drafter_dir
):
    """--speculative-disable-by-batch-size 3: while three requests decode, plain steps (no round);
    once the shortest one ends, the other two draft on the context the plain steps wrote. Greedy
    tokens equal plain greedy, the rounds commit exactly the tokens after the plain steps, and they
    accept as many a round as when the two drafted from their first token (a position the plain
    steps left without context would cost acceptance)."""
    prompts, expected = reference
    short = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    llm = spec_llm(bundled_drafter_dir, speculative_disable_by_batch_size=3)
    outs = [o["output_ids"] for o in llm.generate(prompts[:3], [short, GREEDY, GREEDY])]
    assert outs == [expected[0][:16], expected[1], expected[2]]
    stats = llm.engine.stats()
    # the prefill gave each its first token, 15 plain steps the next ones: rounds did the rest
    assert stats["spec_plain_steps"] == 15
    assert stats["spec_rounds"] * stats["spec_accept_length"] == 2 * (NEW_TOKENS - 16)
    always = spec_llm(bundled_drafter_dir)
    assert [o["output_ids"] for o in always.generate(prompts[1:3], GREEDY)] == expected[1:3]
    assert stats["spec_accept_length"] >= 0.9 * always.engine.stats()["spec_accept_length"]
    llm.engine.check()


def test_disable_by_batch_size_is_checked_at_start_up():
    from sparkrelay.config import ConfigError

    with pytest.raises(
        ConfigError, match="--speculative-disable-by-batch-size must be >= 1, got 0"
    ):
        spec_llm(BUNDLED_DRAFTER, speculative_disable_by_batch_size=0)
    with pytest.raises(
        ConfigError, match="--speculative-disable-by-batch-size needs --speculative-algorithm"
    ):
        LLM(str(BUNDLED), speculative_disable_by_batch_size=4)
