"""Demo: DSpark under PD disaggregation on the bundled pair, next to the aggregated DSpark server.

First the aggregated DSpark server (target + drafter in one process) answers the prompts: that is the reference.
Then, for each handoff mode (hidden, draft-kv, tail), it starts router + prefill (--pp-size 2, no drafter) +
decode (DSpark), asks the same prompts through the OpenAI client (greedy), checks the text against the reference,
and measures acceptance length, TTFT and handoff bytes per request. It ends with a table, its legend and a verdict;
the exit status is 1 if a mode's text differs from the reference, or if `hidden` or `draft-kv` (whose drafter
sees the whole prompt) accepts differently from the aggregated server on any request.

python -m sparkrelay.tools.demo [--pp-size 2] [--modes hidden,draft-kv,tail] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

from sparkrelay.tools.cluster import PDSettings, free_port, handoff_bytes, server_argv, start, start_pd, stream_generate
from sparkrelay.envs import DisaggEnv

MODEL, DRAFTER = "models/tiny-qwen3", "models/tiny-qwen3-dspark"
# Prompts end at a token boundary the tokenizer would produce (a trailing "\n" alone is rare in training).
PROMPTS = [
    "import os\n\n\ndef list_python_files(root):",
    "class Stack:\n    def __init__(self):",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"",
]
# The drafter of these modes sees every prompt position, so acceptance must equal the aggregated server's.
FULL_CONTEXT = ("hidden", "draft-kv")
LEGEND = [
    "deployment       aggregated: one server with target + drafter (the reference); PD <mode>: router + prefill "
    "+ DSpark decode, handing the prompt over in that mode",
    "same text        yes if all {n} greedy completions equal the aggregated server's, character for character",
    "accept len       tokens the decode commits per verify step (a target forward pass), mean over the prompts; "
    "1.00 means no draft token accepted, higher means fewer target passes",
    "TTFT ms          time to the first streamed token, mean; under PD it includes the prefill, the handoff and "
    "the router",
    "handoff KiB/req  bytes the decode received from the prefill per request: target KV + the drafter's context",
    "of which DSpark  the drafter's part: prompt taps (hidden), drafter K/V (draft-kv), one fixed-size row (tail)",
]


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def openai_outputs(url: str, max_tokens: int, show: bool) -> list[str]:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=5)
    texts = []
    for prompt in PROMPTS:
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
        texts.append(out.choices[0].text)
        if show:
            print(f"--- completion of {prompt.splitlines()[-1]!r} ---\n{prompt}{out.choices[0].text}")
    if show:
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "def add(a, b):"}],
                                              max_tokens=24, temperature=0)
        print("--- chat: 'def add(a, b):' ---\n" + (chat.choices[0].message.content or ""))
        print("--- streamed completion (chunks as they arrive) ---")
        for chunk in client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=32, temperature=0,
                                               stream=True):
            print(chunk.choices[0].text, end="", flush=True)
        print()
    return texts


def measure(url: str, decode_url: str | None, ids: list[list[int]], max_tokens: int) -> dict:
    """One streamed greedy /generate per prompt: mean TTFT, per-request acceptance, handoff bytes per request."""
    before = handoff_bytes(decode_url) if decode_url else (0, 0)
    runs = [stream_generate(url, p, max_tokens) for p in ids]
    after = handoff_bytes(decode_url) if decode_url else (0, 0)
    n = len(runs)
    accepts = [r["accept_length"] for r in runs]
    return {"accepts": accepts, "accept": sum(accepts) / n, "ttft_ms": 1000 * sum(r["ttft_s"] for r in runs) / n,
            "kib": (after[0] - before[0]) / n / 1024, "ctx_kib": (after[1] - before[1]) / n / 1024}


def differing(texts: list[str], reference: list[str]) -> list[int]:
    """Indices of the prompts whose completion differs from the reference."""
    return [i for i, (a, b) in enumerate(zip(texts, reference)) if a != b] + list(range(len(texts), len(reference)))


def verdict(rows: list[dict], tail_tokens: int) -> tuple[bool, list[str]]:
    """rows: {"mode", "differ": [prompt indices], "accepts": [per prompt]}, the aggregated row first (mode None).
    (passed, lines ending with the one-line verdict)."""
    ref, pd = rows[0], rows[1:]
    problems, notes = [], []
    for r in pd:
        if r["differ"]:
            problems.append(f"PD {r['mode']}: text differs from the aggregated server on prompt(s) "
                            f"{', '.join(str(i + 1) for i in r['differ'])}")
        same_accept = all(abs(a - b) < 1e-9 for a, b in zip(r["accepts"], ref["accepts"]))
        if r["mode"] in FULL_CONTEXT and not same_accept:
            problems.append(f"PD {r['mode']}: acceptance {_fmt(r['accepts'])} differs from the aggregated "
                            f"{_fmt(ref['accepts'])}, although its drafter sees the whole prompt")
        if r["mode"] == "tail":
            notes.append(f"`tail` accepts {_mean(r['accepts']):.2f} tokens per step against the aggregated "
                         f"{_mean(ref['accepts']):.2f}{' (here the same)' if same_accept else ''}: its drafter sees "
                         f"only the last {tail_tokens} prompt positions, so its guesses can differ; the text cannot, "
                         "because the target checks every guess")
    modes = ", ".join(r["mode"] for r in pd)
    what = (f"each PD handoff mode ({modes}) against the aggregated DSpark server, same {len(PROMPTS)} prompts, "
            "greedy")
    full = [r["mode"] for r in pd if r["mode"] in FULL_CONTEXT]
    lines = [f"Compared: {what}."]
    if not problems:
        lines.append("Text: identical in every mode." + (f" Acceptance: identical per request for {', '.join(full)}."
                                                          if full else ""))
    lines += [n + "." for n in notes]
    lines.append("The bundled model is tiny (made for tests), so it writes repetitive code: expected, not a bug.")
    lines.append("Verdict: PASS (every PD mode wrote the aggregated server's text)" if not problems
                 else "Verdict: FAIL: " + "; ".join(problems))
    return not problems, lines


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _fmt(xs: list[float]) -> str:
    return "[" + ", ".join(f"{x:.2f}" for x in xs) + "]"


def table(rows: list[dict]) -> list[str]:
    out = [f"{'deployment':<14} {'same text':>9} {'accept len':>10} {'TTFT ms':>8} {'handoff KiB/req':>16} "
           f"{'of which DSpark':>16}"]
    for r in rows:
        name = "aggregated" if r["mode"] is None else f"PD {r['mode']}"
        same = "-" if r["mode"] is None else ("NO" if r["differ"] else "yes")
        m = r["m"]
        out.append(f"{name:<14} {same:>9} {m['accept']:>10.2f} {m['ttft_ms']:>8.0f} {m['kib']:>16,.1f} "
                   f"{m['ctx_kib']:>16,.1f}")
    return out


def run_aggregated(args, ids: list[list[int]], logs: str) -> tuple[list[str], dict]:
    say("step 1: the aggregated DSpark server (target + drafter in one process), the reference: loading ...")
    t, port = time.perf_counter(), free_port()
    agg = start("aggregated", server_argv(MODEL, port, ["--speculative-algorithm", "DSPARK",
                                                       "--speculative-draft-model-path", DRAFTER]), port, logs)
    try:
        say(f"ready in {time.perf_counter() - t:.0f} s; {len(PROMPTS)} greedy completions of {args.max_tokens} "
            "tokens through the OpenAI client, then one streamed /generate each to measure ...")
        reference = openai_outputs(agg.url, args.max_tokens, show=False)
        m = measure(agg.url, None, ids, args.max_tokens)
    finally:
        agg.stop()
    return reference, {"mode": None, "differ": [], "accepts": m["accepts"], "m": m}


def run_mode(args, step: int, mode: str, ids: list[list[int]], reference: list[str], logs: str, show: bool) -> dict:
    print(f"\n=== PD, handoff {mode}: router + prefill (--pp-size {args.pp_size}, no drafter) + decode (DSpark) ===",
          flush=True)
    say(f"step {step}: starting the three processes (about half a minute) ...")
    t = time.perf_counter()
    cluster = start_pd(PDSettings(model=MODEL, drafter=DRAFTER, pp_size=args.pp_size, handoff=mode), logs)
    try:
        say(f"ready in {time.perf_counter() - t:.0f} s; the same {len(PROMPTS)} completions through the router ...")
        texts = openai_outputs(cluster.url, args.max_tokens, show=show)
        diff = differing(texts, reference)
        for i in diff:
            print(f"--- prompt {i + 1} differs ---\naggregated: {reference[i]!r}\nPD {mode}: {texts[i]!r}")
        if not show and not diff:
            say(f"the {len(PROMPTS)} completions equal the aggregated server's (printed above for the first mode)")
        say("measuring acceptance, TTFT and handoff bytes (one streamed /generate per prompt) ...")
        m = measure(cluster.url, cluster.decode.url, ids, args.max_tokens)
    finally:
        cluster.stop()
    say(f"text = aggregated: {len(PROMPTS) - len(diff)}/{len(PROMPTS)} prompts; accept len {m['accept']:.2f}")
    return {"mode": mode, "differ": diff, "accepts": m["accepts"], "m": m}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp-size", type=int, default=2)
    p.add_argument("--modes", default="hidden,draft-kv,tail")
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"hidden", "draft-kv", "tail"}:
        p.error(f"--modes {args.modes!r}: a comma-separated list of hidden, draft-kv, tail")
    say(f"compares {', '.join(modes)} with the aggregated server; each deployment loads the bundled model on CPU "
        f"(a few minutes in all)")
    from transformers import AutoTokenizer

    ids = [AutoTokenizer.from_pretrained(MODEL).encode(t) for t in PROMPTS]
    with tempfile.TemporaryDirectory() as logs:
        reference, agg = run_aggregated(args, ids, logs)
        rows = [agg] + [run_mode(args, i + 2, mode, ids, reference, logs, show=i == 0) for i, mode in enumerate(modes)]
    passed, lines = verdict(rows, DisaggEnv.read().tail_tokens)
    print("\n" + "\n".join(table(rows)) + "\n\nColumns:")
    print("\n".join("  " + line.format(n=len(PROMPTS)) for line in LEGEND))
    print("\n" + "\n".join(lines), flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
