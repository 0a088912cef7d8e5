"""The soak's prompt pool and its references: prompts cut from held-out stdlib text, and the
aggregated DSpark output of each (what every answer through the PD deployment must equal)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

from sparkrelay.tools.corpus import read_texts, stdlib_files

MODEL, DRAFTER = "models/tiny-qwen3", "models/tiny-qwen3-dspark"


@dataclass
class Prompt:
    index: int
    ids: list[int]
    max_new: int
    long: bool
    text: str = ""  # encodes to exactly `ids`: the same prompt, for routes that take only text
    ref_ids: Optional[list[int]] = None
    ref_text: Optional[str] = None


def build_pool(n: int, long_fraction: float, seed: int) -> list[Prompt]:
    from transformers import AutoTokenizer

    rng = random.Random(seed)
    text = "\n".join(read_texts(stdlib_files()[1]))[:400_000]
    tok = AutoTokenizer.from_pretrained(MODEL)
    # one long text, cut into prompts below (silences the length warning)
    tok.model_max_length = 10**9
    ids = tok.encode(text)
    n_long = round(n * long_fraction)
    pool, offset = [], 0
    for i in range(n):
        long = i % max(1, n // max(1, n_long)) == 0 and sum(p.long for p in pool) < n_long
        length = rng.randint(500, 1500) if long else rng.randint(8, 64)
        assert offset + length <= len(ids), "not enough held-out text for the prompt pool"
        text = tok.decode(ids[offset : offset + length])
        # A cut may split a merge: the prompt is what the text encodes to, so text and ids prompts
        # are the same.
        pool.append(Prompt(i, tok.encode(text), rng.randint(8, 64), long, text))
        offset += length
    return pool


def compute_references(pool: list[Prompt]) -> None:
    """Aggregated DSpark, greedy, one prompt at a time (what every PD answer must equal)."""
    from sparkrelay.llm import LLM
    from sparkrelay.scheduler.request import SamplingParams

    llm = LLM(MODEL, speculative_algorithm="DSPARK", speculative_draft_model_path=DRAFTER)
    try:
        for p in pool:
            out = llm.generate(
                p.ids, SamplingParams(max_new_tokens=p.max_new, temperature=0.0, ignore_eos=True)
            )
            p.ref_ids, p.ref_text = list(out["output_ids"]), out["text"]
    finally:
        llm.engine.close()
