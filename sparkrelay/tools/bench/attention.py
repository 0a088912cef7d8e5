"""Decode attention alone: a decode row (1 query) and a DSpark verify block (8 queries) of one
sequence against its cached keys, bf16 pools, one layer's call of models/attention.paged_attention
(the K/V write included) with sparkrelay's kernel (the AVX-512 build or the AVX2 one) and with it
off (torch's gather and SDPA), interleaved in one process.

    python -m sparkrelay.tools.bench.attention [--config models/configs/qwen3-0.6b ...]
        [--contexts 300,1200,3000] [--queries 1,8] [--repeats 7] [--out benchmarks/results/attention]

A timed sample is `--calls` calls in a row, divided; min and median over the repeats. GFLOP/s
counts the scores and the weighted sum, 4 T H L D for T queries over L keys; KV GB/s the bytes of
the keys and values read once, 4 L n_kv D. Writes attention.md, .json and .png under --out.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Optional

import torch

from sparkrelay.models import cpu_kernels
from sparkrelay.models.attention import AttnMeta, paged_attention
from sparkrelay.models.loader import read_config
from sparkrelay.tools.bench import bandwidth as bw
from sparkrelay.tools.bench import common as bc

VARIANTS = ("kernel", "torch")
PAGE = 16
SMOLLM2 = Path("models/smollm2-135m-instruct")


class Case:
    """One (shape, context, queries): a pool with `context` cached keys and the block's q/k/v."""

    def __init__(self, shape: bw.Shape, context: int, queries: int) -> None:
        g = torch.Generator().manual_seed(context * 10 + queries)
        total = context + queries
        pages = -(-total // PAGE)
        self.shape, self.context, self.queries = shape, context, queries
        self.meta = AttnMeta.build([context], [total], [list(range(pages))], PAGE, "cpu")
        kv = (pages * PAGE, shape.kv_heads, shape.head_dim)  # [S, n_kv, D]
        self.pools = [torch.randn(kv, generator=g).to(torch.bfloat16) for _ in "kv"]
        self.q = torch.randn(queries, shape.heads, shape.head_dim, generator=g).to(torch.bfloat16)
        self.kv = [
            torch.randn(queries, shape.kv_heads, shape.head_dim, generator=g).to(torch.bfloat16)
            for _ in "kv"
        ]

    def call(self) -> torch.Tensor:
        k, v = self.kv
        return paged_attention(
            self.q, k, v, *self.pools, self.meta, self.shape.head_dim**-0.5
        )  # [T, H, D]

    def flops(self) -> float:
        s = self.shape
        return 4.0 * self.queries * s.heads * (self.context + self.queries) * s.head_dim

    def kv_bytes(self) -> float:
        s = self.shape
        return 4.0 * (self.context + self.queries) * s.kv_heads * s.head_dim


def time_case(case: Case, variant: str, calls: int) -> float:
    """Seconds of one call, averaged over `calls` in a row."""
    if variant == "torch":
        with cpu_kernels.forced_off():
            return _timed(case, calls)
    return _timed(case, calls)


def _timed(case: Case, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        case.call()
    return (time.perf_counter() - start) / calls


def measure(cases: list[Case], repeats: int, calls: int) -> dict[tuple[int, str], list[float]]:
    """(case index, variant) -> seconds per call, one value per repeat, variants interleaved."""
    seconds = {(i, v): [] for i in range(len(cases)) for v in VARIANTS}
    for i, case in enumerate(cases):  # one untimed round, and the two variants agree
        for v in VARIANTS:
            time_case(case, v, 1)
        with cpu_kernels.forced_off():
            ref = case.call().float()
        err = (case.call().float() - ref).abs().max().item()
        assert err < 0.05, f"kernel and torch disagree by {err} at case {i}"
    for r in range(repeats):
        for i, case in enumerate(cases):
            for v in VARIANTS:
                seconds[(i, v)].append(time_case(case, v, calls))
        print(f"  repeat {r + 1}/{repeats} done", flush=True)
    return seconds


def rows_of(names: list[str], cases: list[Case], seconds: dict) -> list[dict]:
    out = []
    for i, (name, case) in enumerate(zip(names, cases)):
        for v in VARIANTS:
            s = seconds[(i, v)]
            best, med = min(s), statistics.median(s)
            out.append(
                {
                    "config": name,
                    "variant": v,
                    "context": case.context,
                    "queries": case.queries,
                    "us_min": best * 1e6,
                    "us_median": med * 1e6,
                    "gflop_s_median": case.flops() / med / 1e9,
                    "kv_gb_s_median": case.kv_bytes() / med / 1e9,
                    "kernel_speedup_median": statistics.median(seconds[(i, "torch")]) / med,
                }
            )
    return out


def report(out: Path, record: dict) -> None:
    table = bc.markdown_table(
        [
            "shape",
            "keys",
            "queries",
            "variant",
            "us (min / median)",
            "GFLOP/s",
            "KV GB/s",
            "vs torch",
        ],
        [
            [
                r["config"],
                r["context"],
                r["queries"],
                r["variant"],
                f"{r['us_min']:.1f} / {r['us_median']:.1f}",
                f"{r['gflop_s_median']:.1f}",
                f"{r['kv_gb_s_median']:.1f}",
                f"{r['kernel_speedup_median']:.2f}x",
            ]
            for r in record["rows"]
        ],
    )
    notes = [
        f"One layer's paged_attention call (K/V write included), bf16, {record['repeats']} repeats "
        f"of {record['calls']} calls, variants interleaved; {torch.get_num_threads()} threads.",
        f"kernel: {record['kernel_build']}; torch: the same call with the kernels forced off "
        "(gather + SDPA). vs torch: torch's median / this row's median.",
    ]
    bc.write_markdown(
        out / "attention.md", "Decode attention", bc.header_lines(record), table, notes
    )
    bc.write_json(out / "attention.json", record)
    bc.variant_chart(
        out / "attention.png",
        record["rows"],
        VARIANTS,
        lambda r: f"{r['config']} L{r['context']} x{r['queries']}",
        "us_median",
        "decode attention, median us",
        "us",
    )
    print(table, *notes, sep="\n")


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m sparkrelay.tools.bench.attention", description=__doc__.split("\n")[0]
    )
    p.add_argument("--config", action="append", default=None, help="Model folder (repeatable).")
    p.add_argument("--contexts", type=bc.int_list, default=[300, 1200, 3000])
    p.add_argument("--queries", type=bc.int_list, default=[1, 8])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--out", default="benchmarks/results/attention")
    args = p.parse_args(argv)
    bc.require_positive(p, args, ("repeats", "calls"))
    ext = cpu_kernels.portable()
    if ext is None:
        raise SystemExit(f"the CPU kernels are off here: {cpu_kernels.why_off()}")
    configs = args.config or [
        *([str(SMOLLM2)] if (SMOLLM2 / "config.json").exists() else []),
        "models/configs/qwen3-0.6b",
    ]
    names, cases = [], []
    for folder in configs:
        shape = bw.Shape.from_hf(read_config(folder))
        for context in args.contexts:
            for queries in args.queries:
                names.append(Path(folder).name)
                cases.append(Case(shape, context, queries))
    seconds = measure(cases, args.repeats, args.calls)
    record = {
        **bc.provenance("sparkrelay.tools.bench.attention", argv),
        "repeats": args.repeats,
        "calls": args.calls,
        "kernel_build": ext.__name__,
        "rows": rows_of(names, cases, seconds),
    }
    report(Path(args.out), record)


if __name__ == "__main__":
    main()
