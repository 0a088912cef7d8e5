"""PD vs aggregated DSpark on the bundled pair: TTFT, decode throughput, acceptance length and
handoff bytes per request for each handoff mode over prompt lengths, and `tail`'s acceptance as a
function of the tail length.

    python -m sparkrelay.tools.bench.pd [--lengths 32,128,512,1024,2048] [--per-length 8] [--pp-size
                                  2] [--backends zmq[,mooncake,nixl]] [--tails 1,2,4,8,16,64,256]
                                  [--out benchmarks/results] [--name bench_pd]

Every deployment is started through the real entry points (sparkrelay.tools.cluster); requests go
one at a time (streamed /generate, greedy) so TTFT and acceptance are not mixed with queueing. The
aggregated server stays up for the whole run and answers every prompt right beside each PD
deployment's request for it (which goes first alternates; its prefix cache flushed before, as a
fresh PD deployment has never seen the prompt), so each PD figure is compared with aggregated
figures taken in the same seconds: this host's speed drifts by tens of percent over minutes, and a
run that measured the aggregated server first, alone, compared its fastest minute with PD's later
ones. The tails section measures each tail length alone. Writes bench_pd.json, bench_pd.md and
bench_pd.png. Ends with a verdict; exit status 1 if a PD mode's greedy tokens differ from the
aggregated server's, `hidden` or `draft-kv` accepts differently, or two tail lengths give different
tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from sparkrelay.tools.bench import breakdown
from sparkrelay.tools.bench import common as bc
from sparkrelay.tools.bench.breakdown import mean_breakdown, request_breakdown
from sparkrelay.tools.cluster import (
    PDCluster,
    PDSettings,
    free_port,
    handoff_bytes,
    server_argv,
    start,
    start_pd,
    stream_generate,
)
from sparkrelay.tools.corpus import read_texts, stdlib_files
from sparkrelay.trace import timeline

MODEL, DRAFTER = "models/tiny-qwen3", "models/tiny-qwen3-dspark"


def prompts_by_length(lengths: list[int], per_length: int) -> dict[int, list[list[int]]]:
    from transformers import AutoTokenizer

    text = "\n".join(read_texts(stdlib_files()[1]))[:2_000_000]
    ids = AutoTokenizer.from_pretrained(MODEL).encode(text)
    need = per_length * sum(lengths)
    if need > len(ids):
        raise SystemExit(
            f"bench_pd: --per-length {per_length} x --lengths needs {need:,} prompt tokens; the held-out "
            f"corpus has {len(ids):,}"
        )
    out, offset = {}, 0
    for n in lengths:
        out[n] = []
        for _ in range(per_length):
            out[n].append(ids[offset : offset + n])
            offset += n
    return out


@contextmanager
def traced(log_dir: str) -> Iterator[str]:
    """SPARKRELAY_TRACE for the processes started inside (they inherit this environment): -> the trace folder."""
    folder = tempfile.mkdtemp(prefix="trace-", dir=log_dir)
    os.environ[timeline.ENV] = folder
    try:
        yield folder
    finally:
        del os.environ[timeline.ENV]


def flush_cache(url: str, wait_s: float = 5.0) -> None:
    """POST /flush_cache: the server's next request computes the whole prompt again. A 400 means a
    request is still in flight (the last one's stream has ended at the client, the engine may not
    have let it go yet): try again."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with urllib.request.urlopen(
                urllib.request.Request(url + "/flush_cache", data=b"", method="POST"), timeout=30
            ):
                return
        except urllib.error.HTTPError as e:
            if e.code != 400 or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def warm_up(url: str, prompts: dict) -> None:
    """One short request (and the router's first connections); its prompt, reversed, is none of the
    measured ones, so no measured prompt finds its prefix cached."""
    stream_generate(url, prompts[min(prompts)][0][::-1], 4)


def summary(
    name: str, n: int, runs: list[dict], trace: Optional[str], sent: tuple[float, float] = (0, 0)
) -> dict:
    """One table row: the means over `runs` (stream_generate's records) of `n`-token prompts, and
    each request's TTFT (ttfts_s, in order); sent: bytes the decode received per request (all, of
    which DSpark context + metadata rows)."""
    events = timeline.read(trace) if trace else []
    return {
        "deployment": name,
        "prompt_len": n,
        "handoff_bytes": sent[0],
        "context_bytes": sent[1],
        **{
            k: sum(r[k] for r in runs) / len(runs)
            for k in ("ttft_s", "decode_tok_s", "accept_length")
        },
        "ttfts_s": [r["ttft_s"] for r in runs],
        "breakdown": mean_breakdown(
            [request_breakdown(events, r["t_send"], r["t_first"]) for r in runs]
        ),
        "outputs": [r["output_ids"] for r in runs],
    }


def printed(row: dict) -> dict:
    print(json.dumps({k: v for k, v in row.items() if k not in ("outputs", "paired")}), flush=True)
    return row


def run_deployment(
    name: str,
    url: str,
    decode_url: str | None,
    prompts: dict,
    max_new: int,
    trace: Optional[str] = None,
) -> list[dict]:
    """A deployment alone: each group's prompts one after another."""
    warm_up(url, prompts)
    rows = []
    for n, group in prompts.items():
        before = handoff_bytes(decode_url) if decode_url else (0, 0)
        runs = [stream_generate(url, p, max_new) for p in group]
        after = handoff_bytes(decode_url) if decode_url else (0, 0)
        rows.append(printed(summary(name, n, runs, trace, per_request(before, after, len(group)))))
    return rows


def per_request(before: tuple[int, int], after: tuple[int, int], count: int) -> tuple[float, float]:
    return (after[0] - before[0]) / count, (after[1] - before[1]) / count


@dataclass
class Aggregated:
    """The aggregated server, up for the whole run; `runs[n]`: its records for n-token prompts, over
    every pairing."""

    url: str
    trace: str
    runs: dict = field(default_factory=dict)


def run_paired(
    name: str, cluster: PDCluster, agg: Aggregated, prompts: dict, max_new: int, trace: str
) -> list[dict]:
    """A PD deployment measured beside the aggregated server: for every prompt, one request to each,
    back to back (which one goes first alternates; the aggregated server's cache is flushed first,
    as the fresh PD deployment has never seen the prompt). Each PD row carries the aggregated
    figures of the same rounds ("paired")."""
    warm_up(cluster.url, prompts)
    rows = []
    for n, group in prompts.items():
        before = handoff_bytes(cluster.decode.url)
        mine, theirs = [], []
        for i, p in enumerate(group):
            flush_cache(agg.url)
            turns = [(mine, cluster.url), (theirs, agg.url)]
            for runs, url in turns if i % 2 else turns[::-1]:
                runs.append(stream_generate(url, p, max_new))
        after = handoff_bytes(cluster.decode.url)
        agg.runs.setdefault(n, []).extend(theirs)
        row = summary(name, n, mine, trace, per_request(before, after, len(group)))
        row["paired"] = {
            k: v
            for k, v in summary("aggregated", n, theirs, None).items()
            if k in ("ttft_s", "ttfts_s", "decode_tok_s", "accept_length", "outputs")
        }
        rows.append(printed(row))
    return rows


def bench_modes(args, prompts: dict, log_dir: str) -> list[dict]:
    """The aggregated rows (every request it served beside any PD deployment, pooled), then every PD
    row."""
    port = free_port()
    with traced(log_dir) as trace:
        server = start(
            "aggregated",
            server_argv(
                MODEL,
                port,
                ["--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", DRAFTER],
            ),
            port,
            log_dir,
        )
    agg, rows = Aggregated(server.url, trace), []
    try:
        warm_up(agg.url, prompts)
        for backend in args.backends:
            for mode in ("hidden", "draft-kv", "tail"):
                rows += [
                    {**r, "mode": mode, "backend": backend}
                    for r in bench_pd(args, prompts, log_dir, backend, mode, agg)
                ]
    finally:
        server.stop()
    return [summary("aggregated", n, agg.runs[n], agg.trace) for n in prompts] + rows


def bench_pd(
    args, prompts: dict, log_dir: str, backend: str, mode: str, agg: Aggregated
) -> list[dict]:
    flag = ["--disaggregation-transfer-backend", backend]
    name = f"PD {mode}" if backend == "zmq" else f"PD {mode} ({backend})"
    with traced(log_dir) as trace:
        cluster = start_pd(
            PDSettings(
                model=MODEL,
                drafter=DRAFTER,
                pp_size=args.pp_size,
                handoff=mode,
                prefill_args=flag,
                decode_args=flag,
            ),
            log_dir,
        )
    try:
        return run_paired(name, cluster, agg, prompts, args.max_new_tokens, trace)
    finally:
        cluster.stop()


def bench_tails(args, log_dir: str) -> list[dict]:
    prompts = prompts_by_length([args.tail_prompt_len], args.per_length * 2)
    rows = []
    for tail in args.tails:
        env = {"SPARKRELAY_DSPARK_PD_PREFILL_TAIL_TOKENS": str(tail)}
        cluster = start_pd(
            PDSettings(model=MODEL, drafter=DRAFTER, pp_size=args.pp_size, handoff="tail", env=env),
            log_dir,
        )
        try:
            got = run_deployment(
                f"tail {tail}", cluster.url, cluster.decode.url, prompts, args.max_new_tokens
            )[0]
            rows.append({"tail": tail, **got})
        finally:
            cluster.stop()
    return rows


def verdict(modes: list[dict], tails: list[dict]) -> list[str]:
    """Reasons to fail: a PD mode's greedy tokens differ from the aggregated server's for the same
    prompts (those it answered in the same rounds), `hidden` or `draft-kv` (whose drafter sees the
    whole prompt) accepts differently, or two tail lengths give different tokens for the same
    prompts (the tail changes the drafter's guesses, never the target's answer)."""
    why = []
    for r in modes:
        agg = r.get("paired")
        if agg is None:
            if r.get("mode"):
                why.append(
                    f"{r['deployment']}, {r['prompt_len']}-token prompts: no aggregated answers to compare"
                )
            continue
        if r["outputs"] != agg["outputs"]:
            why.append(
                f"{r['deployment']}, {r['prompt_len']}-token prompts: tokens differ from aggregated"
            )
        full = r.get("mode") in ("hidden", "draft-kv")
        if full and abs(r["accept_length"] - agg["accept_length"]) > 1e-9:
            why.append(
                f"{r['deployment']}, {r['prompt_len']}-token prompts: accept length {r['accept_length']:.3f} "
                f"!= aggregated {agg['accept_length']:.3f}"
            )
    why += [
        f"tail {r['tail']}: tokens differ from tail {tails[0]['tail']}"
        for r in tails[1:]
        if r["outputs"] != tails[0]["outputs"]
    ]
    return why


def against_aggregated(r: dict, median: bool = False) -> str:
    """PD's TTFT against the aggregated server's in the same rounds: the difference and the ratio,
    of the means (or of the medians: one slow request moves a mean of a few by tens of percent on
    this host)."""
    agg = r.get("paired")
    if agg is None or (median and "ttfts_s" not in agg):
        return "-"
    pd_s, agg_s = (
        (statistics.median(r["ttfts_s"]), statistics.median(agg["ttfts_s"]))
        if median
        else (r["ttft_s"], agg["ttft_s"])
    )
    return f"{1000 * (pd_s - agg_s):+.0f} ms, {pd_s / agg_s:.2f}x"


def verdict_line(why: list[str]) -> str:
    if why:
        return "Verdict: FAIL: " + "; ".join(why)
    return (
        "Verdict: PASS (every PD mode gave the aggregated server's greedy tokens, hidden and draft-kv its "
        "acceptance; every tail length the same tokens)"
    )


def write_report(modes: list[dict], tails: list[dict], out: Path, args, record: dict) -> None:
    """<name>.json, .md (headed by `record`, common.provenance), .png and _ttft.png under `out`;
    prints the .md."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(
        json.dumps({"args": vars(args), **record, "modes": modes, "tails": tails}, indent=1)
    )
    lines = [
        *bc.header_lines(record),
        "",
        f"PP={args.pp_size} prefill, {args.per_length} prompts per length, {args.max_new_tokens} new tokens, "
        "greedy, one request at a time, bundled tiny pair on CPU. Each PD request goes back to back with the "
        "aggregated server's answer to the same prompt (which goes first alternates); `aggregated` rows pool "
        "all of those.",
        "",
        "| deployment | prompt len | TTFT ms | aggregated TTFT ms, same rounds | PD against aggregated | "
        "the same, of medians | decode tok/s | accept len | KiB/request: all | of which DSpark context + row |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in modes:
        agg = f"{1000 * r['paired']['ttft_s']:.0f}" if "paired" in r else "-"
        lines.append(
            f"| {r['deployment']} | {r['prompt_len']} | {1000 * r['ttft_s']:.0f} | {agg} | "
            f"{against_aggregated(r)} | {against_aggregated(r, median=True)} | "
            f"{r['decode_tok_s']:.1f} | {r['accept_length']:.2f} | "
            f"{r['handoff_bytes'] / 1024:,.0f} | {r['context_bytes'] / 1024:,.1f} |"
        )
    if tails:  # --skip-tails: no section
        lines += [
            "",
            f"`tail` acceptance vs tail length ({args.tail_prompt_len}-token prompts):",
            "",
            "| tail rows | accept len | metadata row KiB/request |",
            "|---|---|---|",
        ]
        lines += [
            f"| {r['tail']} | {r['accept_length']:.2f} | {r['context_bytes'] / 1024:,.1f} |"
            for r in tails
        ]
    lines += [
        "",
        f"Where the time to first token goes (ms, mean per request; tools/bench/breakdown.py, "
        f"{args.name}_ttft.png):",
        "",
        *breakdown.markdown(modes),
    ]
    lines += ["", verdict_line(verdict(modes, tails))]
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    _plot(modes, tails, out / f"{args.name}.png")
    breakdown.plot(modes, out / f"{args.name}_ttft.png")
    print("\n".join(lines))


def _plot(modes: list[dict], tails: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name in dict.fromkeys(r["deployment"] for r in modes):
        rs = [r for r in modes if r["deployment"] == name]
        x = [r["prompt_len"] for r in rs]
        axes[0].plot(x, [1000 * r["ttft_s"] for r in rs], marker="o", label=name)
        axes[1].plot(x, [r["accept_length"] for r in rs], marker="o", label=name)
    for ax, title in zip(axes[:2], ("TTFT (ms)", "acceptance length")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_title(title)
        ax.legend()
    if tails:
        axes[2].plot([r["tail"] for r in tails], [r["accept_length"] for r in tails], marker="o")
        axes[2].set_xscale("log", base=2)
    axes[2].set_xlabel("tail rows")
    axes[2].set_title("tail: acceptance length")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m sparkrelay.tools.bench.pd", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--lengths", default="32,128,512,1024,2048")
    ap.add_argument("--per-length", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--pp-size", type=int, default=2)
    ap.add_argument("--tails", default="1,2,4,8,16,64,256")
    ap.add_argument("--tail-prompt-len", type=int, default=512)
    ap.add_argument("--skip-tails", action="store_true")
    ap.add_argument(
        "--backends", default="zmq", help="transfer backends, comma-separated (zmq, mooncake, nixl)"
    )
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="bench_pd", help="file name of the report (.json, .md, .png)")
    args = ap.parse_args(argv)
    record = bc.provenance("sparkrelay.tools.bench.pd", argv)
    args.backends = args.backends.split(",")
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.tails = [int(x) for x in args.tails.split(",")]
    with tempfile.TemporaryDirectory() as logs:
        modes = bench_modes(args, prompts_by_length(args.lengths, args.per_length), logs)
        tails = [] if args.skip_tails else bench_tails(args, logs)
    write_report(modes, tails, Path(args.out), args, record)
    return 1 if verdict(modes, tails) else 0  # the verdict line ends the printed report


if __name__ == "__main__":
    sys.exit(main())
