"""DSpark against plain decoding in tokens per second (python -m sparkrelay.tools.bench.acceptance):
batch 1 and 8, bfloat16 and float32, the variants interleaved wave by wave over rounds."""

from __future__ import annotations

import statistics

from sparkrelay.tools.bench.acceptance_runs import engine, run_timed


def decode_rate(outs: list[dict]) -> float:
    """Decode tokens per second: tokens after each request's first, over the span from the first
    first-token to the last last-token (batch 1: requests run one after another, so their spans
    add)."""
    tokens = sum(len(o["ids"]) - 1 for o in outs)
    return tokens / max(sum(o["end"] - o["first"] for o in outs), 1e-9)


def timed_wave(llm, wave: list[list[int]], params) -> dict:
    """One wave of concurrent requests (batch 1: a single prompt) -> its decode tokens and span as one
    decode_rate record."""
    outs = run_timed(llm, wave, params)
    return {
        "ids": [0] * (sum(len(o["ids"]) - 1 for o in outs) + 1),
        "first": min(o["first"] for o in outs),
        "end": max(o["end"] for o in outs),
    }


def speed_runs(args, prompts: list[list[int]]) -> list[dict]:
    """Per (dtype, batch): plain and a DSpark engine per --speed-draft-weights alternate wave by wave
    (batch 1: prompt by prompt), so that the shared machine's load falls on all alike, after one
    untimed warm-up wave each (the first products of a shape build oneDNN's primitives); min and
    median tok/s over the rounds, each DSpark engine's ratio to plain per round."""
    modes = ["plain"] + [f"dspark {w}" for w in args.speed_draft_weights]
    engines: dict = {}
    rates: dict[tuple, list[float]] = {}
    for r in range(args.rounds):
        for dt in ("bfloat16", "float32"):
            for b in (1, 8):
                for m, rate in one_round(args, engines, dt, b, modes, prompts).items():
                    rates.setdefault((dt, b, m), []).append(rate)
                    print(f"round {r + 1}: {dt} batch {b} {m} {rate:.1f} tok/s", flush=True)
    return [
        speed_row(dt, b, w, rates[(dt, b, "plain")], rates[(dt, b, f"dspark {w}")])
        for dt in ("bfloat16", "float32")
        for b in (1, 8)
        for w in args.speed_draft_weights
    ]


def one_round(args, engines: dict, dt: str, b: int, modes: list[str], prompts) -> dict[str, float]:
    """mode -> decode tok/s of one pass over `prompts` in waves of `b`, the modes alternating wave by
    wave; each (dtype, mode) engine is built and warmed up on first use."""
    from sparkrelay import SamplingParams

    greedy = SamplingParams(max_new_tokens=args.max_new, temperature=0.0)
    warm = SamplingParams(max_new_tokens=min(32, args.max_new), temperature=0.0)
    for m in modes:
        if (dt, m) not in engines:
            engines[(dt, m)] = engine(args, dt, m != "plain", 8, m.split()[-1])
            for size in (1, 8):
                run_timed(engines[(dt, m)], prompts[:size], warm)
    outs: dict[str, list[dict]] = {m: [] for m in modes}
    for wave in [prompts[i : i + b] for i in range(0, len(prompts), b)]:
        for m in modes:
            outs[m].append(timed_wave(engines[(dt, m)], wave, greedy))
    return {m: decode_rate(outs[m]) for m in modes}


def speed_row(dt: str, b: int, w: str, plain: list[float], spec: list[float]) -> dict:
    """min and median tok/s of plain and DSpark over the rounds, and of their ratio per round."""
    ratios = [s / p for s, p in zip(spec, plain)]
    return {
        "dtype": dt,
        "batch": b,
        "draft_weights": w,
        "plain_min": min(plain),
        "plain_median": statistics.median(plain),
        "dspark_min": min(spec),
        "dspark_median": statistics.median(spec),
        "speedup_min": min(ratios),
        "speedup_median": statistics.median(ratios),
    }
