"""The soak (sparkrelay/tools/soak/): its pure figures here; a short real run under `-m slow`."""

from __future__ import annotations

import json

import pytest

from sparkrelay.tools.soak import load, probe, workload
from sparkrelay.tools.soak import report as soak_report
from sparkrelay.tools.soak import run as soak


def test_percentile_interpolates_like_numpy():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert soak_report.percentile(xs, 50) == 3.0
    assert soak_report.percentile(xs, 0) == 1.0 and soak_report.percentile(xs, 100) == 5.0
    assert soak_report.percentile(xs, 99) == pytest.approx(4.96)
    assert soak_report.percentile([7.0], 99) == 7.0
    assert soak_report.percentile([], 50) is None


def test_error_type_buckets_mask_numbers_and_keep_first_words():
    a = soak_report.error_type(
        502, "prefill server failed: HTTP 500: room 123456 failed at stage 1 after 3 s, retry"
    )
    b = soak_report.error_type(
        502, "prefill server failed: HTTP 500: room 98 failed at stage 0 after 10 s, retry"
    )
    assert a == b == "HTTP 502: prefill server failed: HTTP N: room N failed at stage N after"
    assert soak_report.error_type(None, "ReadError") == "ReadError"


def test_http_error_message_reads_both_error_shapes():
    openai = json.dumps(
        {"error": {"message": "bad prompt", "type": "BadRequestError", "code": 400}}
    ).encode()
    assert soak_report.http_error_message(openai) == "bad prompt"
    assert (
        soak_report.http_error_message(json.dumps({"detail": "Not Found"}).encode()) == "Not Found"
    )
    assert soak_report.http_error_message(b"<html>oops") == "<html>oops"
    assert soak_report.http_error_message(b"") == "(empty body)"


def test_memory_growth_compares_first_and_last_window_means():
    samples = [
        (0.0, {"a": 100, "b": 50}),
        (30.0, {"a": 100, "b": 50}),
        (60.0, {"a": 110, "b": 50}),
        (600.0, {"a": 110, "b": 60}),
        (630.0, {"a": 120, "b": 60}),
    ]
    g = soak_report.memory_growth(samples, 60.0)
    assert g["a"] == {"first_kib": 100.0, "last_kib": 115.0, "growth_pct": pytest.approx(15.0)}
    assert g["b"]["growth_pct"] == pytest.approx(20.0)
    gone = soak_report.memory_growth([(0.0, {"a": 1, "c": 5}), (100.0, {"a": 1})], 10.0)
    assert gone["c"]["last_kib"] is None and gone["c"]["growth_pct"] is None
    assert soak_report.memory_growth([], 60.0) == {}


def test_verdict_names_every_failure():
    ok = {
        "load": {"corrupted": 0, "lost": 0, "error": 0},
        "warmup": {"corrupted": 0, "lost": 0, "error": 0},
        "memory": {
            "growth": {"decode": {"first_kib": 100.0, "last_kib": 105.0, "growth_pct": 5.0}}
        },
        "drained": {"prefill": {"kv_used_tokens": 0}, "decode": {"kv_used_tokens": 0}},
        "alive": {"prefill": True, "decode": True},
    }
    assert soak_report.verdict(ok, 10.0) == []
    bad = json.loads(json.dumps(ok))
    bad["load"]["lost"] = 1
    bad["memory"]["growth"]["decode"]["growth_pct"] = 12.0
    bad["drained"]["decode"]["kv_used_tokens"] = 16
    bad["alive"]["prefill"] = False
    assert len(soak_report.verdict(bad, 10.0)) == 4


def _clean_report() -> dict:
    return {
        "load": {"sent": 10, "ok": 8, "aborted": 2, "corrupted": 0, "lost": 0, "error": 0},
        "warmup": {"sent": 3, "ok": 3, "aborted": 0, "corrupted": 0, "lost": 0, "error": 0},
        "memory": {"growth": {}},
        "drained": {"decode": {"kv_used_tokens": 0}},
        "alive": {"decode": True},
    }


@pytest.mark.parametrize("phase", ["load", "warmup"])
@pytest.mark.parametrize("outcome", ["error", "lost", "corrupted"])
def test_verdict_fails_on_any_error_lost_or_corrupted_request(phase, outcome):
    report = _clean_report()
    assert soak_report.verdict(report, 10.0) == []  # aborts the soak made itself are not failures
    report[phase][outcome] = 1
    why = soak_report.verdict(report, 10.0)
    assert len(why) == 1 and f"1 {outcome} request" in why[0], why
    report["failures"] = why
    assert soak_report.verdict_line(why).startswith("Verdict: FAIL: ")
    assert soak_report.verdict_line([]).startswith("Verdict: PASS")


def test_prompt_form_sends_text_only_where_the_router_needs_it():
    assert load.prompt_form("sglang", "openai") == "text"
    assert load.prompt_form("sparkrelay", "openai") == "ids"
    assert (
        load.prompt_form("sglang", "generate")
        == load.prompt_form("sparkrelay", "generate")
        == "ids"
    )
    p = workload.Prompt(0, [1, 2, 3], 8, False, "abc")
    assert load._body(p, "openai", False, "text")[1]["prompt"] == "abc"
    path, body = load._body(p, "openai", True, "ids")
    assert (
        path == "/v1/completions"
        and body["prompt"] == [1, 2, 3]
        and body["model"]
        and body["stream"]
    )
    assert load._body(p, "generate", False, "text")[1]["input_ids"] == [1, 2, 3]


def test_pool_text_encodes_to_the_pool_ids():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(workload.MODEL)
    pool = workload.build_pool(6, 0.0, seed=3)
    for p in pool:
        assert p.text and tok.encode(p.text) == p.ids


def test_injection_sets_the_failure_knob_and_turns_retries_off():
    for router in ("sparkrelay", "sglang"):
        s = soak.cluster_settings(
            soak.parse_args(["--router", router, "--inject-transfer-failures", "0.5"])
        )
        assert s.prefill_env == {"SPARKRELAY_TEST_DISAGG_FAILURE_PROB": "0.5"} and s.router_args
    clean = soak.cluster_settings(soak.parse_args([]))
    assert clean.prefill_env == {} and clean.router_args == []
    with pytest.raises(SystemExit):
        soak.parse_args(["--inject-transfer-failures", "1.5"])


def test_out_must_be_a_file_in_an_existing_folder(tmp_path):
    """Refused at start, not after the soak's minutes: a folder, or a file in a folder that does not
    exist."""
    for out in (tmp_path, tmp_path / "missing" / "soak.json"):
        with pytest.raises(SystemExit):
            soak.parse_args(["--out", str(out)])
    assert soak.parse_args(["--out", str(tmp_path / "soak.json")]).out == str(
        tmp_path / "soak.json"
    )


def test_own_process_snapshot_reads_proc(monkeypatch):
    import os

    st = probe._proc_status(os.getpid())
    assert st["rss_kib"] > 0 and st["threads"] >= 1 and st["fds"] >= 3
    assert probe._proc_status(2**22 + 12345) is None  # no such process


@pytest.mark.slow
def test_short_soak_passes(tmp_path):
    out = tmp_path / "soak.json"
    code = soak.main(
        [
            "--minutes",
            "0.5",
            "--concurrency",
            "4",
            "--max-requests",
            "40",
            "--pool-size",
            "8",
            "--out",
            str(out),
        ]
    )
    report = json.loads(out.read_text())
    assert code == 0, report["failures"]
    assert (
        report["load"]["ok"] > 0
        and report["load"]["corrupted"] == 0
        and report["load"]["lost"] == 0
    )
    assert all(st["kv_used_tokens"] == 0 for st in report["drained"].values())
    assert (tmp_path / "soak.md").is_file()


# -- short real runs (default suite): the references are computed once for the module --------------

_REFS: dict = {}
SHORT = ["--minutes", "0.25", "--concurrency", "4", "--pool-size", "6", "--openai-fraction", "0.5"]


@pytest.fixture
def cached_references(monkeypatch):
    real = soak.compute_references

    def compute(pool):
        todo = [p for p in pool if (tuple(p.ids), p.max_new) not in _REFS]
        if todo:
            real(todo)
        for p in todo:
            _REFS[(tuple(p.ids), p.max_new)] = (p.ref_ids, p.ref_text)
        for p in pool:
            p.ref_ids, p.ref_text = _REFS[(tuple(p.ids), p.max_new)]

    monkeypatch.setattr(soak, "compute_references", compute)


@pytest.mark.slow  # ~35 s each; the soak's verdict is unit-tested above, the sglang-router routes in tests/e2e
@pytest.mark.parametrize("router", ["sparkrelay", "sglang"])
def test_short_soak_through_each_router_has_no_errors(router, tmp_path, cached_references, capsys):
    out = tmp_path / "soak.json"
    code = soak.main([*SHORT, "--router", router, "--out", str(out)])
    report = json.loads(out.read_text())
    for phase in ("warmup", "load"):
        t = report[phase]
        assert (t["error"], t["lost"], t["corrupted"]) == (0, 0, 0), (
            phase,
            t["errors_by_type"],
            report["failures"],
        )
    assert code == 0 and report["failures"] == []
    assert report["load"]["ok"] > 0
    # what each router can take on /v1/completions
    form = "openai-text" if router == "sglang" else "openai"
    assert any(k.startswith(form + "/") for k in report["load"]["by_kind"]), report["load"][
        "by_kind"
    ]
    assert "Verdict: PASS" in capsys.readouterr().out


@pytest.mark.slow  # ~26 s: a PD pair failing half its rooms; the verdict's rules are unit-tested above
def test_injected_transfer_failures_make_the_soak_fail(tmp_path, cached_references, capsys):
    out = tmp_path / "soak.json"
    code = soak.main(
        [*SHORT, "--minutes", "0.1", "--inject-transfer-failures", "0.5", "--out", str(out)]
    )
    report = json.loads(out.read_text())
    assert code != 0
    assert report["load"]["error"] + report["warmup"]["error"] > 0
    assert any("error request" in why for why in report["failures"]), report["failures"]
    assert (
        "Verdict: FAIL" in capsys.readouterr().out
        and "Verdict: FAIL" in (tmp_path / "soak.md").read_text()
    )
