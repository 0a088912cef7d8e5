"""The decode step's linears alone, against the machine's read bandwidth: sparkrelay's kernels
(models/cpu_kernels.py `portable()`: the AVX-512 build, or the AVX2 one's bf16 product) against their
fallbacks, at real model shapes with random weights.

    python -m sparkrelay.tools.bench.linears [--config models/configs/qwen3-0.6b ...] [--rows 1,8]
        [--repeats 7] [--out benchmarks/results/linears]

One pass runs every layer's four products of a decode step in order (fused q/k/v, o, fused
gate/up, down), each layer with its own weights, so nothing is left in cache from the last pass
(0.6B in bf16: 0.9 GB of weights per pass). Variants: `bf16 kernel` (AvxLinear's kernel),
`bf16 onednn` (the fallback, SPARKRELAY_CPU_KERNELS=0: PackedLinear, or on a CPU whose oneDNN has
no bf16 the float32 copy of WideLinear, whose GB/s still counts the bf16 bytes), `int8 kernel`
(Int8Linear's kernel; the AVX-512 build only) and `int8 aten` (torch's _weight_int8pack_mm: its
fallback); on a CPU with AMX, also each
kernel with its tile unit off (`no AMX`, SPARKRELAY_CPU_AMX=0). Each repeat times every
(variant, rows) once, interleaved; min and median over the repeats. The read bandwidth
(bandwidth.py) is measured before and after in the same run; a figure's fraction is of the higher.
Weight GB/s = the weight bytes of one pass / its seconds (int8: one byte per weight plus an fp32
scale per output channel). Writes linears.md, .json and .png under --out.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from sparkrelay.models import cpu_kernels
from sparkrelay.models.kernels import PackedLinear, WideLinear, onednn_bf16
from sparkrelay.models.loader import read_config
from sparkrelay.models.quant import quantize_per_channel
from sparkrelay.tools.bench import bandwidth as bw
from sparkrelay.tools.bench import common as bc

VARIANTS = (
    "bf16 kernel",
    "bf16 kernel, no AMX",
    "bf16 onednn",
    "int8 kernel",
    "int8 kernel, no AMX",
    "int8 aten",
)
NO_AMX = ", no AMX"


def variants() -> list[str]:
    """The variants this CPU has: the `no AMX` ones only where the kernels use AMX, `int8 kernel`
    only in the AVX-512 build."""
    int8 = cpu_kernels.load() is not None
    return [
        v
        for v in VARIANTS
        if (cpu_kernels.amx_on() or not v.endswith(NO_AMX))
        and (int8 or not v.startswith("int8 kernel"))
    ]


def layer_shapes(shape: bw.Shape) -> list[tuple[int, int]]:
    """(N, K) of one layer's products: fused q/k/v, o, fused gate/up, down."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    h, inter = shape.hidden, shape.intermediate
    return [(q + 2 * kv, h), (h, q), (2 * inter, h), (h, inter)]


def build(shape: bw.Shape, ext) -> dict[str, list[tuple[Callable, int]]]:
    """variant -> [(product x -> y, K)] over every layer, each with its own random weight."""
    out: dict[str, list] = {v: [] for v in VARIANTS}
    g = torch.Generator().manual_seed(0)
    for _ in range(shape.layers):
        for n, k in layer_shapes(shape):
            w = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16)
            tiles = cpu_kernels.pack_bf16(w)
            onednn = PackedLinear(w, None) if onednn_bf16() else WideLinear(w, None)
            q, s = quantize_per_channel(w)
            qt, st = cpu_kernels.pack_int8(q), cpu_kernels.pad_to_tile(s)
            qsum, s16 = cpu_kernels.pad_to_tile(q.sum(1, dtype=torch.int32)), s.to(torch.bfloat16)
            out["bf16 kernel"].append((lambda x, t=tiles, n=n: ext.linear_bf16(x, t, n, None), k))
            out["bf16 kernel" + NO_AMX].append(out["bf16 kernel"][-1])
            out["bf16 onednn"].append((onednn, k))
            out["int8 kernel"].append(
                (lambda x, t=qt, s=st, z=qsum, n=n: ext.linear_int8(x, t, s, z, n, None), k)
            )
            out["int8 kernel" + NO_AMX].append(out["int8 kernel"][-1])
            out["int8 aten"].append(
                (lambda x, q=q, s=s16: torch.ops.aten._weight_int8pack_mm(x, q, s), k)
            )
    return out


def pass_bytes(shape: bw.Shape, variant: str) -> int:
    per = sum(n * k for n, k in layer_shapes(shape)) * shape.layers
    channels = sum(n for n, _ in layer_shapes(shape)) * shape.layers
    return 2 * per if variant.startswith("bf16") else per + 4 * channels


def time_pass(
    products: list[tuple[Callable, int]], xs: dict[int, torch.Tensor], variant: str, ext
) -> float:
    """Seconds of one pass; a `no AMX` variant runs with the kernels' tile unit off."""
    amx = getattr(ext, "use_amx", None)  # the AVX2 build has no tile unit
    if amx:
        amx(cpu_kernels.amx_on() and not variant.endswith(NO_AMX))
    start = time.perf_counter()
    for fn, k in products:
        fn(xs[k])
    seconds = time.perf_counter() - start
    if amx:
        amx(cpu_kernels.amx_on())
    return seconds


def measure(shape: bw.Shape, rows: list[int], repeats: int, ext) -> dict:
    """(variant, rows) -> seconds of each timed pass."""
    products = build(shape, ext)
    ks = {k for _, k in layer_shapes(shape)}
    inputs = {r: {k: torch.randn(r, k).to(torch.bfloat16) for k in ks} for r in rows}
    seconds: dict[str, list[float]] = {f"{v}|{r}": [] for v in variants() for r in rows}
    for r in rows:  # one untimed pass each
        for v in variants():
            time_pass(products[v], inputs[r], v, ext)
    for i in range(repeats):
        for r in rows:
            for v in variants():
                seconds[f"{v}|{r}"].append(time_pass(products[v], inputs[r], v, ext))
        print(f"  repeat {i + 1}/{repeats} done", flush=True)
    return seconds


def rows_of(name: str, shape: bw.Shape, seconds: dict, peak: float, rows: list[int]) -> list[dict]:
    out = []
    for v in variants():
        nbytes = pass_bytes(shape, v)
        for r in rows:
            s = seconds[f"{v}|{r}"]
            best, med = min(s), statistics.median(s)
            out.append(
                {
                    "config": name,
                    "variant": v,
                    "rows": r,
                    "weight_bytes": nbytes,
                    "ms_min": best * 1e3,
                    "ms_median": med * 1e3,
                    "gb_s_max": nbytes / best / 1e9,
                    "gb_s_median": nbytes / med / 1e9,
                    "fraction_median": nbytes / med / 1e9 / peak,
                    "cost_vs_1_row": med / statistics.median(seconds[f"{v}|{rows[0]}"]),
                }
            )
    return out


def report(args, record: dict) -> None:
    out = Path(args.out)
    table = bc.markdown_table(
        [
            "shape",
            "variant",
            "rows",
            "ms (min / median)",
            "weight GB/s (max / median)",
            "of read bandwidth",
            f"cost vs {args.rows[0]} row",
        ],
        [
            [
                r["config"],
                r["variant"],
                r["rows"],
                f"{r['ms_min']:.2f} / {r['ms_median']:.2f}",
                f"{r['gb_s_max']:.1f} / {r['gb_s_median']:.1f}",
                f"{r['fraction_median']:.0%}",
                f"{r['cost_vs_1_row']:.2f}x",
            ]
            for r in record["rows"]
        ],
    )
    bwn = record["bandwidth"]
    notes = [
        f"Read bandwidth: {bwn['before']:.1f} GB/s before, {bwn['after']:.1f} GB/s after "
        f"({bwn['method']}); fractions are of {bwn['peak']:.1f}.",
        "One pass = every layer's fused q/k/v, o, fused gate/up and down (the LM head is left "
        f"out), {args.repeats} repeats interleaved; random weights; {torch.get_num_threads()} threads.",
        f"Kernels: {record['kernel_build']}; bf16 onednn: {record['bf16_fallback']} (GB/s counts "
        "2 bytes a weight either way).",
    ]
    bc.write_markdown(
        out / "linears.md",
        "Decode linears against the read bandwidth",
        bc.header_lines(record),
        table,
        notes,
    )
    bc.write_json(out / "linears.json", record)
    bc.variant_chart(
        out / "linears.png",
        record["rows"],
        variants(),
        lambda r: f"{r['config']} x{r['rows']}",
        "gb_s_median",
        "decode linears, median weight GB/s",
        "GB/s",
    )
    print(table, *notes, sep="\n")


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m sparkrelay.tools.bench.linears", description=__doc__.split("\n")[0]
    )
    p.add_argument("--config", action="append", default=None, help="Model folder (repeatable).")
    p.add_argument("--rows", type=bc.int_list, default=[1, 8], help="Activation rows per product.")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default="benchmarks/results/linears")
    args = p.parse_args(argv)
    bc.require_positive(p, args, ("repeats",))
    ext = cpu_kernels.portable()
    if ext is None:
        raise SystemExit(f"the CPU kernels are off here: {cpu_kernels.why_off()}")
    configs = args.config or ["models/configs/qwen3-0.6b", "models/configs/qwen3-1.7b"]
    before = bw.measure_read_bandwidth()
    rows = []
    for folder in configs:
        shape = bw.Shape.from_hf(read_config(folder))
        print(f"{folder}: {shape.layers} layers", flush=True)
        seconds = measure(shape, args.rows, args.repeats, ext)
        rows.append((Path(folder).name, shape, seconds))
    after = bw.measure_read_bandwidth()
    peak = max(before["gb_s"], after["gb_s"])
    record = {
        **bc.provenance("sparkrelay.tools.bench.linears", argv),
        "bandwidth": {
            "before": before["gb_s"],
            "after": after["gb_s"],
            "peak": peak,
            "method": before["method"],
        },
        "rows": [r for name, shape, s in rows for r in rows_of(name, shape, s, peak, args.rows)],
        "kernel_build": ext.__name__,
        "bf16_fallback": "PackedLinear" if onednn_bf16() else "WideLinear (float32 copy)",
    }
    report(args, record)


if __name__ == "__main__":
    main()
