"""The bitmask rows of one forward's sampled rows: a plain decode samples one row per request, a
DSpark verify k + 1 (row j follows the drafts d_1..d_j).

Row j of a verify gets the grammar's mask after d_1..d_j, so the target is judged exactly as plain
constrained decoding would judge it had those drafts been sampled: the matcher walks the drafts it
accepts and rolls back. A draft the grammar refuses is banned by the row before it, so it is
rejected there whatever the sampler draws, and the rows after it (left open) are never read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sparkrelay.grammar.backends import Matcher
from sparkrelay.grammar.bitmask import allowing_all


@dataclass
class Masks:
    """bitmask int32 [T, W] over a forward's sampled rows, and the rows of the requests with a grammar
    (the others, and those after a refused draft, allow every token)."""

    bitmask: torch.Tensor
    rows: list[int]


def masks(
    matchers: list[Optional[Matcher]], drafts: list[list[int]], vocab: int
) -> Optional[Masks]:
    """Per request r (matcher or None), len(drafts[r]) + 1 consecutive rows; None when no request has
    a grammar. Each backend fills its matchers' rows in one call (Matcher.fill_walks); every matcher
    ends where it began."""
    if all(m is None for m in matchers):
        return None
    bitmask = allowing_all(sum(len(d) + 1 for d in drafts), vocab)
    rows, offset = [], 0
    walks: dict[type, list[tuple[Matcher, int, list[int]]]] = {}
    for m, d in zip(matchers, drafts):
        if m is not None:
            walks.setdefault(type(m), []).append((m, offset, d))
            rows += range(offset, offset + len(d) + 1)
        offset += len(d) + 1
    for kind, group in walks.items():
        kind.fill_walks(group, bitmask)
    return Masks(bitmask, rows)
