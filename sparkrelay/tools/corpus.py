"""The corpus every machine has: the running Python's standard-library source, split by a stable hash."""

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
