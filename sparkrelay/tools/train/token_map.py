"""The drafter's draft vocabulary (`--speculative-token-map`): the tokens the target writes most.

    python -m sparkrelay.tools.train.token_map --target models/smollm2-135m-instruct \\
        --answers data/smollm2-answers/greedy.jsonl.gz data/smollm2-answers/sample.jsonl.gz \\
        --size 16384 --out models/smollm2-135m-instruct-dspark/token_map.json

FR-Spec's recipe: rank the tokens by how often the target's own answers use them (the answer rows
of tools/train/chat_data.py, training split only: the evaluation split is never read), then fill up
to `--size` with the lowest ids not yet taken (a BPE vocabulary numbers its tokens in merge order,
frequent pieces first), and always keep the target's end-of-sequence ids, so a draft can end an
answer. Writes a sorted JSON list of ids and prints the share of answer tokens it covers.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
from pathlib import Path


def read_answers(paths: list[str]) -> collections.Counter:
    """Token id -> count over the `answer_ids` of every row of the JSON-lines files (.gz or not)."""
    counts: collections.Counter = collections.Counter()
    for path in paths:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            for line in f:
                counts.update(json.loads(line)["answer_ids"])
    return counts


def end_ids(target: str) -> set[int]:
    """The target's end-of-sequence ids (generation_config.json's, else config.json's)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = Path(target) / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return ids


def token_map(counts: collections.Counter, size: int, vocab: int, keep: set[int]) -> list[int]:
    """`keep`, then the most used ids (ties: lower id first), then the lowest ids left, up to `size`."""
    chosen = dict.fromkeys(sorted(keep))
    for token, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(chosen) >= size:
            break
        chosen.setdefault(token)
    for token in range(vocab):
        if len(chosen) >= size:
            break
        chosen.setdefault(token)
    return sorted(chosen)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--target", required=True, help="The target's folder (vocabulary size, EOS ids)."
    )
    p.add_argument("--answers", nargs="+", required=True, help="Answer rows (training split).")
    p.add_argument("--size", type=int, default=16384, help="Tokens in the map.")
    p.add_argument("--out", required=True, help="The JSON file to write.")
    args = p.parse_args(argv)
    vocab = json.loads((Path(args.target) / "config.json").read_text())["vocab_size"]
    if not 0 < args.size <= vocab:
        p.error(f"--size {args.size} must be in 1..{vocab} (the target's vocab_size)")
    counts = read_answers(args.answers)
    ids = token_map(counts, args.size, vocab, end_ids(args.target))
    Path(args.out).write_text(json.dumps(ids) + "\n")
    covered = sum(counts[t] for t in ids) / max(sum(counts.values()), 1)
    print(
        f"{args.out}: {len(ids)} of {vocab} tokens; {covered:.2%} of the {sum(counts.values())} "
        f"answer tokens read ({len(counts)} distinct)",
        flush=True,
    )


if __name__ == "__main__":
    main()
