"""Paged KV block accounting (plain Python, no torch).

A block holds `page_size` consecutive token slots. Slot `s` of the pool is token `s % page_size` of
block `s // page_size`. Verbs come in pairs: `can_allocate/allocate` and `free`; `check()` is the
invariant that tests run after every step and the server runs when idle.

A block has a reference count: one per owner table holding it, plus one while the prefix cache holds
it (`cache_hold` / `cache_drop`). A request that matched a cached prefix shares its blocks
(`share`), read only. A cached block no request holds (count 1) is *evictable*: it counts as
available, and `allocate` asks the cache's evictor for such blocks when the free list runs short.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Optional


class BlockManager:
    def __init__(self, num_blocks: int, page_size: int) -> None:
        assert num_blocks > 0 and page_size > 0
        self.num_blocks = num_blocks
        self.page_size = page_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks
        # owner -> its block ids, in token order
        self._tables: dict[str, list[int]] = {}
        self._cached: set[int] = set()  # blocks the prefix cache holds (one reference each)
        self.num_evictable = 0  # cached blocks held by nothing else
        self.evictor: Optional[Callable[[int], int]] = (
            None  # frees up to n evictable blocks; returns how many
        )

    # -- queries -----------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks some request holds (cached blocks only the cache holds are not counted)."""
        return self.num_blocks - len(self._free) - self.num_evictable

    @property
    def num_available(self) -> int:
        """Blocks an allocation can get: free, or cached and evictable."""
        return len(self._free) + self.num_evictable

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def blocks_needed(self, owner: str, num_tokens: int) -> int:
        """Extra blocks `owner` needs so that its table covers `num_tokens` token slots."""
        have = len(self._tables.get(owner, ()))
        want = -(-num_tokens // self.page_size)
        return max(0, want - have)

    def can_allocate(self, owner: str, num_tokens: int) -> bool:
        return self.blocks_needed(owner, num_tokens) <= self.num_available

    def table(self, owner: str) -> list[int]:
        return self._tables.get(owner, [])

    def owners(self) -> list[str]:
        return list(self._tables)

    def slots(self, owner: str, start: int, end: int) -> list[int]:
        """Pool slot index of each token position in [start, end) of `owner`."""
        table, ps = self._tables[owner], self.page_size
        return [table[p // ps] * ps + p % ps for p in range(start, end)]

    # -- verbs -------------------------------------------------------------------------------------
    def allocate(self, owner: str, num_tokens: int) -> list[int]:
        """Grow `owner`'s table to cover `num_tokens` slots; returns the new block ids."""
        need = self.blocks_needed(owner, num_tokens)
        if need > len(self._free) and self.evictor is not None:
            self.evictor(need - len(self._free))
        if need > len(self._free):
            raise MemoryError(f"need {need} KV blocks, {len(self._free)} free")
        new = [self._free.popleft() for _ in range(need)]
        for b in new:
            assert self._ref[b] == 0
            self._ref[b] = 1
        self._tables.setdefault(owner, []).extend(new)
        return new

    def share(self, owner: str, blocks: list[int]) -> None:
        """Append cached `blocks` (a matched prefix) to `owner`'s table, which must be empty: read
        only for it."""
        assert not self._tables.get(owner), f"{owner} already owns blocks"
        for b in blocks:
            assert b in self._cached, f"block {b} is not cached"
            self._inc(b)
        self._tables[owner] = list(blocks)

    def free(self, owner: str) -> int:
        """Release every block of `owner` (a no-op for an unknown owner); returns how many were
        freed."""
        table = self._tables.pop(owner, [])
        for b in table:
            self._dec(b)
        return len(table)

    def cache_hold(self, block: int) -> None:
        """The prefix cache takes a reference to `block` (a block some owner holds, with valid
        KV)."""
        assert block not in self._cached and self._ref[block] > 0, f"block {block} cannot be cached"
        self._ref[block] += 1
        self._cached.add(block)

    def cache_drop(self, block: int) -> None:
        """The prefix cache lets `block` go (freed when no owner holds it)."""
        if self.is_evictable(block):
            self.num_evictable -= 1
        self._cached.remove(block)
        self._dec(block)

    def is_cached(self, block: int) -> bool:
        return block in self._cached

    def cached_blocks(self) -> frozenset[int]:
        return frozenset(self._cached)

    def is_evictable(self, block: int) -> bool:
        return block in self._cached and self._ref[block] == 1

    def _inc(self, b: int) -> None:
        if self.is_evictable(b):
            self.num_evictable -= 1
        self._ref[b] += 1

    def _dec(self, b: int) -> None:
        self._ref[b] -= 1
        assert self._ref[b] >= 0, f"block {b} ref count went negative"
        if self._ref[b] == 0:
            self._free.append(b)
        elif self.is_evictable(b):
            self.num_evictable += 1

    def rename(self, owner: str, new_owner: str) -> None:
        """`owner`'s blocks now belong to `new_owner` (which must own none); a no-op for an unknown
        owner."""
        assert new_owner not in self._tables, f"{new_owner} already owns blocks"
        if owner in self._tables:
            self._tables[new_owner] = self._tables.pop(owner)

    def check(self) -> None:
        """Invariant: free + used == total, no block both free and owned, ref counts match the
        tables."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        counts = [0] * self.num_blocks
        for table in self._tables.values():
            for b in table:
                counts[b] += 1
        for b in self._cached:
            counts[b] += 1
        assert counts == self._ref, "ref counts disagree with the block tables and the prefix cache"
        evictable = sum(1 for b in self._cached if counts[b] == 1)
        assert evictable == self.num_evictable, (
            f"{self.num_evictable} evictable counted, {evictable} found"
        )
        assert all(c >= 0 for c in counts)
        used = {b for b, c in enumerate(counts) if c > 0}
        assert not (used & free), f"blocks both free and in use: {sorted(used & free)[:8]}"
        assert len(used) + len(free) == self.num_blocks, (
            f"free {len(free)} + used {len(used)} != total {self.num_blocks}"
        )
