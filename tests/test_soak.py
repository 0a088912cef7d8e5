"""The soak script (sparkrelay/soak.py): its pure figures here; a short real run under `-m slow`."""

from __future__ import annotations

import json

import pytest

from sparkrelay import soak


def test_percentile_interpolates_like_numpy():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert soak.percentile(xs, 50) == 3.0
    assert soak.percentile(xs, 0) == 1.0 and soak.percentile(xs, 100) == 5.0
    assert soak.percentile(xs, 99) == pytest.approx(4.96)
    assert soak.percentile([7.0], 99) == 7.0
    assert soak.percentile([], 50) is None


def test_error_type_buckets_mask_numbers_and_keep_first_words():
    a = soak.error_type(502, "prefill server failed: HTTP 500: room 123456 failed at stage 1 after 3 s, retry")
    b = soak.error_type(502, "prefill server failed: HTTP 500: room 98 failed at stage 0 after 10 s, retry")
    assert a == b == "HTTP 502: prefill server failed: HTTP N: room N failed at stage N after"
    assert soak.error_type(None, "ReadError") == "ReadError"


def test_http_error_message_reads_both_error_shapes():
    openai = json.dumps({"error": {"message": "bad prompt", "type": "BadRequestError", "code": 400}}).encode()
    assert soak.http_error_message(openai) == "bad prompt"
    assert soak.http_error_message(json.dumps({"detail": "Not Found"}).encode()) == "Not Found"
    assert soak.http_error_message(b"<html>oops") == "<html>oops"
    assert soak.http_error_message(b"") == "(empty body)"


def test_memory_growth_compares_first_and_last_window_means():
    samples = [(0.0, {"a": 100, "b": 50}), (30.0, {"a": 100, "b": 50}), (60.0, {"a": 110, "b": 50}),
               (600.0, {"a": 110, "b": 60}), (630.0, {"a": 120, "b": 60})]
    g = soak.memory_growth(samples, 60.0)
    assert g["a"] == {"first_kib": 100.0, "last_kib": 115.0, "growth_pct": pytest.approx(15.0)}
    assert g["b"]["growth_pct"] == pytest.approx(20.0)
    gone = soak.memory_growth([(0.0, {"a": 1, "c": 5}), (100.0, {"a": 1})], 10.0)
    assert gone["c"]["last_kib"] is None and gone["c"]["growth_pct"] is None
    assert soak.memory_growth([], 60.0) == {}


def test_verdict_names_every_failure():
    ok = {"load": {"corrupted": 0, "lost": 0}, "warmup": {"corrupted": 0, "lost": 0},
          "memory": {"growth": {"decode": {"first_kib": 100.0, "last_kib": 105.0, "growth_pct": 5.0}}},
          "drained": {"prefill": {"kv_used_tokens": 0}, "decode": {"kv_used_tokens": 0}},
          "alive": {"prefill": True, "decode": True}}
    assert soak.verdict(ok, 10.0) == []
    bad = json.loads(json.dumps(ok))
    bad["load"]["lost"] = 1
    bad["memory"]["growth"]["decode"]["growth_pct"] = 12.0
    bad["drained"]["decode"]["kv_used_tokens"] = 16
    bad["alive"]["prefill"] = False
    assert len(soak.verdict(bad, 10.0)) == 4


def test_own_process_snapshot_reads_proc(monkeypatch):
    import os
    st = soak._proc_status(os.getpid())
    assert st["rss_kib"] > 0 and st["threads"] >= 1 and st["fds"] >= 3
    assert soak._proc_status(2 ** 22 + 12345) is None  # no such process


@pytest.mark.slow
def test_short_soak_passes(tmp_path):
    out = tmp_path / "soak.json"
    code = soak.main(["--minutes", "0.5", "--concurrency", "4", "--max-requests", "40", "--pool-size", "8",
                      "--out", str(out)])
    report = json.loads(out.read_text())
    assert code == 0, report["failures"]
    assert report["load"]["ok"] > 0 and report["load"]["corrupted"] == 0 and report["load"]["lost"] == 0
    assert all(st["kv_used_tokens"] == 0 for st in report["drained"].values())
    assert (tmp_path / "soak.md").is_file()
