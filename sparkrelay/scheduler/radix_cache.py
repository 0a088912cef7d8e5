"""The prefix (radix) cache over paged KV, with SGLang's semantics (plain Python, no torch).

A tree of pages: each node is one full page of `page_size` token ids (its key) under the page before
it, and holds the block whose KV those tokens produced after exactly that prefix. A block's KV
depends on every token before it, so a node is reachable only through its whole prefix.

    match(tokens, limit)   the longest cached run of full pages that is a prefix of tokens[:limit]
    insert(tokens, table, num_valid, draft_from)
                           a request's full pages with valid KV join the tree (the cache takes one reference on
                           each new block: BlockManager.cache_hold); pages already there are left as they are
    evict(n)               least recently used leaves no request holds go back to the free list (the evictor the
                           BlockManager calls when an allocation runs short)
    flush()                everything, when no request holds a cached block

Reference counts are the BlockManager's: a request using a cached prefix holds each of its blocks
(share), so a node in use is never evicted; since a request holds a prefix, a node's ancestors are
in use whenever it is.

DSpark: the drafter's KV lives in the same slots as the target's (spec/proposer.py), so a cached
page carries it, when it was written. A PD decode in `tail` mode has no drafter context before the
tail: those pages are cached with `draft=False`, and a cache that serves a drafter (`needs_draft`)
stops a match at the first such page, so a hit never gives the drafter less context than a recompute
would.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Optional

from sparkrelay.scheduler.block_manager import BlockManager


@dataclass(eq=False)
class Node:
    key: tuple[int, ...]  # the page's token ids
    block: int
    parent: Optional["Node"]
    draft: bool = True  # the drafter's context is written in this page's slots
    last_access: int = 0
    children: dict[tuple[int, ...], "Node"] = field(default_factory=dict)


class RadixCache:
    def __init__(self, blocks: BlockManager, needs_draft: bool = False) -> None:
        self.blocks = blocks
        self.page_size = blocks.page_size
        self.needs_draft = needs_draft
        self.root = Node((), -1, None)
        self._nodes = 0
        self.num_evicted = 0  # pages evicted since start
        self._clock = itertools.count(1)
        blocks.evictor = self.evict

    @property
    def num_nodes(self) -> int:
        return self._nodes

    def _pages(self, tokens: list[int], n: int):
        ps = self.page_size
        for i in range(n // ps):
            yield i, tuple(tokens[i * ps : (i + 1) * ps])

    # -- lookups -----------------------------------------------------------------------------------
    def match(self, tokens: list[int], limit: int, needs_draft: Optional[bool] = None) -> list[int]:
        """Blocks of the longest cached prefix of tokens[:limit], in page order (touched as just
        used). needs_draft (default: the cache's): stop at the first page without the drafter's
        context."""
        node, out, now = self.root, [], next(self._clock)
        draft = self.needs_draft if needs_draft is None else needs_draft
        for _, key in self._pages(tokens, max(0, limit)):
            child = node.children.get(key)
            if child is None or (draft and not child.draft):
                break
            child.last_access = now
            out.append(child.block)
            node = child
        return out

    # -- verbs -------------------------------------------------------------------------------------
    def insert(
        self, tokens: list[int], table: list[int], num_valid: int, draft_from: int = 0
    ) -> int:
        """Cache the full pages of tokens[:num_valid] whose KV is in `table` (the owner's blocks, in
        page order); positions >= draft_from have the drafter's context. Returns how many pages the
        tree gained."""
        node, now, added, ps = self.root, next(self._clock), 0, self.page_size
        for i, key in self._pages(tokens, min(num_valid, len(table) * ps)):
            draft = i * ps >= draft_from
            child = node.children.get(key)
            if child is None:
                if self.blocks.is_cached(table[i]):
                    break  # cannot happen: a cached block sits at its own prefix; stop rather than alias it
                self.blocks.cache_hold(table[i])
                child = node.children[key] = Node(key, table[i], node, draft)
                self._nodes += 1
                added += 1
            elif draft and not child.draft and child.block != table[i]:
                # this request's copy has the drafter's context: keep that one
                self._replace(child, table[i])
            child.last_access = now
            node = child
        return added

    def _replace(self, node: Node, block: int) -> None:
        self.blocks.cache_hold(block)
        self.blocks.cache_drop(node.block)
        node.block, node.draft = block, True

    def evict(self, n: int) -> int:
        """Free up to `n` blocks: least recently used leaves that only the cache holds, their
        parents as they become such leaves. Returns how many were freed."""
        heap = [
            (nd.last_access, id(nd), nd)
            for nd in self._leaves()
            if self.blocks.is_evictable(nd.block)
        ]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < n:
            _, _, nd = heapq.heappop(heap)
            self._remove(nd)
            freed += 1
            self.num_evicted += 1
            parent = nd.parent
            if (
                parent is not self.root
                and not parent.children
                and self.blocks.is_evictable(parent.block)
            ):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def flush(self) -> bool:
        """Drop every cached page; refused (False, nothing changes) while a request holds one."""
        nodes = list(self._walk())
        if any(not self.blocks.is_evictable(nd.block) for nd in nodes):
            return False
        for nd in reversed(nodes):  # children before parents
            self._remove(nd)
        return True

    def _remove(self, nd: Node) -> None:
        assert not nd.children, "only a leaf leaves the tree"
        del nd.parent.children[nd.key]
        self.blocks.cache_drop(nd.block)
        self._nodes -= 1

    # -- walking and the invariant -----------------------------------------------------------------
    def _walk(self):
        stack = list(self.root.children.values())
        while stack:
            nd = stack.pop()
            yield nd
            stack.extend(nd.children.values())

    def _leaves(self):
        return (nd for nd in self._walk() if not nd.children)

    def check(self) -> None:
        """Invariant: the tree's blocks are exactly the blocks the BlockManager counts as cached,
        each once."""
        held = [nd.block for nd in self._walk()]
        assert len(held) == self._nodes, f"{self._nodes} nodes counted, {len(held)} in the tree"
        assert len(set(held)) == len(held), "a block is cached at two nodes"
        assert set(held) == self.blocks.cached_blocks(), (
            "the tree and the BlockManager disagree on the cached blocks"
        )
