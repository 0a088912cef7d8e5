"""The prefix (radix) cache on a multi-turn workload: each deployment with the cache and with
--disable-radix-cache.

    python -m sparkrelay.tools.bench.prefix_cache [--conversations 4] [--turns 3]
                                                  [--shared-prefix-len 1024] [--user-len 64]
                                                  [--output-len 32] [--out benchmarks/results]

Every deployment is started through the real entry point (sparkrelay.tools.cluster) and driven by
bench_serving's `--dataset multiturn` (sglang backend, greedy, EOS ignored, one request at a time so
TTFT is not queueing): the conversations share a system part of --shared-prefix-len tokens; turn t +
1's prompt is turn t's prompt, its answer and a new user message. Deployments: the bundled pair,
aggregated DSpark, and PD (PP=2 prefill without a drafter, DSpark decode, sparkrelay's router) in
each handoff mode; "no cache" is --disable-radix-cache on every server.

Figures per deployment and turn: mean TTFT, cached prompt tokens (meta_info.cached_tokens: the
decode's, under PD), handoff bytes per request (PD: meta_info.handoff_bytes), and per request the
output ids and DSpark's acceptance (spec_verify_ct, spec_accept_length). The verdict: PASS when
every run's outputs equal the aggregated uncached run's, aggregated, `hidden` and `draft-kv` give
its acceptance per request too, and the cache hit where it should (every turn after the first found
its history cached); the TTFT and handoff-bytes ratios are reported, not asserted. Writes
<out>/bench_prefix_cache.{json,md,png}; exit status 1 on a FAIL verdict.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
from pathlib import Path
from typing import Optional

from sparkrelay.tools import cluster
from sparkrelay.tools.bench import common as bc
from sparkrelay.tools.bench import serving

NAME = "bench_prefix_cache"
MODEL, DRAFTER = "models/tiny-qwen3", "models/tiny-qwen3-dspark"
DSPARK = ["--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", DRAFTER]
DEPLOYMENTS = {
    "aggregated DSpark": None,
    "PD hidden": "hidden",
    "PD draft-kv": "draft-kv",
    "PD tail": "tail",
}
CACHE = {"cache": [], "no cache": ["--disable-radix-cache"]}
REFERENCE = ("aggregated DSpark", "no cache")  # what every run's tokens must equal


def start(name: str, mode: Optional[str], flags: list[str], work: Path):
    """(url, stop) of a deployment: one aggregated server, or a PD pair behind the router."""
    if mode is None:
        port = cluster.free_port()
        server = cluster.start(
            name.replace(" ", "-"),
            cluster.server_argv(MODEL, port, DSPARK + flags),
            port,
            str(work),
        )
        return server.url, server.stop
    pd = cluster.start_pd(
        cluster.PDSettings(
            model=MODEL,
            drafter=DRAFTER,
            pp_size=2,
            handoff=mode,
            router="sparkrelay",
            prefill_args=flags,
            decode_args=flags,
        ),
        str(work),
    )
    return pd.url, pd.stop


def run_one(
    args: argparse.Namespace, name: str, mode: Optional[str], flags: list[str], work: Path
) -> list[dict]:
    """bench_serving's per-request records of one deployment."""
    url, stop = start(name, mode, flags, work)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            result = serving.main(
                [
                    "--backend",
                    "sglang",
                    "--base-url",
                    url,
                    "--dataset",
                    "multiturn",
                    "--num-prompts",
                    str(args.conversations),
                    "--multiturn-turns",
                    str(args.turns),
                    "--shared-prefix-len",
                    str(args.shared_prefix_len),
                    "--random-input-len",
                    str(args.user_len),
                    "--max-new-tokens",
                    str(args.output_len),
                    "--max-concurrency",
                    "1",
                    "--disable-tqdm",
                    "--tokenizer",
                    MODEL,
                ]
            )
    finally:
        stop()
    return result["records"]


def turn_rows(deployment: str, cache: str, records: list[dict], turns: int) -> list[dict]:
    rows = []
    for t in range(turns):
        recs = [r for r in records if r["turn"] == t and r["success"]]
        rows.append(
            {
                "deployment": deployment,
                "cache": cache,
                "turn": t + 1,
                "requests": len(recs),
                "prompt_tokens": bc.mean([r["prompt_tokens"] for r in recs]),
                "cached_tokens": bc.mean([r["cached_tokens"] or 0 for r in recs]),
                "ttft_ms": bc.mean([r["ttft"] * 1000 for r in recs]),
                "handoff_kib": bc.mean(
                    [r["handoff_bytes"] / 1024 for r in recs if r["handoff_bytes"]]
                ),
                "accept_length": bc.mean(
                    [r["spec_accept_length"] for r in recs if r["spec_accept_length"]]
                ),
            }
        )
    return rows


def compare(deployment: str, cache: str, got: list[dict], ref: list[dict]) -> list[str]:
    """What differs between a run and the aggregated uncached one (empty: nothing); `tail`
    acceptance may differ."""
    problems, exact = [], not deployment.endswith("tail")
    for a, b in zip(got, ref):
        where = f"{deployment}, {cache}, conversation {a['conversation']} turn {a['turn'] + 1}"
        if not (a["success"] and b["success"]):
            problems.append(f"{where}: a request failed ({a['error'] or b['error']})")
        elif a["output_ids"] != b["output_ids"]:
            problems.append(f"{where}: the outputs differ from aggregated")
        elif exact and (a["spec_verify_ct"], a["spec_accept_length"]) != (
            b["spec_verify_ct"],
            b["spec_accept_length"],
        ):
            problems.append(
                f"{where}: acceptance differs ({a['spec_verify_ct']} rounds, {a['spec_accept_length']}; "
                f"aggregated without the cache {b['spec_verify_ct']}, {b['spec_accept_length']})"
            )
        elif cache == "cache" and a["turn"] > 0 and not a["cached_tokens"]:
            problems.append(f"{where}: nothing was found in the cache")
        elif cache == "no cache" and a["cached_tokens"]:
            problems.append(f"{where}: --disable-radix-cache still reported cached tokens")
    return problems


def table(rows: list[dict]) -> str:
    headers = [
        "deployment",
        "cache",
        "turn",
        "prompt tokens",
        "cached tokens",
        "TTFT ms",
        "handoff KiB/request",
        "accept len",
    ]
    return bc.markdown_table(
        headers,
        [
            [
                r["deployment"],
                r["cache"],
                r["turn"],
                r["prompt_tokens"],
                r["cached_tokens"],
                r["ttft_ms"],
                r["handoff_kib"],
                r["accept_length"],
            ]
            for r in rows
        ],
    )


def ratios(rows: list[dict], key: str) -> dict[str, dict[int, float]]:
    """Per deployment and turn: the uncached run's `key` / the cached run's."""
    out: dict[str, dict[int, float]] = {}
    for r in rows:
        if r["cache"] == "cache":
            off = next(
                x
                for x in rows
                if x["deployment"] == r["deployment"]
                and x["turn"] == r["turn"]
                and x["cache"] == "no cache"
            )
            out.setdefault(r["deployment"], {})[r["turn"]] = off[key] / r[key]
    return out


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m sparkrelay.tools.bench.prefix_cache", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--shared-prefix-len", type=int, default=1024)
    ap.add_argument("--user-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    bc.require_positive(
        ap, args, ("conversations", "turns", "shared_prefix_len", "user_len", "output_len")
    )
    return args


def run_all(args: argparse.Namespace) -> tuple[list[dict], list[str], dict]:
    """Every deployment with the cache and without: (per-turn rows, problems against the
    reference, per-request records)."""
    rows, problems, records = [], [], {}
    with tempfile.TemporaryDirectory(prefix="bench-prefix-") as tmp:
        for deployment, mode in DEPLOYMENTS.items():
            records[deployment] = {}
            # "no cache" first: the aggregated one is the reference
            for cache, flags in reversed(CACHE.items()):
                got = run_one(args, f"{deployment} {cache}", mode, flags, Path(tmp))
                records[deployment][cache] = got
                rows += turn_rows(deployment, cache, got, args.turns)
                problems += compare(deployment, cache, got, records[REFERENCE[0]][REFERENCE[1]])
                print(f"{deployment}, {cache}: done", file=sys.stderr)
    return rows, problems, records


def per_turn(label: str, ratios_by_deployment: dict) -> str:
    return f"{label}: " + "; ".join(
        f"{d}: " + ", ".join(f"turn {t} {x:.2f}x" for t, x in v.items())
        for d, v in ratios_by_deployment.items()
    )


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    record = bc.provenance("sparkrelay.tools.bench.prefix_cache", argv)
    rows, problems, records = run_all(args)
    speedup = ratios(rows, "ttft_ms")
    bytes_down = ratios([r for r in rows if r["deployment"] != REFERENCE[0]], "handoff_kib")
    verdict = (
        "Verdict: PASS (every run gave the aggregated uncached tokens, aggregated, hidden and draft-kv its "
        "per-request acceptance, with the cache and without; every later turn found its history cached)"
        if not problems
        else "Verdict: FAIL: " + "; ".join(problems[:8])
    )
    head = [
        *bc.header_lines(record),
        f"Bundled pair (`{MODEL}` + `{DRAFTER}`), float32, cpu; {args.conversations} conversations x "
        f"{args.turns} turns, a shared system part of {args.shared_prefix_len} tokens, {args.user_len}-token user "
        f"messages, {args.output_len} new tokens per turn, greedy, one request at a time.",
        per_turn("TTFT without the cache / with it, per turn", speedup),
        per_turn("Handoff bytes per request without the cache / with it, per turn", bytes_down),
    ]
    summary = {"ttft_speedup": speedup, "handoff_bytes_down": bytes_down, "problems": problems}
    files = write_files(args, record, head, rows, [verdict], summary | {"records": records})
    print("\n".join(head) + "\n\n" + table(rows) + f"\n\n{verdict}\nwrote {files}")
    return 0 if not problems else 1


def write_files(
    args: argparse.Namespace,
    record: dict,
    head: list[str],
    rows: list[dict],
    tail: list[str],
    extra: dict,
) -> str:
    """The table (.md), everything (.json) and the TTFT bars (.png) under --out; -> their names."""
    out = Path(args.out)
    md = bc.write_markdown(
        out / f"{NAME}.md", "Prefix (radix) cache, multi-turn", head, table(rows), tail
    )
    js = bc.write_json(
        out / f"{NAME}.json", {"settings": vars(args), **record, "rows": rows, **extra}
    )
    series = {
        f"{r['deployment']}, {r['cache']}": [
            x["ttft_ms"]
            for x in rows
            if x["deployment"] == r["deployment"] and x["cache"] == r["cache"]
        ]
        for r in rows
    }
    png = bc.bar_chart(
        out / f"{NAME}.png",
        [f"turn {t + 1}" for t in range(args.turns)],
        series,
        "Mean TTFT per turn",
        "ms",
    )
    return f"{md}, {js}, {png}"


if __name__ == "__main__":
    raise SystemExit(main())
