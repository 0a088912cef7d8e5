"""Served against offline decode speed, one stream at a time: is the HTTP server as fast as the
engine it serves?

For plain decoding and for DSpark (the bundled pair), in one run: the offline engine
(bench.offline's runner, loaded in this process) and a real server (`launch_server`, its own
processes, one request at a time through `bench.serving`, streamed), on the same prompts
(common.load_prompts), greedy, EOS ignored. Both stay up for all of an engine's rounds, and each
round times the offline workload once and the served one once, back to back (odd
rounds: served first), so the two figures of a round are taken seconds apart. Decode tok/s is
    offline  (N x (out - 1)) / (t(out tokens) - t(1 token))         bench.offline's measure, one repeat
    served   sum(out - 1) / sum(E2E - TTFT) over the requests         from bench.serving's per-request records
both with the prefill and the first token taken out, both totals over the N prompts (a median of per-request
rates would weigh DSpark's fast and slow prompts differently). served / offline is the median over the rounds of
each round's ratio: this host's speed drifts by tens of percent over minutes (rounds of one engine ranged 151-249
tok/s in one run), so a ratio of figures taken minutes apart measures the drift as much as the server.

Usage: python -m sparkrelay.tools.bench.served [--num-prompts 4] [--prompt-len 128] [--output-len
256] [--repeats 9] Writes <out-dir>/bench_served.md and .json.
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
from sparkrelay.tools.bench import offline, serving
from sparkrelay.tools.bench.offline_engines import ENGINE_CONFIGS

NAME = "bench_served"
DRAFTER = "models/tiny-qwen3-dspark"
ENGINES = {
    "sparkrelay": [],
    "sparkrelay+dspark": [
        "--speculative-algorithm",
        "DSPARK",
        "--speculative-draft-model-path",
        DRAFTER,
    ],
}


def offline_args(args: argparse.Namespace) -> argparse.Namespace:
    """bench.offline's settings for one timed repeat at batch 1 of this workload."""
    return offline.parse_args(
        [
            "--model-path",
            args.model_path,
            "--engines",
            ",".join(ENGINES),
            "--batch-sizes",
            "1",
            "--num-prompts",
            str(args.num_prompts),
            "--prompt-len",
            str(args.prompt_len),
            "--output-len",
            str(args.output_len),
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--dtype",
            args.dtype,
            "--device",
            args.device,
            "--draft-model-path",
            DRAFTER,
        ]
    )


def served_decode(args: argparse.Namespace, port: int) -> float:
    with contextlib.redirect_stdout(io.StringIO()):  # its report; the figure used is printed below
        result = serving.main(
            [
                "--backend",
                "sglang",
                "--port",
                str(port),
                "--dataset",
                "code",
                "--num-prompts",
                str(args.num_prompts),
                "--random-input-len",
                str(args.prompt_len),
                "--max-new-tokens",
                str(args.output_len),
                "--max-concurrency",
                "1",
                "--disable-tqdm",
                "--tokenizer",
                args.model_path,
            ]
        )
    done = [r for r in result["records"] if r["success"] and r["output_tokens"] > 1]
    if len(done) != args.num_prompts:
        raise RuntimeError(
            f"{args.num_prompts - len(done)} of {args.num_prompts} served requests failed"
        )
    return sum(r["output_tokens"] - 1 for r in done) / sum(r["e2e"] - r["ttft"] for r in done)


def rounds(
    args: argparse.Namespace, engine: str, ids: list[list[int]], work: Path
) -> tuple[list, list]:
    """(offline, served) decode tok/s of each round, the offline runner and the server up
    throughout."""
    oargs = offline_args(args)
    runner = next(e for e in ENGINE_CONFIGS if e.name == engine).load(oargs)
    port = cluster.free_port()
    server = cluster.start(
        engine, cluster.server_argv(args.model_path, port, ENGINES[engine]), port, str(work)
    )
    try:
        runner.generate(ids[:1], args.output_len)  # warm-up, both sides
        served_decode(argparse.Namespace(**{**vars(args), "num_prompts": 1}), port)
        off, srv = [], []
        for r in range(args.repeats):
            sides = [
                lambda: off.append(offline.measure(runner, ids, 1, oargs)["decode_tok_s"]),
                lambda: srv.append(served_decode(args, port)),
            ]
            for side in sides if r % 2 == 0 else sides[::-1]:
                side()
            print(
                f"{engine} round {r + 1}: offline {off[-1]:.1f}, served {srv[-1]:.1f} tok/s, "
                f"{srv[-1] / off[-1]:.3f}x",
                file=sys.stderr,
            )
    finally:
        server.stop()
        runner.close()
    return off, srv


def run(args: argparse.Namespace) -> list[dict]:
    from transformers import AutoTokenizer

    prompts = bc.load_prompts(
        AutoTokenizer.from_pretrained(args.model_path), args.num_prompts, args.prompt_len
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-served-") as tmp:
        for engine in ENGINES:
            offline_tok_s, served_tok_s = rounds(args, engine, [p.ids for p in prompts], Path(tmp))
            ratios = [s / o for s, o in zip(served_tok_s, offline_tok_s)]
            rows.append(
                {
                    "engine": engine,
                    "offline_tok_s": offline_tok_s,
                    "served_tok_s": served_tok_s,
                    "round_ratios": ratios,
                    "offline_median": bc.median(offline_tok_s),
                    "served_median": bc.median(served_tok_s),
                    "ratio": bc.median(ratios),
                }
            )
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| engine | offline decode tok/s | served decode tok/s | served / offline (median of rounds) | "
        "rounds: offline / served tok/s |",
        "|---|---:|---:|---:|---|",
    ]
    for r in rows:
        pairs = ", ".join(f"{o:.0f}/{s:.0f}" for o, s in zip(r["offline_tok_s"], r["served_tok_s"]))
        lines.append(
            f"| {r['engine']} | {r['offline_median']:.1f} | {r['served_median']:.1f} | "
            f"{r['ratio']:.3f}x | {pairs} |"
        )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> list[dict]:
    parser = argparse.ArgumentParser(
        prog="python -m sparkrelay.tools.bench.served", description=__doc__.split("\n")[0]
    )
    bc.add_workload_args(parser)
    parser.set_defaults(num_prompts=4, prompt_len=128, output_len=256, repeats=9)
    args = parser.parse_args(argv)
    bc.require_positive(parser, args, ("num_prompts", "prompt_len", "output_len", "repeats"))
    record = bc.provenance("sparkrelay.tools.bench.served", argv)
    rows = run(args)
    head = [
        *bc.header_lines(record),
        f"Model `{args.model_path}` (DSpark: `{DRAFTER}`), float32, cpu; {args.num_prompts} prompts x "
        f"{args.prompt_len} tokens, {args.output_len} new tokens, greedy, one request at a time; "
        f"{args.repeats} rounds, each timing offline and served back to back; medians.",
    ]
    text = table(rows)
    out = Path(args.out_dir)
    md = bc.write_markdown(
        out / f"{NAME}.md", "Served vs offline decode (one stream)", head, text, [__doc__]
    )
    js = bc.write_json(out / f"{NAME}.json", {"settings": vars(args), **record, "rows": rows})
    print("\n".join(head) + "\n\n" + text + f"\n\nwrote {md}, {js}")
    return rows


if __name__ == "__main__":
    main()
