"""Hostile input on the transfer sockets and the bootstrap routes, against real agents on loopback.

Every case checks: the input is refused with a logged reason, nothing grows without bound, the
agents keep serving (a following legitimate room succeeds) and none of their threads died. With a
shared token a stranger's message is dropped before it is parsed and never fails a live room; a
message carrying a valid tag (a peer that holds the token, or a capture of one) goes through the
same checks as without a token, except that a replayed duplicate is dropped instead of failing the
room.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import hmac
import http.client
import json
import logging
import socket
import threading
import tracemalloc
from pathlib import Path

import msgpack
import pytest
import zmq

from sparkrelay.config import Config, ConfigError, add_cli_args, config_from_args
from sparkrelay.envs import DisaggEnv
from sparkrelay.transfer import prefill_room, protocol, wire
from sparkrelay.transfer.base import KVPoll, Part
from sparkrelay.transfer.bootstrap import BootstrapError, BootstrapServer, http_request
from sparkrelay.transfer.bootstrap import server as bootstrap_mod
from sparkrelay.transfer.decode_agent import DecodeAgent
from sparkrelay.transfer.prefill_agent import PrefillAgent
from sparkrelay.transfer.protocol import Abort, Data, Status, TransferInfo
from testkit.transfer import HOST, SCHEMA, compare, expected_parts, make_parts, route, wait_for  # noqa: F401

TOKEN = "sr-test-" + "k" * 24
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def logs(caplog):
    caplog.set_level(logging.INFO, logger="sparkrelay.transfer")
    return caplog


@contextlib.contextmanager
def stranger(port: int):
    """A raw PUSH socket to a transfer port: send(frames) as any process on the network could."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)  # what was sent gets delivered before close
    sock.connect(wire.tcp_endpoint(HOST, port))
    try:
        yield lambda msg: sock.send_multipart(msg)
    finally:
        sock.close()
        ctx.term()


def seal(msg: list, token=TOKEN) -> list:
    return wire.FrameAuth(token).seal(msg)


def logged(caplog, needle: str, what: str = "") -> None:
    wait_for(lambda: needle in caplog.text, what=f"log line {needle!r} {what}")


def live(c, room: int) -> None:
    """A room both sides are waiting on (TRANSFER_INFO delivered to both stages)."""
    c.add(room)
    c.decode.begin(room, HOST, c.server.port, 5)
    c.decode_state(room, KVPoll.WaitingForInput)
    for pp in (0, 1):
        c.prefill_state(pp, room, KVPoll.WaitingForInput)


def still_serving(c, room: int) -> None:
    c.run_good_room(room)
    assert c.threads_alive()


def data_head(room, pp: int = 0, **changes) -> bytes:
    kv = make_parts(pp, 1)[0]
    return msgpack.packb(
        {"type": "DATA", "room": room, "pp_rank": pp, **kv.spec.header(), **changes}
    )


# ---- the tag -------------------------------------------------------------------------------------


def test_tag_format_and_checks():
    head, payload = b"\x81\xa4type\xa4DATA", b"\x00" * 100
    want = hmac.new(
        TOKEN.encode(),
        wire.TAG_LABEL
        + len(head).to_bytes(8, "big")
        + head
        + len(payload).to_bytes(8, "big")
        + payload,
        hashlib.sha256,
    ).digest()
    auth = wire.FrameAuth(TOKEN)
    assert auth.seal([head, payload]) == [head, payload, want] and len(want) == wire.TAG_BYTES
    assert auth.open([head, payload, want]) == [head, payload]
    for bad, needle in [
        ([head, payload], "no authentication tag"),  # a 100-byte "tag"
        ([head, payload[:32]], "does not match"),  # a 32-byte payload taken for the tag
        ([head], "no authentication tag"),
        ([head, payload + b"\x01", want], "does not match"),
        ([head + payload[:1], payload[1:], want], "does not match"),  # a shifted split
        ([head, payload, want[:-1]], "no authentication tag"),
        (seal([head, payload], "another-token"), "does not match"),
    ]:
        with pytest.raises(protocol.AuthError, match=needle) as e:
            auth.open(bad)
        assert e.value.room is None
    assert wire.FrameAuth(None).seal([head]) == [head] and wire.FrameAuth("").open([head]) == [head]
    for bad in ("has space", "caf\u00e9", "x" * 4097, "tab\t"):
        with pytest.raises(ValueError, match="printable ASCII"):
            wire.FrameAuth(bad)


def test_reject_log_names_each_peer_once_and_rate_limits_the_rest(caplog):
    log = logging.getLogger("sparkrelay.transfer.test_rejects")
    caplog.set_level(logging.WARNING, logger=log.name)
    rejects = wire.RejectLog(log, burst=3, per_s=0.0)
    for _ in range(10):
        rejects.note("auth", "dropped: %s", "bad tag", peer="10.0.0.7")
    rejects.note("auth", "dropped: %s", "bad tag", peer="10.0.0.8")
    rejects.note(
        "replay", "replayed", peer="10.0.0.7"
    )  # another kind from the same peer: its own line
    for _ in range(10):
        rejects.note("protocol", "no peer known")  # without a peer: the rate limit alone
    lines = [r.getMessage() for r in caplog.records]
    assert rejects.counts() == {"auth": 11, "replay": 1, "protocol": 10}
    assert lines[:3] == [
        "dropped: bad tag (from 10.0.0.7; more from this peer are counted, not logged)",
        "dropped: bad tag (from 10.0.0.8; more from this peer are counted, not logged)",
        "replayed (from 10.0.0.7; more from this peer are counted, not logged)",
    ]
    assert lines[3:] == []  # the burst of 3 was spent by the named lines


def test_tagged_rooms_succeed_and_16_mib_parts(make_cluster):
    c = make_cluster(token=TOKEN, max_part_bytes=17 << 20)
    still_serving(c, 11)
    n = (16 << 20) // 64  # kv [2, 2, n, 8] bfloat16 = 16 MiB per stage
    c.add(12, n)
    c.decode.begin(12, HOST, c.server.port, n)
    c.send(12, 0, n)
    c.send(12, 1, n)
    c.decode_state(12, KVPoll.Success, timeout=20)
    assert c.decode.take(12)[0]["kv"].data == make_parts(0, 12, n)[0].data
    assert c.decode.rejected() == {} and all(p.rejected() == {} for p in c.prefills)


# ---- strangers, with a token ---------------------------------------------------------------------


def test_strangers_cannot_fail_or_feed_a_live_room(make_cluster, logs):
    c = make_cluster(token=TOKEN)
    room = 500
    live(c, room)
    c.send(room, 1)
    c.decode_state(room, KVPoll.Transferring)
    kv = make_parts(0, room)[0]
    fake = Part(kv.spec, b"\xff" * kv.spec.nbytes)  # a well-formed part with the attacker's bytes
    real = Data.of(room, 0, kv).encode()
    to_decode = [
        ("untagged part", Data.of(room, 0, fake).encode(), "no authentication tag"),
        ("wrong token", seal(Data.of(room, 0, fake).encode(), "guessed-token"), "does not match"),
        ("altered payload", [real[0], fake.data, seal(real)[-1]], "does not match"),
        (
            "untagged STATUS failed",
            Status.failed(room, 0, "forged").encode(),
            "no authentication tag",
        ),
        (
            "forged STATUS success",
            seal(Status.success(room, 0).encode(), "guessed"),
            "does not match",
        ),
        ("garbage", [b"\xc1 garbage \x00" * 10], "no authentication tag"),
        ("empty frames", [b"", b"", b""], "no authentication tag"),
        ("msgpack bomb", [b"\x91" * 60000 + b"\xc0", b"\x00" * 32], "does not match"),
    ]
    with stranger(c.decode.port) as send:
        for i, (name, msg, needle) in enumerate(to_decode):
            send(msg)
            wait_for(lambda: c.decode.rejected().get("auth") == i + 1, what=name)
            assert c.decode.poll(room).state == KVPoll.Transferring, name
    # one line for the stranger, naming its address, however many frames it sent
    lines = [r.getMessage() for r in logs.records if "decode: dropped a message" in r.getMessage()]
    assert len(lines) == 1 and "no authentication tag" in lines[0] and "from 127.0.0.1" in lines[0]
    # a hijack: "send room 500's KV to my port"
    info = TransferInfo(room, HOST, 1, 5, SCHEMA).encode()
    to_prefill = [
        ("untagged ABORT", Abort(room, "forged").encode()),
        ("forged TRANSFER_INFO", seal(info, "guessed")),
        ("untagged TRANSFER_INFO", info),
    ]
    logs.clear()
    with stranger(c.prefills[0].port) as send:
        for i, (name, msg) in enumerate(to_prefill):
            send(msg)
            wait_for(lambda: c.prefills[0].rejected().get("auth") == i + 1, what=name)
            assert c.prefills[0].poll(room).state == KVPoll.WaitingForInput, name
    lines = [
        r.getMessage() for r in logs.records if "pp_rank 0: dropped a message" in r.getMessage()
    ]
    assert len(lines) == 1 and "from 127.0.0.1" in lines[0], lines
    c.send(room, 0)  # the real stage 0 finishes the room; none of the strangers' bytes got in
    c.decode_state(room, KVPoll.Success)
    assert c.decode.take(room)[0]["kv"].data == kv.data
    c.prefill_state(0, room, KVPoll.Success)
    still_serving(c, 501)


# ---- malformed, oversized and replayed frames (without a token, and from a peer holding it) ------

BOMBS = {  # name: (frame, reason logged)
    "nested 60000 deep": (b"\x91" * 60000 + b"\xc0", "StackError"),
    "huge array length": (b"\xdd\xff\xff\xff\xff", "exceeds max_array_len"),
    "huge map length": (b"\xdf\xff\xff\xff\xff" + b"\xa1a\x01" * 8, "exceeds max_map_len"),
    "huge str length": (b"\xdb\xff\xff\xff\xf0abc", "undecodable msgpack"),
    "61K empty arrays": (b"\x9f" + (b"\xdc\x0f\xff" + b"\x90" * 4095) * 15, "not a msgpack map"),
    "ext type": (b"\xc7\x05\x01abcde", "exceeds max_ext_len"),
}


def _decode_cases(room: int, other: int):
    """(name, frames, reason logged, does it fail the room?)"""
    kv = make_parts(0, room)[0]
    head = msgpack.packb({"type": "DATA", "room": room, "pp_rank": 0, **kv.spec.header()})
    cases = [
        ("truncated payload", [head, kv.data[:-10]], "bytes, expected", True),
        ("truncated header", [head[:-3], kv.data], "undecodable msgpack", False),
        ("wrong shape", [data_head(room, shape=[1, 2, 5, 16]), kv.data], "!= expected", True),
        ("huge shape", [data_head(room, shape=[2**62] * 4), kv.data], "!= expected", True),
        (
            "negative shape",
            [data_head(room, shape=[-1, 2, 5, 8]), kv.data],
            "non-negative ints",
            True,
        ),
        ("wrong types", [data_head(room, pp_rank="0"), kv.data], "pp_rank must be an int", True),
        ("wrong room: unknown", [data_head(other), kv.data], "unknown room", False),
        ("wrong room: 0", [data_head(0), kv.data], "outside 1..2^63-1", False),
        ("wrong room: str", [data_head("1"), kv.data], "must be an integer", False),
        ("garbage", [b"\x00\xffgarbage" * 50], "undecodable msgpack", False),
        ("empty frame", [b""], "undecodable msgpack", False),
        ("not a map", [msgpack.packb([room, 0])], "not a msgpack map", False),
        ("oversized header", [b"\xc5" + b"\x00" * 70000, kv.data], "exceeds", False),
        ("too many frames", [head, kv.data, b"x", b"y"], "DATA needs 2 frames", True),
    ]
    cases += [(f"msgpack bomb: {k}", [frame], why, False) for k, (frame, why) in BOMBS.items()]
    return cases


@pytest.mark.parametrize("token", [None, TOKEN], ids=["no-token", "token"])
def test_malformed_frames_to_the_decode(make_cluster, logs, token):
    c = make_cluster(token=token, waiting_timeout=5.0)
    auth = wire.FrameAuth(token)
    tracemalloc.start()
    try:
        with stranger(c.decode.port) as send:
            for i, (name, _, needle, fails) in enumerate(_decode_cases(1000, 999)):
                room = 1000 + 10 * i
                msg = _decode_cases(room, room + 5)[i][1]
                live(c, room)
                logs.clear()
                tracemalloc.reset_peak()
                send(auth.seal(msg))
                logged(logs, needle, name)
                if fails:
                    reason = c.decode_state(room, KVPoll.Failed).reason
                    assert needle in reason, (name, reason)
                    for pp in (0, 1):
                        # the decode's ABORT reached every stage
                        c.prefill_state(pp, room, KVPoll.Failed)
                else:
                    assert c.decode.poll(room).state == KVPoll.WaitingForInput, name
                    c.decode.abort(room, "next case")
                # the frame itself is < 100 KiB
                assert tracemalloc.get_traced_memory()[1] < 24 << 20, name
                still_serving(c, room + 1)
    finally:
        tracemalloc.stop()
    n = len(_decode_cases(1, 2))
    assert c.decode.rejected()["protocol"] == n and "auth" not in c.decode.rejected()
    # failed or aborted; the good ones
    assert c.decode.stats()["Failed"] == n and c.decode.stats()["Success"] == n


@pytest.mark.parametrize("token", [None, TOKEN], ids=["no-token", "token"])
def test_frame_over_maxmsgsize_drops_the_connection_only(make_cluster, logs, token):
    c = make_cluster(token=token, max_part_bytes=64 << 10)
    live(c, 300)
    with stranger(c.decode.port) as send:
        send(
            seal([data_head(300), b"\0" * (1 << 20)], token)
            if token
            else [data_head(300), b"\0" * (1 << 20)]
        )
        logged(logs, "MAXMSGSIZE 65536", "(zmq's disconnect, seen by the monitor)")
    # zmq dropped it before the agent saw a byte
    assert c.decode.poll(300).state == KVPoll.WaitingForInput
    c.send(300, 0)
    c.send(300, 1)
    c.decode_state(300, KVPoll.Success)
    logs.clear()
    with stranger(c.prefills[0].port) as send:  # the prefill's limit: 64 KiB control frames
        send([b"\x00" * (protocol.MAX_CONTROL_BYTES + 1)])
        logged(logs, f"MAXMSGSIZE {protocol.MAX_CONTROL_BYTES}")
    still_serving(c, 301)


def test_replays_without_a_token_fail_the_room(make_cluster, logs):
    c = make_cluster()
    live(c, 400)
    part = Data.of(400, 0, make_parts(0, 400)[0]).encode()
    with stranger(c.decode.port) as send:
        send(part)
        send(part)
    assert "arrived twice" in c.decode_state(400, KVPoll.Failed).reason
    still_serving(c, 401)


def test_replays_with_a_token_are_dropped(make_cluster, logs):
    """A capture of the real stage's messages (identical bytes: packing and the tag are
    deterministic)."""
    c = make_cluster(token=TOKEN)
    live(c, 410)
    part = seal(Data.of(410, 0, make_parts(0, 410)[0]).encode())
    with stranger(c.decode.port) as send:
        send(part)
        send(part)  # the same part twice
        logged(logs, "a second copy of part 'kv' from pp_rank 0 dropped")
        assert c.decode.poll(410).state == KVPoll.Transferring
        # the real stage sends it again: also a duplicate, dropped; its STATUS success counts
        c.send(410, 0)
        c.send(410, 1)
        c.decode_state(410, KVPoll.Success)
        assert c.decode.take(410)[0]["kv"].data == make_parts(0, 410)[0].data
        c.decode.clear(410)
        # the whole cleared room again, every stage's parts and STATUS success
        logs.clear()
        for pp in (0, 1):
            for p in make_parts(pp, 410):
                send(seal(Data.of(410, pp, p).encode()))
            send(seal(Status.success(410, pp).encode()))
        logged(logs, "DATA for unknown room 410")
        logged(logs, "STATUS from pp_rank 1 for unknown room 410 dropped")
    # to the prefill: a replayed TRANSFER_INFO of a live room, and of a cleared one
    info = seal(TransferInfo(411, HOST, c.decode.port, 5, SCHEMA).encode())
    live(c, 411)
    with stranger(c.prefills[0].port) as send:
        send(info)
        logged(logs, "duplicate TRANSFER_INFO")
        c.prefills[1].clear(411)
    with stranger(c.prefills[1].port) as send:
        send(info)
        logged(logs, "TRANSFER_INFO for cleared room 411 dropped")
    assert c.prefills[0].rejected()["replay"] == 1 and c.prefills[1].rejected()["replay"] == 1
    assert sum(c.decode.stats().values()) == 1  # only 411: nothing was recreated for 410
    still_serving(c, 412)


@pytest.mark.parametrize("token", [None, TOKEN], ids=["no-token", "token"])
def test_malformed_control_messages_to_the_prefill(make_cluster, logs, token, monkeypatch):
    monkeypatch.setattr(prefill_room, "MAX_EARLY", 100)
    c = make_cluster(token=token)
    auth = wire.FrameAuth(token)
    p = c.prefills[0]

    def info(**changes):
        return [
            msgpack.packb(
                {
                    "type": "TRANSFER_INFO",
                    "room": 600,
                    "decode_host": HOST,
                    "decode_port": 5,
                    "prompt_len": 5,
                    "schema": SCHEMA,
                    **changes,
                }
            )
        ]

    cases = [
        ("garbage", [b"\xc1\xc1 not msgpack"], "undecodable msgpack"),
        ("two frames", [b"a", b"b"], "expected one control frame, got 2"),
        (
            "unknown type",
            [msgpack.packb({"type": "EXEC", "room": 600})],
            "unknown message type 'EXEC'",
        ),
        ("port type", info(decode_port="5"), "decode_port must be an int"),
        ("port range", info(decode_port=70000), "decode_port must be an int"),
        ("prompt_len", info(prompt_len=-1), "prompt_len must be an int"),
        ("host too long", info(decode_host="h" * 300), "decode_host must be a str"),
        ("schema type", info(schema=[1, 2]), "schema must be a map"),
        ("room 0", info(room=0), "outside 1..2^63-1"),
        ("abort room", [msgpack.packb({"type": "ABORT", "room": 2**63})], "outside 1..2^63-1"),
    ]
    cases += [(f"bomb: {k}", [frame], why) for k, (frame, why) in BOMBS.items()]
    with stranger(p.port) as send:
        for name, msg, needle in cases:
            logs.clear()
            send(auth.seal(msg))
            logged(logs, needle, name)
        # a flood of messages for rooms never added: the early buffer keeps the newest MAX_EARLY
        for room in range(10_000, 12_000):
            send(auth.seal(Abort(room, "flood").encode()))
        wait_for(lambda: p.rejected().get("overflow", 0) >= 1900, what="the flood")
        assert len(p._table.early) <= 100
    assert p.rejected()["protocol"] == len(cases)
    still_serving(c, 601)


# ---- one side without the token, or another token ------------------------------------------------


@pytest.mark.parametrize(
    "prefill_token, decode_token, needle",
    [
        (
            TOKEN,
            None,
            "bootstrap server requires --disaggregation-auth-token (no Authorization: Bearer token was sent)",
        ),
        (
            TOKEN,
            "other-token",
            "bootstrap server requires --disaggregation-auth-token (the Bearer token does not match)",
        ),
        (None, TOKEN, "runs without --disaggregation-auth-token, this decode with one"),
    ],
    ids=["decode-none", "mismatch", "prefill-none"],
)
def test_token_on_one_side_fails_the_request_clearly(
    make_cluster, logs, prefill_token, decode_token, needle
):
    c = make_cluster(token=prefill_token, decode_token=decode_token)
    c.add(700)
    c.decode.begin(700, HOST, c.server.port, 5)
    reason = c.decode_state(700, KVPoll.Failed).reason
    assert needle in reason and "BOOTSTRAP_TIMEOUT" not in reason, reason
    if prefill_token:
        logged(logs, "bootstrap: refused GET /route")
        assert c.server.rejected()["auth"] >= 1
    assert c.threads_alive()


def test_prefill_stage_with_a_wrong_token_cannot_register(make_cluster):
    c = make_cluster(token=TOKEN)
    rogue = PrefillAgent(
        0, 2, SCHEMA, compare, c.server.url, HOST, 5.0, lambda *a: None, auth_token="wrong"
    )
    with pytest.raises(
        BootstrapError, match="HTTP 401: bootstrap server requires --disaggregation-auth-token"
    ):
        rogue.start()
    assert not rogue.threads_alive()
    still_serving(c, 710)  # its registration did not replace stage 0's endpoint


def test_tagged_frames_to_an_untagged_agent_say_why(make_cluster, logs):
    c = make_cluster()
    live(c, 720)
    with stranger(c.decode.port) as send:
        send(seal(Data.of(720, 0, make_parts(0, 720)[0]).encode()))
    assert "set the same --disaggregation-auth-token" in c.decode_state(720, KVPoll.Failed).reason
    with stranger(c.prefills[0].port) as send:
        send(seal(Abort(721).encode()))
        logged(logs, "expected one control frame, got 2 (a peer with --disaggregation-auth-token")
    still_serving(c, 722)


# ---- bootstrap routes ----------------------------------------------------------------------------

INFO_ROUTE = "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
ROUTES = [
    ("PUT", "/route"),
    ("GET", INFO_ROUTE),
    ("POST", "/register_dp_rank"),
    ("POST", "/query_dp_ranks"),
    ("GET", "/nowhere"),
    ("POST", "/health"),
]


def test_bootstrap_requires_the_token(make_cluster, logs):
    c = make_cluster(token=TOKEN)
    url = c.server.url
    for method, path in ROUTES:
        for token, why in [
            (None, "no Authorization: Bearer token was sent"),
            ("wrong", "the Bearer token does not match"),
            (TOKEN[:-1], "does not match"),
        ]:
            code, body = http_request(
                method, url + path, {} if method != "GET" else None, token=token
            )
            assert code == 401 and why in json.loads(body)["error"], (method, path, token, body)
            assert "requires --disaggregation-auth-token" in json.loads(body)["error"]
    conn = http.client.HTTPConnection(HOST, c.server.port, timeout=5)
    conn.request("GET", "/route?prefill_dp_rank=-1", headers={"Authorization": f"bearer {TOKEN}"})
    resp = conn.getresponse()
    assert resp.status == 401 and resp.getheader("WWW-Authenticate") == "Bearer"
    conn.close()
    assert http_request("GET", f"{url}/health") == (200, b"OK")
    code, body = route(c.server)
    assert code == 401
    code, body = http_request("GET", url + INFO_ROUTE, token=TOKEN)
    assert code == 200 and json.loads(body)["auth_required"] is True
    assert c.server.rejected()["auth"] == 3 * len(ROUTES) + 2
    logged(logs, "bootstrap: refused PUT /route from 127.0.0.1: 401")
    still_serving(c, 800)


def _pipelined(port: int, requests: list[bytes]) -> bytes:
    """Send every request on one keep-alive connection (HTTP/1.1 pipelining) and read all the
    answers."""
    sock = socket.create_connection((HOST, port), timeout=30)
    writer = threading.Thread(target=sock.sendall, args=(b"".join(requests),), daemon=True)
    writer.start()
    buf = bytearray()
    while buf.count(b"HTTP/1.1 ") < len(requests):
        chunk = sock.recv(1 << 20)
        if not chunk:
            break
        buf += chunk
    writer.join(10)
    sock.close()
    return bytes(buf)


def _post(path: str, body: bytes, token=None, method="POST") -> bytes:
    auth = f"Authorization: Bearer {token}\r\n".encode() if token else b""
    return (
        b"%s %s HTTP/1.1\r\nHost: x\r\n%sContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
        % (method.encode(), path.encode(), auth, len(body), body)
    )


@pytest.mark.parametrize("token", [None, TOKEN], ids=["no-token", "token"])
def test_bootstrap_routes_refuse_bad_bodies(make_cluster, logs, token, monkeypatch):
    monkeypatch.setattr(bootstrap_mod, "DP_RANK_TABLE_MAX", 1000)
    c = make_cluster(token=token)
    url, good = c.server.url, c.prefills[0]._registration()

    def call(method, path, body=None, raw=None):
        if raw is None:
            return http_request(method, url + path, body, token=token)
        conn = http.client.HTTPConnection(HOST, c.server.port, timeout=10)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        conn.request(
            method, path, body=raw, headers=headers, encode_chunked=not isinstance(raw, bytes)
        )
        resp = conn.getresponse()
        out = resp.status, resp.read()
        conn.close()
        return out

    cases = [
        ("malformed JSON", "PUT", "/route", None, b"{not json", 400, "body must be JSON"),
        ("not an object", "POST", "/register_dp_rank", None, b"[1, 2]", 400, "JSON object"),
        (
            "nested 30000 deep",
            "PUT",
            "/route",
            None,
            b"[" * 30000 + b"]" * 30000,
            400,
            "RecursionError",
        ),
        (
            "huge int",
            "POST",
            "/register_dp_rank",
            None,
            b'{"bootstrap_room": ' + b"9" * 5000 + b"}",
            400,
            "body must be JSON",
        ),
        ("non-utf8", "PUT", "/route", None, b'{"a": "\xff\xfe"}', 400, "body must be JSON"),
        ("huge body", "PUT", "/route", None, b"{" + b" " * (1 << 20) + b"}", 413, "over 65536"),
        ("huge chunked body", "PUT", "/route", None, iter([b" " * 8192] * 64), 413, "over 65536"),
        (
            "room type",
            "POST",
            "/register_dp_rank",
            {"bootstrap_room": "5", "dp_rank": 0},
            None,
            400,
            "bootstrap_room",
        ),
        (
            "room float",
            "POST",
            "/register_dp_rank",
            {"bootstrap_room": 1e300, "dp_rank": 0},
            None,
            400,
            "bootstrap_room",
        ),
        (
            "dp_rank negative",
            "POST",
            "/register_dp_rank",
            {"bootstrap_room": 5, "dp_rank": -1},
            None,
            400,
            "dp_rank",
        ),
        (
            "rooms type",
            "POST",
            "/query_dp_ranks",
            {"bootstrap_rooms": {"a": 1}},
            None,
            400,
            "bootstrap_rooms",
        ),
        ("port type", "PUT", "/route", {**good, "rank_port": 1.5}, None, 400, "rank_port"),
        ("port range", "PUT", "/route", {**good, "rank_port": 0}, None, 400, "rank_port"),
        ("bool rank", "PUT", "/route", {**good, "pp_rank": True}, None, 400, "pp_rank"),
        ("ip type", "PUT", "/route", {**good, "rank_ip": ["x"]}, None, 400, "rank_ip"),
        (
            "http port",
            "PUT",
            "/route",
            {**good, "prefill_http_port": "80"},
            None,
            400,
            "prefill_http_port",
        ),
        (
            "query int",
            "GET",
            "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank="
            + "9" * 5000,
            None,
            None,
            400,
            "target_pp_rank",
        ),
    ]
    for name, method, path, body, raw, code, needle in cases:
        logs.clear()
        got, text = call(method, path, body, raw)
        assert got == code and needle in text.decode(errors="replace"), (name, got, text[:200])
        logged(logs, f"bootstrap: refused {method} {path.split('?')[0]}", name)
    # 10k registrations: dp ranks (the table keeps the newest DP_RANK_TABLE_MAX) and stage
    # re-registrations
    reqs = [
        _post("/register_dp_rank", json.dumps({"bootstrap_room": r, "dp_rank": 0}).encode(), token)
        for r in range(1, 10_001)
    ]
    answers = _pipelined(c.server.port, reqs)
    assert answers.count(b"HTTP/1.1 200") == 10_000
    assert len(c.server._dp_ranks) == 1000
    reg = json.dumps(good).encode()
    assert (
        _pipelined(c.server.port, [_post("/route", reg, token, "PUT")] * 500).count(b"HTTP/1.1 200")
        == 500
    )
    assert len(c.server._table) == 2
    rooms = {"bootstrap_rooms": [9_999, 10_000, 5]}
    assert json.loads(call("POST", "/query_dp_ranks", rooms)[1]) == {"9999": 0, "10000": 0}
    assert c.server.rejected()["request"] == len(cases) - 2 and c.server.rejected()["size"] == 2
    still_serving(c, 900)


# ---- deployment warnings, knobs ------------------------------------------------------------------


def test_non_loopback_bind_without_token_warns(caplog):
    assert all(wire.is_loopback(h) for h in ("127.0.0.1", "127.9.9.9", "::1", "[::1]", "localhost"))
    assert not any(wire.is_loopback(h) for h in ("0.0.0.0", "::", "", "10.0.0.1", "example.com"))
    caplog.set_level(logging.WARNING, logger="sparkrelay.transfer")
    for token, warned in [(None, True), (TOKEN, False)]:
        caplog.clear()
        # a wildcard bind needs the address to advertise (SPARKRELAY_HOST_IP)
        server = BootstrapServer(
            "0.0.0.0", 0, 1, SCHEMA, None, 16, "bfloat16", token, host_ip="10.0.0.1"
        )
        server.start()
        server.stop()
        decode = DecodeAgent(
            SCHEMA,
            compare,
            expected_parts,
            "0.0.0.0",
            1.0,
            1.0,
            1.0,
            2,
            1,
            auth_token=token,
            host_ip="10.0.0.2",
        )
        decode.start()
        assert decode.threads_alive()
        decode.close()
        assert not decode.threads_alive()
        text = caplog.text
        assert (
            "the bootstrap server binds 0.0.0.0" in text
            and "decode transfer socket binds 0.0.0.0" in text
        ) == warned, text


def test_knobs(monkeypatch):
    for var in (
        "SPARKRELAY_DISAGGREGATION_AUTH_TOKEN",
        "SGLANG_DISAGGREGATION_AUTH_TOKEN",
        "SPARKRELAY_TEST_DISAGG_FAILURE_PROB",
        "SGLANG_TEST_DISAGG_FAILURE_PROB",
    ):
        monkeypatch.delenv(var, raising=False)
    env = DisaggEnv.read()
    assert env.auth_token is None and env.test_failure_prob == 0.0 and env.token(None) is None
    monkeypatch.setenv("SPARKRELAY_DISAGGREGATION_AUTH_TOKEN", TOKEN)
    monkeypatch.setenv("SGLANG_TEST_DISAGG_FAILURE_PROB", "0.25")
    env = DisaggEnv.read()
    assert (
        env.token(None) == TOKEN
        and env.token("flag-wins") == "flag-wins"
        and env.test_failure_prob == 0.25
    )
    assert TOKEN not in repr(env)
    monkeypatch.setenv("SPARKRELAY_TEST_DISAGG_FAILURE_PROB", "1.5")
    with pytest.raises(ConfigError, match="SPARKRELAY_TEST_DISAGG_FAILURE_PROB"):
        DisaggEnv.read()
    import argparse

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(
        ["--model-path", str(ROOT / "models" / "tiny-qwen3"), "--disaggregation-auth-token", TOKEN]
    )
    assert config_from_args(args).disagg.disaggregation_auth_token == TOKEN
    assert Config().disagg.disaggregation_auth_token is None


# ---- nothing is unpickled ------------------------------------------------------------------------


def test_no_pickle_or_marshal_in_sparkrelay():
    banned_modules = {
        "pickle",
        "cPickle",
        "_pickle",
        "marshal",
        "shelve",
        "dill",
        "cloudpickle",
        "jsonpickle",
    }
    found = []
    for path in sorted((ROOT / "sparkrelay").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        rel = path.relative_to(ROOT)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [
                    f"{rel}:{node.lineno} import {a.name}"
                    for a in node.names
                    if a.name.split(".")[0] in banned_modules
                ]
            elif (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.split(".")[0] in banned_modules
            ):
                found.append(f"{rel}:{node.lineno} from {node.module} import")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = node.func.value
                name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
                if name in banned_modules and node.func.attr in ("load", "loads", "Unpickler"):
                    found.append(f"{rel}:{node.lineno} {name}.{node.func.attr}()")
                # torch.load unpickles: only the offline training tools (their own local files) may
                # use it
                if name == "torch" and node.func.attr == "load" and rel.parts[1] != "tools":
                    found.append(f"{rel}:{node.lineno} torch.load()")
    assert not found, found
