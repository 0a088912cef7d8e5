"""The corpus every machine has: the running Python's standard-library source, split by a stable
hash."""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

SKIP_DIRS = ("site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__")


def stdlib_files() -> tuple[list[Path], list[Path]]:
    """Return (train, held_out) lists of stdlib source files, split by a stable hash of the path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, held = [], []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in SKIP_DIRS for part in rel.parts[:-1]):
            continue
        bucket = int(hashlib.sha1(str(rel).encode()).hexdigest(), 16) % 100
        (held if bucket >= 98 else train).append(path)
    return train, held


def read_texts(paths: list[Path]) -> list[str]:
    texts = []
    for path in paths:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return texts


PROMPT_SETS = ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench", "livecodebench")
EVAL_BUCKETS = 20  # of 100: a fifth of each set is the evaluation split


def prompt_split(text: str) -> str:
    """'eval' or 'train' by a stable hash of the prompt text, so the split survives reordering and
    new rows."""
    return (
        "eval" if int(hashlib.sha1(text.encode()).hexdigest(), 16) % 100 < EVAL_BUCKETS else "train"
    )


def read_prompt_set(folder: str | Path, name: str, split: str) -> list[str]:
    """First user turns of `folder/name.jsonl` ({"turns": [...]} rows) in `split` ('train' |
    'eval'), file order."""
    import json

    path = Path(folder) / f"{name}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"prompt set {path} not found (--prompts names the folder of the *.jsonl sets)"
        )
    rows = [json.loads(line)["turns"][0] for line in path.read_text().splitlines() if line.strip()]
    return [t for t in rows if prompt_split(t) == split]
