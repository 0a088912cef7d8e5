"""Smoke test of the offline benchmark: tiny random model, tiny workload, files written with the
expected rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparkrelay.tools.bench import common as bc
from testkit.http import build_tiny_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("bench-model"), max_positions=512)


def test_bench_offline_writes_table_plot_and_json(tiny_model, tmp_path, capsys):
    import torch

    from sparkrelay.models.dspark_checkpoint import write_random_checkpoint
    from sparkrelay.tools.bench import offline as bench_offline

    out_dir = tmp_path / "results"
    draft = write_random_checkpoint(tmp_path / "draft", tiny_model, target_layer_ids=[-1, 0])
    threads = torch.get_num_threads()
    try:  # one thread: on a busy 2-core machine, more makes torch's kernels spin and the test crawl
        result = bench_offline.main(
            [
                "--model-path",
                str(tiny_model),
                "--num-prompts",
                "2",
                "--prompt-len",
                "8",
                "--output-len",
                "4",
                "--batch-sizes",
                "1,2",
                "--warmup",
                "0",
                "--repeats",
                "1",
                "--threads",
                "1",
                "--out-dir",
                str(out_dir),
                "--draft-model-path",
                str(draft),
            ]
        )
    finally:
        torch.set_num_threads(threads)

    md = (out_dir / "bench_offline.md").read_text()
    png = (out_dir / "bench_offline.png").read_bytes()
    raw = json.loads((out_dir / "bench_offline.json").read_text())
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    assert "float32" in md and "8 tokens" in md and "4 new tokens" in md and "torch threads" in md
    assert (
        raw["command"].startswith("python -m sparkrelay.tools.bench.offline --model-path ")
        and raw["commit"]
    )
    assert md.splitlines()[2:4] == bc.header_lines(raw)  # after the title: command, host, commit
    main_table = md.split("Per-position")[0]
    rows = [
        line
        for line in main_table.splitlines()
        if line.startswith("| ") and not line.startswith("| engine")
    ]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in rows]
    assert [(c[0], c[1]) for c in cells] == [
        ("sparkrelay", "1"),
        ("sparkrelay", "2"),
        ("sparkrelay+dspark", "1"),
        ("sparkrelay+dspark", "2"),
        ("transformers", "1"),
        ("transformers", "2"),
    ]
    for c in cells:
        assert float(c[2].replace(",", "")) > 0  # e2e tok/s
        assert c[8].endswith("/2")  # greedy agreement column
    assert cells[4][4] == "1.00x" and cells[4][5] == "1.00x"  # the reference vs itself
    assert cells[4][8] == "2/2" and cells[2][8] == "2/2"  # DSpark greedy equals the reference
    assert float(cells[2][7]) >= 1.0  # acceptance length of the DSpark rows
    assert "Per-position accept rates" in md

    assert len(raw["rows"]) == 6 and len(raw["prompts"]) == 2
    for row in raw["rows"]:
        assert len(row["outputs"]) == 2 and all(len(o) == 4 for o in row["outputs"])
        assert len(row["t_out_s"]) == 1 and row["e2e_tok_s"] > 0
    assert all(len(p["ids"]) == 8 for p in raw["prompts"])
    assert result["rows"][0]["engine"] == "sparkrelay"
    assert "| engine" in capsys.readouterr().out  # the table is printed


def test_prompts_are_deterministic_fixed_windows(tiny_model):
    from transformers import AutoTokenizer

    from sparkrelay.tools.bench import common as bc

    tok = AutoTokenizer.from_pretrained(tiny_model)
    a = bc.load_prompts(tok, 12, 16)
    b = bc.load_prompts(tok, 12, 16)
    assert [p.ids for p in a] == [p.ids for p in b]
    assert all(len(p.ids) == 16 for p in a)
    assert len({p.source for p in a[:5]}) == 5  # consecutive prompts come from different files


def test_markdown_table_alignment():
    from sparkrelay.tools.bench.common import markdown_table

    text = markdown_table(["engine", "tok/s"], [["a", 1.5], ["bb", 1234.0]])
    lines = text.splitlines()
    # numeric column right-aligned
    assert lines[0].startswith("| engine") and lines[1].endswith(":|")
    assert "1,234.0" in lines[3]
