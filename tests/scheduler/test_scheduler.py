"""Scheduler unit tests: a fake model step drives requests; `check()` runs after every step."""

import random

import pytest

from sparkrelay.scheduler.block_manager import BlockManager
from sparkrelay.scheduler.request import Request, SamplingParams
from sparkrelay.scheduler.scheduler import Scheduler


def make(rid, prompt_len, max_new):
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_new_tokens=max_new))


def drive(sched: Scheduler, bm: BlockManager, reqs, max_steps=10_000):
    """Run fake steps until all requests finish; returns (steps, kinds)."""
    for r in reqs:
        sched.add(r)
    kinds, steps = [], 0
    while sched.has_work():
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
        batch = sched.schedule()
        assert batch is not None
        kinds.append(batch.kind)
        assert batch.num_tokens <= max(sched.token_budget, len(batch.seqs))
        for seq in batch.seqs:
            r = seq.req
            assert seq.start == r.num_computed, "a chunk must start where the KV ends"
            assert len(bm.table(r.rid)) * bm.page_size >= seq.end, "fed tokens must have slots"
            r.num_computed = seq.end
            if seq.sample:
                r.output_ids.append(7)
                if len(r.output_ids) >= r.params.max_new_tokens:
                    r.finish({"type": "length"})
                    sched.remove(r)
        bm.check()
        owned = sum(len(bm.table(r.rid)) for r in sched.running)
        assert owned == bm.num_used, "only running requests hold blocks"
    return steps, kinds


def test_chunked_prefill_respects_budget():
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_running=8, token_budget=16)
    reqs = [make("long", 50, 3), make("short", 5, 3)]
    _, kinds = drive(sched, bm, reqs)
    # 50 tokens in chunks of 16, the short one joins the last chunk
    assert kinds[:4] == ["prefill"] * 4
    assert all(r.is_finished and len(r.output_ids) == 3 for r in reqs)
    assert bm.num_free == 64


def test_max_running_limits_admission():
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_running=2, token_budget=1000)
    for i in range(5):
        sched.add(make(str(i), 4, 4))
    batch = sched.schedule()
    assert len(batch.seqs) == 2 and len(sched.waiting) == 3


def test_kv_exhaustion_preempts_and_everything_finishes():
    bm = BlockManager(num_blocks=12, page_size=4)  # 48 slots for requests that want up to 36 each
    sched = Scheduler(bm, max_running=8, token_budget=64)
    reqs = [make(str(i), 10 + i, 20) for i in range(6)]
    drive(sched, bm, reqs)
    assert sched.num_preemptions > 0
    assert all(r.is_finished and len(r.output_ids) == 20 for r in reqs)
    assert bm.num_free == 12


def test_random_workloads_keep_invariants():
    rng = random.Random(0)
    for trial in range(20):
        bm = BlockManager(num_blocks=rng.randint(10, 30), page_size=rng.choice([1, 2, 4, 16]))
        sched = Scheduler(
            bm,
            max_running=rng.randint(1, 6),
            token_budget=rng.randint(1, 40),
            decode_lookahead=rng.choice([1, 3]),
        )
        cap = bm.num_blocks * bm.page_size
        reqs = []
        for i in range(rng.randint(1, 8)):
            prompt = rng.randint(1, max(1, cap // 2))
            new = rng.randint(1, max(1, cap - prompt - sched.decode_lookahead))
            reqs.append(make(f"{trial}-{i}", prompt, new))
        drive(sched, bm, reqs)
        assert all(r.is_finished for r in reqs)
        assert bm.num_free == bm.num_blocks


def test_abort_frees_blocks():
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, max_running=4, token_budget=64)
    a, b = make("a", 10, 5), make("b", 3, 5)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    assert bm.num_used > 0
    sched.remove(a)
    sched.remove(b)
    bm.check()
    assert bm.num_free == 16 and not sched.has_work()


# ---- the PD roles' verbs: reserve -> admit_transferred (decode), detach (prefill), remove (both) ----


def test_reserve_then_admit_transferred_decodes_from_the_prompt_end():
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_running=4, token_budget=64)
    req = make("d", 10, 3)
    assert sched.reserve(req, 10) == 0  # reserved, no cached prefix
    assert len(req.block_ids) == 3 and not sched.has_work() and req not in sched.running
    sched.check()
    req.output_ids.append(42)  # the prefill's first token
    sched.admit_transferred(req)
    assert req.num_computed == 10 and req in sched.running and req.status.value == "running"
    batch = sched.schedule()
    assert batch.kind == "decode" and [(s.start, s.end) for s in batch.seqs] == [(10, 11)]
    sched.remove(req)
    sched.check()
    assert bm.num_free == 8


def test_reserve_refuses_without_touching_anything_when_full():
    bm = BlockManager(4, 4)
    sched = Scheduler(bm, max_running=4, token_budget=64)
    a, b = make("a", 12, 1), make("b", 8, 1)
    assert sched.reserve(a, 12) == 0
    assert sched.reserve(b, 8) is None  # does not fit
    assert b.block_ids == [] and bm.table("b") == [] and bm.num_free == 1
    sched.check()
    sched.remove(a)  # a reserved request that never arrives (failed, aborted) gives its blocks back
    assert sched.reserve(b, 8) == 0
    sched.remove(b)
    sched.check()
    assert bm.num_free == 4


def test_admit_needs_a_reservation():
    sched = Scheduler(BlockManager(4, 4), max_running=4, token_budget=64)
    with pytest.raises(AssertionError):
        sched.admit_transferred(make("x", 4, 1))


def test_detach_keeps_blocks_out_of_the_batch_until_removed():
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_running=4, token_budget=64)
    p, other = make("p", 9, 1), make("o", 5, 4)
    for r in (p, other):
        sched.add(r)
    batch = sched.schedule()
    for seq in batch.seqs:
        seq.req.num_computed = seq.end
        seq.req.output_ids.append(7)
    used = bm.num_used
    sched.detach(p)  # the prefill's first token is sampled: its KV is being sent
    assert p not in sched.running and bm.num_used == used and len(p.block_ids) == 3
    sched.check()
    batch = sched.schedule()
    assert [s.req for s in batch.seqs] == [other]  # the detached request is never scheduled again
    sched.remove(p)
    sched.check()
    assert bm.num_used == len(bm.table("o"))


def test_check_catches_a_leaked_block_table():
    bm = BlockManager(4, 4)
    sched = Scheduler(bm, max_running=4, token_budget=64)
    bm.allocate("ghost", 4)  # blocks of a request the scheduler never heard of
    with pytest.raises(AssertionError, match="ghost"):
        sched.check()
