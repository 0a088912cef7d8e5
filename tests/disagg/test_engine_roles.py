"""The PD roles an Engine is composed with (disagg/), driven without a model: requests in, typed
events out.

Decode: prealloc (deferred while the cache is full) -> transferring -> KVArrived (the first token, before the
writes) -> KVWritten; a fake bootstrap host gets zero KV and never contacts a peer. Prefill: stage reports (typed,
through the real inbox socket) -> HandedOff or HandoffFailed; a fake bootstrap request finishes once its first token
is sampled.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from sparkrelay.config import Config, ConfigError
from sparkrelay.disagg.decode_role import DecodeRole
from sparkrelay.disagg.handoff import part_of
from sparkrelay.disagg.metadata import MetadataLayout, MetadataRow, pack
from sparkrelay.disagg.prefill_role import PrefillRole
from sparkrelay.disagg.roles import (
    NEWS_WAIT_S,
    EngineParts,
    HandedOff,
    HandoffFailed,
    KVArrived,
    KVWritten,
    Role,
)
from sparkrelay.disagg.stage_report import StageReport, StageReportOutbox
from sparkrelay.kvcache.pool import KVPool
from sparkrelay.scheduler.block_manager import BlockManager
from sparkrelay.scheduler.request import (
    FAKE_BOOTSTRAP_HOST,
    Bootstrap,
    Request,
    RequestError,
    SamplingParams,
)
from sparkrelay.scheduler.scheduler import Scheduler
from sparkrelay.tools.cluster import free_port
from sparkrelay.transfer.base import SCHEMA_MISMATCH, KVPoll, PollResult, piece_name

MODEL = "models/tiny-qwen3"
PAGE = 4


def config(mode: str, **leaves) -> Config:
    return (
        Config()
        .replace(
            model_path=MODEL,
            disaggregation_mode=mode,
            page_size=PAGE,
            disaggregation_bootstrap_port=free_port(),
            **leaves,
        )
        .validate()
    )


def request(rid: str, n: int, max_new: int = 4) -> Request:
    return Request(
        rid, list(range(10, 10 + n)), SamplingParams(max_new_tokens=max_new, temperature=0.0)
    )


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
    h = Role()
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
    big, small = (
        request("big", 13),
        request("small", 3),
    )  # 4 blocks, then 1: the second waits for the first
    assert role.take(big, fake()) and role.take(small, fake(6))
    assert role.stats()["num_prealloc"] == 2 and role.has_work()
    events = role.receive()
    assert (
        [type(e) for e in events] == [KVArrived, KVWritten]
        and events[0].req is big
        and events[1].req is big
    )
    assert events[0].first_token == big.prompt_ids[-1] and big.bootstrap_room == 0
    assert role.stats() == {
        "num_prealloc": 1,
        "num_transfers_inflight": 0,
        "num_quarantined": 0,
        "landed_rooms_total": 0,
        "handoff_bytes_total": 0,
        "context_bytes_total": 0,
    }
    slots = torch.tensor(sched.blocks.slots("big", 0, 13))
    assert all(
        bool((k[slots] == 0).all() and (v[slots] == 0).all()) for k, v in pool.layers.values()
    )
    big.output_ids.append(events[0].first_token)
    sched.admit_transferred(big)  # what the engine does with KVWritten
    assert big.num_computed == 13 and big in sched.running
    assert role.receive() == []  # still no room for `small`
    sched.remove(big)
    role.drop(big)
    assert [e.req for e in role.receive()] == [small, small]
    sched.check()


def room_parts(role: DecodeRole, room: int, n: int, layers: range, first_token: int) -> dict:
    """What a PP=2 prefill hands over for a room of n tokens: each stage's KV of its layers (value =
    layer id + 2), the last stage's metadata row."""
    s = role.schema
    kv = {
        stage: torch.stack(
            [torch.full((2, n, s.kv_heads, s.head_dim), float(layer + 2)) for layer in ids]
        )
        for stage, ids in enumerate((layers[: len(layers) // 2], layers[len(layers) // 2 :]))
    }
    empty = torch.zeros(0)
    row = MetadataRow(
        first_token, room, empty, empty.view(0, s.hidden_width), torch.zeros(0, dtype=torch.bool)
    )
    meta = torch.frombuffer(bytearray(pack(MetadataLayout.of(s), row)), dtype=torch.uint8)
    stage_ids = (tuple(layers[: len(layers) // 2]), tuple(layers[len(layers) // 2 :]))
    name = piece_name("kv", 0)
    return {
        0: {name: part_of(name, stage_ids[0], kv[0])},
        1: {name: part_of(name, stage_ids[1], kv[1]), "meta": part_of("meta", (), meta)},
    }


def test_decode_streams_the_first_token_before_it_writes_the_kv():
    """A room whose parts all arrived: KVArrived (the first token goes out) with nothing written yet and the request
    outside the batch; the next receive() writes its KV -> KVWritten. A write that fails (KV for layers this pool
    lacks) -> HandoffFailed after the first token; a request dropped in between is never written."""
    role = DecodeRole(config("decode"), torch.float32)
    s = role.schema
    sched = Scheduler(BlockManager(8, PAGE), max_running=4, token_budget=64)
    layers = range(s.num_layers)
    pool = KVPool(layers, 8, PAGE, s.kv_heads, s.head_dim, torch.float32, "cpu")
    role.attach(EngineParts(sched, pool, None, torch.device("cpu"), 4096))
    try:
        arrived: dict[int, dict] = {}
        # no prefill: the parts are handed to take() below
        role.agent.begin = lambda room, *a, **k: None
        role.agent.poll = lambda room: PollResult(
            KVPoll.Success if room in arrived else KVPoll.Transferring
        )
        role.agent.take = lambda room: arrived.pop(room)
        role.agent.clear = lambda room: None
        good, bad, gone = request("good", 6), request("bad", 5), request("gone", 3)
        for i, req in enumerate((good, bad, gone)):
            assert role.take(req, Bootstrap("127.0.0.1", free_port(), 40 + i))
        assert role.receive() == []  # reserved, nothing arrived yet
        arrived[40] = room_parts(role, 40, 6, layers, first_token=7)
        # layers the pool does not have
        arrived[41] = room_parts(role, 41, 5, range(100, 108), first_token=8)
        arrived[42] = room_parts(role, 42, 3, layers, first_token=9)
        events = role.receive()
        assert [(type(e), e.req, e.first_token) for e in events] == [
            (KVArrived, good, 7),
            (KVArrived, bad, 8),
            (KVArrived, gone, 9),
        ]
        # nothing written yet
        assert all(bool((k == 0).all() and (v == 0).all()) for k, v in pool.layers.values())
        assert good not in sched.running and role.has_work()
        role.drop(gone)  # ended at its first token: its parts are never written
        sched.remove(gone)
        events = role.receive()
        assert [(type(e), e.req) for e in events] == [(KVWritten, good), (HandoffFailed, bad)]
        assert "does not have" in events[1].reason and role.receive() == [] and not role.has_work()
        slots = torch.tensor(sched.blocks.slots("good", 0, 6))
        assert all(
            bool((k[slots] == layer + 2).all() and (v[slots] == layer + 2).all())
            for layer, (k, v) in pool.layers.items()
        )
        gone_slots = [slot for slot in range(8 * PAGE) if slot not in set(slots.tolist())]
        assert all(bool((k[gone_slots] == 0).all()) for k, _ in pool.layers.values())
    finally:
        role.close()


def test_decode_drop_of_a_transfer_in_flight_frees_its_room(decode):
    role, sched, _ = decode
    req = request("r", 3)
    role.take(req, Bootstrap("127.0.0.1", free_port(), 99))  # a bootstrap server nobody runs
    assert role.stats()["num_prealloc"] == 1
    # blocks reserved, the handshake begun (it can only fail: nobody answers)
    events = role.receive()
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
    assert not role.take(done, Bootstrap("127.0.0.1", None, 11)) and not role.take(
        failed, Bootstrap("h", None, 12)
    )
    for req in (done, failed):
        req.output_ids.append(3)  # the first token was sampled
    role.send([done, failed])
    assert role.stats() == {"num_transfers_inflight": 2}
    out = StageReportOutbox(role.status_address)
    try:
        out.send(StageReport(11, 0, KVPoll.Success))
        out.send(StageReport(12, 1, KVPoll.Failed, SCHEMA_MISMATCH + "dtype"))
        events = wait_events(role, 1)
        assert [(type(e), e.req.rid) for e in events] == [(HandoffFailed, "b")] and events[
            0
        ].status_code == 400
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
    """An idle prefill with a transfer in flight waits for news, not a polling period: wake() (a
    request arrived) or a stage's report ends the wait at once; with neither it waits
    NEWS_WAIT_S."""
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


# ---- the address a PD server advertises (docs/pd_across_hosts.md) -------------------------------


@pytest.fixture
def no_host_ip(monkeypatch):
    for var in ("SPARKRELAY_HOST_IP", "SGLANG_HOST_IP"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_a_wildcard_bootstrap_host_without_host_ip_refuses_to_start(no_host_ip, mode):
    """Bound to every interface, a server cannot know which address its peers reach: it refuses to
    start (before the model loads and before it binds anything) rather than advertise loopback."""
    cfg = config(mode, disaggregation_bootstrap_host="0.0.0.0")
    with pytest.raises(ConfigError) as e:
        (PrefillRole if mode == "prefill" else DecodeRole)(cfg, torch.float32)
    msg = str(e.value)
    assert msg.startswith("--disaggregation-bootstrap-host 0.0.0.0 is a wildcard address"), msg
    assert "Set SPARKRELAY_HOST_IP (or SGLANG_HOST_IP)" in msg, msg
    with socket.socket() as s:  # the bootstrap port was never bound
        s.bind(("0.0.0.0", cfg.disagg.disaggregation_bootstrap_port))


@pytest.mark.parametrize("var", ["SPARKRELAY_HOST_IP", "SGLANG_HOST_IP"])
def test_a_wildcard_bootstrap_host_advertises_host_ip(no_host_ip, var):
    no_host_ip.setenv(var, "10.0.0.1")
    prefill = PrefillRole(config("prefill", disaggregation_bootstrap_host="0.0.0.0"), torch.float32)
    try:
        assert prefill.bootstrap.advertised == "10.0.0.1"
    finally:
        prefill.close()
    decode = DecodeRole(config("decode", disaggregation_bootstrap_host="0.0.0.0"), torch.float32)
    sched = Scheduler(BlockManager(4, PAGE), max_running=4, token_budget=64)
    pool = KVPool(range(2), 4, PAGE, 2, 8, torch.float32, "cpu")
    try:
        decode.attach(EngineParts(sched, pool, None, torch.device("cpu"), 4096))
        assert decode.agent.host == "10.0.0.1"  # what its TRANSFER_INFO names
    finally:
        decode.close()
