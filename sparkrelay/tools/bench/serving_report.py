"""bench_serving's records and figures: one record per request, the summary (throughput, latency
percentiles, errors by type), SGLang's printed report, and the JSON / markdown / PNG outputs."""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from sparkrelay.tools.bench import common as bc


@dataclass
class Record:
    """What one request gave; times in seconds, `start` relative to the start of the benchmark."""

    index: int
    success: bool = False
    error_type: Optional[str] = None
    error: Optional[str] = None
    start: float = 0.0
    prompt_tokens: Optional[int] = None
    output_tokens: int = 0
    ttft: Optional[float] = None
    e2e: Optional[float] = None
    itl: list[float] = field(default_factory=list)
    # tokens per content chunk (estimated for OpenAI)
    chunk_tokens: list[float] = field(default_factory=list)
    spec_verify_ct: Optional[int] = None
    spec_accept_length: Optional[float] = None
    text: str = ""
    cached_tokens: Optional[int] = (
        None  # prompt tokens the server found in its prefix cache (meta_info)
    )
    handoff_bytes: Optional[int] = (
        None  # a sparkrelay PD deployment: the bytes the prefill handed off (meta_info)
    )
    output_ids: list[int] = field(default_factory=list)  # sglang backend
    conversation: int = -1  # multiturn: the item's conversation and turn
    turn: int = 0


def stats_ms(prefix: str, values: list[float]) -> dict:
    ms = [v * 1000 for v in values]
    return {
        f"mean_{prefix}_ms": bc.mean(ms),
        f"median_{prefix}_ms": bc.percentile(ms, 50),
        f"p90_{prefix}_ms": bc.percentile(ms, 90),
        f"p99_{prefix}_ms": bc.percentile(ms, 99),
    }


def summarize(records: list[Record], duration: float, accept: Optional[float]) -> dict:
    ok = [r for r in records if r.success]
    n_in = sum(r.prompt_tokens or 0 for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    errors = Counter(r.error_type for r in records if not r.success)
    examples = {t: next(r.error for r in records if r.error_type == t) for t in errors}
    tpots = [
        (r.e2e - r.ttft) / (r.output_tokens - 1)
        for r in ok
        if r.output_tokens > 1 and r.ttft is not None
    ]
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": {t: {"count": c, "example": examples[t]} for t, c in errors.most_common()},
        "duration_s": duration,
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": bc.rate(len(ok), duration),
        "input_throughput": bc.rate(n_in, duration),
        "output_throughput": bc.rate(n_out, duration),
        "total_throughput": bc.rate(n_in + n_out, duration),
        "concurrency": bc.rate(sum(r.e2e for r in ok), duration),
        "accept_length": accept,
        **stats_ms("e2e_latency", [r.e2e for r in ok]),
        **stats_ms("ttft", [r.ttft for r in ok if r.ttft is not None]),
        **stats_ms("tpot", tpots),
        **stats_ms("itl", [g for r in ok for g in r.itl]),
        **cache_figures(ok),
    }


def cache_figures(ok: list[Record]) -> dict:
    """Prefix cache figures, when the server reports cached tokens: the share of prompt tokens it
    found cached; for multi-turn runs, TTFT and that share per turn."""
    out: dict[str, Any] = {}
    reported = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens]
    if reported:
        out["cache_hit_rate"] = sum(r.cached_tokens for r in reported) / sum(
            r.prompt_tokens for r in reported
        )
    turns = sorted({r.turn for r in ok if r.conversation >= 0})
    for t in turns:
        rows = [r for r in ok if r.conversation >= 0 and r.turn == t]
        out[f"turn{t}"] = {
            "requests": len(rows),
            "prompt_tokens": bc.mean([r.prompt_tokens or 0 for r in rows]),
            **stats_ms("ttft", [r.ttft for r in rows if r.ttft is not None]),
            "cached_tokens": bc.mean([r.cached_tokens or 0 for r in rows]),
            "handoff_bytes": bc.mean(
                [r.handoff_bytes for r in rows if r.handoff_bytes is not None]
            ),
        }
    return out


def accept_length(
    records: list[Record], before: Optional[dict], after: Optional[dict]
) -> Optional[float]:
    rounds = [
        (
            r.spec_verify_ct,
            r.output_tokens / r.spec_verify_ct
            if r.spec_accept_length is None
            else r.spec_accept_length,
        )
        for r in records
        if r.success and r.spec_verify_ct
    ]
    if rounds:  # per request (sglang meta_info; SGLang itself reports only spec_verify_ct), weighted by rounds
        return sum(ct * tau for ct, tau in rounds) / sum(ct for ct, _ in rounds)
    if after is None:
        return None
    if before and before["rounds"] is not None and after["rounds"] is not None:
        d = after["rounds"] - before["rounds"]  # server-wide average over this run only
        committed = (
            after["rounds"] * after["accept_length"] - before["rounds"] * before["accept_length"]
        )
        return committed / d if d else None
    return after["accept_length"]


def report_lines(s: dict, args: argparse.Namespace) -> list[str]:
    def row(name: str, value: Any, digits: int = 2) -> str:
        return f"{name:<40} {bc.fmt(value, digits):<10}"

    def block(title: str, key: str, label: str) -> list[str]:
        return [f"{title:-^50}"] + [
            row(f"{w} {label} (ms):", s[f"{k}_{key}_ms"])
            for w, k in (("Mean", "mean"), ("Median", "median"), ("P99", "p99"))
        ]

    lines = [
        "{:=^50}".format(" Serving Benchmark Result "),
        row("Backend:", args.backend),
        row("Traffic request rate:", args.request_rate),
        row("Max request concurrency:", args.max_concurrency or "not set"),
        row("Successful requests:", s["completed"]),
        row("Failed requests:", s["failed"]),
    ]
    lines += [
        row(f"  {t}:", e["count"]) + f" e.g. {e['example'][:120]}" for t, e in s["errors"].items()
    ]
    lines += [
        row("Benchmark duration (s):", s["duration_s"]),
        row("Total input tokens:", s["total_input_tokens"]),
        row("Total generated tokens:", s["total_output_tokens"]),
        row("Request throughput (req/s):", s["request_throughput"]),
        row("Input token throughput (tok/s):", s["input_throughput"]),
        row("Output token throughput (tok/s):", s["output_throughput"]),
        row("Total token throughput (tok/s):", s["total_throughput"]),
        row("Concurrency:", s["concurrency"]),
        row("Accept length:", s["accept_length"]),
    ]
    lines += block("End-to-End Latency", "e2e_latency", "E2E Latency") + block(
        "Time to First Token", "ttft", "TTFT"
    )
    lines += block("Time per Output Token (excl. 1st token)", "tpot", "TPOT")
    lines += block("Inter-Token Latency", "itl", "ITL")
    if "cache_hit_rate" in s:
        lines += [
            f"{'Prefix Cache':-^50}",
            row("Cached prompt tokens / prompt tokens:", s["cache_hit_rate"], 3),
        ]
    turns = sorted(k for k in s if k.startswith("turn"))
    lines += [
        row(f"{t.capitalize()}: mean TTFT (ms), cached tokens:", s[t]["mean_ttft_ms"])
        + f" {bc.fmt(s[t]['cached_tokens'], 0)} of {bc.fmt(s[t]['prompt_tokens'], 0)}"
        for t in turns
    ]
    return lines + ["=" * 50]


def verdict_line(s: dict) -> str:
    """PASS only when every request completed: a benchmark that lost requests measured a different
    load."""
    total = s["completed"] + s["failed"]
    if not s["failed"] and total:
        return f"Verdict: PASS (all {total} requests completed)"
    kinds = ", ".join(f"{t}: {e['count']}" for t, e in s["errors"].items())
    return f"Verdict: FAIL: {s['failed']} of {total} requests failed" + (
        f" ({kinds})" if kinds else ""
    )


def write_outputs(path: Path, result: dict, header: list[str]) -> list[Path]:
    s = result["summary"]
    rows = [
        [k, v if isinstance(v, (int, float)) or v is None else str(v)]
        for k, v in s.items()
        if k != "errors"
    ]
    rows += [[f"errors: {t}", e["count"]] for t, e in s["errors"].items()]
    md = bc.write_markdown(
        path.with_suffix(".md"),
        "Serving benchmark",
        header,
        bc.markdown_table(["figure", "value"], rows),
    )
    kinds = ("ttft", "itl", "tpot")
    png = bc.bar_chart(
        path.with_suffix(".png"),
        [k.upper() for k in kinds],
        {w: [s[f"{w}_{k}_ms"] for k in kinds] for w in ("mean", "median", "p99")},
        title=f"{result['settings']['backend']} {result['model']}: latency",
        ylabel="ms",
    )
    return [bc.write_json(path, result), md, png]
