"""The roofline benchmark: its arithmetic on given numbers, and one tiny run whose files are checked
for structure and for derived figures that follow from the raw ones (never for timings)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sparkrelay.tools.bench import bandwidth as bw
from sparkrelay.tools.bench import common as bc
from sparkrelay.tools.bench import roofline_report as report
from testkit.http import build_tiny_model

QWEN3_06B = {
    "hidden_size": 1024,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 3072,
    "vocab_size": 151936,
}


# -- arithmetic ------------------------------------------------------------------------------------


def test_weight_bytes_of_the_qwen3_06b_shape():
    shape = bw.Shape.from_hf(QWEN3_06B)
    # per layer: q 1024x2048 + k, v 1024x1024 each + o 2048x1024 + gate, up, down 1024x3072 each =
    # 15,728,640
    assert shape.layer_weights() == 15_728_640
    assert shape.lm_head_weights() == 155_582_464
    weights = 28 * 15_728_640 + 155_582_464  # 595,984,384 (the 1.19 GB of the issue in bf16)
    assert bw.weight_bytes(shape, "bfloat16") == 2 * weights
    assert bw.weight_bytes(shape, "float32") == 4 * weights
    # int8wo: 1 byte a weight + a 2-byte scale per output channel (2048 + 1024 + 1024 + 1024 + 3072
    # * 2 = 12,288), the LM head bf16 (or int8 with a scale per vocabulary row)
    assert shape.layer_channels() == 12_288
    assert bw.weight_bytes(shape, "int8wo") == 28 * (15_728_640 + 2 * 12_288) + 2 * 155_582_464
    assert (
        bw.weight_bytes(shape, "int8wo", int8_lm_head=True)
        == 28 * (15_728_640 + 2 * 12_288) + 155_582_464 + 2 * 151_936
    )


def test_kv_step_bytes_and_roofline():
    shape = bw.Shape.from_hf(QWEN3_06B)
    assert bw.kv_bytes(shape, "bfloat16", 160) == 2 * 28 * 8 * 128 * 160 * 2
    assert bw.kv_bytes(shape, "int8wo", 160) == bw.kv_bytes(shape, "bfloat16", 160)  # KV stays bf16
    assert bw.step_bytes(shape, "float32", 8, 100) == bw.weight_bytes(
        shape, "float32"
    ) + 8 * bw.kv_bytes(shape, "float32", 100)
    assert bw.roofline_tok_s(24.0, 1.2e9, 1) == pytest.approx(20.0)
    assert bw.roofline_tok_s(24.0, 2.4e9, 8) == pytest.approx(80.0)
    assert bw.fraction(15.0, 20.0) == pytest.approx(0.75) and bw.fraction(None, 20.0) is None


def test_bandwidth_is_bytes_over_the_median_pass():
    assert bw.bandwidth_gb_s(2 * 10**9, [0.2, 0.1, 0.4]) == pytest.approx(10.0)


def test_measure_read_bandwidth_reports_its_method():
    out = bw.measure_read_bandwidth(nbytes=1 << 22, repeats=3)
    assert out["bytes"] == 1 << 22 and len(out["seconds"]) == 3 and out["gb_s"] > 0
    assert "torch.sum float32" in out["method"] and "median of 3" in out["method"]
    assert set(out["reads_gb_s"]) == {"sum float32", "amax float32", "sum bfloat16"}
    assert out["gb_s"] == pytest.approx(max(out["reads_gb_s"].values()))


def test_predicted_speedup_formula():
    assert bw.predicted_speedup(4.5, 1.2, 0.3) == pytest.approx(3.0)
    row = {
        "t_decode_s": 0.1,
        "t_verify_s": 0.12,
        "t_draft_s": 0.03,
        "t_step_s": 0.11,
        "t_round_s": 0.2,
        "tau_measured": 2.0,
        "plain_tok_s": 10.0,
        "dspark_tok_s": 15.0,
    }
    report._derive_spec(row)
    assert row["verify_ratio"] == pytest.approx(1.2) and row["draft_ratio"] == pytest.approx(0.3)
    assert row["predicted"] == {
        "3": pytest.approx(2.0),
        "4.5": pytest.approx(3.0),
        "6": pytest.approx(4.0),
    }
    assert row["predicted_at_measured_tau"] == pytest.approx(2.0 / 1.5)
    assert row["speedup_measured"] == pytest.approx(1.5) and row["round_ratio"] == pytest.approx(
        0.2 / 0.11
    )


def test_engine_flags_pass_through_and_the_kv_capacity_fits_the_workload():
    from sparkrelay.tools.bench import roofline

    args, settings = roofline.parse_args(
        [
            "--batches",
            "1,4",
            "--prompt-len",
            "100",
            "--new-tokens",
            "20",
            "--prefill-len",
            "50",
            "--page-size",
            "32",
            "--enable-torch-compile",
        ]
    )
    assert settings["page_size"] == 32 and settings["enable_torch_compile"] is True
    # the largest batch's prompts + outputs + lookahead
    assert settings["max_total_tokens"] == 4 * (100 + 20 + 16)
    assert "dtype" not in settings and args.dtypes == ["float32", "bfloat16", "int8wo"]
    _, settings = roofline.parse_args(["--max-total-tokens", "999"])
    assert settings["max_total_tokens"] == 999
    for bad in (["--tp-size", "2"], ["--no-such-flag"], ["--dtypes", "int4"]):
        with pytest.raises(SystemExit):
            roofline.parse_args(bad)


# -- one tiny run ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    from sparkrelay.models.dspark_checkpoint import write_random_checkpoint

    out = tmp_path_factory.mktemp("roofline-model")
    target, draft = build_tiny_model(out / "tiny", max_positions=512), out / "tiny-dspark"
    write_random_checkpoint(draft, target, target_layer_ids=[-1, 0])
    return target, draft


def test_roofline_run_writes_consistent_files(tiny_pair, tmp_path):
    import torch

    from sparkrelay.tools.bench import roofline

    target, _ = tiny_pair
    out = tmp_path / "results"
    threads = torch.get_num_threads()
    try:  # one thread: on a busy 2-core machine more makes torch's kernels spin
        roofline.main(
            [
                "--config",
                str(target),
                "--pair",
                "",
                "--dtypes",
                "float32,bfloat16",
                "--batches",
                "1,2",
                "--new-tokens",
                "4",
                "--prompt-len",
                "8",
                "--prefill-len",
                "32",
                "--repeats",
                "1",
                "--spec-prompts",
                "1",
                "--threads",
                "1",
                "--out",
                str(out),
                "--page-size",
                "8",
                "--kernels-off",
            ]
        )
    finally:
        torch.set_num_threads(threads)
    raw = json.loads((out / "roofline.json").read_text())
    md = (out / "roofline.md").read_text()
    assert (out / "roofline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {
        "settings",
        "machine",
        "load",
        "bandwidth",
        "shapes",
        "decode",
        "prefill",
        "spec",
        "skipped",
        "command",
        "commit",
    } <= set(raw)
    assert raw["command"].startswith("python -m sparkrelay.tools.bench.roofline --config ")
    assert md.splitlines()[2:4] == bc.header_lines(raw)  # after the title: command, host, commit
    assert raw["settings"]["engine"]["page_size"] == 8  # an engine flag passed through
    assert raw["load"]["start"] and raw["load"]["end"] and raw["bandwidth"]["gb_s"] > 0
    assert [s["weights"] for s in raw["shapes"]] == ["checkpoint"]
    _check_decode(raw, md, target)
    _check_prefill_and_spec(raw, md)


def _check_decode(raw: dict, md: str, target: Path) -> None:
    keys = {(r["dtype"], r["engine"], r["batch"]) for r in raw["decode"]}
    off = report.FALLBACK  # --kernels-off: not for float32, which has no kernels
    assert keys == {
        (d, e, b)
        for d in ("float32", "bfloat16")
        for e in ("sparkrelay", "transformers", off)
        for b in (1, 2)
        if not (d == "float32" and e == off)
    }
    gb_s = raw["bandwidth"]["gb_s"]
    shape = bw.Shape.from_hf(json.loads((target / "config.json").read_text()))
    assert raw["shapes"][0]["shape"] == vars(shape)
    for r in raw["decode"]:
        assert r["context"] == 8 + 4 / 2
        assert r["step_bytes"] == bw.step_bytes(shape, r["dtype"], r["batch"], r["context"])
        assert r["roofline_tok_s"] == pytest.approx(r["batch"] * gb_s * 1e9 / r["step_bytes"])
        if r["decode_tok_s"] is not None:
            assert r["roofline_fraction"] == pytest.approx(r["decode_tok_s"] / r["roofline_tok_s"])
        assert r["step_tok_s"] == pytest.approx(r["batch"] / r["median_step_s"])
        assert r["step_fraction"] == pytest.approx(r["step_tok_s"] / r["roofline_tok_s"])
        if r["engine"] == "sparkrelay":
            ref = next(
                x
                for x in raw["decode"]
                if x["engine"] == "transformers"
                and (x["dtype"], x["batch"]) == (r["dtype"], r["batch"])
            )
            if r["decode_tok_s"] and ref["decode_tok_s"]:
                assert r["vs_transformers"] == pytest.approx(
                    r["decode_tok_s"] / ref["decode_tok_s"]
                )
            assert r["step_vs_transformers"] == pytest.approx(r["step_tok_s"] / ref["step_tok_s"])
            fallback = [
                x
                for x in raw["decode"]
                if x["engine"] == off and (x["dtype"], x["batch"]) == (r["dtype"], r["batch"])
            ]
            if fallback and r["decode_tok_s"] and fallback[0]["decode_tok_s"]:
                ratio = r["decode_tok_s"] / fallback[0]["decode_tok_s"]
                assert r["vs_kernels_off"] == pytest.approx(ratio)
            elif r["dtype"] == "float32":
                assert r["vs_kernels_off"] is None
        assert len(r["t_new_s"]) == len(r["t_1_s"]) == 1
        assert r["weight_bytes"] == bw.weight_bytes(shape, r["dtype"], int8_lm_head=True)
        if r["engine"] in ("sparkrelay", off):  # the step profile: 3 decode steps after prefill
            assert r["profiled_steps"] == 4 - 1
            assert 0 < r["linear_s_per_step"] < r["profiled_step_s"]
            linear_gb_s = r["weight_bytes"] / r["linear_s_per_step"] / 1e9
            assert r["linear_gb_s"] == pytest.approx(linear_gb_s)
            assert r["linear_fraction"] == pytest.approx(linear_gb_s / gb_s)
            assert r["rest_share"] == pytest.approx(
                1 - r["linear_s_per_step"] / r["profiled_step_s"]
            )
        else:
            assert "profiled_step_s" not in r
    f32 = [r for r in raw["decode"] if r["dtype"] == "float32" and r["engine"] == "sparkrelay"]
    # same checkpoint, float32: token for token
    assert all(r["greedy_agreement"] == 1.0 for r in f32)
    assert (
        "## Decode" in md
        and "of roofline" in md
        and "Read bandwidth" in md
        and "load average" in md
    )
    # decode, profile, prefill and round-cost rows
    assert md.count("| tiny ") >= 10 + 6 + 4 + 2
    assert "| vs kernels off |" in md and f"| {off} |" in md
    assert "## The decode step: linears and the rest" in md


def _check_prefill_and_spec(raw: dict, md: str) -> None:
    assert {(r["dtype"], r["engine"]) for r in raw["prefill"]} == {
        (d, e) for d in ("float32", "bfloat16") for e in ("sparkrelay", "transformers")
    } | {("bfloat16", report.FALLBACK)}
    for r in raw["prefill"]:
        assert r["prompt_len"] == 32 and r["prefill_tok_s"] > 0
    assert [r["dtype"] for r in raw["spec"]] == ["float32", "bfloat16"]
    for r in raw["spec"]:
        assert r["block"] == 7 and r["new_tokens"] == 24  # >= 3 full rounds of 1 + 7
        assert (
            r["samples"]["verify"] > 0 and r["samples"]["decode"] > 0 and r["samples"]["draft"] > 0
        )
        # the draft's parts were timed too
        assert r["t_draft_body_s"] > 0 and r["t_draft_markov_s"] > 0
        assert r["verify_ratio"] == pytest.approx(r["t_verify_s"] / r["t_decode_s"])
        assert r["draft_ratio"] == pytest.approx(r["t_draft_s"] / r["t_decode_s"])
        for tau in ("3", "4.5", "6"):
            assert r["predicted"][tau] == pytest.approx(
                float(tau) / (r["verify_ratio"] + r["draft_ratio"])
            )
        if r["dtype"] == "float32":
            assert r["greedy_equal"] is True  # DSpark greedy = plain greedy
        assert r["speedup_measured"] == pytest.approx(r["dspark_tok_s"] / r["plain_tok_s"])
    assert "## DSpark round cost" in md and "pred. tau=4.5" in md


def test_the_step_profile_times_each_served_linear_once(tiny_pair):
    """outer_linears: every module a weight is served by, none inside another (AvxLinear holds a
    oneDNN copy for many rows, which must not be timed twice); after the profile the modules are
    unwrapped."""
    from sparkrelay.tools.bench.roofline_engines import SparkrelayEngine, Target, outer_linears

    target, _ = tiny_pair
    t = Target(str(target), json.loads((target / "config.json").read_text()))
    engine = SparkrelayEngine(t, "bfloat16", {"max_total_tokens": 256})
    model = engine.llm.engine.model
    names = {id(m): n for n, m in model.named_modules()}
    chosen = [names[id(m)] for m in outer_linears(model)]
    assert not [a for a in chosen for b in chosen if a.startswith(b + ".")]
    assert "head" in chosen or "lm_head" in chosen
    served = {n.rsplit(".", 1)[-1] for n in chosen}
    assert {"qkv", "o_proj", "gate_up", "down_proj"} <= served, served
    profile = engine.linear_profile([[5, 6, 7, 8]], 6)
    assert profile["profiled_steps"] == 5 and 0 < profile["linear_s_per_step"]
    assert not [m for m in outer_linears(model) if "forward" in vars(m)]  # unwrapped


def test_roofline_on_a_config_without_weights(tiny_pair, tmp_path):
    """A folder with only config.json runs with --load-format dummy, and transformers gets the same
    values."""
    import torch

    from sparkrelay.tools.bench import roofline
    from sparkrelay.tools.bench.roofline_engines import engine_knows

    if not engine_knows("load_format"):
        pytest.skip("this build has no --load-format dummy")
    target, draft = tiny_pair
    folder, draft_folder = tmp_path / "shape", tmp_path / "shape-dspark"
    for src, dst in ((target, folder), (draft, draft_folder)):
        dst.mkdir()
        shutil.copy(src / "config.json", dst / "config.json")
    threads = torch.get_num_threads()
    try:
        result = roofline.main(
            [
                "--config",
                str(folder),
                "--pair",
                "",
                "--dtypes",
                "float32",
                "--batches",
                "1",
                "--new-tokens",
                "3",
                "--prompt-len",
                "8",
                "--prefill-len",
                "0",
                "--repeats",
                "1",
                "--spec-prompts",
                "1",
                "--threads",
                "1",
                "--out",
                str(tmp_path / "out"),
            ]
        )
    finally:
        torch.set_num_threads(threads)
    assert [s["weights"] for s in result["shapes"]] == ["dummy"] and result["skipped"] == []
    assert result["prefill"] == [] and [r["shape"] for r in result["spec"]] == ["shape"]
    (spark,) = [r for r in result["decode"] if r["engine"] == "sparkrelay"]
    assert spark["greedy_agreement"] == 1.0  # the same dummy weights in both engines


@pytest.mark.slow  # ~17 s: the roofline tool twice; its one-run files: test_roofline_run_writes_consistent_files
def test_roofline_resume_keeps_finished_rows(tiny_pair, tmp_path, monkeypatch):
    import torch

    from sparkrelay.tools.bench import roofline

    target, _ = tiny_pair
    out = tmp_path / "results"
    flags = [
        "--config",
        str(target),
        "--pair",
        "",
        "--dtypes",
        "float32",
        "--batches",
        "1",
        "--new-tokens",
        "4",
        "--prompt-len",
        "8",
        "--prefill-len",
        "0",
        "--repeats",
        "1",
        "--spec-prompts",
        "1",
        "--threads",
        "1",
        "--out",
        str(out),
    ]
    threads = torch.get_num_threads()
    try:
        first = roofline.main(flags)
        assert first["done"] == [[Path(target).name, "float32"]] and len(first["decode"]) == 2

        def refuse(*a, **k):
            raise AssertionError("a finished (shape, dtype) was measured again")

        monkeypatch.setattr(roofline, "SparkrelayEngine", refuse)
        again = roofline.main(flags + ["--resume"])
        with pytest.raises(SystemExit, match="other settings .*batches"):
            roofline.main(flags[:7] + ["2"] + flags[8:] + ["--resume"])
    finally:
        torch.set_num_threads(threads)
    assert again["decode"] == first["decode"] and again["done"] == first["done"]
    assert len(again["load"]["resumed"]) == 1 and again["load"]["resumed"][0]["bandwidth_gb_s"] > 0
    assert "Resumed (--resume) at" in (out / "roofline.md").read_text()
