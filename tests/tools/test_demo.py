"""The demo's verdict and table (sparkrelay/tools/demo.py). The demo itself starts four deployments
(minutes on CPU) and is run by hand (`python -m sparkrelay.tools.demo`); here its pass/fail rule and
its output are checked on given figures."""

from __future__ import annotations

import pytest

from sparkrelay.tools import demo

M = {"accept": 3.0, "ttft_ms": 50.0, "kib": 100.0, "ctx_kib": 10.0}


def _rows(**changes) -> list[dict]:
    """The aggregated row and one row per mode, all matching; `changes` maps a mode to the fields it
    changes."""
    rows = [{"mode": None, "differ": [], "accepts": [3.0, 2.5, 4.0], "m": M}]
    for mode in ("hidden", "draft-kv", "tail"):
        base = {"mode": mode, "differ": [], "accepts": [3.0, 2.5, 4.0], "m": M}
        rows.append(base | changes.get(mode.replace("-", "_"), {}))
    return rows


def test_all_modes_matching_pass_and_the_verdict_explains_itself():
    passed, lines = demo.verdict(_rows(tail={"accepts": [2.0, 2.5, 3.0]}), tail_tokens=8)
    assert passed and lines[-1].startswith("Verdict: PASS")
    text = "\n".join(lines)
    assert "hidden, draft-kv, tail" in text and "aggregated" in text and "greedy" in text
    assert (
        "last 8 prompt positions" in text
        and "2.50 tokens per step against the aggregated 3.17" in text
    )
    assert "repetitive code" in text and "not a bug" in text


@pytest.mark.parametrize("mode", ["hidden", "draft_kv", "tail"])
def test_text_differing_in_any_mode_fails(mode):
    passed, lines = demo.verdict(_rows(**{mode: {"differ": [1]}}), tail_tokens=8)
    assert not passed
    assert lines[-1].startswith("Verdict: FAIL: ") and "prompt(s) 2" in lines[-1]
    assert f"PD {mode.replace('_', '-')}: text differs" in lines[-1]


@pytest.mark.parametrize("mode", ["hidden", "draft_kv"])
def test_full_context_modes_must_accept_exactly_like_the_aggregated_server(mode):
    passed, lines = demo.verdict(_rows(**{mode: {"accepts": [3.0, 2.4, 4.0]}}), tail_tokens=8)
    assert not passed and "acceptance" in lines[-1] and "whole prompt" in lines[-1]


def test_tail_may_accept_differently():
    passed, _ = demo.verdict(_rows(tail={"accepts": [1.0, 1.0, 1.0]}), tail_tokens=4)
    assert passed


def test_differing_lists_prompt_indices():
    assert demo.differing(["a", "b", "c"], ["a", "b", "c"]) == []
    assert demo.differing(["a", "x", "c"], ["a", "b", "c"]) == [1]
    assert demo.differing(["a"], ["a", "b"]) == [1]


def test_table_marks_mismatches_and_has_a_legend_line_per_column():
    rows = _rows(draft_kv={"differ": [0]})
    out = demo.table(rows)
    assert out[1].split()[:2] == ["aggregated", "-"]
    assert [line.split()[2] for line in out[2:]] == ["yes", "NO", "yes"]
    header_words = [
        "deployment",
        "same text",
        "accept len",
        "TTFT ms",
        "handoff KiB/req",
        "of which DSpark",
    ]
    assert all(w in out[0] for w in header_words)
    assert [line.split("  ")[0] for line in demo.LEGEND] == header_words


def test_unknown_mode_is_a_usage_error():
    with pytest.raises(SystemExit) as e:
        demo.main(["--modes", "hidden,bogus"])
    assert e.value.code == 2
