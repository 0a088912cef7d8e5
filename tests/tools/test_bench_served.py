"""Smoke test of the served-vs-offline benchmark on the bundled pair: every round times both sides,
the ratio is the median of the rounds' own ratios, and the files are written."""

from __future__ import annotations

import json
import statistics

import pytest

from sparkrelay.tools.bench import common as bc


@pytest.mark.slow  # ~17 s: a server and the offline engine, two engines' rounds
def test_bench_served_pairs_its_rounds(bundled_model_dir, bundled_drafter_dir, tmp_path, capsys):
    from sparkrelay.tools.bench import served

    rows = served.main(
        [
            "--model-path",
            str(bundled_model_dir),
            "--num-prompts",
            "1",
            "--prompt-len",
            "16",
            "--output-len",
            "12",
            "--repeats",
            "2",
            "--out-dir",
            str(tmp_path),
        ]
    )
    assert [r["engine"] for r in rows] == list(served.ENGINES)
    for r in rows:
        assert len(r["offline_tok_s"]) == len(r["served_tok_s"]) == 2
        assert all(x > 0 for x in r["offline_tok_s"] + r["served_tok_s"])
        ratios = [s / o for s, o in zip(r["served_tok_s"], r["offline_tok_s"])]
        assert r["round_ratios"] == ratios and r["ratio"] == statistics.median(ratios)
    raw = json.loads((tmp_path / "bench_served.json").read_text())
    saved = raw["rows"]
    assert [r["ratio"] for r in saved] == [r["ratio"] for r in rows]
    table = (tmp_path / "bench_served.md").read_text()
    assert (
        raw["command"].startswith("python -m sparkrelay.tools.bench.served --model-path ")
        and raw["commit"]
    )
    assert table.splitlines()[2:4] == bc.header_lines(raw)  # after the title: command, host, commit
    assert all(f"| {e} |" in table for e in served.ENGINES)
    assert "round 2" in capsys.readouterr().err
