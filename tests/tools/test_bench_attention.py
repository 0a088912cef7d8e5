"""tools/bench/attention: a run at a small shape writes its table, JSON and chart, one row per
(case, variant), with GFLOP/s consistent with the case's arithmetic and its time."""

import json

import pytest

from sparkrelay.models import cpu_kernels
from sparkrelay.tools.bench import attention
from testkit.models import write_qwen3_config


@pytest.mark.skipif(cpu_kernels.portable() is None, reason="the CPU kernels are off here")
def test_a_small_run_writes_consistent_files(tmp_path):
    cfg = write_qwen3_config(tmp_path / "cfg", num_attention_heads=4, num_key_value_heads=2)
    out = tmp_path / "out"
    argv = ["--config", str(cfg), "--contexts", "40,70", "--queries", "1,8", "--repeats", "2"]
    attention.main([*argv, "--calls", "2", "--out", str(out)])
    record = json.loads((out / "attention.json").read_text())
    rows = record["rows"]
    assert {(r["context"], r["queries"], r["variant"]) for r in rows} == {
        (c, q, v) for c in (40, 70) for q in (1, 8) for v in attention.VARIANTS
    }
    for r in rows:  # 4 T H L D over the median time, L = the context and the block's own keys
        flops = 4 * r["queries"] * 4 * (r["context"] + r["queries"]) * 64
        assert r["gflop_s_median"] == pytest.approx(flops / r["us_median"] / 1e3, rel=1e-6)
        assert r["us_min"] <= r["us_median"]
        if r["variant"] == "torch":
            assert r["kernel_speedup_median"] == pytest.approx(1.0)
    assert "commit" in record and "Decode attention" in (out / "attention.md").read_text()
