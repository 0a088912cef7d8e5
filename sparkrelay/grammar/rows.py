"""The bitmask rows of a forward's sampled rows. A plain decode (or a pipeline's last stage)
samples one row per request: `masks`. A DSpark round masks the drafter's slots as it samples them
and the verify rows with the same masks: `DraftGuide`.

Verify row j of a request gets the grammar's state after d_1..d_j, so the target is judged exactly
as plain constrained decoding would judge it had those drafts been sampled. The drafts come from the
masked drafter, so the grammar accepts them; one it refuses anyway (a grammar that ended) is banned
by the row before it, so it is rejected there whatever the sampler draws, and the rows after it
(left open) are never read.

A greedy row's mask is computed only when the grammar refuses the row's argmax (`Deferred`): where
it allows it, the masked argmax is that same token (first of equal maxima either way), so the row
needs no mask: asking about one token is far cheaper than a whole-vocabulary mask (figures:
docs/structured_outputs.md; llama.cpp's grammar sampler checks the sampled token first too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from sparkrelay.grammar.backends import Matcher
from sparkrelay.grammar.bitmask import allowing_all, ban_, constrain
from sparkrelay.models.argmax import argmax


@dataclass
class Deferred:
    """A greedy row whose mask waits for its logits: the matcher, the tokens after its current state
    that lead to the row (`prefix`), and the draft the row verifies (None for a request's last row).
    The draft was proposed under the grammar, so the grammar allows it there."""

    row: int
    matcher: Matcher
    prefix: list[int] = field(default_factory=list)
    draft: Optional[int] = None
    filled: bool = False  # its mask is in the bitmask already (the drafter needed it)

    def fill(self, bitmask: torch.Tensor) -> None:
        """Write the row's mask into bitmask [T, W] (the matcher walks the prefix and back)."""
        taken = 0
        for t in self.prefix:
            if not self.matcher.consume(t):
                break
            taken += 1
        self.matcher.fill(bitmask, self.row)
        self.matcher.rollback(taken)
        self.filled = True


@dataclass
class Masks:
    """bitmask int32 [T, W] over a forward's sampled rows; `rows`: those masked before sampling (the
    others allow every token); `chains`: per greedy request with a grammar, its rows in order,
    masked only where the grammar refuses the row's argmax (`settle`)."""

    bitmask: torch.Tensor
    rows: list[int]
    chains: list[list[Deferred]] = field(default_factory=list)

    def apply(self, scores: torch.Tensor, writable: bool = False) -> torch.Tensor:
        """scores [T, V] (penalised) -> scores with every banned token that can matter at -inf: the
        filled rows, then each chain's rows in order up to the first whose (masked) argmax is not
        its draft, since greedy verification reads no row after it. scores is written only where
        `writable` (float32 logits nobody reads again: no copy of a verify pass's [T, V])."""
        own = writable and scores.dtype == torch.float32
        if own:
            ban_(scores, self.bitmask, self.rows)
        out = scores if own else constrain(scores, self.bitmask, self.rows)
        for chain in self.chains:
            for d in chain:
                top = int(argmax(out[d.row]))
                if top != d.draft and not d.matcher.allows(d.prefix + [top]):
                    if not d.filled:
                        d.fill(self.bitmask)
                    if out is scores and not own:  # the first row masked here: a copy to write
                        out = scores.to(torch.float32, copy=True)
                    ban_(out, self.bitmask, [d.row])
                    top = int(argmax(out[d.row]))
                if top != d.draft:
                    break
        return out


def masks(
    matchers: list[Optional[Matcher]], vocab: int, greedy: Optional[list[bool]] = None
) -> Optional[Masks]:
    """One row per request (matcher or None): the tokens its grammar allows next, filled now, or for
    a greedy request (`greedy`) only if its argmax is refused; None when no request has a grammar.
    A pipeline's rank 0, which ships the masks before the logits exist, passes no `greedy`."""
    if all(m is None for m in matchers):
        return None
    lazy = greedy or [False] * len(matchers)
    bitmask = allowing_all(len(matchers), vocab)
    rows = [r for r, m in enumerate(matchers) if m is not None and not lazy[r]]
    _fill([(matchers[r], r) for r in rows], bitmask)
    chains = [[Deferred(r, m)] for r, m in enumerate(matchers) if m is not None and lazy[r]]
    return Masks(bitmask, rows, chains)


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
    after d_1..d_k: verify row k's mask too, so the round computes each mask once. A greedy
    request's slot is masked only when the grammar refuses the slot's argmax, and its verify rows
    are settled from the target's logits (`Masks.apply`). `finish` takes the last draft (verify row
    B) and rolls every matcher back to where it began."""

    def __init__(
        self,
        matchers: list[Optional[Matcher]],
        slots: int,
        vocab: int,
        greedy: Optional[list[bool]] = None,
    ) -> None:
        self.matchers, self.rows = matchers, slots + 1  # anchor row + one per draft
        self.greedy = greedy or [False] * len(matchers)
        self.bitmask = allowing_all(len(matchers) * self.rows, vocab)  # [R * (B + 1), W]
        self.consumed = [0] * len(matchers)
        self.open = [m is not None for m in matchers]
        self.filled = [[False] * self.rows for _ in matchers]  # [R][B + 1]
        self.reached = [0] * len(matchers)  # rows 0..reached-1 of a request are under its grammar

    @classmethod
    def of(
        cls,
        matchers: list[Optional[Matcher]],
        slots: int,
        vocab: int,
        greedy: Optional[list[bool]] = None,
    ) -> Optional["DraftGuide"]:
        return None if all(m is None for m in matchers) else cls(matchers, slots, vocab, greedy)

    def __call__(self, k: int, prev: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Slot k's logits z float32 [R, V] (the Markov head's own buffer) -> z, masked in place;
        prev [R]: draft d_k (the anchor at k = 0, already taken by the matchers)."""
        reached = self._advance(prev.tolist() if k else None)
        tops = argmax(z).tolist() if any(self.greedy[r] for r in reached) else []
        filled = [
            r for r in reached if not self.greedy[r] or not self.matchers[r].allows([tops[r]])
        ]
        self._fill_slot(k, filled)
        if filled:
            ban_(z, self.bitmask.view(len(self.matchers), self.rows, -1)[:, k], filled)  # [R, W]
        return z

    def finish(self, drafts: torch.Tensor) -> None:
        """drafts [R, B]: take the last one (verify row B's mask; a greedy request's waits for the
        target's logits), then undo every draft taken."""
        reached = self._advance(drafts[:, -1].tolist())
        self._fill_slot(self.rows - 1, [r for r in reached if not self.greedy[r]])
        for m, n in zip(self.matchers, self.consumed):
            if m is not None:
                m.rollback(n)

    def _advance(self, prev: Optional[list[int]]) -> list[int]:
        """Matchers take d_k (prev, k > 0); -> the requests whose next row is under their grammar (a
        refused or grammar-ending draft leaves the rest of its rows open)."""
        reached = []
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
            self.reached[r] += 1
            reached.append(r)
        return reached

    def _fill_slot(self, k: int, requests: list[int]) -> None:
        _fill([(self.matchers[r], r * self.rows + k) for r in requests], self.bitmask)
        for r in requests:
            self.filled[r][k] = True

    def verify_masks(self, n: list[int], drafts: Optional[list[list[int]]] = None) -> Masks:
        """The verify pass's masks: request r's n[r] + 1 rows (anchor, d_1..d_n) in order; a greedy
        request's rows as a chain (drafts [R][>= n[r]]: the drafts they verify)."""
        view = self.bitmask.view(len(self.matchers), self.rows, -1)
        bitmask = torch.cat([view[r, : k + 1] for r, k in enumerate(n)])
        rows, chains, offset = [], [], 0
        for r, (m, k) in enumerate(zip(self.matchers, n)):
            under = min(k + 1, self.reached[r])  # rows after a refused draft stay open
            if m is not None and self.greedy[r]:
                d = drafts[r]
                chains.append(
                    [
                        Deferred(offset + j, m, d[:j], d[j] if j < k else None, self.filled[r][j])
                        for j in range(under)
                    ]
                )
            elif m is not None:
                rows += range(offset, offset + under)
            offset += k + 1
        return Masks(bitmask, rows, chains)
