"""The prefix (radix) cache: page-granular matching, shared blocks with reference counts, LRU
eviction of leaves no request holds, the drafter's-context flag, flush; and the scheduler using it
(check() after every step)."""

import random

import pytest

from sparkrelay.scheduler.block_manager import BlockManager
from sparkrelay.scheduler.radix_cache import RadixCache
from sparkrelay.scheduler.request import Request, SamplingParams
from sparkrelay.scheduler.scheduler import Scheduler

PS = 4


def cached(num_blocks=16, needs_draft=False):
    bm = BlockManager(num_blocks, PS)
    return bm, RadixCache(bm, needs_draft)


def owned(bm, owner, tokens):
    bm.allocate(owner, len(tokens))
    return bm.table(owner)


def check(bm, cache):
    bm.check()
    cache.check()


def test_match_is_page_granular_and_a_hit_shares_the_blocks():
    bm, cache = cached()
    toks = list(range(100, 111))  # 11 tokens: 2 full pages and 3 tokens
    table = owned(bm, "a", toks)
    assert cache.insert(toks, table, len(toks)) == 2
    bm.free("a")
    check(bm, cache)
    assert bm.num_used == 0 and bm.num_evictable == 2 and bm.num_available == 16

    assert cache.match(toks, 11) == table[:2]
    assert cache.match(toks, 7) == table[:1]  # the limit cuts inside page 2: only page 1
    assert cache.match(toks[:4] + [0] * 4, 8) == table[:1]  # a different second page
    # a different first token: nothing, whatever follows
    assert cache.match([0] + toks[1:], 11) == []

    bm.share("b", cache.match(toks, 11))
    assert bm.num_evictable == 0 and bm.num_used == 2
    assert cache.evict(2) == 0  # held by a request: not evictable
    bm.free("b")
    check(bm, cache)
    assert bm.num_evictable == 2


def test_eviction_takes_least_recently_used_leaves_first_then_their_parents():
    bm, cache = cached(num_blocks=6)
    a, b = list(range(8)), list(range(4)) + [50, 51, 52, 53]  # share page 1, differ on page 2
    ta = owned(bm, "a", a)
    cache.insert(a, ta, 8)
    bm.share("b", cache.match(b, 4))
    bm.allocate("b", 8)
    tb = bm.table("b")
    cache.insert(b, tb, 8)
    bm.free("a"), bm.free("b")
    check(bm, cache)
    assert cache.num_nodes == 3 and bm.num_evictable == 3
    cache.match(b, 8)  # b's pages are the most recently used now
    assert cache.evict(1) == 1
    assert cache.match(a, 8) == [ta[0]] and cache.match(b, 8) == tb  # a's leaf went first
    assert cache.evict(5) == 2  # b's leaf, then the shared page, once a leaf
    check(bm, cache)
    assert cache.num_nodes == 0 and bm.num_free == 6


def test_an_allocation_evicts_what_it_needs_and_only_that():
    bm, cache = cached(num_blocks=4)
    toks = list(range(12))
    cache.insert(toks, owned(bm, "a", toks), 12)
    bm.free("a")
    assert bm.num_free == 1 and bm.num_available == 4
    assert bm.can_allocate("b", 8)
    bm.allocate("b", 8)  # 2 blocks: the free one and one evicted (the deepest leaf)
    check(bm, cache)
    assert cache.num_nodes == 2 and cache.match(toks, 12) == cache.match(toks, 8)
    bm.share("c", cache.match(toks, 8))
    with pytest.raises(MemoryError):
        bm.allocate("c", 20)
    bm.free("c")
    check(bm, cache)


def test_insert_keeps_what_is_cached_and_a_duplicate_goes_back_with_its_owner():
    bm, cache = cached()
    toks = list(range(8))
    first = owned(bm, "a", toks)
    second = owned(bm, "b", toks)  # computed the same prompt at the same time
    assert cache.insert(toks, first, 8) == 2
    assert cache.insert(toks, second, 8) == 0
    bm.free("a"), bm.free("b")
    check(bm, cache)
    assert cache.match(toks, 8) == first and bm.num_free == 16 - 2


def test_only_computed_full_pages_are_cached():
    bm, cache = cached()
    toks = list(range(12))
    table = owned(bm, "a", toks)
    assert cache.insert(toks, table, 7) == 1  # tokens 0..6 computed: page 1 only
    bm.free("a")
    assert cache.match(toks, 12) == table[:1]


def test_a_cache_for_a_drafter_stops_at_pages_without_its_context_and_takes_a_better_copy():
    bm, cache = cached(needs_draft=True)
    toks = list(range(12))
    tail = owned(bm, "tail", toks)
    cache.insert(toks, tail, 12, draft_from=6)  # a `tail` decode: context from position 6 on
    assert cache.match(toks, 12) == []  # page 1 has no drafter context
    full = owned(bm, "full", toks)
    cache.insert(toks, full, 12, draft_from=0)
    bm.free("tail"), bm.free("full")
    check(bm, cache)
    # the pages without context replaced, page 3 kept
    assert cache.match(toks, 12) == full[:2] + tail[2:3]
    assert bm.num_free == 16 - 3


def test_flush_is_refused_while_a_block_is_in_use():
    bm, cache = cached()
    toks = list(range(8))
    cache.insert(toks, owned(bm, "a", toks), 8)
    assert not cache.flush()
    check(bm, cache)
    bm.free("a")
    assert cache.flush()
    check(bm, cache)
    assert cache.num_nodes == 0 and bm.num_free == 16


def make(rid, prompt, max_new=3):
    return Request(rid, list(prompt), SamplingParams(max_new_tokens=max_new))


def run(sched, reqs, max_steps=2_000):
    """Fake steps (KV 'computed' as scheduled, token 7 sampled) until every request finishes."""
    for r in reqs:
        sched.add(r)
    for _ in range(max_steps):
        if not sched.has_work():
            return
        batch = sched.schedule()
        for seq in batch.seqs:
            r = seq.req
            assert seq.start == r.num_computed
            assert len(r.block_ids) * PS >= seq.end
            r.num_computed = seq.end
            if seq.sample:
                sched.cache_computed(r)
                r.output_ids.append(7)
                if len(r.output_ids) >= r.params.max_new_tokens:
                    sched.remove(r)
        sched.check()
    raise AssertionError("no progress")


def test_the_scheduler_reuses_a_finished_turn_and_counts_the_hit():
    bm, cache = cached(num_blocks=32)
    sched = Scheduler(bm, max_running=4, token_budget=64, cache=cache)
    turn1 = make("t1", range(1, 21))  # 20 tokens -> 23 with the outputs; 22 computed: 5 full pages
    run(sched, [turn1])
    turn2 = make("t2", turn1.all_ids + [9, 9, 9])  # the next turn extends prompt and answer
    sched.add(turn2)
    batch = sched.schedule()
    assert turn2.cached_tokens == 20 and batch.seqs[0].start == 20
    assert sched.cache_hit_tokens == 20 and sched.cache_queried_tokens == 20 + 26
    run(sched, [])
    assert bm.num_used == 0 and sched.flush_cache() and bm.num_free == 32


def test_a_whole_cached_prompt_still_computes_its_last_token_and_prompt_logprobs_limit_the_hit():
    bm, cache = cached(num_blocks=32)
    sched = Scheduler(bm, max_running=4, token_budget=64, cache=cache)
    run(sched, [make("a", range(1, 17), max_new=1)])
    again = make("b", range(1, 17))
    sched.add(again)
    # 16 tokens cached, the last page recomputed for its logits
    assert sched.schedule().seqs[0].start == 12
    scored = Request(
        "c",
        list(range(1, 17)),
        SamplingParams(max_new_tokens=1, return_logprob=True, logprob_start_len=6),
    )
    sched.add(scored)
    run(sched, [])
    # positions from 6 scored: rows from 5 computed, so pages before 5 only
    assert scored.cached_tokens == 4


def test_under_memory_pressure_the_cache_gives_way_and_every_invariant_holds():
    rng = random.Random(0)
    bm, cache = cached(num_blocks=40)
    sched = Scheduler(bm, max_running=6, token_budget=32, decode_lookahead=3, cache=cache)
    system = [rng.randrange(1000) for _ in range(24)]
    reqs = [
        make(
            f"r{i}",
            system + [rng.randrange(1000) for _ in range(rng.randrange(1, 30))],
            max_new=rng.randrange(1, 20),
        )
        for i in range(60)
    ]
    for i in range(0, 60, 6):
        batch = reqs[i : i + 6]
        if i % 12 == 6:  # some are aborted mid-way
            sched.add(batch[0])
            sched.schedule()
            sched.remove(batch[0])
            batch = batch[1:]
        run(sched, batch)
    assert sched.cache_hit_tokens > 0 and sched.num_preemptions >= 0
    assert bm.num_used == 0  # idle: every block free or cached, none in use
    assert bm.num_free + bm.num_evictable == 40
    assert sched.flush_cache() and bm.num_free == 40


def test_waiting_requests_hold_no_blocks_so_preemption_under_a_full_cache_still_finishes():
    """A request that matched a prefix but got no chunk gives the blocks back: waiting requests
    holding cached prefixes while nothing runs was a deadlock (every block held, none evictable)."""
    rng = random.Random(1)
    bm, cache = cached(num_blocks=24)
    sched = Scheduler(bm, max_running=12, token_budget=8, decode_lookahead=3, cache=cache)
    shared = [rng.randrange(1000) for _ in range(12)]
    reqs = [
        make(
            f"r{i}", shared + [rng.randrange(1000) for _ in range(rng.randrange(1, 20))], max_new=12
        )
        for i in range(20)
    ]
    run(sched, reqs, max_steps=5_000)
    assert sched.num_preemptions > 0 and sched.cache_hit_tokens > 0
    assert bm.num_used == 0


def test_a_computed_tail_is_never_taken_from_the_cache():
    """A PD prefill in `tail` mode computes its prompt's last `tail` positions itself (their rows
    are never cached)."""
    bm, cache = cached(num_blocks=32)
    sched = Scheduler(bm, max_running=4, token_budget=64, cache=cache, computed_tail=8)
    run(sched, [make("a", range(1, 33), max_new=1)])  # 32 tokens: 8 pages cached
    again = make("b", range(1, 33))
    sched.add(again)
    # the last 8 positions (and the page they start in) recomputed
    assert sched.schedule().seqs[0].start == 24


def test_a_decode_reserves_its_cached_prefix_in_whole_pieces():
    """reserve(align): the prompt's cached start, cut to a multiple of `align` (the prefill's
    piece), shared; the rest allocated; nothing held when the rest does not fit."""
    bm, cache = cached(num_blocks=12)
    sched = Scheduler(bm, max_running=4, token_budget=64, cache=cache)
    run(sched, [make("a", range(1, 30), max_new=4)])  # 29 + 4 tokens, 32 computed: 8 pages cached
    turn2 = make("b", list(range(1, 30)) + [7, 7, 7, 7] + [5] * 6)  # 39 tokens
    assert sched.reserve(turn2, 39, align=16) == 32 and turn2.cached_tokens == 32
    assert bm.table("b")[:8] == cache.match(turn2.prompt_ids, 32) and len(bm.table("b")) == 10
    sched.remove(turn2)
    # its rest (28 tokens: 7 pages + 8 shared) does not fit 12 - 8
    big = make("c", list(range(1, 30)) + [9] * 30)
    assert sched.reserve(big, 59, align=16) is None and bm.table("c") == [] and bm.num_used == 0
    # no align: no match (a fake request)
    assert sched.reserve(make("d", range(1, 30)), 29, align=0) == 0
    sched.check()
