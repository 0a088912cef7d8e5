"""Served against offline decode speed, one stream at a time: is the HTTP server as fast as the engine it serves?

For plain decoding and for DSpark (the bundled pair), in one run, alternating: the offline engine
(`bench.offline` at batch 1, in its own process) and a real server (`launch_server`, one request at a time through
`bench.serving`, streamed), on the same prompts (common.load_prompts), greedy, EOS ignored. Decode tok/s is
    offline  (N x (out - 1)) / (t(out tokens) - t(1 token))         bench.offline's decode tok/s (median of 3)
    served   sum(out - 1) / sum(E2E - TTFT) over the requests         from bench.serving's per-request records
both with the prefill and the first token taken out, both totals over the N prompts (a median of per-request
rates would weigh DSpark's fast and slow prompts differently); each figure is the median of `--repeats` rounds.

Usage: python -m sparkrelay.tools.bench.served [--num-prompts 4] [--prompt-len 128] [--output-len 256]
Writes <out-dir>/bench_served.md and .json.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

from sparkrelay.tools import cluster
from sparkrelay.tools.bench import common as bc
from sparkrelay.tools.bench import serving

NAME = "bench_served"
DRAFTER = "models/tiny-qwen3-dspark"
ENGINES = {"sparkrelay": [], "sparkrelay+dspark": ["--speculative-algorithm", "DSPARK",
                                                  "--speculative-draft-model-path", DRAFTER]}


def offline_decode(args: argparse.Namespace, engine: str, work: Path) -> float:
    out = work / f"offline-{engine}"
    subprocess.run([sys.executable, "-m", "sparkrelay.tools.bench.offline", "--model-path", args.model_path,
                    "--engines", engine, "--batch-sizes", "1", "--num-prompts", str(args.num_prompts),
                    "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len), "--repeats", "3",
                    "--draft-model-path", DRAFTER, "--out-dir", str(out)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    row = json.loads((out / "bench_offline.json").read_text())["rows"][0]
    return float(row["decode_tok_s"])


def served_decode(args: argparse.Namespace, engine: str, work: Path) -> float:
    port = cluster.free_port()
    server = cluster.start(engine, cluster.server_argv(args.model_path, port, ENGINES[engine]), port, str(work))
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # its report; the figure used is printed below
            result = serving.main(["--backend", "sglang", "--port", str(port), "--dataset", "code", "--num-prompts",
                                   str(args.num_prompts), "--random-input-len", str(args.prompt_len),
                                   "--max-new-tokens", str(args.output_len), "--max-concurrency", "1",
                                   "--disable-tqdm", "--tokenizer", args.model_path])
    finally:
        server.stop()
    done = [r for r in result["records"] if r["success"] and r["output_tokens"] > 1]
    if len(done) != args.num_prompts:
        raise RuntimeError(f"{args.num_prompts - len(done)} of {args.num_prompts} served requests failed")
    return sum(r["output_tokens"] - 1 for r in done) / sum(r["e2e"] - r["ttft"] for r in done)


def run(args: argparse.Namespace) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-served-") as tmp:
        for engine in ENGINES:
            offline, served = [], []
            for r in range(args.repeats):
                offline.append(offline_decode(args, engine, Path(tmp)))
                served.append(served_decode(args, engine, Path(tmp)))
                print(f"{engine} round {r + 1}: offline {offline[-1]:.1f}, served {served[-1]:.1f} tok/s",
                      file=sys.stderr)
            off, srv = bc.median(offline), bc.median(served)
            rows.append({"engine": engine, "offline_tok_s": offline, "served_tok_s": served,
                         "offline_median": off, "served_median": srv, "ratio": srv / off})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| engine | offline decode tok/s | served decode tok/s | served / offline | rounds (offline; served) |",
             "|---|---:|---:|---:|---|"]
    for r in rows:
        rounds = ", ".join(f"{x:.0f}" for x in r["offline_tok_s"]) + "; " + ", ".join(
            f"{x:.0f}" for x in r["served_tok_s"])
        lines.append(f"| {r['engine']} | {r['offline_median']:.1f} | {r['served_median']:.1f} | "
                     f"{r['ratio']:.2f}x | {rounds} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m sparkrelay.tools.bench.served", description=__doc__.split("\n")[0])
    bc.add_workload_args(parser)
    parser.set_defaults(num_prompts=4, prompt_len=128, output_len=256)
    args = parser.parse_args(argv)
    bc.require_positive(parser, args, ("num_prompts", "prompt_len", "output_len", "repeats"))
    machine = bc.machine_info()
    rows = run(args)
    head = [f"Model `{args.model_path}` (DSpark: `{DRAFTER}`), float32, cpu; {args.num_prompts} prompts x "
            f"{args.prompt_len} tokens, {args.output_len} new tokens, greedy, one request at a time; "
            f"median of {args.repeats} rounds.",
            f"torch {machine['torch']}, {machine['cpu_cores']} cores ({machine['cpu']}), {machine['date']}."]
    text = table(rows)
    out = Path(args.out_dir)
    md = bc.write_markdown(out / f"{NAME}.md", "Served vs offline decode (one stream)", head, text, [__doc__])
    js = bc.write_json(out / f"{NAME}.json", {"settings": vars(args), "machine": machine, "rows": rows})
    print("\n".join(head) + "\n\n" + text + f"\n\nwrote {md}, {js}")
    return rows


if __name__ == "__main__":
    main()
