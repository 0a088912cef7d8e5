"""What a long acceptance run keeps (python -m sparkrelay.tools.bench.acceptance --resume): each
finished set and each finished chunk of a set, appended under --out-dir with the settings and the
weights they were measured with, so a stopped run over whole splits measures only the rest."""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

SETS_FILE = "acceptance_sets.jsonl"  # one finished set per line, written as each set ends
CHUNKS_FILE = "acceptance_chunks.jsonl"  # one finished chunk of a set per line
SET_SETTINGS = ("target", "drafter", "token_map", "prompts", "limit", "max_new")


def set_settings(args: argparse.Namespace) -> dict:
    """What a set's figures depend on: a resumed run keeps only rows measured with the same,
    weights included (a drafter trained further keeps its folder's name)."""
    return {**{k: getattr(args, k) for k in SET_SETTINGS}, "weights": weights_digest(args)}


def weights_digest(args: argparse.Namespace) -> str:
    """sha256 (16 hex digits) over the target's and the drafter's *.safetensors files."""
    h = hashlib.sha256()
    for folder in (args.target, args.drafter):
        for path in sorted(Path(folder).glob("*.safetensors")):
            with path.open("rb") as f:
                while chunk := f.read(1 << 24):
                    h.update(chunk)
    return h.hexdigest()[:16]


def recorded(args: argparse.Namespace, name: str) -> list[dict]:
    """The records of file `name` under --out-dir measured with this run's settings (--resume), else
    []."""
    path = Path(args.out_dir) / name
    if not args.resume or not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    mine = set_settings(args)
    return [r for r in rows if r["settings"] == mine]


def finished_sets(args: argparse.Namespace) -> dict[str, dict]:
    """set -> its row from an earlier run with the same settings (--resume), else {}."""
    return {r["row"]["set"]: r["row"] for r in recorded(args, SETS_FILE)}


def finished_chunks(args: argparse.Namespace, name: str) -> dict[int, dict]:
    """first prompt -> the sums of set `name`'s chunk from an earlier run (--resume), else {}."""
    return {r["first"]: r["sums"] for r in recorded(args, CHUNKS_FILE) if r["set"] == name}


def record(args: argparse.Namespace, name: str, entry: dict) -> None:
    """Append `entry` with this run's settings to file `name` under --out-dir: a long run stopped
    later keeps it (--resume)."""
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with (out / name).open("a") as f:
        f.write(json.dumps({"settings": set_settings(args), **entry}) + "\n")
