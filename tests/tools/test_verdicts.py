"""The verdicts of the tools other than the soak and the demo (bench_serving, bench_pd, fuzz_http):
any error, lost or corrupted answer fails them. Pure functions on given figures; the tools' own runs
are tested elsewhere."""

from __future__ import annotations

from sparkrelay.tools.bench import pd as bench_pd
from sparkrelay.tools.bench.serving_report import verdict_line as serving_verdict
from sparkrelay.tools.fuzz import run as fuzz_http


def test_bench_serving_fails_on_any_failed_request():
    ok = {"completed": 4, "failed": 0, "errors": {}}
    assert serving_verdict(ok) == "Verdict: PASS (all 4 requests completed)"
    one = {"completed": 3, "failed": 1, "errors": {"HTTP 500": {"count": 1, "example": "boom"}}}
    assert serving_verdict(one) == "Verdict: FAIL: 1 of 4 requests failed (HTTP 500: 1)"
    assert serving_verdict({"completed": 0, "failed": 0, "errors": {}}).startswith("Verdict: FAIL")


def _mode(name: str, outputs, accept: float = 3.0, n: int = 32) -> dict:
    """A bench_pd row; a PD row ("PD <mode>[ (<backend>)]") carries the aggregated answers of its
    rounds, [[1, 2]] accepted at 3.0."""
    mode = name.split()[1] if name.startswith("PD ") else None
    row = {
        "deployment": name,
        "mode": mode,
        "prompt_len": n,
        "outputs": outputs,
        "accept_length": accept,
    }
    return {**row, "paired": {"outputs": [[1, 2]], "accept_length": 3.0}} if mode else row


def test_bench_pd_fails_on_corrupted_tokens_and_full_context_acceptance():
    good = [
        _mode("aggregated", [[1, 2]]),
        _mode("PD hidden", [[1, 2]]),
        _mode("PD draft-kv", [[1, 2]]),
        _mode("PD tail", [[1, 2]], accept=2.0),
    ]
    tails = [{"tail": 1, "outputs": [[5]]}, {"tail": 8, "outputs": [[5]]}]
    assert bench_pd.verdict(good, tails) == [] and bench_pd.verdict_line([]).startswith(
        "Verdict: PASS"
    )
    bad = [*good[:2], _mode("PD draft-kv", [[1, 3]]), _mode("PD tail", [[1, 2]], accept=2.0)]
    assert bench_pd.verdict(bad, tails) == [
        "PD draft-kv, 32-token prompts: tokens differ from aggregated"
    ]
    slow = [*good[:1], _mode("PD hidden", [[1, 2]], accept=2.9), *good[2:]]
    assert "accept length" in bench_pd.verdict(slow, [])[0]
    assert bench_pd.verdict(good, [*tails, {"tail": 64, "outputs": [[6]]}]) == [
        "tail 64: tokens differ from tail 1"
    ]
    assert bench_pd.verdict_line(["x"]) == "Verdict: FAIL: x"
    alone = {k: v for k, v in good[1].items() if k != "paired"}
    assert bench_pd.verdict([alone], []) == [
        "PD hidden, 32-token prompts: no aggregated answers to compare"
    ]


def test_fuzz_verdict_fails_on_5xx_transport_errors_health_and_leftover_kv():
    r = fuzz_http.Report()
    r.record("POST /generate", 400, "bad")
    assert fuzz_http.verdict(r, 200, {"kv_used_tokens": 0})[0]
    assert not fuzz_http.verdict(r, 503, None)[0]
    ok, line = fuzz_http.verdict(r, 200, {"kv_used_tokens": 16})
    assert not ok and "16 KV tokens" in line
    r.record("POST /generate", 500, "boom")
    r.record("POST /generate", None, "hang")
    ok, line = fuzz_http.verdict(r, 200, None)
    assert not ok and line == "Verdict: FAIL: 1 5xx answers; 1 transport errors (crashes or hangs)"


def test_bench_offline_fails_on_any_output_that_differs_from_transformers():
    from sparkrelay.tools.bench import offline_report as bo

    rows = [
        {"engine": "transformers", "batch": 1, "match": 2, "first_divergence": [None, None]},
        {"engine": "sparkrelay+dspark", "batch": 8, "match": 2, "first_divergence": [None, None]},
    ]
    assert bo.verdict(rows, 2) == [] and bo.verdict_line([]).startswith("Verdict: PASS")
    rows[1] |= {"match": 1, "first_divergence": [None, 5]}
    assert bo.verdict(rows, 2) == [
        "sparkrelay+dspark batch 8: 1 of 2 outputs differ from transformers "
        "(first differing token per prompt: [None, 5])"
    ]
    assert bo.verdict_line(bo.verdict(rows, 2)).startswith(
        "Verdict: FAIL: sparkrelay+dspark batch 8"
    )
