"""A prefill stage's sends to one decode never hold up its rooms for another decode.

Agent level (a real bootstrap server, a PrefillAgent and a DecodeAgent on loopback, no model), with
auth on: decode X sent its TRANSFER_INFOs and then stopped reading (a PULL socket bound with a tiny
receive buffer, never polled); decode Y is healthy. Y's rooms complete at once while X's frames are
stuck, and X's rooms fail after SEND_TIMEOUT_S (shortened here) saying why.
"""

from __future__ import annotations

import time

import zmq

from sparkrelay.transfer import prefill_agent, wire
from sparkrelay.transfer.base import KVPoll, Part, PartSpec
from sparkrelay.transfer.bootstrap import BootstrapServer
from sparkrelay.transfer.decode_agent import DecodeAgent
from sparkrelay.transfer.prefill_agent import PrefillAgent
from sparkrelay.transfer.protocol import TransferInfo
from testkit.transfer import wait_for

HOST = "127.0.0.1"
TOKEN = "prefill-outbox-test-token-0123456789"
SCHEMA = {
    "version": 1,
    "page_size": 16,
    "dtype": "bfloat16",
    "num_layers": 4,
    "hidden": 8,
    "pp_size": 1,
}
PROMPT_LEN = 2048  # one part of [4, 2, 2048, 8] bf16 = 256 KiB per room
TIMEOUT_S = 2.0


def compare(a: dict, b: dict) -> list[str]:
    return [
        f"{k}: prefill={a.get(k)!r} decode={b.get(k)!r}"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k)
    ]


def expected_parts(schema: dict, prompt_len: int, prefix: int = 0) -> dict[int, list[PartSpec]]:
    return {0: [PartSpec("kv", (0, 1, 2, 3), "bfloat16", (4, 2, prompt_len, 8))]}


def parts(room: int) -> list[Part]:
    spec = expected_parts(SCHEMA, PROMPT_LEN)[0][0]
    return [Part(spec, bytes([room % 251]) * spec.nbytes)]


def test_a_stalled_decode_never_holds_up_the_prefills_rooms_for_another(monkeypatch):
    # read when the agent starts its outbox
    monkeypatch.setattr(prefill_agent, "SEND_TIMEOUT_S", TIMEOUT_S)
    statuses: dict[int, tuple[KVPoll, str, float]] = {}
    server = BootstrapServer(
        HOST, 0, 1, SCHEMA, 30000, SCHEMA["page_size"], SCHEMA["dtype"], auth_token=TOKEN
    )
    server.start()
    prefill = PrefillAgent(
        0,
        1,
        SCHEMA,
        compare,
        server.url,
        HOST,
        20.0,
        lambda room, state, reason: statuses.setdefault(room, (state, reason, time.monotonic())),
        auth_token=TOKEN,
    )
    decode_y = DecodeAgent(
        SCHEMA, compare, expected_parts, HOST, 20.0, 30.0, 60.0, 2, 0, auth_token=TOKEN
    )
    ctx = zmq.Context()
    x_pull, x_push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        prefill.start()
        decode_y.start()
        # decode X: bound, never read, as small a buffer as the kernel allows
        x_pull.setsockopt(zmq.RCVHWM, 1)
        x_pull.setsockopt(zmq.RCVBUF, 4096)
        x_port = x_pull.bind_to_random_port(f"tcp://{HOST}")
        x_push.connect(f"tcp://{HOST}:{prefill.port}")
        auth = wire.FrameAuth(TOKEN)
        # 192 messages, 24 MiB: more than zmq (64 messages) and the kernel hold
        x_rooms = list(range(1000, 1096))
        for room in x_rooms:
            prefill.add_room(room, PROMPT_LEN)
            x_push.send_multipart(
                auth.seal(TransferInfo(room, HOST, x_port, PROMPT_LEN, SCHEMA).encode())
            )
            prefill.send(room, parts(room))
        pushing = (KVPoll.Transferring, KVPoll.Success)  # Success: zmq took all of that room
        wait_for(
            lambda: all(prefill.poll(r).state in pushing for r in x_rooms),
            5.0,
            "X's rooms to be pushing",
        )
        time.sleep(0.3)  # X's pipe is full by now
        stuck_at = time.monotonic()
        stuck = [r for r in x_rooms if prefill.poll(r).state == KVPoll.Transferring]
        assert len(stuck) >= 16 and not any(r in statuses for r in stuck), (len(stuck), statuses)
        y_times = []
        for room in range(2000, 2008):
            t0 = time.monotonic()
            prefill.add_room(room, PROMPT_LEN)
            decode_y.begin(room, HOST, server.port, PROMPT_LEN)
            prefill.send(room, parts(room))
            wait_for(lambda: decode_y.poll(room).state == KVPoll.Success, 5.0, f"Y's room {room}")
            wait_for(lambda: statuses.get(room), 5.0, f"the prefill's status of room {room}")
            y_times.append(time.monotonic() - t0)
            assert statuses[room][:2] == (KVPoll.Success, ""), statuses[room]
            assert decode_y.take(room)[0]["kv"].data == parts(room)[0].data
            decode_y.clear(room)
        y_done = time.monotonic() - stuck_at
        assert max(y_times) < 0.5, y_times  # the old blocking sender: Y's first room 1.7 s
        assert not any(room in statuses for room in stuck), (
            "X's stuck rooms cannot have gone out yet"
        )
        for room in stuck:  # X's rooms fail on their own, after no progress for TIMEOUT_S
            state, reason, at = wait_for(
                lambda: statuses.get(room), TIMEOUT_S + 5.0, f"X's room {room} to fail"
            )
            assert state == KVPoll.Failed, (state, reason)
            assert (
                reason
                == f"sending to the decode at {HOST}:{x_port} failed: no progress within {TIMEOUT_S:g} s"
            )
            # X's last progress: < stuck_at
            assert TIMEOUT_S / 2 <= at - stuck_at <= TIMEOUT_S + 3.0, at - stuck_at
            assert prefill.poll(room).state == KVPoll.Failed
        print(
            f"\nY's 8 rooms (256 KiB each) while X was stuck: max {max(y_times) * 1000:.0f} ms, all in "
            f"{y_done * 1000:.0f} ms; X: {len(stuck)}/{len(x_rooms)} rooms stuck, failed "
            f"{max(statuses[r][2] for r in stuck) - stuck_at:.2f} s later"
        )
    finally:
        x_push.close(0)
        x_pull.close(0)
        ctx.term()
        decode_y.close()
        prefill.close()
        server.stop()
