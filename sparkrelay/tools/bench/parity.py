"""Greedy parity with transformers on a real model: sparkrelay serving a GGUF file against
transformers loading the same file, float32, chat prompts.

    python -m sparkrelay.tools.bench.parity [--model FILE.gguf | FOLDER] [--new 64]

For each of 16 chat questions (single user turn, the model's chat template), both generate `--new`
tokens greedily (no stop at EOS, so every position is compared). A prompt passes when the token
lists are equal; where they differ, the report gives the first diverging position and, at it,
transformers' gap between its two highest
logits: a gap below 1e-3 is a near-tie, where float32 summation order alone may pick either token.
Writes parity.md and parity.json under --out-dir.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from sparkrelay.tools.bench.common import (
    header_lines,
    markdown_table,
    provenance,
    write_json,
    write_markdown,
)

QUESTIONS = (
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a Python function that reverses a string.",
    "What are the three states of matter?",
    "Give me a recipe for a simple pancake.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "List four planets of the solar system.",
    "Write a haiku about the sea.",
    "What is 12 times 7? Explain your steps.",
    "How do I make a cup of tea?",
    "Summarize the plot of Romeo and Juliet.",
    "What does a CPU do in a computer?",
    "Suggest a name for a pet turtle.",
    "Write a SQL query that counts the rows of a table named users.",
    "What is the boiling point of water?",
)
NEAR_TIE = 1e-3


def default_model() -> str:
    """The GGUF file set-up converted (recorded in the converted folder's source.json)."""
    import json

    return json.loads(Path("models/smollm2-135m-instruct/source.json").read_text())["gguf"]


def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    p = Path(path)
    kw = {"gguf_file": p.name} if p.suffix == ".gguf" else {}
    return AutoModelForCausalLM.from_pretrained(
        str(p.parent if kw else p), dtype=torch.float32, **kw
    ).eval()


@torch.inference_mode()
def hf_greedy_logits(model, prompt: list[int], new: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens and, per step, its logits [V] (the gap is read at the diverging
    step)."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens, logits = [], []
    for _ in range(new):
        row = out.logits[0, -1]
        logits.append(row)
        tokens.append(int(row.argmax()))
        out = model(
            torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True
        )
    return tokens, logits


def compare(ours: list[int], ref: list[int], logits: list[torch.Tensor]) -> dict:
    first = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
    if first is None:
        return {"equal": True}
    top2 = logits[first].topk(2).values
    return {
        "equal": False,
        "first_diff": first,
        "ours": ours[first],
        "theirs": ref[first],
        "logit_gap": float(top2[0] - top2[1]),
        "near_tie": float(top2[0] - top2[1]) < NEAR_TIE,
    }


def main(argv: list[str] | None = None) -> int:
    from sparkrelay import LLM, SamplingParams
    from sparkrelay.tools.train.chat_data import chat_ids

    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model",
        default=None,
        help="a .gguf file or a folder (default: set-up's SmolLM2 GGUF file)",
    )
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--out-dir", default="benchmarks/results/parity")
    args = p.parse_args(argv)
    model = args.model or default_model()
    llm = LLM(model, dtype="float32", max_total_tokens=8192)
    hf = hf_model(model)
    prompts = [chat_ids(llm.tokenizer, q) for q in QUESTIONS]
    ours = [
        o["output_ids"]
        for o in llm.generate(
            prompts, SamplingParams(max_new_tokens=args.new, temperature=0, ignore_eos=True)
        )
    ]
    rows = []
    for q, prompt, mine in zip(QUESTIONS, prompts, ours):
        ref, logits = hf_greedy_logits(hf, prompt, args.new)
        rows.append({"question": q, **compare(mine, ref, logits)})
        print(q, rows[-1], flush=True)
    equal = sum(r["equal"] for r in rows)
    others_near_tie = all(r["near_tie"] for r in rows if not r["equal"])
    verdict = "PASS" if equal >= 15 and others_near_tie else "FAIL"
    record = provenance("sparkrelay.tools.bench.parity", argv)
    header = [
        *header_lines(record),
        f"model {model}; float32, greedy, {args.new} new tokens, chat template; sparkrelay reads the GGUF "
        "file itself, transformers loads the same file (gguf_file=)",
    ]
    table = markdown_table(
        ["question", "equal", "first diff", "transformers' top-2 logit gap there"],
        [
            [
                r["question"],
                "yes" if r["equal"] else "no",
                r.get("first_diff", "-"),
                f"{r['logit_gap']:.2e}" if "logit_gap" in r else "-",
            ]
            for r in rows
        ],
    )
    notes = [
        f"{equal}/{len(rows)} equal token for token; the others diverge at a near-tie (gap < {NEAR_TIE}): "
        f"{'yes' if others_near_tie else 'no'}. Verdict: {verdict}"
    ]
    out = Path(args.out_dir)
    write_markdown(out / "parity.md", "Greedy parity with transformers", header, table, notes)
    write_json(
        out / "parity.json",
        {
            **record,
            "model": model,
            "new": args.new,
            "rows": rows,
            "equal": equal,
            "verdict": verdict,
        },
    )
    print(table + "\n" + notes[0])
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
