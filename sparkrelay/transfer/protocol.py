"""The control-channel messages, typed: frozen dataclasses whose encode() gives the frames and whose
decode() checks every field before anything uses it. No sockets here (transfer/wire/ moves and
authenticates the frames).

Every message is one ZMQ multipart message on a PUSH -> PULL pair:

    control  [msgpack map]               TRANSFER_INFO, ABORT (decode -> prefill); STATUS (prefill -> decode)
    data     [msgpack map, raw bytes]    DATA (prefill -> decode); the bytes are exactly spec.nbytes, C order

    TRANSFER_INFO {type, room, decode_host, decode_port, prompt_len, schema, landing}
                                                              landing: {} for zmq; a one-sided backend's write
                                                              targets (transfer/landing.py)
    ABORT         {type, room, reason}                        reason: why the decode gave up (lenient: not a str
                                                              reads as "")
    STATUS        {type, room, pp_rank, status, reason}       status: int(KVPoll.Success) or int(KVPoll.Failed)
    DATA          {type, room, pp_rank, name, layer_ids, dtype, shape}   the PartSpec of the bytes frame

Every map key is a str; nothing is unpickled. A field that breaks its rule raises FrameError naming
the field (and the room, once the room field itself was valid, so the receiver can fail that room).
The size of DATA's bytes is checked by the decode against the PartSpec it expects for the room
(transfer/decode_room.py), not here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Union

from sparkrelay.codec import (
    MAX_CONTROL_BYTES,
    MAX_LIST_LEN,
    FrameError,
    Message,
    a_map,
    check_frame_count,
    int_in,
    int_list,
    opt_int,
    opt_map,
    pack,
    read_head,
    str_max,
)
from sparkrelay.transfer.base import DTYPE_SIZES, KVPoll, Part, PartSpec, check_room

__all__ = [
    "MAX_CONTROL_BYTES",
    "MAX_LIST_LEN",
    "MAX_REASON_CHARS",
    "Abort",
    "AuthError",
    "Data",
    "FrameError",
    "Message",
    "Status",
    "TransferInfo",
    "clip",
    "pack",
    "read_at_decode",
    "read_at_prefill",
    "read_head",
    "room_field",
]

MAX_REASON_CHARS = 4096


class AuthError(FrameError):
    """A message without a valid tag. Never names a room: a stranger's frame must not fail a live
    room."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason, None)


def clip(reason: str) -> str:
    """A reason short enough for ABORT / STATUS."""
    return reason[:MAX_REASON_CHARS]


# ---- field rules: (value, room the message named or None) -> the value to keep, or FrameError ----


def room_field(name: str, v: Any, room: Optional[int]) -> int:
    """The rule of a bootstrap room field (every message about a room has one)."""
    why = check_room(v)
    if why:
        raise FrameError(why)
    return v


def _lenient_reason(name: str, v: Any, room: Optional[int]) -> str:
    return clip(v) if isinstance(v, str) else ""


def _dtype(name: str, v: Any, room: Optional[int]) -> str:
    v = str_max(64)(name, v, room)
    if v not in DTYPE_SIZES:
        raise FrameError(f"unknown dtype {v!r}", room)
    return v


# ---- messages ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TransferInfo(Message):
    """decode -> every prefill stage: send room's parts to decode_host:decode_port."""

    TYPE: ClassVar[str] = "TRANSFER_INFO"
    RULES: ClassVar[tuple] = (
        ("room", room_field),
        ("schema", a_map),
        ("decode_host", str_max(255)),
        ("decode_port", int_in(1, 65535)),
        ("prompt_len", int_in(0, 1 << 40)),
        ("landing", opt_map),
        ("prefix", opt_int(0, 1 << 40)),
    )
    room: int
    decode_host: str
    decode_port: int
    prompt_len: int
    schema: dict
    landing: Optional[dict] = (
        None  # where a one-sided backend writes the parts; {} (None reads as {}) for zmq
    )
    prefix: int = 0  # leading prompt tokens the decode holds already (its prefix cache): not sent (None reads as 0)

    @property
    def dest(self) -> tuple[str, int]:
        return self.decode_host, self.decode_port


@dataclass(frozen=True)
class Abort(Message):
    """decode -> every prefill stage: the decode gave up on the room, and why."""

    TYPE: ClassVar[str] = "ABORT"
    RULES: ClassVar[tuple] = (("room", room_field), ("reason", _lenient_reason))
    room: int
    reason: str = ""


@dataclass(frozen=True)
class Status(Message):
    """prefill stage -> decode: the stage finished the room (every DATA frame went before it) or failed it."""

    TYPE: ClassVar[str] = "STATUS"
    RULES: ClassVar[tuple] = (
        ("room", room_field),
        ("pp_rank", int_in(0, 1 << 16)),
        ("status", int_in(0, 4)),
        ("reason", str_max(MAX_REASON_CHARS)),
    )
    room: int
    pp_rank: int
    status: int
    reason: str = ""

    @classmethod
    def failed(cls, room: int, pp_rank: int, reason: str) -> "Status":
        return cls(room, pp_rank, int(KVPoll.Failed), clip(reason))

    @classmethod
    def success(cls, room: int, pp_rank: int) -> "Status":
        return cls(room, pp_rank, int(KVPoll.Success), "")


@dataclass(frozen=True)
class Data(Message):
    """prefill stage -> decode: one part of the room; the header is the part's PartSpec, the second frame its
    bytes (sent by reference, never copied)."""

    TYPE: ClassVar[str] = "DATA"
    RULES: ClassVar[tuple] = (
        ("room", room_field),
        ("pp_rank", int_in(0, 1 << 16)),
        ("name", str_max(255)),
        ("dtype", _dtype),
        ("layer_ids", int_list),
        ("shape", int_list),
    )
    FRAMES: ClassVar[int] = 2
    room: int
    pp_rank: int
    name: str
    layer_ids: tuple[int, ...]
    dtype: str
    shape: tuple[int, ...]
    payload: Any = b""  # bytes-like, exactly the spec's nbytes once the decode accepts it

    @classmethod
    def of(cls, room: int, pp_rank: int, part: Part) -> "Data":
        s = part.spec
        return cls(room, pp_rank, s.name, s.layer_ids, s.dtype, s.shape, part.data)

    @classmethod
    def _extra(cls, extra: tuple) -> dict:
        return {"payload": extra[0]}

    @property
    def spec(self) -> PartSpec:
        return PartSpec(self.name, self.layer_ids, self.dtype, self.shape)

    def encode(self) -> list:
        return [pack(self.head()), self.payload]


ToPrefill = Union[TransferInfo, Abort]
ToDecode = Union[Data, Status]
_TO_PREFILL = {m.TYPE: m for m in (TransferInfo, Abort)}
_TO_DECODE = {m.TYPE: m for m in (Data, Status)}


# ---- reading frames ------------------------------------------------------------------------------


def room_of(head: dict) -> Optional[int]:
    """The head's room when it is a valid one, else None."""
    return head.get("room") if check_room(head.get("room")) is None else None


def read_at_prefill(frames: list, hint: str = "") -> ToPrefill:
    """A TRANSFER_INFO or ABORT. The frame count is checked first (every message to a prefill is one
    frame); an unknown type names no room (the prefill fails no room for it)."""
    if len(frames) != 1:
        extra = hint if hint and len(frames) == 2 else ""
        raise FrameError(f"expected one control frame, got {len(frames)}{extra}")
    head = read_head(frames[0])
    kind = _TO_PREFILL.get(head["type"])
    if kind is None:
        raise FrameError(f"unknown message type {head['type'][:64]!r}")
    return kind.from_head(head)


def read_at_decode(frames: list, hint: str = "") -> ToDecode:
    """A DATA or STATUS; a frame-count or type error names the room when the head named a valid
    one."""
    head = read_head(frames[0])
    room = room_of(head)
    kind = _TO_DECODE.get(head["type"])
    if kind is None:
        raise FrameError(f"unknown message type {head['type'][:64]!r}", room)
    check_frame_count(kind, frames, hint, room)
    return kind.from_head(head, *frames[1:])
