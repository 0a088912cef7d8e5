"""The PD roles an Engine is composed with (disagg/), driven without a model: requests in, typed events out.

Decode: prealloc (deferred while the cache is full) -> transferring -> KVArrived; a fake bootstrap host gets zero
KV and never contacts a peer. Prefill: stage reports (typed, through the real inbox socket) -> HandedOff or
HandoffFailed; a fake bootstrap request finishes once its first token is sampled.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from sparkrelay.config import Config
from sparkrelay.disagg.decode_role import DecodeRole
from sparkrelay.disagg.prefill_role import PrefillRole
from sparkrelay.disagg.roles import NEWS_WAIT_S, EngineParts, HandedOff, Handoff, HandoffFailed, KVArrived
from sparkrelay.disagg.stage_report import StageReport, StageReportOutbox
from sparkrelay.kvcache.pool import KVPool
from sparkrelay.scheduler.block_manager import BlockManager
from sparkrelay.scheduler.request import FAKE_BOOTSTRAP_HOST, Bootstrap, Request, RequestError, SamplingParams
from sparkrelay.scheduler.scheduler import Scheduler
from sparkrelay.tools.cluster import free_port
from sparkrelay.transfer.base import SCHEMA_MISMATCH, KVPoll

MODEL = "models/tiny-qwen3"
PAGE = 4


def config(mode: str, **leaves) -> Config:
    return Config().replace(model_path=MODEL, disaggregation_mode=mode, page_size=PAGE,
                            disaggregation_bootstrap_port=free_port(), **leaves).validate()


def request(rid: str, n: int, max_new: int = 4) -> Request:
    return Request(rid, list(range(10, 10 + n)), SamplingParams(max_new_tokens=max_new, temperature=0.0))


def fake(room: int = 5) -> Bootstrap:
    return Bootstrap(FAKE_BOOTSTRAP_HOST, None, room)


@pytest.fixture
def decode():
    role = DecodeRole(config("decode"), torch.float32)
    sched = Scheduler(BlockManager(4, PAGE), max_running=4, token_budget=64)
    pool = KVPool(range(2), 4, PAGE, 2, 8, torch.float32, "cpu")
    for k, v in pool.layers.values():
        k.fill_(1.0)
        v.fill_(1.0)
    role.attach(EngineParts(sched, pool, None, torch.device("cpu"), 4096))
    yield role, sched, pool
    role.close()


def test_aggregated_handoff_is_inert():
    h = Handoff()
    req = request("a", 3)
    h.check(None)
    assert not h.take(req, None) and h.receive() == [] and not h.has_work() and h.stats() == {}
    assert h.status_address == "" and not h.sends_first_token
    with pytest.raises(AssertionError):
        h.send([req])


def test_pd_role_checks_the_bootstrap_fields(decode):
    role, _, _ = decode
    with pytest.raises(RequestError, match="bootstrap_host"):
        role.check(None)
    with pytest.raises(RequestError, match="outside"):
        role.check(Bootstrap("127.0.0.1", None, 0))
    role.check(fake(0))  # never a real room: no room rule applies
    role.take(request("a", 3), Bootstrap("127.0.0.1", None, 77))
    with pytest.raises(RequestError, match="already in use"):
        role.check(Bootstrap("127.0.0.1", None, 77))


def test_decode_prealloc_defers_then_a_fake_request_arrives_with_zero_kv(decode):
    role, sched, pool = decode
    big, small = request("big", 13), request("small", 3)  # 4 blocks, then 1: the second waits for the first
    assert role.take(big, fake()) and role.take(small, fake(6))
    assert role.stats()["num_prealloc"] == 2 and role.has_work()
    events = role.receive()
    assert [type(e) for e in events] == [KVArrived] and events[0].req is big
    assert events[0].first_token == big.prompt_ids[-1] and big.bootstrap_room == 0
    assert role.stats() == {"num_prealloc": 1, "num_transfers_inflight": 0, "num_quarantined": 0,
                            "landed_rooms_total": 0, "handoff_bytes_total": 0, "context_bytes_total": 0}
    slots = torch.tensor(sched.blocks.slots("big", 0, 13))
    assert all(bool((k[slots] == 0).all() and (v[slots] == 0).all()) for k, v in pool.layers.values())
    big.output_ids.append(events[0].first_token)
    sched.admit_transferred(big)  # what the engine does with KVArrived
    assert big.num_computed == 13 and big in sched.running
    assert role.receive() == []  # still no room for `small`
    sched.remove(big)
    role.drop(big)
    assert [e.req for e in role.receive()] == [small]
    sched.check()


def test_decode_drop_of_a_transfer_in_flight_frees_its_room(decode):
    role, sched, _ = decode
    req = request("r", 3)
    role.take(req, Bootstrap("127.0.0.1", free_port(), 99))  # a bootstrap server nobody runs
    assert role.stats()["num_prealloc"] == 1
    events = role.receive()  # blocks reserved, the handshake begun (it can only fail: nobody answers)
    assert all(isinstance(e, HandoffFailed) for e in events) and role.stats()["num_prealloc"] == 0
    assert len(req.block_ids) == 1
    role.drop(req)  # aborted by its client (or done with after its failure)
    sched.remove(req)
    assert not role.has_work() and 99 not in role.by_room
    sched.check()
    assert sched.blocks.num_free == 4


@pytest.fixture
def prefill():
    role = PrefillRole(config("prefill", pp_size=2), torch.float32)
    yield role
    role.close()


def wait_events(role: PrefillRole, want: int, timeout: float = 10.0) -> list:
    events, deadline = [], time.monotonic() + timeout
    while len(events) < want and time.monotonic() < deadline:
        role.wait(idle=True)
        events += role.receive()
    return events


def test_prefill_hands_off_once_every_stage_reported(prefill):
    role = prefill
    assert role.sends_first_token and role.status_address.startswith("tcp://127.0.0.1:")
    done, failed = request("a", 5), request("b", 5)
    assert not role.take(done, Bootstrap("127.0.0.1", None, 11)) and not role.take(failed, Bootstrap("h", None, 12))
    for req in (done, failed):
        req.output_ids.append(3)  # the first token was sampled
    role.send([done, failed])
    assert role.stats() == {"num_transfers_inflight": 2}
    out = StageReportOutbox(role.status_address)
    try:
        out.send(StageReport(11, 0, KVPoll.Success))
        out.send(StageReport(12, 1, KVPoll.Failed, SCHEMA_MISMATCH + "dtype"))
        events = wait_events(role, 1)
        assert [(type(e), e.req.rid) for e in events] == [(HandoffFailed, "b")] and events[0].status_code == 400
        out.send(StageReport(11, 1, KVPoll.Success))  # the second of pp_size = 2 stages
        events = wait_events(role, 1)
        assert [(type(e), e.req.rid) for e in events] == [(HandedOff, "a")]
    finally:
        out.close()
    assert not role.has_work()


def test_prefill_fake_request_finishes_without_a_transfer(prefill):
    req = request("health", 4)
    assert not prefill.take(req, fake())
    assert req.bootstrap_room == 0  # room 0: no pipeline stage captures or sends anything for it
    req.output_ids.append(3)
    prefill.send([req])
    assert prefill.stats() == {"num_transfers_inflight": 0} and prefill.has_work()
    assert [(type(e), e.req) for e in prefill.receive()] == [(HandedOff, req)]
    assert not prefill.has_work()


def test_prefill_wait_ends_on_wake_or_report(prefill):
    """An idle prefill with a transfer in flight waits for news, not a polling period: wake() (a request arrived)
    or a stage's report ends the wait at once; with neither it waits NEWS_WAIT_S."""
    role = prefill
    req = request("a", 5)
    role.take(req, Bootstrap("127.0.0.1", None, 21))
    req.output_ids.append(3)
    role.send([req])
    t = time.monotonic()
    role.wait(idle=True)
    assert time.monotonic() - t >= NEWS_WAIT_S * 0.9
    timer = threading.Timer(0.01, role.wake)
    timer.start()
    t = time.monotonic()
    role.wait(idle=True)
    assert time.monotonic() - t < NEWS_WAIT_S * 0.8
    timer.join()
    assert role.receive() == [] and role.has_work()  # a wake-up is not a report
    out = StageReportOutbox(role.status_address)
    try:
        threading.Timer(0.01, out.send, [StageReport(21, 0, KVPoll.Success)]).start()
        t = time.monotonic()
        role.wait(idle=True)
        assert time.monotonic() - t < NEWS_WAIT_S * 0.8
        time.sleep(0.02)
    finally:
        out.close()
