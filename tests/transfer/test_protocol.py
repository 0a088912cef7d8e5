"""The typed control-channel messages (transfer/protocol.py): encode/decode round trips, and every
field rule raising a FrameError that names the field (and the room, once the room itself was valid).
No sockets."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from sparkrelay.transfer import protocol
from sparkrelay.transfer.backends import get_backend
from sparkrelay.transfer.base import KVPoll, Part, PartSpec
from sparkrelay.transfer.protocol import (
    Abort,
    Data,
    FrameError,
    Status,
    TransferInfo,
    read_at_decode,
    read_at_prefill,
    read_head,
)

ROOM = 12345
SPEC = PartSpec("kv", (0, 1), "bfloat16", (2, 2, 3, 4))
SCHEMA = {"version": 1, "layers": [0, 1]}


def raw(**head) -> list[bytes]:
    return [msgpack.packb(head)]


def test_round_trips():
    part = Part(SPEC, b"\x05" * SPEC.nbytes)
    info = TransferInfo(ROOM, "127.0.0.1", 4242, 7, SCHEMA)
    assert read_at_prefill(info.encode()) == info and info.dest == ("127.0.0.1", 4242)
    assert read_at_prefill(Abort(ROOM, "client gone").encode()) == Abort(ROOM, "client gone")
    assert read_at_prefill(Abort(ROOM).encode()).reason == ""
    for status in (Status.success(ROOM, 1), Status.failed(ROOM, 0, "out of memory")):
        assert read_at_decode(status.encode()) == status
    data = Data.of(ROOM, 1, part)
    frames = data.encode()
    assert len(frames) == 2 and frames[1] is part.data  # the bytes go by reference
    got = read_at_decode(frames)
    assert got == data and got.spec == SPEC and got.payload == part.data
    assert Status.decode(Status.success(ROOM, 0).encode()) == Status.success(ROOM, 0)
    assert Data.decode(frames) == data


def test_wire_format_is_the_documented_map():
    head = msgpack.unpackb(Data.of(ROOM, 1, Part(SPEC, b"")).encode()[0])
    assert list(head) == ["type", "room", "pp_rank", "name", "layer_ids", "dtype", "shape"]
    assert head == {"type": "DATA", "room": ROOM, "pp_rank": 1, **SPEC.header()}
    assert msgpack.unpackb(Status.failed(ROOM, 0, "x").encode()[0]) == {
        "type": "STATUS",
        "room": ROOM,
        "pp_rank": 0,
        "status": int(KVPoll.Failed),
        "reason": "x",
    }
    assert list(msgpack.unpackb(TransferInfo(ROOM, "h", 1, 0, {}).encode()[0])) == [
        "type",
        "room",
        "decode_host",
        "decode_port",
        "prompt_len",
        "schema",
        "landing",
        "prefix",
    ]
    assert TransferInfo(ROOM, "h", 1, 0, {}).prefix == 0  # the decode's cached prefix: none
    # zmq: none; a one-sided backend's write targets
    assert TransferInfo(ROOM, "h", 1, 0, {}).landing == {}
    # deterministic
    assert TransferInfo(ROOM, "h", 1, 0, {}).encode() == TransferInfo(ROOM, "h", 1, 0, {}).encode()


def test_messages_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Abort(ROOM).room = 5


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda: TransferInfo(0, "h", 1, 5, {}), "outside 1..2^63-1"),
        (
            lambda: TransferInfo(ROOM, "h", 0, 5, {}),
            "decode_port must be an int in 1..65535, got 0",
        ),
        (lambda: TransferInfo(ROOM, "h", "80", 5, {}), "decode_port must be an int"),
        (
            lambda: TransferInfo(ROOM, "h" * 256, 80, 5, {}),
            "decode_host must be a str of at most 255 chars",
        ),
        (lambda: TransferInfo(ROOM, "h", 80, -1, {}), "prompt_len must be an int"),
        (lambda: TransferInfo(ROOM, "h", 80, 5, [1]), "schema must be a map"),
        (lambda: TransferInfo(ROOM, "h", 80, 5, {}, [1]), "landing must be a map"),
        (
            lambda: TransferInfo(ROOM, "h", 80, 5, {}, {}, -16),
            "prefix must be an int in 0..1099511627776, got -16",
        ),
        (lambda: Abort(True), "bootstrap_room must be an integer, got bool"),
        (lambda: Status(ROOM, 0, 5, ""), "status must be an int in 0..4"),
        (lambda: Status(ROOM, True, 4, ""), "pp_rank must be an int"),
        (lambda: Status(ROOM, 0, 4, "r" * 4097), "reason must be a str of at most 4096 chars"),
        (lambda: Data(ROOM, 0, "kv", (0,), "float8", (1,)), "unknown dtype 'float8'"),
        (
            lambda: Data(ROOM, 0, "kv", (-1,), "bfloat16", (1,)),
            "layer_ids must be a list of non-negative ints",
        ),
        (
            lambda: Data(ROOM, 0, "kv", (0,), "bfloat16", [1] * 4097),
            "shape must be a list of non-negative ints",
        ),
        (
            lambda: Data(ROOM, 0, "kv", (0,), "bfloat16", (True,)),
            "shape must be a list of non-negative ints",
        ),
        (lambda: Data(ROOM, 0, 7, (0,), "bfloat16", (1,)), "name must be a str"),
    ],
)
def test_every_field_is_checked_on_construction(make, needle):
    with pytest.raises(FrameError) as e:
        make()
    assert needle in e.value.reason, e.value.reason
    assert isinstance(e.value, ValueError)
    # a field after a valid room names the room (the receiver may fail it); a bad room names none
    assert e.value.room == (None if "bootstrap_room" in needle or "outside" in needle else ROOM)


def test_reasons_are_clipped_when_sent_and_lenient_in_abort():
    assert len(Status.failed(ROOM, 0, "x" * 10_000).reason) == protocol.MAX_REASON_CHARS
    assert read_at_prefill(raw(type="ABORT", room=ROOM, reason=5)) == Abort(ROOM, "")
    assert read_at_prefill(raw(type="ABORT", room=ROOM)) == Abort(ROOM, "")
    assert (
        len(read_at_prefill(raw(type="ABORT", room=ROOM, reason="y" * 5000)).reason)
        == protocol.MAX_REASON_CHARS
    )


def test_reading_at_the_prefill():
    hint = " (set the token)"
    with pytest.raises(
        FrameError, match=r"expected one control frame, got 2 \(set the token\)"
    ) as e:
        read_at_prefill([b"a", b"b"], hint)
    assert e.value.room is None
    with pytest.raises(FrameError, match=r"expected one control frame, got 3$"):
        read_at_prefill([b"a", b"b", b"c"], hint)
    # a decode-bound type
    with pytest.raises(FrameError, match="unknown message type 'STATUS'") as e:
        read_at_prefill(Status.success(ROOM, 0).encode())
    assert e.value.room is None  # the prefill fails no room for an unknown type
    with pytest.raises(FrameError, match="decode_port must be an int") as e:
        read_at_prefill(
            raw(
                type="TRANSFER_INFO",
                room=ROOM,
                decode_host="h",
                decode_port=None,
                prompt_len=1,
                schema={},
            )
        )
    assert e.value.room == ROOM


def test_reading_at_the_decode():
    head = Data.of(ROOM, 0, Part(SPEC, b"")).encode()[0]
    with pytest.raises(FrameError, match=r"DATA needs 2 frames, got 3 \(hint\)") as e:
        read_at_decode([head, b"", b"tag"], " (hint)")
    assert e.value.room == ROOM
    with pytest.raises(FrameError, match=r"DATA needs 2 frames, got 4$"):
        read_at_decode([head, b"", b"x", b"y"], " (hint)")
    with pytest.raises(FrameError, match="STATUS needs 1 frame, got 2"):
        read_at_decode(Status.success(ROOM, 0).encode() + [b"x"])
    with pytest.raises(FrameError, match="unknown message type 'ABORT'") as e:
        read_at_decode(Abort(ROOM).encode())
    assert e.value.room == ROOM
    with pytest.raises(FrameError, match="expected a STATUS message, got 'DATA'"):
        Status.decode([head, b""])
    with pytest.raises(FrameError, match="pp_rank must be an int") as e:
        read_at_decode(raw(type="STATUS", room=ROOM, pp_rank="0", status=4, reason=""))
    assert e.value.room == ROOM


@pytest.mark.parametrize(
    "frame, needle",
    [
        (b"\x00" * (protocol.MAX_CONTROL_BYTES + 1), "exceeds"),
        (b"\xc1 garbage", "undecodable msgpack"),
        (b"", "undecodable msgpack"),
        (msgpack.packb([1, 2]), "not a msgpack map with a str 'type'"),
        (msgpack.packb({"type": 5}), "not a msgpack map with a str 'type'"),
        (msgpack.packb({1: "x"}), "undecodable msgpack"),  # non-str keys
        (b"\xdd\xff\xff\xff\xff", "exceeds max_array_len"),
    ],
)
def test_read_head_refuses(frame, needle):
    with pytest.raises(FrameError, match=needle) as e:
        read_head(frame)
    assert e.value.room is None


def test_backend_registry():
    """Every backend is the same two agents composed with its carrier; the one-sided ones need no
    engine to be named (it is opened when an agent starts)."""
    from sparkrelay.transfer.frames import FramesCarrier
    from sparkrelay.transfer.onesided import OneSidedCarrier

    zmq = get_backend("zmq")
    assert zmq.carrier is FramesCarrier and not zmq.one_sided
    for name in ("mooncake", "nixl"):
        backend = get_backend(name)
        assert backend.carrier is OneSidedCarrier and backend.args == (name,) and backend.one_sided
    with pytest.raises(
        ValueError, match="unknown transfer backend 'rdma'; valid: mooncake, nixl, zmq"
    ):
        get_backend("rdma")
