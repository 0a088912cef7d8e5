"""The prefill and decode room state machines (transfer/prefill_room.py, transfer/decode_room.py) on
their own: pure transitions and timeouts with an explicit clock, no sockets, no threads."""

from __future__ import annotations

import pytest

from sparkrelay.transfer import prefill_room
from sparkrelay.transfer.base import (
    SCHEMA_MISMATCH,
    KVPoll,
    Part,
    PartSpec,
    PollResult,
    TransferError,
)
from sparkrelay.transfer.decode_room import DecodeRoom, DecodeRooms, plan
from sparkrelay.transfer.prefill_room import PrefillRooms
from sparkrelay.transfer.protocol import TransferInfo

KV = PartSpec("kv", (0, 1), "bfloat16", (2, 2, 5, 8))
META = PartSpec("meta", (), "int64", (4,))
DEST = ("127.0.0.1", 5000)


def info(room: int, prompt_len: int = 5, port: int = 5000) -> TransferInfo:
    return TransferInfo(room, "127.0.0.1", port, prompt_len, {})


# ---- prefill -------------------------------------------------------------------------------------


def test_prefill_room_happy_path_in_either_order():
    for info_first in (True, False):
        t = PrefillRooms("prefill pp_rank 0")
        assert t.add(7, 5, now=0.0) is None
        rec = t.rooms[7]
        assert rec.result() == PollResult(KVPoll.Bootstrapping) and 7 in t.pending
        steps = [
            lambda: t.accept(7, rec, info(7), []),
            lambda: rec.hand_over(7, [Part(KV, b"")], True),
        ]
        for step in steps if info_first else steps[::-1]:
            assert not rec.take_push()  # not before both the destination and the parts are known
            assert not step()
        assert rec.state == KVPoll.WaitingForInput and rec.dest == DEST and 7 not in t.pending
        assert rec.take_push() and not rec.take_push()  # handed to the sender once
        with pytest.raises(ValueError, match="send\\(\\) after its last send"):
            rec.hand_over(7, [], True)
        assert rec.take_parts() == ([Part(KV, b"")], True) and not rec.take_push()
        rec.start_push()
        assert rec.state == KVPoll.Transferring
        assert rec.succeed() and rec.state == KVPoll.Success and rec.pending == []
        assert not rec.fail("too late") and rec.state == KVPoll.Success


def test_prefill_room_streams_its_hand_overs():
    """A stage hands its parts over chunk by chunk: one push waits at a time and takes every part
    handed over so far; the push that takes the last hand-over ends the room (its STATUS success
    follows)."""
    kv0, kv1 = (
        Part(PartSpec("kv@0", (0, 1), "bfloat16", (2, 2, 3, 8)), b""),
        Part(PartSpec("kv@3", (0, 1), "bfloat16", (2, 2, 2, 8)), b""),
    )
    t = PrefillRooms("prefill pp_rank 0")
    t.add(7, 5, now=0.0)
    rec = t.rooms[7]
    rec.hand_over(7, [kv0], False)
    assert not rec.take_push()  # no destination yet
    t.accept(7, rec, info(7), [])
    assert rec.take_push() and not rec.take_push()
    rec.hand_over(7, [kv1], False)
    assert not rec.take_push()  # rides on the push already queued
    assert rec.take_parts() == ([kv0, kv1], False)
    assert not rec.take_push()  # nothing new handed over
    with pytest.raises(ValueError, match="kv@3"):
        rec.hand_over(7, [kv1], True)  # each part once
    rec.hand_over(7, [Part(META, b"")], True)
    assert rec.take_push() and rec.take_parts() == ([Part(META, b"")], True)
    assert not rec.take_push() and rec.closing


def test_prefill_room_sends_nothing_the_decode_holds():
    """TRANSFER_INFO's prefix (the decode's cached prefix, whole pieces): pieces before it are
    dropped, the row goes; a prefix that is not a whole number of pieces below the prompt length
    fails the room."""
    kv0, kv4, meta = (
        Part(PartSpec(n, (0,), "bfloat16", (1,)), b"") for n in ("kv@0", "kv@4", "meta")
    )
    t = PrefillRooms("prefill pp_rank 0")
    t.add(7, 10, now=0.0)
    rec = t.rooms[7]
    rec.hand_over(7, [kv0, kv4, meta], True)
    assert t.accept(7, rec, TransferInfo(7, "127.0.0.1", 5000, 10, {}, prefix=4), [], align=4) == ""
    assert rec.take_push() and rec.take_parts() == ([kv4, meta], True)
    for bad in (2, 12):
        t.add(8 + bad, 10, now=0.0)
        why = t.accept(
            8 + bad,
            t.rooms[8 + bad],
            TransferInfo(8 + bad, "127.0.0.1", 5000, 10, {}, prefix=bad),
            [],
            align=4,
        )
        assert (
            f"cached prefix {bad} is not a multiple of 4 positions below the prompt length 10"
            in why
        )


def test_prefill_room_refusals():
    t = PrefillRooms("prefill pp_rank 1")
    t.add(1, 5, 0.0)
    t.add(2, 6, 0.0)
    t.add(3, 5, 0.0)
    mismatch = "hidden: prefill=8 decode=16"
    assert t.accept(1, t.rooms[1], info(1), [mismatch]) == SCHEMA_MISMATCH + mismatch
    assert t.accept(2, t.rooms[2], info(2), []).startswith(
        "prompt_len mismatch: prefill=6 decode=5"
    )
    # the agent fails them (and says why)
    assert t.rooms[1].state == t.rooms[2].state == KVPoll.Bootstrapping
    rec = t.rooms[3]
    assert rec.fail("rejected by the scheduler") and not rec.fail("again")
    # tell it now
    assert t.accept(3, rec, info(3), []) == "" and rec.state == KVPoll.Failed and rec.dest == DEST
    rec.hand_over(3, [Part(KV, b"")], True)
    assert rec.pending == [] and not rec.take_push()  # a failed room sends nothing
    with pytest.raises(ValueError, match="already in use on prefill pp_rank 1"):
        t.add(3, 5, 0.0)


def test_prefill_timeouts_early_messages_and_cleared_rooms(monkeypatch):
    monkeypatch.setattr(prefill_room, "MAX_EARLY", 3)
    t = PrefillRooms("prefill pp_rank 0")
    t.add(1, 5, now=0.0)
    t.add(2, 5, now=0.5)
    t.accept(2, t.rooms[2], info(2), [])
    assert t.hold_early(10, 0.2, info=info(10)) == []
    assert t.hold_early(11, 0.3, aborted="aborted by the decode server") == []
    assert t.expire(now=1.0, timeout=1.0) == ([], [])
    late, unclaimed = t.expire(now=1.35, timeout=1.0)
    assert late == [1] and unclaimed == [
        info(10)
    ]  # 2 got its TRANSFER_INFO; 11's ABORT needs no answer
    assert not t.early and not t.pending
    # an ABORT keeps an earlier TRANSFER_INFO; the oldest early messages go past MAX_EARLY
    t.hold_early(20, 2.0, info=info(20))
    t.hold_early(20, 2.1, aborted="gone")
    assert t.early[20].info == info(20) and t.early[20].aborted == "gone"
    assert (
        t.hold_early(21, 2.2) == []
        and t.hold_early(22, 2.3) == []
        and t.hold_early(23, 2.4) == [20]
    )
    early = t.add(21, 5, 2.5)
    assert early is not None and early.info is None and 21 not in t.early
    t.clear(21, now=3.0)
    assert 21 not in t.rooms and 21 in t.cleared
    t.expire(now=62.0, timeout=1.0)
    assert 21 in t.cleared  # kept max(2 * timeout, 60 s)
    t.expire(now=63.5, timeout=1.0)
    assert 21 not in t.cleared


def test_prefill_dead_decodes(monkeypatch):
    monkeypatch.setattr(prefill_room, "MAX_DEAD", 2)
    t = PrefillRooms("prefill pp_rank 0")
    t.mark_dead([("h", 1), DEST, ("h", 3)], now=1.0)
    assert list(t.dead) == [DEST, ("h", 3)]  # the oldest forgotten past MAX_DEAD
    t.add(6, 5, 2.0)
    t.accept(6, t.rooms[6], info(6), [])  # a TRANSFER_INFO from it: alive again
    assert list(t.dead) == [("h", 3)]


# ---- decode --------------------------------------------------------------------------------------


def ready_room(now: float = 0.0) -> DecodeRoom:
    rec = DecodeRoom(("127.0.0.1", 8998), 5, begun=now)
    rec.ready({0: {"kv": KV}, 1: {"kv": KV, "meta": META}}, now)
    return rec


def test_decode_room_happy_path():
    rec = DecodeRoom(("127.0.0.1", 8998), 5, begun=0.0)
    assert rec.accept(0, KV, b"\0" * KV.nbytes) == "DATA before this decode sent its TRANSFER_INFO"
    rec = ready_room()
    assert rec.state == KVPoll.WaitingForInput and rec.received == {0: {}, 1: {}}
    assert rec.accept(0, KV, b"\1" * KV.nbytes) is None and rec.state == KVPoll.Transferring
    assert rec.stage_done(0) is None and rec.state == KVPoll.Transferring  # stage 1 not yet
    assert rec.accept(1, KV, b"\2" * KV.nbytes) is None
    assert (
        rec.stage_done(1) == "prefill pp_rank 1 reported success but part(s) ['meta'] never arrived"
    )
    assert rec.accept(1, META, b"\3" * META.nbytes) is None
    with pytest.raises(TransferError, match="needs Success"):
        rec.take(9)
    assert rec.stage_done(1) is None and rec.state == KVPoll.Success
    parts = rec.take(9)
    assert parts[1]["meta"].data == b"\3" * META.nbytes and rec.received == {}
    with pytest.raises(TransferError, match="called twice"):
        rec.take(9)


@pytest.mark.parametrize(
    "pp, spec, nbytes, needle",
    [
        (2, KV, KV.nbytes, "DATA from pp_rank 2, the room expects pp_rank(s) [0, 1]"),
        (0, META, META.nbytes, "unexpected part 'meta' from pp_rank 0 (expected ['kv'])"),
        (0, PartSpec("kv", (0, 1), "bfloat16", (2, 2, 5, 16)), KV.nbytes * 2, "!= expected"),
        (0, KV, KV.nbytes - 1, f"{KV.nbytes - 1} bytes, expected {KV.nbytes}"),
    ],
)
def test_decode_room_refuses_parts_that_do_not_fit(pp, spec, nbytes, needle):
    rec = ready_room()
    assert needle in rec.accept(pp, spec, b"\0" * nbytes)
    assert rec.state == KVPoll.WaitingForInput and rec.received == {0: {}, 1: {}}


def test_decode_room_replays_and_failures():
    rec = ready_room()
    assert not rec.is_replay(0, KV)
    rec.accept(0, KV, b"\0" * KV.nbytes)
    assert rec.is_replay(0, KV) and "arrived twice" in rec.accept(0, KV, b"\0" * KV.nbytes)
    rec.stage_done(0)
    assert rec.part_problem(0, KV, KV.nbytes) == "DATA from pp_rank 0 after its success STATUS"
    assert "STATUS success from pp_rank 3" in rec.stage_done(3)
    assert rec.fail("lost", permanent=True) and rec.result() == PollResult(
        KVPoll.Failed, "lost", True
    )
    assert rec.received == {} and not rec.fail("again") and rec.reason == "lost"
    done = ready_room()
    done.state = KVPoll.Success
    assert not done.fail("late") and done.state == KVPoll.Success
    assert done.fail("client went away", force=True) and done.state == KVPoll.Failed


def test_decode_rooms_waiting_timeout_and_table():
    t = DecodeRooms()
    a, b = DecodeRoom(("h", 1), 5, 0.0), DecodeRoom(("h", 1), 5, 0.0)
    t.add(1, a)
    t.add(2, b)
    with pytest.raises(ValueError, match="already in use"):
        t.add(1, a)
    plan_ = {0: {"kv": KV}}
    t.ready(1, a, plan_, now=1.0)
    t.ready(2, b, plan_, now=2.0)
    assert t.expire(now=2.0, timeout=1.0) == []
    assert t.expire(now=2.5, timeout=1.0) == [(1, a, [0])]
    t.clear(2, now=2.6)  # cleared and begun again: the stale waiting entry is skipped
    c = DecodeRoom(("h", 1), 5, 2.7)
    t.add(2, c)
    assert t.expire(now=10.0, timeout=1.0) == [] and not t.waiting
    assert (
        t.stats()["Bootstrapping"] == 1
        and t.stats()["WaitingForInput"] == 1
        and sum(t.stats().values()) == 2
    )


def test_plan():
    info = {"schema": {"hidden": 8}, "pp_size": 2}

    def parts(schema, prompt_len, prefix=0):
        return {0: [KV], 1: [KV, META]}

    def compare(a, b):
        return [f"hidden: prefill={a['hidden']} decode={b['hidden']}"] if a != b else []

    assert plan(compare, parts, info, {"hidden": 8}, 5, 1 << 20) == (
        "",
        {0: {"kv": KV}, 1: {"kv": KV, "meta": META}},
    )
    mismatch = SCHEMA_MISMATCH + "hidden: prefill=8 decode=16"
    assert plan(compare, parts, info, {"hidden": 16}, 5, 1 << 20) == (mismatch, {})
    broken = plan(lambda a, b: 1 / 0, parts, info, {}, 5, 1 << 20)[0]
    assert broken.startswith(SCHEMA_MISMATCH + "schema compare failed (ZeroDivisionError")
    assert "over max_part_bytes" in plan(compare, parts, info, {"hidden": 8}, 5, 100)[0]
    assert (
        plan(compare, lambda s, n, p: {2: [KV]}, info, {"hidden": 8}, 5, 1 << 20)[0]
        == "expected_parts names pp_rank 2, the prefill has pp_size 2"
    )
    assert (
        "twice" in plan(compare, lambda s, n, p: {0: [KV, KV]}, info, {"hidden": 8}, 5, 1 << 20)[0]
    )

    def refuses(schema, prompt_len, prefix=0):
        raise ValueError("nothing to transfer")

    assert plan(compare, refuses, info, {"hidden": 8}, 0, 1 << 20) == ("nothing to transfer", {})
