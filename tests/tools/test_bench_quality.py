"""The quality tool on the bundled model, at a small size: figures of the right kind, the reference
row exact."""

import json

import pytest

from sparkrelay.tools.bench import common as bc
from sparkrelay.tools.bench import quality


def test_quality_tool_writes_its_table(tmp_path, bundled_model_dir):
    result = quality.main(
        [
            "--model",
            str(bundled_model_dir),
            "--windows",
            "2",
            "--window-len",
            "64",
            "--prompts",
            "2",
            "--prompt-len",
            "16",
            "--new-tokens",
            "8",
            "--out",
            str(tmp_path),
        ]
    )
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["float32", "bfloat16", "int8wo"]
    ref = rows["float32"]
    assert ref["top1_vs_float32"] == 1.0 and ref["greedy_vs_float32"]["outputs_equal"] == 2
    for r in rows.values():
        assert 0 < r["loss"] < 10, r  # nats/token of a trained model on held-out code
        assert (
            0 <= r["top1_vs_float32"] <= 1 and 0 <= r["greedy_vs_bfloat16"]["positions_equal"] <= 1
        )
    # int8 weights with per-channel scales stay close to bf16
    assert rows["int8wo"]["top1_vs_bfloat16"] > 0.8
    saved = json.loads((tmp_path / "quality.json").read_text())
    assert saved["rows"][2]["torchao_config"] == "int8wo"
    md = (tmp_path / "quality.md").read_text()
    assert "| int8wo" in md
    assert (
        saved["command"].startswith("python -m sparkrelay.tools.bench.quality --model ")
        and saved["commit"]
    )
    assert md.splitlines()[2:4] == bc.header_lines(saved)  # after the title: command, host, commit


def test_quality_tool_refuses_bad_sizes(capsys):
    with pytest.raises(SystemExit) as e:
        quality.parse_args(["--windows", "0"])
    assert e.value.code == 2 and "--windows must be positive" in capsys.readouterr().err
