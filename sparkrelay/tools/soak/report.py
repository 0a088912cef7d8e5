"""The soak's figures and report (sparkrelay/tools/soak/run.py): per-request results, percentiles,
error buckets, memory growth between the first and last window, the pass/fail verdict and the
markdown table. Pure functions."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Optional

from sparkrelay.tools.bench.common import header_lines


@dataclass
class Result:
    """One request. outcome: ok | corrupted | aborted | error | lost; `kind` is e.g.
    'generate/stream'."""

    kind: str
    prompt: int
    long: bool
    start: float
    outcome: str = "lost"
    error_type: str = ""
    detail: str = ""
    e2e: Optional[float] = None
    ttft: Optional[float] = None


def percentile(values: list[float], q: float) -> Optional[float]:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def error_type(status: Optional[int], message: str) -> str:
    """A stable bucket: `HTTP 503: first words` (numbers masked), or the message alone when there is
    no status."""
    msg = re.sub(r"\d+", "N", " ".join(str(message).split()[:12]))
    return f"HTTP {status}: {msg}" if status is not None else msg


def http_error_message(raw: bytes) -> str:
    try:
        obj = json.loads(raw)
        err = obj.get("error", obj.get("detail", obj))
        return str(err.get("message", err) if isinstance(err, dict) else err)
    except (ValueError, AttributeError):
        return raw.decode("utf-8", "replace")[:200] or "(empty body)"


def memory_growth(samples: list[tuple[float, dict[str, int]]], window_s: float) -> dict[str, dict]:
    """Per process: mean RSS (KiB) over samples with t < first + window and over t > last - window,
    and growth %. A process missing from the last window has last_kib None (it exited)."""
    if not samples:
        return {}
    t0, t1 = samples[0][0], samples[-1][0]
    first = [s for t, s in samples if t < t0 + window_s]
    last = [s for t, s in samples if t > t1 - window_s]
    out = {}
    for name in dict.fromkeys(n for _, s in samples for n in s):
        a = [s[name] for s in first if name in s]
        b = [s[name] for s in last if name in s]
        fa = sum(a) / len(a) if a else None
        fb = sum(b) / len(b) if b else None
        growth = 100.0 * (fb - fa) / fa if fa and fb is not None else None
        out[name] = {"first_kib": fa, "last_kib": fb, "growth_pct": growth}
    return out


def tally(results: list[Result]) -> dict:
    out = {"sent": len(results)}
    for k in ("ok", "corrupted", "aborted", "error", "lost"):
        out[k] = sum(r.outcome == k for r in results)
    out["completed"] = out["ok"] + out["corrupted"]
    bad = {}
    for r in results:
        if r.outcome in ("error", "lost"):
            key = f"{r.outcome}: {r.error_type}"
            bad[key] = bad.get(key, 0) + 1
    out["errors_by_type"] = dict(sorted(bad.items(), key=lambda kv: -kv[1]))
    out["by_kind"] = {
        k: sum(r.kind == k for r in results) for k in sorted({r.kind for r in results})
    }
    out["corrupted_examples"] = [r.detail for r in results if r.outcome == "corrupted"][:5]
    return out


def latencies(results: list[Result]) -> dict:
    ok = [r for r in results if r.outcome == "ok"]
    rows = {
        "all": ok,
        "short prompts": [r for r in ok if not r.long],
        "long prompts": [r for r in ok if r.long],
    }
    out = {
        name: {
            "n": len(rs),
            "e2e_p50_s": percentile([r.e2e for r in rs], 50),
            "e2e_p99_s": percentile([r.e2e for r in rs], 99),
        }
        for name, rs in rows.items()
    }
    ttft = [r.ttft for r in ok if r.ttft is not None]
    out["streamed TTFT"] = {
        "n": len(ttft),
        "p50_s": percentile(ttft, 50),
        "p99_s": percentile(ttft, 99),
    }
    return out


def request_failures(t: dict, phase: str) -> list[str]:
    """Reasons from one phase's tally: any error, lost or corrupted request fails the run. An abort
    the soak itself made is none of these."""
    return [
        f"{phase}: {t[k]} {k} request{'s' if t[k] != 1 else ''}"
        for k in ("error", "lost", "corrupted")
        if t[k]
    ]


def verdict(report: dict, max_growth: float) -> list[str]:
    """Reasons the run failed (empty: passed)."""
    why = request_failures(report["warmup"], "warm-up") + request_failures(report["load"], "load")
    for name, m in report["memory"]["growth"].items():
        if m["last_kib"] is None or m["growth_pct"] is None or m["growth_pct"] >= max_growth:
            why.append(f"memory of {name}: {m}")
    for name, st in report["drained"].items():
        if st.get("kv_used_tokens") != 0:
            why.append(f"{name} did not drain: {st}")
        if st.get("check_error"):
            why.append(f"{name}'s idle invariant check failed: {st['check_error']}")
    dead = [n for n, alive in report["alive"].items() if not alive]
    if dead:
        why.append(f"servers exited: {dead}")
    return why


def verdict_line(failures: list[str]) -> str:
    if failures:
        return "Verdict: FAIL: " + "; ".join(failures) + "."
    return (
        "Verdict: PASS (no request ended in an error, was lost or differed from the aggregated output; memory "
        "stayed bounded, both servers drained and stayed up)."
    )


def _f(x, scale=1.0, fmt="{:.0f}") -> str:
    return "-" if x is None else fmt.format(x * scale)


def markdown(report: dict) -> str:
    """The .md: the common header (command, host, commit: common.header_lines), the deployment, then
    the tables."""
    a, t, lat, mem = report["args"], report["load"], report["latency"], report["memory"]
    lines = [
        *header_lines(report),
        "",
        f"Router ({a['router']}) + PP={a['pp_size']} prefill + DSpark decode ({a['handoff']}), concurrency "
        f"{a['concurrency']}, {report['duration_s']:.0f} s of load, pool of {len(report['pool'])} prompts.",
        "",
        "| requests | sent | completed | of which = aggregated | aborted | errors | corrupted | lost | req/s "
        "| output tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| load | {t['sent']} | {t['completed']} | {t['ok']} | {t['aborted']} | {t['error']} | {t['corrupted']} "
        f"| {t['lost']} | {report['throughput_rps']:.2f} | {report['output_tokens_per_s']:.0f} |",
        "",
        "| latency | n | p50 ms | p99 ms |",
        "|---|---|---|---|",
    ]
    for name, v in lat.items():
        p50, p99 = v.get("e2e_p50_s", v.get("p50_s")), v.get("e2e_p99_s", v.get("p99_s"))
        lines.append(f"| {name} | {v['n']} | {_f(p50, 1000)} | {_f(p99, 1000)} |")
    lines += [
        "",
        "| process | RSS MiB at start | first window MiB | last window MiB | growth % | RSS MiB at end "
        "| threads start → end | fds start → end |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, g in mem["growth"].items():
        s, e = mem["start"].get(name, {}), mem["end"].get(name, {})
        lines.append(
            f"| {name} | {_f(s.get('rss_kib'), 1 / 1024)} | {_f(g['first_kib'], 1 / 1024)} | "
            f"{_f(g['last_kib'], 1 / 1024)} | {_f(g['growth_pct'], fmt='{:+.1f}')} | "
            f"{_f(e.get('rss_kib'), 1 / 1024)} | {s.get('threads', '-')} → {e.get('threads', '-')} | "
            f"{s.get('fds', '-')} → {e.get('fds', '-')} |"
        )
    warm = report["warmup"].get("errors_by_type")
    lines += [
        "",
        "Errors by type: "
        + (json.dumps(t["errors_by_type"]) if t["errors_by_type"] else "none")
        + "."
        + (f" In the warm-up: {json.dumps(warm)}." if warm else ""),
        "After draining: "
        + "; ".join(
            f"{n} kv_used_tokens {st.get('kv_used_tokens')}" for n, st in report["drained"].items()
        )
        + ".",
        verdict_line(report["failures"]),
    ]
    return "\n".join(lines) + "\n"
