"""Continuous batching with chunked prefill and recompute preemption (plain Python, no torch).

Each step is either a prefill batch (prefill first, as SGLang does by default) or a decode batch:
  prefill: running requests still mid-prefill, then waiting requests in arrival order, each given a
           chunk of its uncomputed tokens while the step's token budget and free KV blocks last;
  decode:  every running request feeds its last sampled token (plus `decode_lookahead - 1` reserved slots,
           used by speculative decoding); when blocks run out the newest running request is preempted: its
           blocks are freed and it goes back to the front of the waiting queue to be recomputed later.
Running out of blocks therefore delays or preempts a request; it never crashes or corrupts one.

With a prefix cache (scheduler/radix_cache.py), a waiting request first takes the longest cached
prefix of its tokens (its blocks shared, those tokens counted as computed: `cached_tokens`), and a
request's computed full pages join the cache when its prompt is computed (`cache_computed`), when it
is preempted and when it is removed; cached blocks no request holds are evicted, least recently used
first, when an allocation needs them.

The PD roles (disagg/) move requests in and out of the batch only through the verbs below, never by
editing `running` / `waiting` or the block tables:
  decode:  reserve(req, n)         blocks for the prompt, before its KV is received (the prealloc queue); held
           admit_transferred(req)  the prompt's KV arrived: RUNNING with every prompt token computed
  prefill: detach(req)             the first token is sampled: out of the batch, its blocks held while they are sent
           quarantine(req)         a failed one-sided transfer: its blocks kept (a prefill may still be writing
                                   into them) under their own owner until release_quarantined(owner)
  both:    remove(req)             finished, failed or aborted: out of every list, blocks freed (held ones too)
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional

from sparkrelay.scheduler.block_manager import BlockManager
from sparkrelay.scheduler.radix_cache import RadixCache
from sparkrelay.scheduler.request import Request, Status


@dataclass
class ScheduledSeq:
    """Feed tokens [start, end) of `req`; sample after them when `end` reaches the request's last
    token."""

    req: Request
    start: int
    end: int

    @property
    def sample(self) -> bool:
        return self.end == self.req.num_tokens


@dataclass
class Batch:
    kind: str  # "prefill" | "decode"
    seqs: list[ScheduledSeq]

    @property
    def num_tokens(self) -> int:
        return sum(s.end - s.start for s in self.seqs)


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        max_running: int,
        token_budget: int,
        decode_lookahead: int = 1,
        cache: Optional[RadixCache] = None,
        computed_tail: int = 1,
    ) -> None:
        self.blocks = blocks
        self.cache = cache
        self.computed_tail = (
            computed_tail  # positions at the end of a request always computed (a PD tail's rows)
        )
        self.cache_queried_tokens = 0  # tokens of requests matched against the cache
        self.cache_hit_tokens = 0  # of which found in it
        self.max_running = max_running
        self.token_budget = token_budget
        self.decode_lookahead = decode_lookahead
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.held: dict[
            str, Request
        ] = {}  # rid -> a request holding blocks outside the batch (reserved, detached)
        # owners of blocks a failed one-sided transfer may still write
        self.quarantined: set[str] = set()
        self.num_preemptions = 0

    # -- membership --------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, req: Request) -> None:
        """Drop a finished or aborted request and free its blocks (wherever it is: batch, queue or
        held)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.held.pop(req.rid, None)
        self.cache_computed(req)
        self.blocks.free(req.rid)
        req.block_ids = []

    # -- the PD roles' verbs -----------------------------------------------------------------------
    def reserve(
        self,
        req: Request,
        num_tokens: int,
        align: int = 0,
        keep: int = 1,
        needs_draft: Optional[bool] = None,
    ) -> Optional[int]:
        """Blocks for `num_tokens` of `req` outside the batch, if they fit (else nothing changes:
        None). With `align` and a prefix cache, the first blocks are its cached prefix (the leading
        tokens it holds, a multiple of `align`, leaving at least the last `keep` positions to be
        received; needs_draft as RadixCache.match); returns how many tokens that prefix covers (0:
        none)."""
        assert req not in self.running and req not in self.waiting, (
            f"{req.rid} is already scheduled"
        )
        hit = (
            self.cache.match(req.prompt_ids, num_tokens - keep, needs_draft)
            if self.cache and align
            else []
        )
        # pages per aligned unit (align: a multiple of pages)
        per = align // self.blocks.page_size if hit else 1
        hit = hit[: len(hit) // per * per]
        if hit:
            self.blocks.share(req.rid, hit)
        if not self.blocks.can_allocate(req.rid, num_tokens):
            self.blocks.free(req.rid)
            return None
        self.blocks.allocate(req.rid, num_tokens)
        req.block_ids = self.blocks.table(req.rid)
        self.held[req.rid] = req
        if align:
            self._count_hit(req, len(hit) * self.blocks.page_size)
        return len(hit) * self.blocks.page_size

    def admit_transferred(self, req: Request) -> None:
        """A reserved request whose prompt KV arrived joins the batch: RUNNING, every prompt token
        computed; its next step is a decode of the last known token (the first token the prefill
        sampled)."""
        assert self.held.pop(req.rid, None) is req, f"{req.rid} holds no reserved blocks"
        n = len(req.prompt_ids)
        assert len(req.block_ids) * self.blocks.page_size >= n, (
            f"{req.rid}: blocks for {n} tokens were not reserved"
        )
        req.num_computed = n
        req.status = Status.RUNNING
        self.running.append(req)

    def detach(self, req: Request) -> None:
        """`req` leaves the batch but keeps its blocks (a prefill sending its KV); `remove` frees
        them later."""
        self.running.remove(req)
        self.held[req.rid] = req

    def quarantine(self, req: Request) -> str:
        """Keep `req`'s blocks out of use after it is removed; returns their owner for
        release_quarantined()."""
        owner = f"quarantine:{req.rid}"
        self.blocks.rename(req.rid, owner)
        self.quarantined.add(owner)
        req.block_ids = []
        return owner

    def release_quarantined(self, owner: str) -> None:
        self.quarantined.discard(owner)
        self.blocks.free(owner)

    # -- the prefix cache --------------------------------------------------------------------------
    def cache_computed(self, req: Request) -> None:
        """`req`'s full pages of computed tokens join the prefix cache (those already there stay as
        they are)."""
        if self.cache is not None and req.num_computed > 0 and req.block_ids:
            self.cache.insert(
                req.all_ids, self.blocks.table(req.rid), req.num_computed, req.draft_ctx_start
            )

    def flush_cache(self) -> bool:
        """Empty the prefix cache; refused (False) while any request is queued, running or holding
        blocks."""
        if self.cache is None:
            return True
        if self.running or self.waiting or self.held:
            return False
        return self.cache.flush()

    def _match(self, req: Request) -> int:
        """A waiting request (it holds no blocks) takes the longest cached prefix of its tokens;
        returns its length. At least its last token is computed (its logits sample the next one; a
        prefill in `tail` mode: its tail), and so are the prompt positions whose logprobs it asked
        for."""
        if self.cache is None:
            return 0
        limit = req.num_tokens - self.computed_tail
        if req.logprobs is not None and req.logprobs.input_start >= 0:
            # position p is scored by the row of p - 1
            limit = min(limit, req.logprobs.input_start - 1)
        hit = self.cache.match(req.all_ids, limit)
        if hit:
            self.blocks.share(req.rid, hit)
            req.block_ids = self.blocks.table(req.rid)
            req.num_computed = len(hit) * self.blocks.page_size
        return req.num_computed

    def _unmatch(self, req: Request) -> None:
        self.blocks.free(req.rid)
        req.block_ids, req.num_computed = [], 0

    def _count_hit(self, req: Request, hit: int) -> None:
        if self.cache is None:
            return
        self.cache_queried_tokens += req.num_tokens
        self.cache_hit_tokens += hit
        if hit:
            req.cached_tokens = hit
            if self.cache.needs_draft:
                req.draft_ctx_start = (
                    0  # every matched page carries the drafter's context; the rest is computed
                )

    def check(self) -> None:
        """The block invariant (and the cache's), and every block owner is a request this scheduler
        knows."""
        self.blocks.check()
        if self.cache is not None:
            self.cache.check()
        known = {r.rid for r in self.running} | set(self.held) | self.quarantined
        leaked = [owner for owner in self.blocks.owners() if owner not in known]
        assert not leaked, (
            f"blocks held by waiting requests or requests the scheduler does not know: {leaked[:8]}"
        )

    # -- the step ----------------------------------------------------------------------------------
    def schedule(self) -> Batch | None:
        while self.running or self.waiting:
            batch = self._schedule_prefill()
            if batch.seqs:
                return batch
            batch = self._schedule_decode()
            if batch.seqs:
                return batch
            if not self.running:
                # waiting requests that do not fit yet; nothing runs (cannot happen when admission
                # checks capacity)
                return None
            self._preempt(self.running[-1])
        return None

    def _schedule_prefill(self) -> Batch:
        budget, seqs = self.token_budget, []
        mid_prefill = [r for r in self.running if r.num_uncomputed > 1]
        for req in mid_prefill:
            seq = self._chunk(req, budget)
            if seq is not None:
                seqs.append(seq)
                budget -= seq.end - seq.start
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            hit = self._match(self.waiting[0])
            seq = self._chunk(self.waiting[0], budget)
            # arrival order: a later request does not overtake one that does not fit; a waiting
            if seq is None:
                # request holds no blocks (else they could all be held, none run)
                self._unmatch(self.waiting[0])
                break
            self._count_hit(self.waiting[0], hit)
            req = self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            seqs.append(seq)
            budget -= seq.end - seq.start
        return Batch("prefill", seqs)

    def _chunk(self, req: Request, budget: int) -> ScheduledSeq | None:
        """The largest chunk of `req`'s uncomputed tokens that fits the budget and the free
        blocks."""
        ps = self.blocks.page_size
        capacity = (len(self.blocks.table(req.rid)) + self.blocks.num_available) * ps
        end = min(req.num_tokens, req.num_computed + budget, capacity)
        if end <= req.num_computed:
            return None
        self.blocks.allocate(req.rid, end)
        req.block_ids = self.blocks.table(req.rid)
        return ScheduledSeq(req, req.num_computed, end)

    def _schedule_decode(self) -> Batch:
        seqs = []
        for req in list(self.running):
            if req not in self.running or req.num_uncomputed != 1:
                continue
            need = req.num_tokens - 1 + self.decode_lookahead
            while not self.blocks.can_allocate(req.rid, need) and self.running[-1] is not req:
                self._preempt(self.running[-1])
            if not self.blocks.can_allocate(req.rid, need):
                self._preempt(req)
                continue
            self.blocks.allocate(req.rid, need)
            req.block_ids = self.blocks.table(req.rid)
            seqs.append(ScheduledSeq(req, req.num_tokens - 1, req.num_tokens))
        seqs = [s for s in seqs if s.req in self.running]
        return Batch("decode", seqs)

    def _preempt(self, req: Request) -> None:
        """Free `req`'s blocks and queue it first in line; its prompt and outputs are recomputed
        later (from the prefix cache, as far as its pages are still there)."""
        self.running.remove(req)
        self.cache_computed(req)
        self.blocks.free(req.rid)
        req.block_ids = []
        req.num_computed = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
