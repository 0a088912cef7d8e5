"""Restarting a prefill: the decode must not keep a stale record of it, and a dead prefill must not
hold up other prefills' rooms.

Agent level (a real bootstrap server and agents on loopback, no model): a schema mismatch drops the
decode's record and the ABORT tells the prefill both values; a prefill restarted behind the same
bootstrap port serves the next room; TRANSFER_INFOs and ABORTs queued for a dead prefill's stages
never delay another prefill's rooms. Real servers: the same two faults through launch_server, with
the figures printed (run with -s to see them).
"""

from __future__ import annotations

import concurrent.futures
import random
import threading
import time

import pytest

from sparkrelay.tools.cluster import free_port, server_argv, start
from sparkrelay.transfer.base import KVPoll, Part, PartSpec
from sparkrelay.transfer.bootstrap import BootstrapServer
from sparkrelay.transfer.decode_agent import DecodeAgent
from sparkrelay.transfer.prefill_agent import PrefillAgent
from testkit.pd import DRAFTER, MODEL, post
from testkit.transfer import wait_for

HOST = "127.0.0.1"
SCHEMA = {
    "version": 1,
    "page_size": 16,
    "dtype": "bfloat16",
    "num_layers": 4,
    "hidden": 8,
    "pp_size": 2,
    "handoff": "hidden",
}
FAST = {
    "SPARKRELAY_DISAGGREGATION_HEARTBEAT_INTERVAL": "0.5",
    "SPARKRELAY_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2",
    "SPARKRELAY_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "20",
    "SPARKRELAY_DISAGGREGATION_WAITING_TIMEOUT": "30",
}
PROMPT = list(range(300, 340))


# ---- agent level ---------------------------------------------------------------------------------


def compare(prefill: dict, decode: dict) -> list[str]:
    keys = sorted(set(prefill) | set(decode))
    return [
        f"{k}: prefill={prefill.get(k)!r} decode={decode.get(k)!r}"
        for k in keys
        if prefill.get(k) != decode.get(k)
    ]


def expected_parts(schema: dict, prompt_len: int, prefix: int = 0) -> dict[int, list[PartSpec]]:
    per = schema["num_layers"] // schema["pp_size"]
    return {
        s: [
            PartSpec(
                "kv", tuple(range(s * per, (s + 1) * per)), "bfloat16", (per, 2, prompt_len, 8)
            )
        ]
        for s in range(schema["pp_size"])
    }


class PrefillSide:
    """A bootstrap server and its two stage agents: one prefill server, as the decode sees it."""

    def __init__(self, schema: dict, port: int = 0) -> None:
        self.schema, self.statuses = schema, {}
        self.server = BootstrapServer(
            HOST, port, 2, schema, 30000, schema["page_size"], schema["dtype"]
        )
        self.server.start()
        self.port = self.server.port
        self.agents = [
            PrefillAgent(pp, 2, schema, compare, self.server.url, HOST, 20.0, self._status(pp))
            for pp in (0, 1)
        ]
        for a in self.agents:
            a.start()

    def _status(self, pp: int):
        return lambda room, state, reason: self.statuses.setdefault((pp, room), (state, reason))

    def add(self, room: int) -> None:
        for a in self.agents:
            a.add_room(room, 5)

    def send(self, room: int) -> None:
        for pp, a in enumerate(self.agents):
            a.send(room, [Part(s, bytes(s.nbytes)) for s in expected_parts(self.schema, 5)[pp]])

    def stop(self) -> None:
        for a in self.agents:
            a.close()
        self.server.stop()


def make_decode(schema: dict, default_port: int, hb_interval: float = 0.2) -> DecodeAgent:
    d = DecodeAgent(schema, compare, expected_parts, HOST, 20.0, 30.0, hb_interval, 2, default_port)
    d.start()
    return d


def room_state(decode: DecodeAgent, room: int, state: KVPoll, timeout: float):
    return wait_for(
        lambda: decode.poll(room).state == state and decode.poll(room),
        timeout,
        f"room {room} -> {state.name} (now {decode.poll(room)})",
    )


def run_room(decode: DecodeAgent, side: PrefillSide, room: int, timeout: float = 5.0) -> float:
    """Seconds from begin() to Success for one room through `side`."""
    t0 = time.monotonic()
    side.add(room)
    decode.begin(room, HOST, side.port, 5)
    side.send(room)
    room_state(decode, room, KVPoll.Success, timeout)
    decode.take(room)
    decode.clear(room)
    return time.monotonic() - t0


def test_schema_mismatch_then_fixed_prefill_serves_the_next_room():
    bad = PrefillSide({**SCHEMA, "handoff": "tail"})
    decode = make_decode(SCHEMA, bad.port)
    try:
        bad.add(1)
        decode.begin(1, HOST, bad.port, 5)
        res = room_state(decode, 1, KVPoll.Failed, 5.0)
        assert (
            res.permanent
            and "schema mismatch: handoff: prefill='tail' decode='hidden'" in res.reason
        ), res
        for pp in (0, 1):  # the ABORT carries the reason: each stage fails the room saying why
            state, reason = wait_for(lambda: bad.statuses.get((pp, 1)), 5.0, f"stage {pp} status")
            assert (
                state == KVPoll.Failed and reason == f"aborted by the decode server: {res.reason}"
            ), reason
        decode.clear(1)
        port = bad.port
        bad.stop()
        good = PrefillSide(SCHEMA, port)  # the fixed prefill, same bootstrap port, new stage ports
        try:
            took = run_room(decode, good, 2)
            assert took < 2.0, took
            assert not decode.poll(2).permanent
        finally:
            good.stop()
    finally:
        decode.close()


def test_a_dead_prefill_never_delays_another_prefills_rooms():
    """Prefill A's stages die behind a live bootstrap server (a restart quicker than the heartbeat
    notices): TRANSFER_INFOs and ABORTs for A's old endpoints wait on their own, B's rooms go
    through at once, A's rooms fail after the send timeout, and the next room of A reads /route
    afresh and succeeds."""
    a, b = PrefillSide(SCHEMA), PrefillSide(SCHEMA)
    decode = make_decode(SCHEMA, a.port, hb_interval=60.0)  # no heartbeat round during the test
    try:
        run_room(decode, a, 10)
        run_room(decode, b, 11)
        for agent in a.agents:  # A's stages go away; the decode still holds their endpoints
            agent.close()
        a.agents = [
            PrefillAgent(pp, 2, SCHEMA, compare, a.server.url, HOST, 20.0, a._status(pp))
            for pp in (0, 1)
        ]
        for agent in a.agents:
            agent.start()  # re-register new endpoints with the same bootstrap server
        stale = list(range(100, 108))
        for room in stale:
            decode.begin(room, HOST, a.port, 5)
        room_state(decode, stale[-1], KVPoll.WaitingForInput, 5.0)
        for room in stale[:4]:
            decode.abort(room, "client went away")  # ABORTs for A's old endpoints
        t0 = time.monotonic()
        b_times = [run_room(decode, b, 200 + i) for i in range(10)]
        assert max(b_times) < 1.0, b_times
        # all of B's rooms before A's queued messages even expired
        assert time.monotonic() - t0 < 4.0
        for room in stale[4:]:
            reason = room_state(decode, room, KVPoll.Failed, 10.0).reason
            assert "could not send TRANSFER_INFO" in reason and "within 5 s" in reason, reason
            decode.clear(room)
        # the record was retired with its endpoints: /route is read again
        took = run_room(decode, a, 300)
        assert took < 2.0, took
        print(
            f"\nB's rooms while A's messages were stuck: max {max(b_times) * 1000:.0f} ms; "
            f"A's next room after the refresh: {took * 1000:.0f} ms"
        )
    finally:
        decode.close()
        a.stop()
        b.stop()


def test_an_unreachable_bootstrap_server_holds_one_bootstrap_worker_not_all():
    """Rooms whose prefill's bootstrap server is down wait behind one fetch; another prefill's rooms
    go on."""
    b = PrefillSide(SCHEMA)
    down = free_port()  # nothing listens there
    decode = make_decode(SCHEMA, b.port)
    try:
        for room in range(400, 408):
            decode.begin(room, HOST, down, 5)
        took = [run_room(decode, b, 500 + i) for i in range(3)]
        assert max(took) < 1.0, took
        for room in range(400, 408):  # the client gives up: the fetch stops retrying for nobody
            decode.abort(room, "client went away")
            assert decode.poll(room).state == KVPoll.Failed
    finally:
        decode.close()
        b.stop()


def test_outbox_a_dead_destination_waits_alone_and_expires():
    import zmq

    from sparkrelay.transfer.wire import FrameAuth, Outbox

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port(f"tcp://{HOST}")
    out = Outbox(ctx, 0.5, FrameAuth(None))
    try:
        dead = (HOST, free_port())
        assert out.put(dead, [b"a"], "t1") and out.put(dead, [b"b"], "t2")
        t0 = time.monotonic()
        for i in range(20):  # the live peer gets each message at once, in order
            out.put((HOST, port), [str(i).encode()], None)
            out.pump(1)
        got = [pull.recv(flags=0) for _ in range(20)]
        assert got == [str(i).encode() for i in range(20)] and time.monotonic() - t0 < 0.5
        expired = []
        while not expired and time.monotonic() - t0 < 3.0:
            expired = out.pump(10)
        assert expired == [(dead, "t1"), (dead, "t2")] and not out.queues
        assert out.put(dead, [b"c"], "t3") and out.drop(dead) == ["t3"] and dead not in out.socks
    finally:
        out.close()
        pull.close(0)
        ctx.term()


# ---- real servers --------------------------------------------------------------------------------


def _prefill(name: str, port: int, boot: int, log_dir: str, handoff: str):
    return start(
        name,
        server_argv(
            MODEL,
            port,
            [
                "--disaggregation-mode",
                "prefill",
                "--disaggregation-bootstrap-port",
                str(boot),
                "--speculative-draft-model-path",
                DRAFTER,
                "--dspark-pd-handoff",
                handoff,
            ],
        ),
        port,
        log_dir,
        FAST,
    )


def _decode(port: int, boot: int, log_dir: str):
    return start(
        "decode",
        server_argv(
            MODEL,
            port,
            [
                "--disaggregation-mode",
                "decode",
                "--disaggregation-bootstrap-port",
                str(boot),
                "--speculative-algorithm",
                "DSPARK",
                "--speculative-draft-model-path",
                DRAFTER,
            ],
        ),
        port,
        log_dir,
        FAST,
    )


def _body(boot: int, max_new: int = 8) -> dict:
    return {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0},
        "bootstrap_host": HOST,
        "bootstrap_port": boot,
        "bootstrap_room": random.randrange(1, 1 << 63),
    }


def _pair(pool, prefill_url: str, decode_url: str, boot: int, timeout: float = 60.0):
    """What a router does: the same body to both servers at once. ((status, out) prefill, (status,
    out) decode)."""
    b = _body(boot)
    fp = pool.submit(post, prefill_url + "/generate", b, timeout)
    fd = pool.submit(post, decode_url + "/generate", b, timeout)
    return fp.result(timeout + 5), fd.result(timeout + 5)


# ~34 s: two real servers; test_schema_mismatch_then_fixed_prefill_serves_the_next_room covers the
# rule in the default run
@pytest.mark.slow
def test_restarted_prefill_after_schema_mismatch_serves_the_next_request(tmp_path):
    boot, pport, dport = free_port(), free_port(), free_port()
    prefill = _prefill("prefill-tail", pport, boot, str(tmp_path), "tail")
    decode = None
    try:
        decode = _decode(dport, boot, str(tmp_path))
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            (ps, pout), (ds, dout) = _pair(pool, prefill.url, decode.url, boot)
            want = "schema mismatch: handoff: prefill='tail' decode='hidden'"
            assert ds == 400 and want in dout["error"]["message"], (
                ds,
                dout,
            )  # deterministic: not retryable
            assert ps == 400 and want in pout["error"]["message"], (ps, pout)
            wait_for(
                lambda: want in prefill.log_tail(200), 5.0, "the mismatch in the prefill's log"
            )
            prefill.kill()
            prefill = _prefill("prefill-fixed", pport, boot, str(tmp_path), "hidden")
            healthy_at = time.monotonic()
            (ps, pout), (ds, dout) = _pair(pool, prefill.url, decode.url, boot)
            took = time.monotonic() - healthy_at
            assert ps == 200 and ds == 200 and len(dout["output_ids"]) == 8, (ps, pout, ds, dout)
            assert took < 5.0, took
            print(
                f"\nfirst request after the fixed prefill's /health was 200: {ds} in {took * 1000:.0f} ms"
            )
    finally:
        for s in (prefill, decode):
            if s is not None:
                s.stop()


def _p95(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))]


@pytest.mark.slow  # ~36 s: two PD pairs under load and a restart
def test_prefill_killed_and_restarted_under_load_other_rooms_keep_their_latency(tmp_path):
    a_boot, a_port, b_boot, b_port, dport = (free_port() for _ in range(5))
    log_dir = str(tmp_path)
    a = _prefill("prefill-a", a_port, a_boot, log_dir, "hidden")
    b = decode = None
    samples: list[tuple[float, float, int]] = []  # (start, seconds, decode status) of B's requests
    stop = threading.Event()
    try:
        b = _prefill("prefill-b", b_port, b_boot, log_dir, "hidden")
        decode = _decode(dport, a_boot, log_dir)
        with concurrent.futures.ThreadPoolExecutor(12) as pool:

            def steady() -> None:
                while not stop.is_set():
                    t0 = time.monotonic()
                    (ps, _), (ds, _) = _pair(pool, b.url, decode.url, b_boot, timeout=30.0)
                    samples.append((t0, time.monotonic() - t0, ds if ps == 200 else ps))
                    time.sleep(0.05)

            # A works, and the decode knows it
            (ps, _), (ds, _) = _pair(pool, a.url, decode.url, a_boot)
            assert ps == ds == 200
            loader = threading.Thread(target=steady, daemon=True)
            loader.start()
            time.sleep(2.5)
            queued = [
                pool.submit(post, decode.url + "/generate", _body(a_boot), 30.0) for _ in range(3)
            ]
            time.sleep(0.5)  # A's rooms wait on the decode for KV that never comes
            kill_at = time.monotonic()
            a.kill()
            # before the heartbeat notices: the decode still holds A's endpoints, so these
            # TRANSFER_INFOs go to dead stages (a single blocking sender used to stall every room 5
            # s per message here)
            late = [
                pool.submit(post, decode.url + "/generate", _body(a_boot), 40.0) for _ in range(3)
            ]
            for f in queued + late:
                status, out = f.result(45)
                assert status == 502 and "prefill" in out["error"]["message"], (status, out)
            a = _prefill("prefill-a2", a_port, a_boot, log_dir, "hidden")
            healthy_at = time.monotonic()
            (ps, pout), (ds, dout) = _pair(pool, a.url, decode.url, a_boot)
            first_a = time.monotonic() - healthy_at
            assert ps == 200 and ds == 200, (ps, pout, ds, dout)
            time.sleep(2.5)
            stop.set()
            loader.join(40)
        before = [s for t, s, _ in samples if t < kill_at]
        during = [s for t, s, _ in samples if kill_at <= t < healthy_at + first_a]
        after = [s for t, s, _ in samples if t >= healthy_at + first_a]
        fig = lambda xs: (
            f"n={len(xs)} p50={sorted(xs)[len(xs) // 2] * 1000:.0f} ms p95={_p95(xs) * 1000:.0f} ms "
            f"max={max(xs) * 1000:.0f} ms"
        )
        print(
            f"\nB before: {fig(before)}\nB during A's kill+restart ({healthy_at - kill_at:.1f} s): {fig(during)}"
            f"\nB after: {fig(after)}\nA's first request after its /health was 200: {first_a * 1000:.0f} ms"
        )
        assert all(code == 200 for _, _, code in samples), [c for _, _, c in samples]
        assert len(before) >= 3 and len(during) >= 3 and len(after) >= 3, (
            len(before),
            len(during),
            len(after),
        )
        assert max(s for _, s, _ in samples) < 5.0
        assert _p95(during) < 4 * _p95(before) + 1.0, (fig(before), fig(during))
        assert first_a < 5.0, first_a
    finally:
        stop.set()
        for s in (a, b, decode):
            if s is not None:
                s.stop()
