"""The ZMQ transfer backend end to end on loopback: a real bootstrap server, two prefill stages, one
decode."""

from __future__ import annotations

import json
import logging
import random
import socket
import threading
import time

import msgpack
import pytest
import zmq

from sparkrelay.transfer import prefill_agent, wire
from sparkrelay.transfer.base import KVPoll, PartSpec, PollResult, TransferError
from sparkrelay.transfer.bootstrap import (
    BootstrapError,
    BootstrapServer,
    http_request,
    register_rank,
)
from sparkrelay.transfer.decode_agent import DecodeAgent
from sparkrelay.transfer.prefill_agent import PrefillAgent
from sparkrelay.transfer.protocol import Data
from testkit.transfer import (
    HOST,
    SCHEMA,
    compare,
    expected_parts,
    make_parts,
    route,
    wait_for,
)  # noqa: F401

# ---- happy path ----------------------------------------------------------------------------------


def test_happy_path_bytes_intact_and_success_waits_for_every_stage(make_cluster):
    c = make_cluster()
    room = 2**63 - 1
    c.add(room)
    c.send(room, 1)  # before the decode's TRANSFER_INFO exists: must wait for it, not fail
    assert c.prefills[1].poll(room).state == KVPoll.Bootstrapping
    c.decode.begin(room, HOST, None, 5)  # None -> default_bootstrap_port
    c.prefill_state(1, room, KVPoll.Success)
    c.prefill_state(0, room, KVPoll.WaitingForInput)
    c.decode_state(room, KVPoll.Transferring)
    time.sleep(0.2)
    assert c.decode.poll(room).state == KVPoll.Transferring  # stage 1 done, stage 0 not yet
    with pytest.raises(TransferError):
        c.decode.take(room)
    c.send(room, 0)
    c.decode_state(room, KVPoll.Success)
    got = c.decode.take(room)
    assert sorted(got) == [0, 1] and sorted(got[1]) == ["kv", "meta"] and sorted(got[0]) == ["kv"]
    for pp in (0, 1):
        for part in make_parts(pp, room):
            assert (
                got[pp][part.spec.name].data == part.data
                and got[pp][part.spec.name].spec == part.spec
            )
    c.prefill_state(0, room, KVPoll.Success)
    assert c.statuses[(0, room)] == [(KVPoll.Success, "")] and c.statuses[(1, room)] == [
        (KVPoll.Success, "")
    ]
    assert c.decode.stats()["Success"] == 1
    c.decode.clear(room)
    assert c.decode.stats() == {s.name: 0 for s in KVPoll}
    c.run_good_room(7)  # endpoints and sockets are reused


def test_many_rooms_interleaved(make_cluster):
    c = make_cluster()
    rooms = [1000 + i for i in range(48)]
    for i, room in enumerate(rooms):
        c.add(room)
        if i % 2:
            c.send(room, 0)  # half send before the decode begins, half after
        c.decode.begin(room, HOST, c.server.port, 5)
    for i, room in enumerate(rooms):
        c.send(room, 1)
        if not i % 2:
            c.send(room, 0)
    for room in rooms:
        c.decode_state(room, KVPoll.Success)
        assert c.decode.take(room)[0]["kv"].data == make_parts(0, room)[0].data
        c.decode.clear(room)
    assert c.decode.stats() == {s.name: 0 for s in KVPoll}


# ---- bootstrap server ----------------------------------------------------------------------------


def test_route_503_until_every_stage_registered(make_cluster):
    server = BootstrapServer(HOST, 0, 2, SCHEMA, None, 16, "bfloat16")
    server.start()
    p0 = p1 = None
    try:
        assert http_request("GET", f"{server.url}/health") == (200, b"OK")
        p0 = PrefillAgent(
            0, 2, SCHEMA, compare, server.url, HOST, 5.0, lambda *a: None, prefill_http_port=30001
        )
        p0.start()
        assert route(server)[0] == 503
        assert route(server, "0", "0", "0", "0")[0] == 503
        p1 = PrefillAgent(1, 2, SCHEMA, compare, server.url, HOST, 5.0, lambda *a: None)
        p1.start()
        code, body = route(server)
        info = json.loads(body)
        assert (
            code == 200
            and info["pp_size"] == 2
            and info["schema"] == SCHEMA
            and info["page_size"] == 16
        )
        assert info["kv_cache_dtype"] == "bfloat16" and info["prefill_http_port"] == 30001
        assert info["attn_tp_size"] == 1 and info["follow_bootstrap_room"] is False
        code, body = route(server, "0", "0", "0", "1")
        assert code == 200 and json.loads(body) == {"rank_ip": HOST, "rank_port": p1.port}
    finally:
        for p in (p0, p1):
            if p is not None:
                p.close()
        server.stop()


def test_route_errors_and_dp_rank_table(make_cluster):
    c = make_cluster()
    s = c.server
    assert route(s, pp=None)[0] == 400
    code, body = route(s, pp="x")
    assert code == 400 and b"target_pp_rank" in body
    assert route(s, "0", "0", "0", "5")[0] == 404
    assert route(s, "0", "0", "-1", "0")[0] == 400
    good = c.prefills[0]._registration()
    for field, value, needle in [
        ("rank_port", "x", b"rank_port"),
        ("pp_rank", 7, b"pp_rank"),
        ("attn_tp_size", 2, b"attn_tp_size"),
        ("page_size", 32, b"page_size"),
        ("rank_ip", 5, b"rank_ip"),
        ("pp_size", 3, b"pp_size"),
    ]:
        code, body = http_request("PUT", f"{s.url}/route", {**good, field: value})
        assert code == 400 and needle in body, (field, code, body)
    assert http_request("PUT", f"{s.url}/route", None)[0] == 400
    with pytest.raises(BootstrapError, match="pp_rank"):
        register_rank(s.url, {**good, "pp_rank": -1})
    # a wildcard rank_ip from this host is stored as the server's advertised address (loopback here)
    assert http_request(
        "PUT", f"{s.url}/route", {**good, "rank_ip": "0.0.0.0", "rank_port": 4242}
    ) == (200, b"OK")
    assert json.loads(route(s, "0", "0", "0", "0")[1]) == {
        "rank_ip": "127.0.0.1",
        "rank_port": 4242,
    }
    # DP-rank table
    assert (
        http_request("POST", f"{s.url}/register_dp_rank", {"bootstrap_room": 11, "dp_rank": 0})[0]
        == 200
    )
    assert (
        http_request("POST", f"{s.url}/register_dp_rank", {"bootstrap_room": 0, "dp_rank": 0})[0]
        == 400
    )
    assert (
        http_request("POST", f"{s.url}/register_dp_rank", {"bootstrap_room": 12, "dp_rank": "a"})[0]
        == 400
    )
    code, body = http_request("POST", f"{s.url}/query_dp_ranks", {"bootstrap_rooms": [11, 13]})
    assert code == 200 and json.loads(body) == {"11": 0}
    assert http_request("POST", f"{s.url}/query_dp_ranks", {"bootstrap_rooms": "11"})[0] == 400
    # the port is taken
    with pytest.raises(OSError, match="bootstrap server cannot listen"):
        BootstrapServer(HOST, s.port, 2, SCHEMA, None, 16, "bfloat16").start()


def test_rooms_zero_and_out_of_range_are_refused(make_cluster):
    c = make_cluster()
    for bad in (0, 2**63, -1, True, "5"):
        with pytest.raises(ValueError):
            c.decode.begin(bad, HOST, c.server.port, 5)
        with pytest.raises(ValueError):
            c.prefills[0].add_room(bad, 5)
    c.add(9)
    with pytest.raises(ValueError, match="already in use"):
        c.prefills[0].add_room(9, 5)


# ---- refusals and timeouts -----------------------------------------------------------------------


def test_schema_mismatch_fails_both_sides(make_cluster):
    c = make_cluster(decode_schema={**SCHEMA, "hidden": 16})
    c.add(21)
    c.decode.begin(21, HOST, c.server.port, 5)
    reason = c.decode_state(21, KVPoll.Failed).reason
    assert reason.startswith("schema mismatch:") and "hidden: prefill=8 decode=16" in reason
    for pp in (0, 1):
        assert "hidden: prefill=8 decode=16" in c.prefill_state(pp, 21, KVPoll.Failed).reason
        assert c.statuses[(pp, 21)][0][0] == KVPoll.Failed


def test_schema_mismatch_seen_by_the_prefill_only(make_cluster):
    """A decode whose own check passes: the prefill's check of TRANSFER_INFO fails the room on both
    sides."""
    c = make_cluster(decode_schema={**SCHEMA, "hidden": 16}, decode_compare=lambda a, b: [])
    c.add(22)
    c.decode.begin(22, HOST, c.server.port, 5)
    assert (
        "schema mismatch: hidden: prefill=8 decode=16"
        in c.prefill_state(1, 22, KVPoll.Failed).reason
    )
    reason = c.decode_state(22, KVPoll.Failed).reason
    assert "failed: schema mismatch" in reason and "hidden: prefill=8 decode=16" in reason


def test_prompt_len_mismatch_and_expected_parts_error(make_cluster):
    c = make_cluster()
    c.add(23, prompt_len=6)
    c.decode.begin(23, HOST, c.server.port, 5)
    assert "prompt_len mismatch: prefill=6 decode=5" in c.prefill_state(0, 23, KVPoll.Failed).reason
    assert "prompt_len mismatch" in c.decode_state(23, KVPoll.Failed).reason
    c.decode.begin(24, HOST, c.server.port, 0)
    assert "nothing to transfer" in c.decode_state(24, KVPoll.Failed).reason


def test_prefill_bootstrap_timeout(make_cluster):
    c = make_cluster(bootstrap_timeout=0.5)
    c.add(31)
    t0 = time.monotonic()
    reason = c.prefill_state(0, 31, KVPoll.Failed, timeout=3).reason
    assert 0.4 < time.monotonic() - t0 < 2.0
    assert "SPARKRELAY_DISAGGREGATION_BOOTSTRAP_TIMEOUT" in reason and "0.5 s" in reason
    wait_for(lambda: (1, 31) in c.statuses)
    assert c.statuses[(1, 31)][0][0] == KVPoll.Failed


def test_decode_waiting_timeout_aborts_the_prefill(make_cluster):
    c = make_cluster(waiting_timeout=0.5)
    c.add(32)
    c.decode.begin(32, HOST, c.server.port, 5)
    reason = c.decode_state(32, KVPoll.Failed, timeout=3).reason
    assert "SPARKRELAY_DISAGGREGATION_WAITING_TIMEOUT" in reason and "[0, 1]" in reason
    for pp in (0, 1):
        r = c.prefill_state(pp, 32, KVPoll.Failed).reason
        assert r.startswith("aborted by the decode server") and "WAITING_TIMEOUT" in r


def test_bootstrap_server_never_ready(make_cluster):
    # pp_size 2, only stage 0 registered: 503 forever
    c = make_cluster(bootstrap_timeout=0.5, n_prefills=1)
    c.decode.begin(33, HOST, c.server.port, 5)
    reason = c.decode_state(33, KVPoll.Failed, timeout=3).reason
    assert "503" in reason and "BOOTSTRAP_TIMEOUT" in reason


# ---- aborts --------------------------------------------------------------------------------------


def test_abort_from_decode_reaches_every_stage(make_cluster):
    c = make_cluster()
    c.add(41)
    c.decode.begin(41, HOST, c.server.port, 5)
    c.decode_state(41, KVPoll.WaitingForInput)
    c.prefill_state(0, 41, KVPoll.WaitingForInput)
    c.decode.abort(41, "client disconnected")
    assert c.decode.poll(41).reason == "client disconnected"
    for pp in (0, 1):
        assert (
            c.prefill_state(pp, 41, KVPoll.Failed).reason
            == "aborted by the decode server: client disconnected"
        )
    c.send(41, 0)  # a send after the abort is a no-op
    c.run_good_room(42)


def test_abort_on_prefill_reaches_decode(make_cluster):
    c = make_cluster()
    c.add(43)
    c.decode.begin(43, HOST, c.server.port, 5)
    c.prefill_state(1, 43, KVPoll.WaitingForInput)
    c.prefills[1].abort(43, "prefill out of memory")
    assert (
        c.decode_state(43, KVPoll.Failed).reason
        == "prefill pp_rank 1 failed: prefill out of memory"
    )
    assert c.prefill_state(0, 43, KVPoll.Failed).reason.startswith("aborted by the decode server")
    assert c.statuses[(1, 43)] == [(KVPoll.Failed, "prefill out of memory")]
    # aborted before the decode showed up: the prefill answers its TRANSFER_INFO with the failure
    c.add(44)
    c.prefills[0].abort(44, "rejected by the scheduler")
    c.decode.begin(44, HOST, c.server.port, 5)
    assert (
        c.decode_state(44, KVPoll.Failed).reason
        == "prefill pp_rank 0 failed: rejected by the scheduler"
    )


# ---- bad frames ----------------------------------------------------------------------------------


def _bad_frames(room: int):
    kv = make_parts(0, room)[0]
    head = {"type": "DATA", "room": room, "pp_rank": 0, **kv.spec.header()}
    wrong_shape = {**head, "shape": [1, 2, 5, 16]}
    return [  # (name, frames, substring of the room's reason or None when no room can be blamed)
        ("truncated bytes", [msgpack.packb(head), kv.data[:-10]], "bytes, expected"),
        (
            "wrong size",
            [
                msgpack.packb(wrong_shape),
                b"\0" * PartSpec("kv", (0, 1), "bfloat16", (1, 2, 5, 16)).nbytes,
            ],
            "!= expected",
        ),
        (
            "wrong pp_rank",
            [msgpack.packb({**head, "pp_rank": 5}), kv.data],
            "expects pp_rank(s) [0, 1]",
        ),
        (
            "unknown part",
            [msgpack.packb({**head, "name": "draft_kv"}), kv.data],
            "unexpected part 'draft_kv'",
        ),
        ("replayed part", "replay", "arrived twice"),
        ("unknown dtype", [msgpack.packb({**head, "dtype": "float8"}), kv.data], "unknown dtype"),
        ("three frames", [msgpack.packb(head), kv.data, b"x"], "DATA needs 2 frames"),
        (
            "bad status",
            [
                msgpack.packb(
                    {"type": "STATUS", "room": room, "pp_rank": 0, "status": 2, "reason": ""}
                )
            ],
            "neither Success nor Failed",
        ),
        (
            "early success",
            [
                msgpack.packb(
                    {"type": "STATUS", "room": room, "pp_rank": 0, "status": 4, "reason": ""}
                )
            ],
            "part(s) ['kv'] never arrived",
        ),
        ("unknown room", [msgpack.packb({**head, "room": 987654}), kv.data], None),
        ("garbage msgpack", [b"\xc1\xc1\xc1 not msgpack"], None),
        ("not a map", [msgpack.packb([1, 2, 3])], None),
        (
            "oversized",
            [msgpack.packb(head), b"\0" * ((8 << 10) + (64 << 10) + 1)],
            "WAITING_TIMEOUT",
        ),
    ]


def test_bad_frames_fail_only_their_room(make_cluster, caplog):
    c = make_cluster(waiting_timeout=1.0, max_part_bytes=8 << 10)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(wire.tcp_endpoint(HOST, c.decode.port))
    try:
        for i, (name, msg, needle) in enumerate(_bad_frames(100)):
            room = 100 + 10 * i
            _, msg, _ = _bad_frames(room)[i]
            c.add(room)
            c.decode.begin(room, HOST, c.server.port, 5)
            c.decode_state(room, KVPoll.WaitingForInput)
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="sparkrelay.transfer"):
                if msg == "replay":
                    kv = make_parts(0, room)[0]
                    raw.send_multipart(Data.of(room, 0, kv).encode())
                    raw.send_multipart(Data.of(room, 0, kv).encode())
                else:
                    raw.send_multipart(msg)
                if needle is None:
                    wait_for(
                        lambda: "dropped a bad frame" in caplog.text, what=f"{name}: a log line"
                    )
                    assert c.decode.poll(room).state == KVPoll.WaitingForInput, name
                    c.decode.abort(room, "done with this case")
                else:
                    reason = c.decode_state(room, KVPoll.Failed, timeout=4).reason
                    assert needle in reason, (name, reason)
                    assert f"room {room} failed" in caplog.text, name
                    for pp in (0, 1):
                        # the decode's ABORT reached every stage
                        c.prefill_state(pp, room, KVPoll.Failed)
            c.run_good_room(room + 1)
    finally:
        raw.close()
        ctx.term()


def test_decode_messages_before_add_room(make_cluster):
    """The decode often begins before the prefill schedules the request: its TRANSFER_INFO / ABORT
    wait."""
    c = make_cluster()
    c.decode.begin(71, HOST, c.server.port, 5)
    c.decode_state(71, KVPoll.WaitingForInput)
    time.sleep(0.1)  # the TRANSFER_INFO reaches the prefill stages before add_room
    c.add(71)
    assert c.prefills[0].poll(71).state == KVPoll.WaitingForInput
    c.send(71, 0)
    c.send(71, 1)
    c.decode_state(71, KVPoll.Success)
    # an ABORT before add_room: the room fails on add_room, and on_status comes from an agent thread
    c.decode.begin(72, HOST, c.server.port, 5)
    c.decode_state(72, KVPoll.WaitingForInput)
    c.decode.abort(72, "client gone")
    time.sleep(0.1)
    callers = []
    c.prefills[0]._on_status = lambda room, state, reason: callers.append(
        (threading.current_thread(), state)
    )
    c.prefills[0].add_room(72, 5)
    assert c.prefills[0].poll(72) == PollResult(
        KVPoll.Failed, "aborted by the decode server: client gone"
    )
    wait_for(lambda: callers, what="on_status")
    assert callers[0][0] is not threading.current_thread() and callers[0][1] == KVPoll.Failed


# ---- fault injection (SPARKRELAY_TEST_DISAGG_FAILURE_PROB) ---------------------------------------


def test_injected_failures_take_the_normal_failure_path(make_cluster):
    c = make_cluster(failure_prob=1.0)
    c.add(81)
    c.decode.begin(81, HOST, c.server.port, 5)
    c.send(81, 0)
    c.send(81, 1)
    reason = c.decode_state(81, KVPoll.Failed).reason
    assert reason.startswith("prefill pp_rank ") and reason.endswith(
        prefill_agent.INJECTED_FAILURE
    ), reason
    for pp in (0, 1):
        assert (
            "injected failure (SPARKRELAY_TEST_DISAGG_FAILURE_PROB)"
            in c.prefill_state(pp, 81, KVPoll.Failed).reason
        )
        wait_for(lambda: (pp, 81) in c.statuses)
        assert c.statuses[(pp, 81)][0][0] == KVPoll.Failed
    # half the rooms fail, on every stage (one draw per room id), and the agents go on
    for p in c.prefills:
        p.failure_prob = 0.5
    rooms = range(82, 102)
    for room in rooms:
        c.add(room)
        c.decode.begin(room, HOST, c.server.port, 5)
        c.send(room, 0)
        c.send(room, 1)
    wait_for(lambda: all(c.decode.poll(r).state in (KVPoll.Success, KVPoll.Failed) for r in rooms))
    failed = [r for r in rooms if c.decode.poll(r).state == KVPoll.Failed]
    assert failed == [r for r in rooms if random.Random(r).random() < 0.5] and 0 < len(
        failed
    ) < len(rooms)
    assert all("SPARKRELAY_TEST_DISAGG_FAILURE_PROB" in c.decode.poll(r).reason for r in failed)
    # both stages fail it (their own draw, or the decode's ABORT that followed the other's)
    for room in failed:
        for pp in (0, 1):
            wait_for(lambda: (pp, room) in c.statuses)
            state, reason = c.statuses[(pp, room)][0]
            assert state == KVPoll.Failed and prefill_agent.INJECTED_FAILURE in reason, reason
    for p in c.prefills:
        p.failure_prob = 0.0
    c.run_good_room(200)
    with pytest.raises(ValueError, match="failure_prob"):
        PrefillAgent(
            0, 2, SCHEMA, compare, c.server.url, HOST, 1.0, lambda *a: None, failure_prob=1.5
        )


# ---- heartbeat and clearing ----------------------------------------------------------------------


def test_heartbeat_fails_rooms_when_the_prefill_goes_away(make_cluster):
    c = make_cluster(hb_interval=0.2, hb_failures=2)
    c.add(51)
    c.add(52)
    c.decode.begin(51, HOST, c.server.port, 5)
    c.decode.begin(52, HOST, c.server.port, 5)
    c.decode_state(51, KVPoll.WaitingForInput)
    c.decode_state(52, KVPoll.WaitingForInput)
    c.send(51, 1)
    c.decode_state(51, KVPoll.Transferring)
    port = c.server.port
    c.server.stop()
    t0 = time.monotonic()
    for room in (51, 52):
        reason = c.decode_state(room, KVPoll.Failed, timeout=0.2 * 2 + 2.0).reason
        assert reason.startswith(f"lost connection with prefill at {HOST}:{port}")
    assert time.monotonic() - t0 < 0.2 * 2 + 2.0
    assert c.decode.stats()["Failed"] == 2


def test_cleared_room_ignores_a_late_failed(make_cluster):
    c = make_cluster()
    c.add(61)
    c.decode.begin(61, HOST, c.server.port, 5)
    c.prefill_state(0, 61, KVPoll.WaitingForInput)
    c.decode.clear(61)
    c.prefills[0].abort(61, "late")  # STATUS failed reaches a decode that forgot the room
    time.sleep(0.2)
    assert "not known" in c.decode.poll(61).reason and sum(c.decode.stats().values()) == 0
    # prefill side: cleared, then the decode's ABORT arrives; a reused room id must start clean
    c.add(62)
    c.decode.begin(62, HOST, c.server.port, 5)
    c.prefill_state(1, 62, KVPoll.WaitingForInput)
    c.prefills[1].clear(62)
    c.decode.abort(62, "late abort")
    c.prefill_state(0, 62, KVPoll.Failed)
    time.sleep(0.2)
    assert "not known" in c.prefills[1].poll(62).reason and (1, 62) not in c.statuses
    c.prefills[1].add_room(62, 5)
    time.sleep(0.2)
    assert c.prefills[1].poll(62).state == KVPoll.Bootstrapping


def test_close_is_idempotent_and_frees_the_port():
    server = BootstrapServer(HOST, 0, 1, SCHEMA, None, 16, "bfloat16")
    server.start()
    port = server.port
    server.stop()
    server.stop()
    with socket.create_server((HOST, port)):
        pass
    d = DecodeAgent(SCHEMA, compare, expected_parts, HOST, 1.0, 1.0, 0.5, 2, port)
    d.start()
    d.close()
    d.close()


def test_bootstrap_connections_send_without_nagle():
    """asyncio sets TCP_NODELAY only on sockets made with proto IPPROTO_TCP; without it a keep-alive
    reply's body waited 44 ms for the delayed ACK of its headers. The accepted connection must have
    it."""
    import socket
    import time

    server = BootstrapServer(HOST, 0, 1, SCHEMA, None, 16, "bfloat16")
    server.start()
    try:
        with socket.create_connection((HOST, server.port)) as c:
            c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert c.recv(4096).startswith(b"HTTP/1.1 200")
            deadline = time.monotonic() + 5
            while not server._server.server_state.connections and time.monotonic() < deadline:
                time.sleep(0.01)
            (conn,) = server._server.server_state.connections
            sock = conn.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        server.stop()


@pytest.mark.parametrize("backend", ["zmq", "mooncake", "nixl"])
def test_a_stage_streams_its_parts_in_several_sends(make_cluster, backend):
    """A stage hands its parts over as they are computed (send(..., last=False), then the last one):
    the decode holds the room open until the last hand-over's STATUS success, and gets every byte of
    every hand-over."""
    from testkit.transfer import make_parts

    c = make_cluster(backend=backend)
    room = 31
    c.add(room)
    kv, meta = make_parts(1, room)
    c.prefills[1].send(room, [kv], last=False)  # before the decode's TRANSFER_INFO: waits for it
    c.begin(room, c.server.port)
    c.send(room, 0)
    c.prefill_state(1, room, KVPoll.Transferring)
    time.sleep(0.2)
    assert c.decode.poll(room).state in (
        KVPoll.WaitingForInput,
        KVPoll.Transferring,
    )  # the last part is missing
    assert c.prefills[1].poll(room).state == KVPoll.Transferring
    with pytest.raises(ValueError, match="sent before"):
        c.prefills[1].send(room, [kv])
    c.prefills[1].send(room, [meta], last=True)
    c.decode_state(room, KVPoll.Success)
    got = c.received(room, c.decode.take(room))
    assert got[1] == {"kv": kv.data, "meta": meta.data}
    c.prefill_state(1, room, KVPoll.Success)
    with pytest.raises(ValueError, match="after its last send"):
        c.prefills[1].send(room, [])
