"""The drafter's chat training data: the target's own answers to the training split of the prompt
sets.

    python -m sparkrelay.tools.train.chat_data --target models/smollm2-135m-instruct \\
        --prompts ../shared/data/prompts --out .cache/train_smollm2_dspark/answers --mode greedy

DeepSpec's recipe: every prompt of the training split (tools/corpus.py: a stable hash puts a fifth
of each set in the evaluation split, never used here) as a single user turn under the target's chat
template with no system message, answered by the target itself through sparkrelay's own offline
engine (continuous batching), greedy (`--mode greedy`) or sampled as DeepSpec regenerates (`--mode
sample`: temperature 0.7, top-p 0.8, top-k 20, a seed per prompt). Rows go to OUT/MODE.jsonl, one
per prompt, appended a chunk at a time: a rerun skips the rows already written, so an interrupted
run resumes where it stopped.

`--split eval --per-set N` answers the first N evaluation prompts of each set instead
(OUT/eval_MODE.jsonl): the training tool's learning curve measures acceptance along them, and never
trains on them.

`--variants K` answers K new prompts per training prompt instead (OUT/MODE_variants.jsonl, rows
with a "v" field): the prompt with every integer redrawn at its digit count (`number_variant`), so a
word problem keeps its wording and gets new arithmetic. More problems of a set's kind is more data
where the drafter overfits the training split; they come from training prompts only.

`--synthetic N` answers N general chat prompts of tools/train/chat_prompts.py instead
(OUT/MODE_synthetic.jsonl, set "chat"): writing, role play, explanations, advice and small programs,
the kinds of request the sets' training splits hold few of.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from pathlib import Path

from sparkrelay.tools.corpus import PROMPT_SETS, read_prompt_set

MODES = {"greedy": dict(temperature=0.0), "sample": dict(temperature=0.7, top_p=0.8, top_k=20)}


def split_prompts(
    folder: str, sets: tuple[str, ...], split: str = "train", per_set: int = 0
) -> list[tuple[str, int, str]]:
    """(set, index in its split, text), interleaved across the sets so that any prefix of the list
    mixes every set; `per_set` > 0 keeps the first that many of each set."""
    per_set_rows = {name: read_prompt_set(folder, name, split) for name in sets}
    per_set = {k: v[:per_set] if per_set else v for k, v in per_set_rows.items()}
    out, longest = [], max(len(v) for v in per_set.values())
    for i in range(longest):
        out.extend((name, i, rows[i]) for name, rows in per_set.items() if i < len(rows))
    return out


def number_variant(text: str, seed: int) -> str:
    """`text` with each integer (a run of digits) replaced by a random one with as many digits and
    no leading zero; `seed` fixes the draw, so a rerun writes the same prompt."""
    rng = random.Random(seed)

    def redraw(m: re.Match) -> str:
        n = len(m.group(0))
        return str(rng.randint(10 ** (n - 1) if n > 1 else 1, 10**n - 1))

    return re.sub(r"\d+", redraw, text)


def variant_prompts(prompts: list[tuple[str, int, str]], k: int) -> list[tuple[str, int, int, str]]:
    """(set, i, v, text): K number variants of each prompt, v = 1..K (v = 0 is the prompt itself);
    prompts without a digit have none."""
    return [
        (name, i, v, number_variant(text, hash_seed(f"{name}:v{v}", i)))
        for name, i, text in prompts
        if re.search(r"\d", text)
        for v in range(1, k + 1)
    ]


def chat_ids(tokenizer, text: str) -> list[int]:
    """One user turn under the chat template, no system message, ready for the assistant's
    answer."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def read_rows(path: Path) -> list[dict]:
    """The rows already written (a torn last line, from a killed run, is dropped)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def output_path(args: argparse.Namespace) -> Path:
    """Where the rows go: eval_MODE.jsonl, MODE_variants.jsonl, MODE_synthetic.jsonl or MODE.jsonl
    under --out."""
    if args.split == "eval":
        return Path(args.out) / f"eval_{args.mode}.jsonl"
    suffix = "_variants" if args.variants else "_synthetic" if args.synthetic else ""
    return Path(args.out) / f"{args.mode}{suffix}.jsonl"


def todo_prompts(args: argparse.Namespace, done: set) -> list[tuple[str, int, int, str]]:
    """(set, i, v, text) still to answer: the split's prompts (v = 0), their number variants or the
    synthetic chat prompts."""
    if args.synthetic:
        from sparkrelay.tools.train.chat_prompts import synthetic_prompts

        items = [("chat", i, 0, text) for i, text in enumerate(synthetic_prompts(args.synthetic))]
        return [p for p in items if p[:3] not in done]
    prompts = split_prompts(args.prompts, tuple(args.sets), args.split, args.per_set)
    if args.variants:
        items = variant_prompts(prompts, args.variants)
    else:
        items = [(name, i, 0, text) for name, i, text in prompts]
    return [p for p in items if p[:3] not in done]


def generate(args: argparse.Namespace) -> Path:
    from sparkrelay import LLM, SamplingParams

    out = output_path(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = read_rows(out)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))  # rewrite without a torn tail
    done = {(r["set"], r["i"], r.get("v", 0)) for r in rows}
    todo = todo_prompts(args, done)
    print(f"{len(done)} answers already written, {len(todo)} to go -> {out}", flush=True)
    if not todo:
        return out
    llm = LLM(args.target, dtype=args.dtype, max_running_requests=args.batch)
    t0, tokens = time.time(), 0
    for c in range(0, len(todo), args.chunk):
        chunk = todo[c : c + args.chunk]
        prompts = [chat_ids(llm.tokenizer, text) for *_, text in chunk]
        # shortest prompts first: requests decoding together have similar lengths, so a batch's
        # attention pads its keys to little more than each row's own
        order = sorted(range(len(chunk)), key=lambda k: len(prompts[k]))
        chunk, prompts = [chunk[k] for k in order], [prompts[k] for k in order]
        params = [
            SamplingParams(
                max_new_tokens=args.max_new,
                seed=hash_seed(s if v == 0 else f"{s}:v{v}", i),
                **MODES[args.mode],
            )
            for s, i, v, _ in chunk
        ]
        results = llm.generate(prompts, params)
        with out.open("a") as f:
            for (name, i, v, _), ids, res in zip(chunk, prompts, results):
                row = {"set": name, "i": i} | ({"v": v} if v else {})
                row |= {
                    "prompt_ids": ids,
                    "answer_ids": res["output_ids"],
                    "finish": res["meta_info"]["finish_reason"],
                }
                f.write(json.dumps(row) + "\n")
        tokens += sum(len(r["output_ids"]) for r in results)
        el = time.time() - t0
        print(
            f"answers {len(done) + c + len(chunk)}/{len(done) + len(todo)} new tokens {tokens} "
            f"{tokens / el:.0f} tok/s {el:.0f}s",
            flush=True,
        )
    return out


def hash_seed(name: str, i: int) -> int:
    import hashlib

    return int(hashlib.sha1(f"{name}:{i}".encode()).hexdigest()[:8], 16)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--target", default="models/smollm2-135m-instruct")
    p.add_argument(
        "--prompts", default="../shared/data/prompts", help="folder of the {set}.jsonl prompt sets"
    )
    p.add_argument("--sets", nargs="+", default=list(PROMPT_SETS))
    p.add_argument("--out", default=".cache/train_smollm2_dspark/answers")
    p.add_argument("--mode", choices=sorted(MODES), default="greedy")
    p.add_argument("--split", choices=("train", "eval"), default="train")
    p.add_argument(
        "--per-set", type=int, default=0, help="only the first N prompts of each set (0: all)"
    )
    p.add_argument("--max-new", type=int, default=512)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=32, help="requests decoded together")
    p.add_argument("--chunk", type=int, default=64, help="prompts per appended chunk")
    p.add_argument(
        "--variants",
        type=int,
        default=0,
        help="answer K number variants of each training prompt instead (MODE_variants.jsonl)",
    )
    p.add_argument(
        "--synthetic",
        type=int,
        default=0,
        help="answer N general chat prompts of chat_prompts.py instead (MODE_synthetic.jsonl)",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.variants and args.split != "train":
        parser.error("--variants makes new prompts from the training split only (--split train)")
    if args.synthetic and (args.variants or args.split != "train"):
        parser.error("--synthetic is its own training data: not with --variants or --split eval")
    generate(args)


if __name__ == "__main__":
    main()
