"""tools/bench/acceptance: its learning curve, read from the drafter's train_report.json into a table
(every point's step, CPU hours and acceptance per set, the last point always shown) and a PNG;
nothing without a curve."""

import json

import pytest

from sparkrelay.tools.bench.acceptance_report import learning_curve


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


def test_finished_sets_are_recorded_and_resumed_only_with_the_same_settings(tmp_path, monkeypatch):
    """Each set's row is appended as the set ends; --resume keeps the rows of the same settings and
    measures only the rest; without --resume (or with other settings, or a drafter whose weights
    changed in the same folder) everything is measured."""
    from sparkrelay.tools.bench import acceptance

    measured, stops = [], [RuntimeError("stopped")]

    def fake_run(args, spec_llm, plain_llm, name, prompts):
        measured.append(name)
        if name == "mbpp" and stops:
            raise stops.pop()  # the first run is stopped inside its third set
        return {"set": name, "prompts": len(prompts), "tau_greedy": 2.0 + len(measured)}

    monkeypatch.setattr(acceptance, "acceptance_run", fake_run)
    sets = ["gsm8k", "math500", "mbpp"]
    prompts = {s: [[1, 2, 3]] * 2 for s in sets}

    for name in ("target", "drafter"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(name.encode())
    models = ["--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter")]

    def parse(*extra):
        return acceptance.build_parser().parse_args(
            ["--out-dir", str(tmp_path), *models, "--sets", *sets, "--limit", "2", *extra]
        )

    with pytest.raises(RuntimeError, match="stopped"):
        acceptance.measure_sets(parse(), None, None, prompts)
    assert measured == sets
    lines = (tmp_path / acceptance.SETS_FILE).read_text().splitlines()
    assert [json.loads(x)["row"]["set"] for x in lines] == ["gsm8k", "math500"]
    measured.clear()
    rows = acceptance.measure_sets(parse("--resume"), None, None, prompts)
    assert measured == ["mbpp"] and [r["set"] for r in rows] == sets
    assert [r["tau_greedy"] for r in rows[:2]] == [3.0, 4.0]  # the first run's rows, kept
    measured.clear()
    other = acceptance.build_parser().parse_args(
        ["--out-dir", str(tmp_path), *models, "--sets", *sets, "--limit", "3", "--resume"]
    )
    acceptance.measure_sets(other, None, None, prompts)
    assert measured == sets  # other settings: nothing is reused
    measured.clear()
    (tmp_path / "drafter" / "model.safetensors").write_bytes(b"trained further")
    acceptance.measure_sets(parse("--resume"), None, None, prompts)
    assert measured == sets  # the same folder with other weights: nothing is reused
    measured.clear()
    acceptance.measure_sets(parse("--limit", "2"), None, None, prompts)
    assert measured == sets  # no --resume: a fresh record
    assert len((tmp_path / acceptance.SETS_FILE).read_text().splitlines()) == 3


def test_a_set_resumes_at_its_first_unfinished_chunk(tmp_path, monkeypatch):
    """A set is measured CHUNK_PROMPTS prompts at a time, each chunk recorded as it ends; a run
    stopped inside a set resumes at its first unfinished chunk (seeds by index in the set), and the
    set's row sums its chunks as one run over the whole set would."""
    from sparkrelay.tools.bench import acceptance

    monkeypatch.setattr(acceptance, "CHUNK_PROMPTS", 2)
    calls, stops = [], [RuntimeError("stopped")]

    def fake_chunk(args, spec_llm, plain_llm, prompts, first):
        calls.append((first, len(prompts)))
        if first == 4 and stops:
            raise stops.pop()
        stats = {"rounds": 2 * len(prompts), "committed": 5 * len(prompts)}
        at = {"proposed_at": [len(prompts), len(prompts)], "accepted_at": [len(prompts), first]}
        return {
            "prompts": len(prompts),
            "greedy": {**stats, **at},
            "t1": {"rounds": len(prompts), "committed": 2 * len(prompts), **at},
            "greedy_equal": len(prompts),
            "greedy_runs": [{"ids": [first + i] * 3, "rounds": 1} for i in range(len(prompts))],
        }

    monkeypatch.setattr(acceptance, "measure_chunk", fake_chunk)
    for name in ("target", "drafter"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(name.encode())
    argv = ["--out-dir", str(tmp_path), "--target", str(tmp_path / "target")]
    argv += ["--drafter", str(tmp_path / "drafter"), "--sets", "mbpp"]
    prompts = {"mbpp": [[1, 2]] * 5}  # chunks at 0, 2 and 4 (one prompt)
    with pytest.raises(RuntimeError, match="stopped"):
        acceptance.measure_sets(acceptance.build_parser().parse_args(argv), None, None, prompts)
    assert calls == [(0, 2), (2, 2), (4, 1)]
    calls.clear()
    args = acceptance.build_parser().parse_args([*argv, "--resume"])
    (row,) = acceptance.measure_sets(args, None, None, prompts)
    assert calls == [(4, 1)]  # the two recorded chunks are taken back
    assert row["prompts"] == 5 and row["tau_greedy"] == 2.5 and row["tau_t1"] == 2.0
    assert row["rounds_greedy"] == 10 and row["greedy_equal"] == 5 and row["tokens"] == 15
    assert row["accept_rate_greedy"] == [1.0, round((0 + 2 + 4) / 5, 3)]
    assert [r["ids"][0] for r in row["greedy_runs"]] == [0, 1, 2, 3, 4]
