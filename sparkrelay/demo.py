"""Demo: DSpark under PD disaggregation on the bundled pair, next to the aggregated DSpark server.

For each handoff mode (hidden, draft-kv, tail) it starts router + prefill (--pp-size 2, no drafter) + decode
(DSpark), asks through the OpenAI client, and prints the outputs, then the acceptance length, TTFT and handoff
bytes per request next to the aggregated server's (same greedy tokens expected everywhere).

python -m sparkrelay.demo [--pp-size 2] [--modes hidden,draft-kv,tail] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import tempfile

from sparkrelay.cluster import PDSettings, free_port, handoff_bytes, server_argv, start, start_pd, stream_generate

MODEL, DRAFTER = "models/tiny-qwen3", "models/tiny-qwen3-dspark"
# Prompts end at a token boundary the tokenizer would produce (a trailing "\n" alone is rare in training).
PROMPTS = [
    "import os\n\n\ndef list_python_files(root):",
    "class Stack:\n    def __init__(self):",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"",
]


def openai_outputs(url: str, max_tokens: int, show: bool) -> list[str]:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=5)
    texts = []
    for prompt in PROMPTS:
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
        texts.append(out.choices[0].text)
        if show:
            print(f"--- {prompt.splitlines()[-1]!r} ---\n{prompt}{out.choices[0].text}")
    if show:
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "def add(a, b):"}],
                                              max_tokens=24, temperature=0)
        print("--- chat ---\n" + (chat.choices[0].message.content or ""))
        print("--- streamed ---")
        for chunk in client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=32, temperature=0,
                                               stream=True):
            print(chunk.choices[0].text, end="", flush=True)
        print()
    return texts


def measure(url: str, decode_url: str | None, ids: list[list[int]], max_tokens: int) -> dict:
    before = handoff_bytes(decode_url) if decode_url else (0, 0)
    runs = [stream_generate(url, p, max_tokens) for p in ids]
    after = handoff_bytes(decode_url) if decode_url else (0, 0)
    n = len(runs)
    return {"accept": sum(r["accept_length"] for r in runs) / n, "ttft_ms": 1000 * sum(r["ttft_s"] for r in runs) / n,
            "kib": (after[0] - before[0]) / n / 1024, "ctx_kib": (after[1] - before[1]) / n / 1024}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp-size", type=int, default=2)
    p.add_argument("--modes", default="hidden,draft-kv,tail")
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    from transformers import AutoTokenizer

    ids = [AutoTokenizer.from_pretrained(MODEL).encode(t) for t in PROMPTS]
    rows = []
    with tempfile.TemporaryDirectory() as logs:
        port = free_port()
        print("starting the aggregated DSpark server ...", flush=True)
        agg = start("aggregated", server_argv(MODEL, port, ["--speculative-algorithm", "DSPARK",
                                                           "--speculative-draft-model-path", DRAFTER]), port, logs)
        try:
            reference = openai_outputs(agg.url, args.max_tokens, show=False)
            rows.append(("aggregated", "-", measure(agg.url, None, ids, args.max_tokens)))
        finally:
            agg.stop()
        for i, mode in enumerate(args.modes.split(",")):
            print(f"\n=== PD, handoff {mode}: router + prefill (--pp-size {args.pp_size}, no drafter) + decode "
                  "(DSpark) ===", flush=True)
            cluster = start_pd(PDSettings(model=MODEL, drafter=DRAFTER, pp_size=args.pp_size, handoff=mode), logs)
            try:
                texts = openai_outputs(cluster.url, args.max_tokens, show=i == 0)
                same = "yes" if texts == reference else "NO"
                rows.append((f"PD {mode}", same, measure(cluster.url, cluster.decode.url, ids, args.max_tokens)))
            finally:
                cluster.stop()
    print(f"\n{'deployment':<14} {'same text':>9} {'accept len':>10} {'TTFT ms':>8} {'handoff KiB/req':>16} "
          f"{'of which DSpark ctx':>20}")
    for name, same, m in rows:
        print(f"{name:<14} {same:>9} {m['accept']:>10.2f} {m['ttft_ms']:>8.0f} {m['kib']:>16,.1f} {m['ctx_kib']:>20,.1f}")


if __name__ == "__main__":
    main()
