"""The `tail` handoff end to end through the sparkrelay router, with the prefill chunked into
16-token steps, so the last `tail` rows (8 by default) of a prompt straddle chunk boundaries and, at
PP 2, arrive on the last stage chunk by chunk. Prompts of 5 (shorter than the tail), 35 and 100
tokens; greedy.

Asserted: the tokens equal the aggregated DSpark server's (the target decides every token), and each
request's acceptance (verify rounds, accept length) is the same at prefill PP 1 and PP 2: the
decode's drafter sees the same last rows whatever the prefill's pipeline. Acceptance against the
aggregated server is not asserted equal: its drafter sees the whole prompt, the tail's only the last
rows.
"""

from __future__ import annotations

import concurrent.futures
import time

import pytest
import torch

from sparkrelay.disagg.metadata import TailRows, build_tail
from sparkrelay.llm import LLM
from sparkrelay.scheduler.request import SamplingParams
from sparkrelay.tools.cluster import PDSettings, start_pd
from testkit.pd import DRAFTER, MAX_NEW, MODEL, generate

LENGTHS = (5, 35, 100)
CHUNK = 16


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(MODEL).encode(
        open("sparkrelay/scheduler/scheduler.py").read()
    )
    out = [ids[200 * i : 200 * i + n] for i, n in enumerate(LENGTHS)]
    assert [len(p) for p in out] == list(LENGTHS)
    return out


@pytest.fixture(scope="module")
def reference(prompts) -> list[dict]:
    """Aggregated DSpark (target + drafter in one process), one prompt at a time."""
    llm = LLM(MODEL, speculative_algorithm="DSPARK", speculative_draft_model_path=DRAFTER)
    try:
        return [
            llm.generate(p, SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0))
            for p in prompts
        ]
    finally:
        llm.engine.close()


def run_tail(tmp_path, prompts: list[list[int]], pp: int) -> list[dict]:
    log_dir = tmp_path / f"pp{pp}"
    log_dir.mkdir()
    cluster = start_pd(
        PDSettings(
            model=MODEL,
            drafter=DRAFTER,
            pp_size=pp,
            handoff="tail",
            router="sparkrelay",
            prefill_args=["--chunked-prefill-size", str(CHUNK)],
        ),
        str(log_dir),
    )
    try:
        results = []
        for i, ids in enumerate(prompts):
            status, out = generate(
                cluster.url, ids, retries_until=time.monotonic() + (30 if i == 0 else 0)
            )
            assert status == 200, (
                pp,
                len(ids),
                status,
                out,
                cluster.prefill.log_tail(),
                cluster.decode.log_tail(),
            )
            results.append(out)
        return results
    finally:
        cluster.stop()


@pytest.mark.slow  # ~20 s: two PD pairs
def test_tail_handoff_chunked_prefill_pp1_pp2(tmp_path, prompts, reference):
    # two independent deployments, side by side
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        by_pp = dict(zip((1, 2), pool.map(lambda pp: run_tail(tmp_path, prompts, pp), (1, 2))))
    for i, ref in enumerate(reference):
        one, two = by_pp[1][i]["meta_info"], by_pp[2][i]["meta_info"]
        for pp in (1, 2):
            assert by_pp[pp][i]["output_ids"] == ref["output_ids"], (
                f"{LENGTHS[i]}-token prompt, PP {pp}: tail PD tokens differ from aggregated DSpark"
            )
        assert one["spec_verify_ct"] >= 1 and one["spec_accept_length"] >= 1.0, one
        accept = {
            pp: (m["spec_verify_ct"], m["spec_accept_length"]) for pp, m in ((1, one), (2, two))
        }
        assert accept[1] == accept[2], (
            f"{LENGTHS[i]}-token prompt: (verify rounds, accept length) at PP 1 "
            f"{accept[1]} vs PP 2 {accept[2]}"
        )
        print(
            f"{LENGTHS[i]}-token prompt: tail acceptance {one['spec_verify_ct']} rounds, "
            f"{one['spec_accept_length']:.3f} (aggregated {ref['meta_info']['spec_accept_length']:.3f})"
        )


@pytest.mark.parametrize("tail", [1, 8, 40])
@pytest.mark.parametrize("n", LENGTHS)
def test_tail_rows_keep_only_the_last_rows_across_chunks(n, tail):
    """What the last stage keeps per room: [tail, W] whatever the prompt's length, equal to the last
    rows of the whole prompt's aux rows once every chunk has been written."""
    rows = torch.randn(n, 24)  # [n, W]: every prompt position's aux row
    kept = TailRows(n, tail, 24, torch.float32)
    for start in range(0, n, CHUNK):
        kept.write(start, rows[start : start + CHUNK])
        assert kept.rows.shape == (tail, 24)
    want_rows, want_valid = build_tail(rows, tail)
    assert torch.equal(kept.rows, want_rows) and torch.equal(kept.valid, want_valid)
