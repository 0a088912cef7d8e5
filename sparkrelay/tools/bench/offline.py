"""Offline throughput: sparkrelay's `LLM.generate` against Hugging Face transformers' `generate`,
same model, same prompts, greedy, fixed output length.

Each engine configuration runs the workload (common.load_prompts: N windows of held-out stdlib code) at
each batch size B: the N prompts go in consecutive groups of B, one generate call per group (B = 1: one prompt
at a time; B = N: all together). Every timed repeat runs the workload twice, with `--output-len` new tokens and
with 1 new token; the medians over `--repeats` give
    e2e tok/s    = N * out / t_out
    decode tok/s = N * (out - 1) / (t_out - t_1)   (prefill and the first token taken out)
The greedy outputs of every row are compared token for token with transformers at batch 1, because a fast
engine that answers differently is worthless: any difference ends the run with `Verdict: FAIL` and exit status 1.

Results: `<out-dir>/bench_offline.md` (table), `.png` (decode tok/s bars), `.json` (raw timings,
outputs).
Usage: python -m sparkrelay.tools.bench.offline [--model-path models/tiny-qwen3] [--batch-sizes 1,8]
[--repeats 3]

The engine configurations are in offline_engines.py (another one is one `EngineConfig` appended to
`ENGINE_CONFIGS`); the comparisons, the verdict and the tables in offline_report.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from tqdm.auto import tqdm

from sparkrelay.tools.bench import common as bc
from sparkrelay.tools.bench.offline_engines import DEFAULT_ENGINES, DSPARK, ENGINE_CONFIGS, Runner
from sparkrelay.tools.bench.offline_report import (
    NOTES,
    add_comparisons,
    header_lines,
    tables,
    verdict,
    verdict_line,
)

NAME = "bench_offline"


# -- measurement -----------------------------------------------------------------------------------


def run_workload(runner: Runner, groups: list[list[list[int]]], output_len: int) -> list[list[int]]:
    outs = [ids for group in groups for ids in runner.generate(group, output_len)]
    bad = [len(o) for o in outs if len(o) != output_len]
    if bad:
        raise RuntimeError(f"asked for {output_len} tokens per prompt, got lengths {bad[:5]}")
    return outs


def measure(
    runner: Runner,
    prompts: list[list[int]],
    batch: int,
    args: argparse.Namespace,
    bar: Optional[tqdm] = None,
) -> dict:
    """Time the workload at one batch size (see the module docstring); returns the raw and median
    figures."""
    groups = bc.batches(prompts, batch)
    out_len = args.output_len
    for _ in range(args.warmup):
        runner.generate(groups[0], out_len)
        bar and bar.update(1)
    t_out, t_one, outputs, spec = [], [], None, None
    stats = getattr(runner, "spec_stats", lambda: None)
    for _ in range(args.repeats):
        stats()
        seconds, outputs = bc.timed(lambda: run_workload(runner, groups, out_len), args.device)
        # the acceptance of this full-length run (every repeat is the same greedy work)
        spec = stats()
        t_out.append(seconds)
        t_one.append(bc.timed(lambda: run_workload(runner, groups, 1), args.device)[0])
        bar and bar.update(1)
    n = len(prompts)
    t_out_med, t_one_med = bc.median(t_out), bc.median(t_one)
    decode = (
        bc.rate(n * (out_len - 1), t_out_med - t_one_med)
        if out_len > 1 and t_out_med > t_one_med
        else None
    )
    return {
        "batch": batch,
        "groups": len(groups),
        "t_out_s": t_out,
        "t_1_s": t_one,
        "t_out_median_s": t_out_med,
        "t_1_median_s": t_one_med,
        "e2e_tok_s": bc.rate(n * out_len, t_out_med),
        "decode_tok_s": decode,
        "outputs": outputs,
        "spec": spec,
    }


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m sparkrelay.tools.bench.offline",
        description="Offline tokens/s of sparkrelay vs transformers on one model and "
        "workload; writes bench_offline.md/.png/.json.",
    )
    bc.add_workload_args(parser)
    parser.add_argument(
        "--batch-sizes",
        type=bc.int_list,
        default=None,
        help="Comma-separated batch sizes (default: 1,N).",
    )
    parser.add_argument(
        "--engines",
        default=",".join(DEFAULT_ENGINES),
        help="Comma-separated engine configurations to run, of: "
        + ", ".join(e.name for e in ENGINE_CONFIGS)
        + " (+compile: --enable-torch-compile).",
    )
    parser.add_argument(
        "--draft-model-path",
        default="models/tiny-qwen3-dspark",
        help=f"DSpark drafter of the {DSPARK} rows.",
    )
    parser.add_argument(
        "--confidence-threshold",
        type=float,
        default=0.0,
        help=f"--speculative-dspark-confidence-threshold of the {DSPARK} rows.",
    )
    parser.add_argument(
        "--num-draft-tokens",
        type=int,
        default=None,
        help=f"--speculative-num-draft-tokens of the {DSPARK} rows (default: the block size).",
    )
    args = parser.parse_args(argv)
    if args.batch_sizes is None:
        args.batch_sizes = sorted({1, args.num_prompts})
    bc.require_positive(parser, args, ("num_prompts", "prompt_len", "output_len", "repeats"))
    if max(args.batch_sizes) > args.num_prompts:
        parser.error(
            f"--batch-sizes {args.batch_sizes}: a batch cannot exceed --num-prompts {args.num_prompts}"
        )
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    known = {e.name for e in ENGINE_CONFIGS}
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(args.engines) - known
    if unknown or not args.engines:
        parser.error(f"--engines: unknown {sorted(unknown)}; known: {sorted(known)}")
    if not Path(args.model_path).is_dir():
        parser.error(f"--model-path {args.model_path!r} is not a folder")
    return args


def run_engines(args: argparse.Namespace, ids: list[list[int]]) -> list[dict]:
    """One row per (engine, batch size), engines in ENGINE_CONFIGS order, each loaded once."""
    engines = [e for e in ENGINE_CONFIGS if e.name in args.engines]
    steps_per_engine = 1 + len(args.batch_sizes) * (args.warmup + args.repeats)
    rows: list[dict] = []
    with tqdm(total=len(engines) * steps_per_engine, desc=NAME, unit="run", file=sys.stderr) as bar:
        for engine in engines:
            bar.set_postfix_str(f"{engine.name} load")
            runner = engine.load(args)
            bar.update(1)
            try:
                for batch in args.batch_sizes:
                    bar.set_postfix_str(f"{engine.name} b{batch}")
                    rows.append({"engine": engine.name, **measure(runner, ids, batch, args, bar)})
            finally:
                runner.close()
    return rows


def plot(path: Path, args: argparse.Namespace, rows: list[dict]) -> Path:
    """Decode tok/s bars: one group per batch size, one bar per engine."""
    engines = [e.name for e in ENGINE_CONFIGS if e.name in args.engines]
    series = {
        e: [
            next((r["decode_tok_s"] for r in rows if r["engine"] == e and r["batch"] == b), None)
            for b in args.batch_sizes
        ]
        for e in engines
    }
    return bc.bar_chart(
        path,
        [f"batch {b}" for b in args.batch_sizes],
        series,
        title=f"{Path(args.model_path).name} {args.dtype}: decode tok/s "
        f"({args.num_prompts} prompts, {args.prompt_len}+{args.output_len} tokens)",
        ylabel="decode tokens/s",
    )


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    import torch
    from transformers import AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    record = bc.provenance("sparkrelay.tools.bench.offline", argv)
    prompts = bc.load_prompts(
        AutoTokenizer.from_pretrained(args.model_path), args.num_prompts, args.prompt_len
    )
    rows = run_engines(args, [p.ids for p in prompts])
    add_comparisons(rows)
    out_dir = Path(args.out_dir)
    head, text = header_lines(args, record, prompts), tables(rows, len(prompts))
    md = bc.write_markdown(
        out_dir / f"{NAME}.md", "Offline throughput (sparkrelay vs transformers)", head, text, NOTES
    )
    png = plot(out_dir / f"{NAME}.png", args, rows)
    failures = verdict(rows, len(prompts))
    result = {
        "settings": {k: v for k, v in vars(args).items()},
        **record,
        "prompts": [{"source": p.source, "window": p.window, "ids": p.ids} for p in prompts],
        "rows": rows,
        "failures": failures,
    }
    js = bc.write_json(out_dir / f"{NAME}.json", result)
    print("\n".join(head) + "\n\n" + text + "\n")
    print(f"wrote {md}, {png}, {js}")
    print(verdict_line(failures))
    return result


if __name__ == "__main__":
    sys.exit(1 if main()["failures"] else 0)
