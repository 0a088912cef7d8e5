"""The one-sided backends (Mooncake, NIXL) at the agent level on loopback: a real bootstrap server,
two prefill stages that write with the engine into a decode's registered memory, the control
messages on ZMQ."""

from __future__ import annotations

import pytest

from sparkrelay.transfer.base import KVPoll, Part, PartSpec
from sparkrelay.transfer.landing import Landing, pack_pages, runs, unpack_pages, writes
from testkit.transfer import HOST, make_parts

BACKENDS = ["mooncake", "nixl"]


def test_runs_merge_consecutive_pages_and_stop_at_the_prompt():
    assert runs((3, 4, 9), 4, 10) == [(0, 12, 8), (8, 36, 2)]
    assert runs((5,), 16, 1) == [(0, 80, 1)]
    with pytest.raises(ValueError, match="need 3 pages, the landing has 2"):
        runs((1, 2), 4, 9)


def test_writes_place_each_plane_at_its_layer_and_refuse_a_landing_that_cannot_hold_the_part():
    # kv of layers 2, 3 [2, 2, 5, 8] bf16 (16-byte rows) + meta (32 bytes)
    parts = make_parts(1, 77, prompt_len=5)
    landing = Landing(
        "p", b"", 4, (7, 2), {2: (1000, 2000), 3: (3000, 4000)}, 16, meta=9000, meta_bytes=32
    )
    got = writes(landing, parts, {"kv": 0, "meta": 500}, 5)
    # plane (layer 2, K): tokens 0-3 -> page 7 (slot 28), token 4 -> page 2 (slot 8)
    assert got[:2] == [(0, 1000 + 28 * 16, 64), (4 * 16, 1000 + 8 * 16, 16)]
    assert got[2] == (5 * 16, 2000 + 28 * 16, 64) and got[-1] == (500, 9000, 32) and len(got) == 9
    with pytest.raises(ValueError, match="no layer 3"):
        writes(
            Landing("p", b"", 4, (7, 2), {2: (1, 2)}, 16, meta=9, meta_bytes=32),
            parts,
            {"kv": 0, "meta": 0},
            5,
        )
    with pytest.raises(ValueError, match="16 bytes per token, the landing's rows are 32"):
        writes(
            Landing("p", b"", 4, (7, 2), {2: (1, 2), 3: (3, 4)}, 32, meta=9, meta_bytes=32),
            parts,
            {"kv": 0, "meta": 0},
            5,
        )


def test_a_streamed_piece_lands_at_its_positions():
    """A piece "kv@3" of 2 positions goes where tokens 3 and 4 of the prompt live, not at the room's
    first slot."""
    assert runs((3, 4, 9), 4, 10, start=5) == [(0, 17, 3), (3, 36, 2)]
    piece = Part(PartSpec("kv@3", (2, 3), "bfloat16", (2, 2, 2, 8)), bytes(128))  # 16-byte rows
    landing = Landing(
        "p", b"", 4, (7, 2), {2: (1000, 2000), 3: (3000, 4000)}, 16, meta=9000, meta_bytes=32
    )
    got = writes(landing, [piece], {"kv@3": 0}, 5)
    # plane (layer 2, K): token 3 -> page 7 (slot 31), token 4 -> page 2 (slot 8); each plane holds 2 rows
    assert got[:2] == [(0, 1000 + 31 * 16, 16), (16, 1000 + 8 * 16, 16)] and got[2] == (
        32,
        2000 + 31 * 16,
        16,
    )
    assert len(got) == 8
    with pytest.raises(ValueError, match="positions 4..5, the prompt has 5"):
        writes(
            landing,
            [Part(PartSpec("kv@4", (2, 3), "bfloat16", (2, 2, 2, 8)), bytes(128))],
            {"kv@4": 0},
            5,
        )


def test_pages_travel_as_runs():
    pages = (5, 6, 7, 2, 3, 9)
    assert len(pack_pages(pages)) == 3 * 8 and unpack_pages(pack_pages(pages)) == pages
    for bad in (
        b"\x01\x00\x00",
        pack_pages((1,))[:4] + b"\x00" * 4,
        b"\xff" * 8,
    ):  # odd size, count 0, page < 0
        with pytest.raises(ValueError):
            unpack_pages(bad)


@pytest.mark.parametrize("backend", ["mooncake"])
def test_a_landing_too_large_for_one_message_fails_its_room_only(make_cluster, backend):
    c = make_cluster(backend=backend)
    n = 20_000 * 16
    # 20,000 runs
    c.decode.begin(51, HOST, c.server.port, n, c.memory.landing(tuple(range(0, 40_000, 2))))
    res = c.decode.poll(51)
    assert (
        res.state == KVPoll.Failed
        and res.permanent
        and "raise it" in res.reason
        and "--page-size" in res.reason
    )
    c.run_good_room(52)


@pytest.mark.parametrize("token", [None, "s3cret"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_parts_land_at_the_rooms_pages(make_cluster, backend, token):
    # with a token every control message carries its HMAC tag
    c = make_cluster(backend=backend, token=token)
    for room, n in ((11, 5), (12, 40)):  # one page; three pages, two of them consecutive
        c.add(room, n)
        c.begin(room, c.server.port, n)
        c.prefills[1].send(room, make_parts(1, room, n))
        c.prefills[0].send(room, make_parts(0, room, n))
        c.decode_state(room, KVPoll.Success)
        got = c.received(room, c.decode.take(room), n)
        for pp in (0, 1):
            assert got[pp] == {p.spec.name: p.data for p in make_parts(pp, room, n)}
            c.prefill_state(pp, room, KVPoll.Success)
        c.decode.clear(room)
    assert c.threads_alive() and c.decode.stats()["Failed"] == 0
    assert sum(c.decode.rejected().values()) == 0 and all(
        sum(p.rejected().values()) == 0 for p in c.prefills
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_decode_abort_before_the_write_writes_nothing(make_cluster, backend):
    c = make_cluster(backend=backend)
    room = 21
    c.add(room)
    c.begin(room, c.server.port)
    c.prefill_state(0, room, KVPoll.WaitingForInput)
    c.decode.abort(room, "client went away")
    c.prefill_state(0, room, KVPoll.Failed)
    c.prefills[0].send(room, make_parts(0, room))
    assert not c.memory.kv.any() and not c.memory.meta.any()
    c.run_good_room(22)  # the agents go on


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_prefill_without_a_landing_is_told_the_backends_differ(make_cluster, backend):
    # same schema, so only the missing landing shows it
    c = make_cluster(backend="zmq", prefill_backend=backend)
    room = 31
    c.add(room)
    c.begin(room, c.server.port)
    c.send(room, 0)
    res = c.prefill_state(0, room, KVPoll.Failed)
    assert "no landing" in res.reason and "--disaggregation-transfer-backend differs" in res.reason
    assert "no landing" in c.decode_state(room, KVPoll.Failed).reason


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_prefill_closed_mid_room_fails_it_by_heartbeat(make_cluster, backend):
    c = make_cluster(backend=backend, hb_interval=0.1, hb_failures=2)
    room = 41
    c.add(room)
    c.begin(room, c.server.port)
    c.send(room, 1)
    c.prefill_state(1, room, KVPoll.Success)
    c.prefills[0].close()
    c.server.stop()  # the prefill is gone: its bootstrap server with it
    res = c.decode_state(room, KVPoll.Failed, timeout=10)
    assert "pp_rank(s) [0]" in res.reason or "heartbeat" in res.reason or "health" in res.reason, (
        res.reason
    )


def test_a_missing_engine_names_what_to_install(monkeypatch):
    import builtins

    from sparkrelay.transfer.engines import EngineMissing, open_engine

    real = builtins.__import__

    def no_engines(name, *a, **kw):
        if name.startswith(("mooncake", "nixl")):
            raise ImportError(
                "libibverbs.so.1: cannot open shared object file"
                if name.startswith("mooncake")
                else f"No module named {name!r}"
            )
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_engines)
    with pytest.raises(EngineMissing, match=r"apt-get install libibverbs1"):
        open_engine("mooncake", HOST)
    with pytest.raises(EngineMissing, match=r"pip install -e \.\[nixl\]"):
        open_engine("nixl", HOST)


def test_an_idle_nixl_agent_does_not_spin_a_core():
    """NIXL's Python API starts the agent's progress thread with no delay: it then spins a whole
    core (1.0 CPU s per s measured, idle), which starved a 2-core PD deployment's engines. Ours is
    paced (0.02 measured)."""
    import time

    from sparkrelay.transfer.engines import open_engine

    engine = open_engine("nixl", HOST)
    try:
        wall, cpu = time.monotonic(), time.process_time()
        time.sleep(1.0)
        used = (time.process_time() - cpu) / (time.monotonic() - wall)
    finally:
        engine.close()
    assert used < 0.5, f"an idle NIXL agent used {used:.2f} CPU s per s"
