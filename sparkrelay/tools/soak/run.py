"""Soak the PD deployment: router + PP prefill (no drafter) + DSpark decode on 127.0.0.1, under
mixed load.

    python -m sparkrelay.tools.soak [--minutes 11] [--max-requests N] [--concurrency 8] [--pp-size
                              2] [--handoff hidden] [--abort-fraction 0.1] [--stream-fraction 0.5]
                              [--out benchmarks/results/soak.json] [--router sparkrelay|sglang]
                              [--inject-transfer-failures P] [--max-total-tokens N]

A fixed pool of prompts cut from held-out stdlib text (mostly 8-64 tokens, some 500-1500), each with
its own max_new_tokens (8-64), greedy, ignore_eos. Their aggregated DSpark outputs are computed
first, in process, one prompt at a time: those are the references. Then `--concurrency` workers loop
until time or count runs out, each sending a random prompt as /generate or /v1/completions, streamed
or not, and aborting some of them (closing the connection after the first chunk or after a short
random delay). Every completed answer must equal its reference exactly (streamed chunks must be
prefixes of it); anything else is `corrupted`. A non-2xx or a broken body is an error, counted by
type; a request that got no answer at all is `lost`; an abort is neither. /v1/completions gets token
ids as its prompt, or the prompt's text where the router takes only text there (sglang-router);
/generate always gets token ids.

Process memory (VmRSS, each server and its pipeline stage children) is sampled every
`--sample-every` seconds; growth is the last window's mean against the first window's (window: a
minute, or a third of a short run). After the load, the servers must drain to kv_used_tokens == 0.
Exit status 0 (`Verdict: PASS`) only if no request, in the warm-up or the load, ended in an error,
was lost or corrupted, every process grew less than `--max-growth-pct`, both servers drained (and
their idle block-manager check passed), and every server is still alive. `--inject-transfer-failures
P` makes the prefill fail rooms (router retries off) to see the run fail. Writes the JSON (`--out`)
and a markdown table next to it (.md).

This module runs the phases; workload.py builds the prompt pool and its references, load.py sends
the requests, probe.py reads the processes, server states and logs, report.py turns it all into
figures and the verdict.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from sparkrelay.tools.bench.common import provenance
from sparkrelay.tools.cluster import PDCluster, PDSettings, start_pd
from sparkrelay.tools.soak.load import run_load, sample_memory, warm_up
from sparkrelay.tools.soak.probe import drain, log_findings, print_log_tails, snapshot
from sparkrelay.tools.soak.report import latencies, markdown, memory_growth, tally, verdict
from sparkrelay.tools.soak.workload import DRAFTER, MODEL, Prompt, build_pool, compute_references

NO_RETRIES = {"sparkrelay": ["--max-retries", "0"], "sglang": ["--disable-retries"]}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m sparkrelay.tools.soak", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--minutes", type=float, default=11.0, help="Load duration (the count may end it sooner)."
    )
    p.add_argument(
        "--max-requests", type=int, default=100_000, help="Most requests sent during the load."
    )
    p.add_argument(
        "--concurrency", type=int, default=8, help="Workers, each with one request in flight."
    )
    p.add_argument("--pp-size", type=int, default=2)
    p.add_argument("--handoff", default="hidden", choices=("hidden", "draft-kv", "tail"))
    p.add_argument("--router", default="sparkrelay", choices=("sparkrelay", "sglang"))
    p.add_argument("--abort-fraction", type=float, default=0.1)
    p.add_argument("--stream-fraction", type=float, default=0.5)
    p.add_argument(
        "--openai-fraction", type=float, default=0.2, help="Share sent to /v1/completions."
    )
    p.add_argument("--pool-size", type=int, default=32)
    p.add_argument(
        "--long-fraction", type=float, default=0.2, help="Share of pool prompts of 500-1500 tokens."
    )
    p.add_argument(
        "--warmup-requests",
        type=int,
        default=None,
        help="Before the load (default: the pool size).",
    )
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument(
        "--sample-every", type=float, default=30.0, help="Memory sampling period, seconds."
    )
    p.add_argument("--max-growth-pct", type=float, default=10.0)
    p.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        help="Both servers' KV capacity (default: theirs); below the pool's working set the prefix caches "
        "evict under load.",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--keep-logs", action="store_true", help="Keep the server logs even when the run passes."
    )
    p.add_argument(
        "--inject-transfer-failures",
        type=float,
        default=0.0,
        metavar="P",
        help="Check the checker: the prefill fails this share of rooms just before sending "
        "(SPARKRELAY_TEST_DISAGG_FAILURE_PROB) and the router's retries are off, so clients get "
        "errors and the run must end in FAIL.",
    )
    p.add_argument("--out", default="benchmarks/results/soak.json")
    args = p.parse_args(argv)
    for name in (
        "abort_fraction",
        "stream_fraction",
        "openai_fraction",
        "long_fraction",
        "inject_transfer_failures",
    ):
        if not 0 <= getattr(args, name) <= 1:
            p.error(f"--{name.replace('_', '-')} must be in [0, 1]")
    if args.minutes <= 0 or args.max_requests <= 0 or args.concurrency <= 0 or args.pool_size <= 0:
        p.error("--minutes, --max-requests, --concurrency and --pool-size must be positive")
    if Path(args.out).is_dir() or not Path(args.out).parent.is_dir():
        p.error(
            f"--out {args.out}: a JSON file to write in an existing folder (the .md goes next to it)"
        )
    return args


def soak(args, pool: list[Prompt], cluster: PDCluster) -> dict:
    url = cluster.url
    assert url.startswith("http://127.0.0.1:"), url  # loopback only
    warm = asyncio.run(warm_up(url, pool, args))
    print(f"[soak] warm-up: {tally(warm)}", flush=True)
    start_mem = snapshot(cluster)
    seconds = args.minutes * 60
    every = min(args.sample_every, max(0.5, seconds / 12))
    samples: list = []
    sampler = lambda t0, tasks, res: sample_memory(cluster, every, samples, t0, tasks, res)  # noqa: E731
    print(
        f"[soak] load: {args.concurrency} workers for {seconds:.0f} s or {args.max_requests} requests",
        flush=True,
    )
    results, duration = asyncio.run(run_load(url, pool, args, seconds, args.max_requests, sampler))
    drained = drain(cluster)
    end_mem = snapshot(cluster)
    window = min(60.0, duration / 3)
    return {
        "duration_s": duration,
        "warmup": tally(warm),
        "load": tally(results),
        "throughput_rps": sum(r.outcome == "ok" for r in results) / duration,
        "output_tokens_per_s": sum(
            len(pool[r.prompt].ref_ids) for r in results if r.outcome == "ok"
        )
        / duration,
        "latency": latencies(results),
        "drained": drained,
        "memory": {
            "sample_every_s": every,
            "window_s": window,
            "start": start_mem,
            "end": end_mem,
            "growth": memory_growth(samples, window),
            "samples": samples,
        },
        "alive": {s.name: s.proc.poll() is None for s in cluster.servers()},
        "records": [asdict(r) for r in results],
    }


def cluster_settings(args) -> PDSettings:
    s = PDSettings(
        model=MODEL, drafter=DRAFTER, pp_size=args.pp_size, handoff=args.handoff, router=args.router
    )
    # a KV cache below the pool's working set: the prefix caches must evict
    if args.max_total_tokens:
        s.prefill_args += ["--max-total-tokens", str(args.max_total_tokens)]
        s.decode_args += ["--max-total-tokens", str(args.max_total_tokens)]
    if args.inject_transfer_failures:
        s.prefill_env["SPARKRELAY_TEST_DISAGG_FAILURE_PROB"] = str(args.inject_transfer_failures)
        s.router_args += NO_RETRIES[args.router]
    return s


def start_with_references(args, pool: list[Prompt], log_dir: str) -> PDCluster:
    """Starts the deployment while this process computes the references (each takes tens of
    seconds)."""
    t = time.perf_counter()
    print(
        f"[soak] starting the {args.router} router + PP={args.pp_size} prefill + DSpark decode, and computing "
        f"the references of {len(pool)} prompts ({sum(p.long for p in pool)} long) meanwhile ...",
        flush=True,
    )
    with ThreadPoolExecutor(1) as pool_thread:
        refs = pool_thread.submit(compute_references, pool)
        cluster = start_pd(cluster_settings(args), log_dir)
        try:
            refs.result()
        except BaseException:
            cluster.stop()
            raise
    print(
        f"[soak] deployment up and references ready in {time.perf_counter() - t:.0f} s", flush=True
    )
    return cluster


def write_report(report: dict, out: Path) -> None:
    """The JSON, the markdown table next to it (.md); prints the table and the logs' warning/error
    lines."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report) + f"wrote {out} and {out.with_suffix('.md')}")
    for name, found in report["logs"].items():
        if found["matching_lines"]:
            print(
                f"[soak] {name} log: {found['matching_lines']} warning/error lines, e.g.:\n  "
                + "\n  ".join(found["examples"])
            )


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    record = provenance("sparkrelay.tools.soak", argv)
    pool = build_pool(args.pool_size, args.long_fraction, args.seed)
    log_dir = tempfile.mkdtemp(prefix="sparkrelay-soak-")
    cluster = start_with_references(args, pool, log_dir)
    try:
        report = soak(args, pool, cluster)
    except BaseException:
        cluster.stop()
        print_log_tails(cluster)
        raise
    cluster.stop()
    report |= {
        "args": vars(args),
        **record,
        "logs": log_findings(cluster),
        "pool": [{"prompt_tokens": len(p.ids), "max_new_tokens": p.max_new} for p in pool],
    }
    report["failures"] = verdict(report, args.max_growth_pct)
    write_report(report, Path(args.out))
    if report["failures"] or args.keep_logs:
        print_log_tails(cluster)
    else:
        shutil.rmtree(log_dir, ignore_errors=True)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
