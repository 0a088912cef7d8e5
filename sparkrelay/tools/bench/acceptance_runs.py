"""The acceptance tool's engines and timed runs (python -m sparkrelay.tools.bench.acceptance): an
offline engine of the target, plain or DSpark; prompts under the chat template; a batch of requests
stepped here with each request's first- and last-token times; the engine's DSpark counters."""

from __future__ import annotations

import argparse
import time


def engine(
    args: argparse.Namespace, dtype: str, dspark: bool, batch: int, draft_weights: str = "unquant"
):
    """An offline engine of the target, plain or DSpark (its drafter's linears `draft_weights`:
    --speculative-draft-model-quantization)."""
    from sparkrelay import LLM

    spec = (
        dict(
            speculative_algorithm="DSPARK",
            speculative_draft_model_path=args.drafter,
            speculative_token_map=args.token_map,
            speculative_draft_model_quantization=draft_weights,
        )
        if dspark
        else {}
    )
    return LLM(
        args.target,
        dtype=dtype,
        max_running_requests=batch,
        max_total_tokens=args.kv_tokens,
        **spec,
    )


def chat_prompts(tokenizer, texts: list[str]) -> list[list[int]]:
    from sparkrelay.tools.train.chat_data import chat_ids

    return [chat_ids(tokenizer, t) for t in texts]


def run_timed(llm, prompts: list[list[int]], params) -> list[dict]:
    """Generate (`params` one SamplingParams or one per prompt), recording each request's first- and
    last-token times (the engine stepped here, not by LLM)."""
    rids = [f"bench-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    per = params if isinstance(params, list) else [params] * len(prompts)
    for rid, ids, p in zip(rids, prompts, per):
        llm.engine.add_request(rid, ids, p)
    first, out, pending = {}, {}, set(rids)
    while pending:
        for o in llm.engine.step():
            now = time.monotonic()
            if o.rid in pending and o.new_ids and o.rid not in first:
                first[o.rid] = now
            if o.finished and o.rid in pending:
                pending.discard(o.rid)
                out[o.rid] = {
                    "ids": o.output_ids,
                    "first": first.get(o.rid, now),
                    "end": now,
                    "rounds": o.spec_verify_ct,
                }
    return [out[r] for r in rids]


def stats_delta(llm, before: dict) -> dict:
    s = llm.engine.spec_stats
    return {
        "rounds": s.rounds - before["rounds"],
        "committed": s.committed - before["committed"],
        "proposed_at": [a - b for a, b in zip(s.proposed_at, before["proposed_at"])],
        "accepted_at": [a - b for a, b in zip(s.accepted_at, before["accepted_at"])],
    }


def snapshot(llm) -> dict:
    s = llm.engine.spec_stats
    return {
        "rounds": s.rounds,
        "committed": s.committed,
        "proposed_at": list(s.proposed_at),
        "accepted_at": list(s.accepted_at),
    }
