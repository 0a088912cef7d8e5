"""The header every results .md starts with (tools/bench/common.py: provenance, header_lines): the
command that reruns the tool, host, cores, torch, commit and date; and the report writers of
bench_pd, bench_transfer and the soak put it at the top of their .md and record command and commit
in their JSON. Pure functions on given figures."""

from __future__ import annotations

import json
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from sparkrelay.tools.bench import common as bc

REPO = Path(__file__).resolve().parents[2]


def _head() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=REPO,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def test_header_names_the_command_host_cores_torch_commit_and_date():
    import torch

    record = bc.provenance("sparkrelay.tools.bench.quality", ["--out", "a b", "--windows", "2"])
    # shell-quoted
    assert record["command"] == "python -m sparkrelay.tools.bench.quality --out 'a b' --windows 2"
    assert record["commit"].removesuffix("+changes") == _head()
    m = record["machine"]
    command, machine = bc.header_lines(record)
    assert command == f"`{record['command']}`"
    assert machine.startswith(f"Host {m['host']} (") and f"{m['cpu_cores']} cores" in machine
    assert (
        f"torch {torch.__version__}" in machine
        and f"commit {record['commit']}, {m['date']}." in machine
    )


def test_command_defaults_to_this_process_and_masks_keys(monkeypatch):
    monkeypatch.setattr(
        sys, "argv", ["x", "--port", "8000", "--api-key", "s3cret", "--api-key=s3cret"]
    )
    text = bc.command("sparkrelay.tools.bench.serving")
    assert text.startswith("python -m sparkrelay.tools.bench.serving --port 8000 --api-key ")
    assert "s3cret" not in text and text.count("REDACTED") == 2


@pytest.mark.parametrize(
    "error", [FileNotFoundError("git"), subprocess.CalledProcessError(128, "git")]
)
def test_commit_is_unknown_outside_a_git_checkout(monkeypatch, error):
    def run(*args, **kwargs):
        raise error

    monkeypatch.setattr(bc.subprocess, "run", run)
    assert bc.commit() == "unknown"


@pytest.mark.parametrize(
    "status, expected", [("", "abc1234"), (" M engine/engine.py\n", "abc1234+changes")]
)
def test_commit_says_when_the_package_differs_from_it(monkeypatch, status, expected):
    """A figure measured on uncommitted code names its commit with "+changes"."""

    def git(args, cwd):
        assert cwd.name == "sparkrelay"
        out = "abc1234\n" if args[0] == "rev-parse" else status
        return subprocess.CompletedProcess(args, 0, stdout=out, stderr="")

    monkeypatch.setattr(bc, "_git", git)
    assert bc.commit() == expected


def _starts_with_header(md: str, saved: dict, module: str) -> None:
    """The .md's first lines are the header of the run the JSON records (command and commit beside
    machine)."""
    assert (
        saved["command"].startswith(f"python -m {module} ")
        and saved["commit"].removesuffix("+changes") == _head()
    )
    assert md.splitlines()[:2] == bc.header_lines(saved)


def test_bench_pd_report_starts_with_the_header(tmp_path):
    from sparkrelay.tools.bench import pd as bench_pd

    argv = ["--lengths", "32", "--skip-tails", "--out", str(tmp_path)]
    args = Namespace(
        name="bench_pd", pp_size=2, per_length=1, max_new_tokens=4, tail_prompt_len=512
    )
    seg = {
        "to engine": 1.0,
        "queue": 0.0,
        "compute": 5.0,
        "transfer": 1.0,
        "commit": 1.0,
        "to client": 1.0,
    }
    row = {
        "deployment": "aggregated",
        "prompt_len": 32,
        "ttft_s": 0.01,
        "decode_tok_s": 100.0,
        "accept_length": 3.0,
        "handoff_bytes": 0,
        "context_bytes": 0,
        "breakdown": seg,
        "outputs": [[1, 2]],
    }
    bench_pd.write_report(
        [row], [], tmp_path, args, bc.provenance("sparkrelay.tools.bench.pd", argv)
    )
    saved = json.loads((tmp_path / "bench_pd.json").read_text())
    _starts_with_header((tmp_path / "bench_pd.md").read_text(), saved, "sparkrelay.tools.bench.pd")
    assert saved["machine"]["cpu_cores"] and saved["args"]["pp_size"] == 2


def test_bench_transfer_report_starts_with_the_header(tmp_path):
    from sparkrelay.tools.bench import transfer

    row = {
        "backend": "zmq",
        "mib": 1,
        "bytes": 1 << 20,
        "median_s": 0.01,
        "best_s": 0.009,
        "median_gb_s": 0.1,
        "best_gb_s": 0.11,
    }
    record = bc.provenance("sparkrelay.tools.bench.transfer", ["--backends", "zmq"])
    transfer.report([row], tmp_path, Namespace(repeats=1), record)
    saved = json.loads((tmp_path / "transfer.json").read_text())
    _starts_with_header(
        (tmp_path / "transfer.md").read_text(), saved, "sparkrelay.tools.bench.transfer"
    )
    assert saved["rows"] == [row]


def test_soak_markdown_starts_with_the_header():
    from sparkrelay.tools.soak import report as soak_report

    tally = {
        "sent": 2,
        "completed": 2,
        "ok": 2,
        "aborted": 0,
        "error": 0,
        "corrupted": 0,
        "lost": 0,
        "errors_by_type": {},
    }
    report = {
        **bc.provenance("sparkrelay.tools.soak", ["--minutes", "0.1"]),
        "load": tally,
        "warmup": tally,
        "args": {"router": "sparkrelay", "pp_size": 2, "handoff": "hidden", "concurrency": 4},
        "duration_s": 6.0,
        "pool": [{}],
        "throughput_rps": 0.3,
        "output_tokens_per_s": 9.0,
        "latency": {"all": {"n": 2, "e2e_p50_s": 0.1, "e2e_p99_s": 0.2}},
        "memory": {"growth": {}, "start": {}, "end": {}},
        "drained": {"decode": {"kv_used_tokens": 0}},
        "failures": [],
    }
    md = soak_report.markdown(report)
    _starts_with_header(md, report, "sparkrelay.tools.soak")
    assert "Router (sparkrelay) + PP=2 prefill" in md and md.rstrip().endswith(
        soak_report.verdict_line([])
    )
