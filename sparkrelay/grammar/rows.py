"""The bitmask rows of a forward's sampled rows. A plain decode (or a pipeline's last stage)
samples one row per request: `masks`. A DSpark round masks the drafter's slots as it samples them
and the verify rows with the same masks: `DraftGuide`.

Verify row j of a request gets the grammar's state after d_1..d_j, so the target is judged exactly
as plain constrained decoding would judge it had those drafts been sampled. The drafts come from the
masked drafter, so the grammar accepts them; one it refuses anyway (a grammar that ended) is banned
by the row before it, so it is rejected there whatever the sampler draws, and the rows after it
(left open) are never read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sparkrelay.grammar.backends import Matcher
from sparkrelay.grammar.bitmask import allowing_all, constrain


@dataclass
class Masks:
    """bitmask int32 [T, W] over a forward's sampled rows, and the rows of the requests with a grammar
    (the others, and those after a refused draft, allow every token)."""

    bitmask: torch.Tensor
    rows: list[int]


def masks(matchers: list[Optional[Matcher]], vocab: int) -> Optional[Masks]:
    """One row per request (matcher or None): the tokens its grammar allows next; None when no
    request has a grammar."""
    if all(m is None for m in matchers):
        return None
    bitmask = allowing_all(len(matchers), vocab)
    rows = [r for r, m in enumerate(matchers) if m is not None]
    _fill([(matchers[r], r) for r in rows], bitmask)
    return Masks(bitmask, rows)


def _fill(entries: list[tuple[Matcher, int]], bitmask: torch.Tensor) -> None:
    """Each backend fills its matchers' rows in one call (Matcher.fill_rows)."""
    by_kind: dict[type, list[tuple[Matcher, int]]] = {}
    for m, row in entries:
        by_kind.setdefault(type(m), []).append((m, row))
    for kind, group in by_kind.items():
        kind.fill_rows(group, bitmask)


class DraftGuide:
    """The grammars in the drafter's sampling loop (DSpark's Markov head samples the block's slots
    one after another): before slot k is sampled, each constrained request's matcher takes draft
    d_k and the slot's logits get its mask, so the drafts follow the grammar and their distribution
    q is the masked one (which the acceptance rule then reads). Slot k's mask is the grammar's state
    after d_1..d_k: verify row k's mask too, so the round computes each mask once. `finish` takes
    the last draft (verify row B) and rolls every matcher back to where it began."""

    def __init__(self, matchers: list[Optional[Matcher]], slots: int, vocab: int) -> None:
        self.matchers, self.rows = matchers, slots + 1  # anchor row + one per draft
        self.bitmask = allowing_all(len(matchers) * self.rows, vocab)  # [R * (B + 1), W]
        self.consumed = [0] * len(matchers)
        self.open = [m is not None for m in matchers]

    @classmethod
    def of(
        cls, matchers: list[Optional[Matcher]], slots: int, vocab: int
    ) -> Optional["DraftGuide"]:
        return None if all(m is None for m in matchers) else cls(matchers, slots, vocab)

    def __call__(self, k: int, prev: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Slot k's logits z [R, V] -> masked float32 logits [R, V]; prev [R]: draft d_k (the anchor
        at k = 0, already taken by the matchers)."""
        filled = self._advance(k, prev.tolist() if k else None)
        if not filled:
            return z
        view = self.bitmask.view(len(self.matchers), self.rows, -1)[:, k]  # [R, W]
        return constrain(z, view, filled)

    def finish(self, drafts: torch.Tensor) -> None:
        """drafts [R, B]: take the last one (verify row B's mask), then undo every draft taken."""
        self._advance(self.rows - 1, drafts[:, -1].tolist())
        for m, n in zip(self.matchers, self.consumed):
            if m is not None:
                m.rollback(n)

    def _advance(self, k: int, prev: Optional[list[int]]) -> list[int]:
        """Matchers take d_k (k > 0) and fill row k; -> the requests whose row k was filled (a
        refused or grammar-ending draft leaves the rest of its rows open)."""
        entries, filled = [], []
        for r, m in enumerate(self.matchers):
            if not self.open[r]:
                continue
            if prev is not None:
                if not m.consume(prev[r]):
                    self.open[r] = False
                    continue
                self.consumed[r] += 1
                if m.finished:
                    self.open[r] = False
                    continue
            entries.append((m, r * self.rows + k))
            filled.append(r)
        _fill(entries, self.bitmask)
        return filled

    def verify_masks(self, n: list[int]) -> Masks:
        """The verify pass's masks: request r's n[r] + 1 rows (anchor, d_1..d_n) in order."""
        view = self.bitmask.view(len(self.matchers), self.rows, -1)
        bitmask = torch.cat([view[r, : k + 1] for r, k in enumerate(n)])
        rows, offset = [], 0
        for m, k in zip(self.matchers, n):
            if m is not None:
                rows += range(offset, offset + k + 1)
            offset += k + 1
        return Masks(bitmask, rows)
