"""tools/bench/acceptance's learning curve: read from the drafter's train_report.json into a table
(every point's step, CPU hours and acceptance per set, the last point always shown) and a PNG;
nothing without a curve."""

import json

from sparkrelay.tools.bench.acceptance import learning_curve


def write_report(folder, points: int) -> None:
    folder.mkdir()
    curve = [
        {
            "step": 100 * (i + 1),
            "cpu_hours": 0.3 * (i + 1),
            "tau": 1.2 + 0.05 * i,
            "tau_gsm8k": 1.3 + 0.05 * i,
            "tau_mbpp": 1.1 + 0.04 * i,
            "per_set": {},
        }
        for i in range(points)
    ]
    (folder / "train_report.json").write_text(
        json.dumps({"steps": 100 * points, "learning_curve": curve})
    )


def test_the_curve_becomes_a_table_and_a_png(tmp_path):
    write_report(tmp_path / "drafter", 30)
    text = learning_curve(str(tmp_path / "drafter"), tmp_path / "out")
    rows = [
        line
        for line in text.splitlines()
        if line.startswith("|") and line[1:].strip()[:1].isdigit()
    ]
    assert rows[0].split("|")[1].strip() == "100" and rows[-1].split("|")[1].strip() == "3000"
    assert len(rows) <= 16
    header = [c.strip() for c in text.splitlines()[2].split("|")[1:-1]]
    assert header == ["step", "CPU hours", "tau, mean of sets", "tau gsm8k", "tau mbpp"]
    assert [c.strip() for c in rows[0].split("|")[1:-1]] == ["100", "0.30", "1.20", "1.30", "1.10"]
    assert (tmp_path / "out" / "acceptance_curve.png").stat().st_size > 1000


def test_no_report_no_curve(tmp_path):
    (tmp_path / "drafter").mkdir()
    assert learning_curve(str(tmp_path / "drafter"), tmp_path / "out") == ""
    assert not (tmp_path / "out").exists()
