"""tools/bench/linears: a run at a small shape writes its table, JSON and chart, with one row per
(variant, rows) and weight GB/s consistent with the bytes and the time."""

import json

import pytest

from sparkrelay.models import cpu_kernels
from sparkrelay.tools.bench import linears
from testkit.models import write_qwen3_config


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels are off here")
def test_a_small_run_writes_consistent_files(tmp_path):
    cfg = write_qwen3_config(tmp_path / "cfg")
    out = tmp_path / "out"
    linears.main(["--config", str(cfg), "--rows", "1,8", "--repeats", "1", "--out", str(out)])
    record = json.loads((out / "linears.json").read_text())
    assert {(r["variant"], r["rows"]) for r in record["rows"]} == {
        (v, n) for v in linears.variants() for n in (1, 8)
    }
    no_amx = {v for v in linears.variants() if v.endswith(linears.NO_AMX)}
    assert len(no_amx) == (2 if cpu_kernels.amx_on() else 0)
    for r in record["rows"]:
        assert r["gb_s_max"] == pytest.approx(r["weight_bytes"] / r["ms_min"] / 1e6, rel=0.02)
    assert record["bandwidth"]["peak"] > 0 and "commit" in record
    assert "Decode linears" in (out / "linears.md").read_text()
