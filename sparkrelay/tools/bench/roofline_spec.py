"""DSpark's round cost at batch 1, from the engine's own pieces timed while it decodes.

Two sparkrelay engines of one target and dtype, plain and DSpark, generate the same batch-1 prompts, interleaved
(plain, DSpark, plain, DSpark ...). Wrapped while they run (roofline_engines.PieceTimer):
  plain  ModelRunner.forward   with 1 token        -> t_decode  (the target forward of a decode step)
         ModelRunner.run       of a decode batch   -> t_step    (the whole decode step: forward + sampling)
  DSpark SpecRunner.forward    with 1 + B tokens   -> t_verify  (the target forward over the anchor and B drafts)
         DSparkProposer.propose for one row        -> t_draft   (the drafter's block forward and its heads), of
           which Qwen3DSparkModel.block_forward_paged -> t_draft_body   (the draft layers over the block)
           and   Qwen3DSparkModel.markov_sample    -> t_draft_markov (the B sequential Markov-head steps);
           the rest is the LM head over the block and the context gather
         SpecRunner.run        of a decode batch   -> t_round   (propose + verify + acceptance + context writes)
B = the drafts proposed per round (the block size, or --speculative-num-draft-tokens); rounds near the end that
propose fewer are left out, and each prompt generates at least 3 (B + 1) tokens so full rounds are timed.
The same run gives the end-to-end figures: batch-1 decode tok/s of both engines (roofline_engines.decode_rates),
the acceptance length tau, and whether the greedy outputs are equal.
"""

from __future__ import annotations

from sparkrelay.tools.bench.roofline_engines import PieceTimer, SparkrelayEngine, decode_rates

PLAIN, DSPARK = "plain", "dspark"


def _wrap(plain: SparkrelayEngine, spec: SparkrelayEngine, device: str) -> dict[str, PieceTimer]:
    runner, spec_runner = plain.llm.engine.runner, spec.llm.engine.runner
    n_ids = lambda args: len(args[1])  # noqa: E731  forward(meta, ids, logits_rows)
    kind = lambda args: args[0].kind  # noqa: E731  run(batch)
    rows = lambda args: args[0].shape[0]  # noqa: E731  block_forward_paged(block_ids [R, B], ...), markov_sample(u, ...)
    drafter = spec_runner.proposer.drafter
    return {
        "decode": PieceTimer(runner, "forward", n_ids, device),
        "step": PieceTimer(runner, "run", kind, device),
        "verify": PieceTimer(spec_runner, "forward", n_ids, device),
        "draft": PieceTimer(spec_runner.proposer, "propose", lambda args: len(args[0]), device),
        "round": PieceTimer(spec_runner, "run", kind, device),
        "draft_body": PieceTimer(drafter, "block_forward_paged", rows, device),
        "draft_markov": PieceTimer(drafter, "markov_sample", rows, device),
    }


def round_costs(
    plain: SparkrelayEngine,
    spec: SparkrelayEngine,
    prompts: list[list[int]],
    new_tokens: int,
    repeats: int,
    device: str,
) -> dict:
    """The raw figures of one (shape, dtype) row of the round-cost table (see the module
    docstring)."""
    block = spec.llm.engine.proposer.max_drafts
    new_tokens = max(new_tokens, 3 * (block + 1))
    for e in (plain, spec):
        # warm-up, untimed, out of the statistics
        e.generate(prompts[:1], min(new_tokens, 2 * block + 2))
    spec.spec_summary()  # a fresh acceptance count
    timers = _wrap(plain, spec, device)
    rates = decode_rates(
        {PLAIN: plain, DSPARK: spec},
        [[p] for p in prompts],
        new_tokens,
        repeats,
        device,
        warmup=False,
    )
    summary = spec.spec_summary() or {}
    return {
        "block": block,
        "new_tokens": new_tokens,
        "t_decode_s": timers["decode"].median(1),
        "t_verify_s": timers["verify"].median(1 + block),
        "t_draft_s": timers["draft"].median(1),
        "t_step_s": timers["step"].median("decode"),
        "t_round_s": timers["round"].median("decode"),
        "t_draft_body_s": timers["draft_body"].median(1),
        "t_draft_markov_s": timers["draft_markov"].median(1),
        "samples": {
            k: timers[k].count(size)
            for k, size in (
                ("decode", 1),
                ("verify", 1 + block),
                ("draft", 1),
                ("step", "decode"),
                ("round", "decode"),
            )
        },
        "tau_measured": summary.get("spec_accept_length"),
        "plain_tok_s": rates[PLAIN]["decode_tok_s"],
        "dspark_tok_s": rates[DSPARK]["decode_tok_s"],
        "greedy_equal": rates[PLAIN]["outputs"] == rates[DSPARK]["outputs"],
        "t_new_s": {k: v["t_new_s"] for k, v in rates.items()},
        "t_1_s": {k: v["t_1_s"] for k, v in rates.items()},
    }
