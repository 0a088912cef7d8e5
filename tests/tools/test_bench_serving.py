"""bench_serving against a real uvicorn server on 127.0.0.1 (tiny random model), both API families;
its figures from synthetic chunks (multi-token chunks, acceptance lengths); clear errors for bad or
unreachable servers."""

from __future__ import annotations

import json

import pytest

from sparkrelay.tools.bench import (
    common as bc,
)
from sparkrelay.tools.bench import (
    serving as bs,
)
from sparkrelay.tools.bench import (
    serving_report as sr,
)
from sparkrelay.tools.bench import (
    serving_requests as sq,
)
from testkit.http import UvicornThread, free_port, make_app

N, OUT, IN = 4, 4, 12
HEADER = "============ Serving Benchmark Result ============"


@pytest.fixture(scope="module")
def server_url(tiny_model_dir):
    app, _ = make_app(tiny_model_dir)
    with UvicornThread(app) as server:
        yield server.url


def run(capsys, *argv) -> tuple[dict, str]:
    result = bs.main([*argv, "--disable-tqdm"])
    return result, capsys.readouterr().out


def check(result: dict, out: str, path, n: int = N) -> dict:
    s = result["summary"]
    assert s["completed"] == n and s["failed"] == 0 and s["errors"] == {}
    # ignore_eos: exactly max_new_tokens each, counted by the server
    assert s["total_output_tokens"] == n * OUT
    assert s["total_input_tokens"] > 0 and s["duration_s"] > 0 and s["output_throughput"] > 0
    assert (
        0 < s["median_ttft_ms"] <= s["p99_ttft_ms"]
        and 0 < s["mean_itl_ms"]
        and 0 < s["mean_tpot_ms"]
    )
    assert s["median_e2e_latency_ms"] >= s["median_ttft_ms"] and s["accept_length"] is None
    for line in (
        HEADER,
        "Successful requests:",
        "Mean TTFT (ms):",
        "P99 ITL (ms):",
        "Median E2E Latency (ms):",
    ):
        assert line in out
    saved = json.loads(path.read_text())  # strict JSON: no NaN or Infinity
    assert saved["summary"] == s and len(saved["records"]) == n
    for rec in saved["records"]:
        assert (
            rec["success"]
            and rec["output_tokens"] == OUT
            and len(rec["itl"]) == len(rec["chunk_tokens"]) - 1
        )
        assert rec["ttft"] <= rec["e2e"]
    md = path.with_suffix(".md").read_text()
    assert md.startswith("# Serving benchmark")
    assert (
        saved["command"].startswith("python -m sparkrelay.tools.bench.serving ") and saved["commit"]
    )
    assert md.splitlines()[2:4] == bc.header_lines(saved)  # after the title: command, host, commit
    assert path.with_suffix(".png").stat().st_size > 0
    return saved


def test_sglang_random_ids(server_url, tmp_path, capsys):
    path = tmp_path / "sglang.json"
    result, out = run(
        capsys,
        "--backend",
        "sglang",
        "--base-url",
        server_url,
        "--dataset",
        "random",
        "--num-prompts",
        str(N),
        "--random-input-len",
        str(IN),
        "--max-new-tokens",
        str(OUT),
        "--max-concurrency",
        "2",
        "--output-file",
        str(path),
    )
    saved = check(result, out, path)
    assert saved["summary"]["total_input_tokens"] == N * IN  # token ids sent as they are
    assert (
        saved["settings"]["request_rate"] == "inf"
        and "Max request concurrency:                 2" in out
    )


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_openai_jsonl(server_url, tmp_path, capsys, backend):
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "\n".join(json.dumps({"turns": [t, "second turn"]}) for t in ("def add(a, b):", "Hello"))
    )
    path = tmp_path / f"{backend}.json"
    result, out = run(
        capsys,
        "--backend",
        backend,
        "--base-url",
        server_url,
        "--dataset-path",
        str(data),
        "--num-prompts",
        str(N),
        "--max-new-tokens",
        str(OUT),
        "--request-rate",
        "200",
        "--output-file",
        str(path),
    )
    saved = check(result, out, path)
    assert saved["model"] == saved["settings"]["model"]  # from GET /v1/models


def test_unreachable_server_and_bad_url(capsys):
    for url in (f"http://127.0.0.1:{free_port()}", "127.0.0.1:80", "ftp://127.0.0.1"):
        with pytest.raises(SystemExit) as exc:
            bs.main(["--base-url", url, "--num-prompts", "1", "--disable-tqdm"])
        assert exc.value.code == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "Traceback" not in err, err


def test_failed_requests_are_counted(server_url, tmp_path, capsys):
    # prompts longer than the context: every request fails with HTTP 400
    with pytest.raises(SystemExit) as exc:
        bs.main(
            [
                "--base-url",
                server_url,
                "--num-prompts",
                "2",
                "--random-input-len",
                "400",
                "--max-new-tokens",
                "2",
                "--warmup-requests",
                "0",
                "--disable-tqdm",
                "--output-file",
                str(tmp_path / "f.json"),
            ]
        )
    assert exc.value.code == 1
    summary = json.loads((tmp_path / "f.json").read_text())["summary"]
    assert summary["failed"] == 2 and summary["errors"]["HTTP 400"]["count"] == 2
    assert "HTTP 400:" in capsys.readouterr().out


def test_multi_token_chunks_and_accept_length():
    rec, state = sr.Record(0), {"tokens": 0, "last": 0.0}
    for t, total, tau in (
        (1.0, 1, None),
        (1.3, 4, 2.0),
        (1.5, 6, 2.5),
    ):  # speculative chunks of 3 and 2 tokens
        meta = {"completion_tokens": total, "prompt_tokens": 5}
        if tau:
            meta |= {"spec_verify_ct": total // 2, "spec_accept_length": tau}
        sq.on_chunk(
            rec,
            {"text": "x" * total, "output_ids": [7] * total, "meta_info": meta},
            "sglang",
            t,
            0.5,
            state,
        )
    assert (
        rec.ttft == pytest.approx(0.5)
        and rec.itl == pytest.approx([0.1, 0.1])
        and rec.chunk_tokens == [1, 3, 2]
    )
    other = sr.Record(1, success=True, spec_verify_ct=1, spec_accept_length=4.0)
    rec.success = True  # 3 rounds at 2.5, 1 round at 4.0
    assert sr.accept_length([rec, other], None, None) == pytest.approx((3 * 2.5 + 4.0) / 4)
    assert (
        sr.accept_length(
            [sr.Record(2, success=True, output_tokens=9, spec_verify_ct=3)], None, None
        )
        == 3.0
    )
    before, after = {"rounds": 10, "accept_length": 2.0}, {"rounds": 20, "accept_length": 2.5}
    assert sr.accept_length([], before, after) == pytest.approx(3.0)  # this run's rounds only
    with pytest.raises(RuntimeError, match="boom"):
        sq.on_chunk(rec, {"error": {"message": "boom"}}, "sglang", 2.0, 0.5, state)


def test_openai_chunks_spread_usage_tokens():
    rec, state = sr.Record(0), {"tokens": 0, "last": 0.0}
    for t, piece in ((1.0, "a"), (1.4, ""), (1.6, "bc"), (2.0, "d")):
        sq.on_chunk(
            rec,
            {"choices": [{"delta": {"content": piece}}], "usage": None},
            "openai-chat",
            t,
            0.0,
            state,
        )
    sq.on_chunk(
        rec,
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 6}},
        "openai-chat",
        2.1,
        0.0,
        state,
    )
    sq.finish_openai(rec, state)
    assert (
        rec.text == "abcd" and rec.prompt_tokens == 3 and rec.output_tokens == 6 and rec.ttft == 1.0
    )
    assert rec.chunk_tokens == [2.0, 2.0, 2.0] and rec.itl == pytest.approx([0.3, 0.2])
