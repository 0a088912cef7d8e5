"""The offline benchmark's comparisons and report: ratios between rows, greedy agreement with the
reference engine, the pass/fail verdict and the markdown tables (python -m
sparkrelay.tools.bench.offline)."""

from __future__ import annotations

import argparse
from typing import Optional

from sparkrelay.tools.bench import common as bc
from sparkrelay.tools.bench.offline_engines import REFERENCE, plain_of

# -- comparisons -----------------------------------------------------------------------------------


def first_divergence(a: list[int], b: list[int]) -> Optional[int]:
    """Index of the first differing token, None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def add_comparisons(rows: list[dict]) -> None:
    """Ratios vs the reference engine at the same batch and vs the row's own batch 1 (smallest
    batch), and greedy agreement with the reference's smallest batch; filled into each row dict."""
    by_key = {(r["engine"], r["batch"]): r for r in rows}
    ref_rows = sorted((r for r in rows if r["engine"] == REFERENCE), key=lambda r: r["batch"])
    ref_out = ref_rows[0]["outputs"] if ref_rows else None
    for r in rows:
        ref = by_key.get((REFERENCE, r["batch"]))
        own1 = min((x for x in rows if x["engine"] == r["engine"]), key=lambda x: x["batch"])
        r["vs_reference"] = _ratio(r["decode_tok_s"], ref and ref["decode_tok_s"])
        r["vs_own_b1"] = _ratio(r["decode_tok_s"], own1["decode_tok_s"])
        plain = by_key.get((plain_of(r["engine"]), r["batch"]))
        r["vs_plain"] = _ratio(r["decode_tok_s"], plain and plain["decode_tok_s"])
        if ref_out is not None:
            div = [first_divergence(a, b) for a, b in zip(r["outputs"], ref_out)]
            r["first_divergence"] = div
            r["match"] = sum(d is None for d in div)
        else:
            r["first_divergence"], r["match"] = None, None


def verdict(rows: list[dict], num_prompts: int) -> list[str]:
    """Rows whose greedy outputs are not all equal to the reference's at batch 1 (a wrong answer
    fails the run)."""
    return [
        f"{r['engine']} batch {r['batch']}: {num_prompts - r['match']} of {num_prompts} outputs differ from "
        f"{REFERENCE} (first differing token per prompt: {r['first_divergence']})"
        for r in rows
        if r["match"] is not None and r["match"] < num_prompts
    ]


def verdict_line(why: list[str]) -> str:
    if why:
        return "Verdict: FAIL: " + "; ".join(why)
    return f"Verdict: PASS (every row's greedy outputs equal {REFERENCE}'s at batch 1, token for token)"


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


# -- report ----------------------------------------------------------------------------------------


def header_lines(args: argparse.Namespace, record: dict, prompts: list[bc.Prompt]) -> list[str]:
    """The common header of `record` (common.provenance), then the workload and the torch
    threads."""
    files = sorted({p.source for p in prompts})
    machine = record["machine"]
    return [
        *bc.header_lines(record),
        f"Model `{args.model_path}`, dtype {args.dtype}, device {args.device}; {len(prompts)} prompts x "
        f"{args.prompt_len} tokens of held-out stdlib code ({len(files)} files), {args.output_len} new tokens each, "
        f"greedy, EOS ignored; median of {args.repeats} runs after {args.warmup} warm-up.",
        f"torch threads: {machine['torch_threads']}, Python {machine['python']}.",
    ]


def table(rows: list[dict], num_prompts: int) -> str:
    headers = [
        "engine",
        "batch",
        "e2e tok/s",
        "decode tok/s",
        f"vs {REFERENCE}",
        "vs own b1",
        "vs plain",
        "accept len",
        f"= {REFERENCE} b1",
    ]
    body = [
        [
            r["engine"],
            r["batch"],
            r["e2e_tok_s"],
            r["decode_tok_s"],
            _x(r["vs_reference"]),
            _x(r["vs_own_b1"]),
            _x(r["vs_plain"]),
            "-" if not r.get("spec") else f"{r['spec']['spec_accept_length']:.2f}",
            "-" if r["match"] is None else f"{r['match']}/{num_prompts}",
        ]
        for r in rows
    ]
    return bc.markdown_table(headers, body)


def accept_table(rows: list[dict]) -> str:
    """Per-position accept rates of the speculative rows: accept_rate@k = the rounds whose accepted
    prefix reached draft slot k / the rounds that proposed it."""
    spec_rows = [r for r in rows if r.get("spec")]
    if not spec_rows:
        return ""
    width = max(len(r["spec"]["spec_accept_rate_per_position"]) for r in spec_rows)
    headers = ["engine", "batch", "rounds", "accept len", "verify rate"] + [
        f"@{k}" for k in range(width)
    ]
    body = [
        [
            r["engine"],
            r["batch"],
            r["spec"]["spec_rounds"],
            f"{r['spec']['spec_accept_length']:.2f}",
            f"{r['spec']['spec_verify_rate']:.2f}",
        ]
        + [f"{a:.2f}" for a in r["spec"]["spec_accept_rate_per_position"]]
        for r in spec_rows
    ]
    return bc.markdown_table(headers, body)


def tables(rows: list[dict], num_prompts: int) -> str:
    """The main table, then the per-position accept rates when a row ran speculative decoding."""
    text = table(rows, num_prompts)
    accepts = accept_table(rows)
    if accepts:
        text += (
            "\n\nPer-position accept rates (rounds whose accepted prefix reached draft slot k / rounds that "
            "proposed it):\n\n" + accepts
        )
    return text


def _x(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}x"


NOTES = [
    "e2e tok/s = N x out / t(out tokens); decode tok/s = N x (out - 1) / (t(out tokens) - t(1 token)), i.e. with "
    "prefill and the first token taken out. Batch B: the N prompts go in N/B consecutive generate calls of B "
    "prompts. Ratios are of decode tok/s; `vs plain` compares a +dspark row with the same engine without DSpark "
    "(same compile setting). `+compile` rows run with --enable-torch-compile (compiled during the warm-up). "
    "The last column counts prompts whose greedy output equals "
    f"{REFERENCE}'s at batch 1, token for token.",
]
