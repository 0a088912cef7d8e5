"""The control-channel messages, typed: frozen dataclasses whose encode() gives the frames and whose decode() checks
every field before anything uses it. No sockets here (transfer/wire/ moves and authenticates the frames).

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

Every map key is a str; nothing is unpickled. A field that breaks its rule raises FrameError naming the field (and
the room, once the room field itself was valid, so the receiver can fail that room). The size of DATA's bytes is
checked by the decode against the PartSpec it expects for the room (transfer/decode_room.py), not here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Optional, Union

import msgpack

from sparkrelay.transfer.base import DTYPE_SIZES, KVPoll, Part, PartSpec, check_room

MAX_CONTROL_BYTES = 64 << 10  # a control map or data header (schema included, < 2 KiB) larger than this is refused
MAX_REASON_CHARS = 4096
MAX_LIST_LEN = 4096  # layer_ids / shape entries, and any msgpack array
# msgpack limits: every object costs at least one byte of the frame, so a 64 KiB frame makes at most ~64K objects
# (a few MB); without them a small frame of empty arrays unpacks into far more memory and time than its size.
# Nesting is capped by msgpack's stack (StackError).
UNPACK_LIMITS = dict(max_str_len=MAX_CONTROL_BYTES, max_bin_len=MAX_CONTROL_BYTES, max_array_len=MAX_LIST_LEN,
                     max_map_len=256, max_ext_len=0)


class FrameError(ValueError):
    """A message that breaks the protocol. `room` is set when the message named a valid room."""

    def __init__(self, reason: str, room: Optional[int] = None) -> None:
        super().__init__(reason)
        self.reason, self.room = reason, room


class AuthError(FrameError):
    """A message without a valid tag. Never names a room: a stranger's frame must not fail a live room."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason, None)


def clip(reason: str) -> str:
    """A reason short enough for ABORT / STATUS."""
    return reason[:MAX_REASON_CHARS]


# ---- field rules: (value, room the message named or None) -> the value to keep, or FrameError ----------------

def _room(name: str, v: Any, room: Optional[int]) -> int:
    why = check_room(v)
    if why:
        raise FrameError(why)
    return v


def _int(lo: int, hi: int):
    def rule(name: str, v: Any, room: Optional[int]) -> int:
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise FrameError(f"{name} must be an int in {lo}..{hi}, got {v!r}"[:300], room)
        return v
    return rule


def _opt_int(lo: int, hi: int):
    check = _int(lo, hi)

    def rule(name: str, v: Any, room: Optional[int]) -> int:
        return 0 if v is None else check(name, v, room)
    return rule


def _str(max_len: int):
    def rule(name: str, v: Any, room: Optional[int]) -> str:
        if not isinstance(v, str) or len(v) > max_len:
            raise FrameError(f"{name} must be a str of at most {max_len} chars, got {type(v).__name__}", room)
        return v
    return rule


def _lenient_reason(name: str, v: Any, room: Optional[int]) -> str:
    return clip(v) if isinstance(v, str) else ""


def _int_list(name: str, v: Any, room: Optional[int]) -> tuple[int, ...]:
    if (not isinstance(v, (list, tuple)) or len(v) > MAX_LIST_LEN
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)):
        raise FrameError(f"{name} must be a list of non-negative ints", room)
    return tuple(v)


def _map(name: str, v: Any, room: Optional[int]) -> dict:
    if not isinstance(v, dict):
        raise FrameError(f"{name} must be a map", room)
    return v


def _opt_map(name: str, v: Any, room: Optional[int]) -> dict:
    return {} if v is None else _map(name, v, room)


def _dtype(name: str, v: Any, room: Optional[int]) -> str:
    v = _str(64)(name, v, room)
    if v not in DTYPE_SIZES:
        raise FrameError(f"unknown dtype {v!r}", room)
    return v


# ---- messages -------------------------------------------------------------------------------------------------

class Message:
    """A control-channel message: TYPE on the wire, RULES checked in order on construction (so a message built
    here and one read off the wire pass the same checks), FRAMES frames on the wire."""

    TYPE: ClassVar[str]
    RULES: ClassVar[tuple]  # ((field name, rule), ...) in the order they are checked
    FRAMES: ClassVar[int] = 1

    def __post_init__(self) -> None:
        room = None
        for name, rule in self.RULES:
            object.__setattr__(self, name, rule(name, getattr(self, name), room))
            if name == "room":
                room = self.room

    def head(self) -> dict:
        return {"type": self.TYPE, **{f.name: getattr(self, f.name) for f in fields(self) if f.name != "payload"}}

    def encode(self) -> list:
        return [pack(self.head())]

    @classmethod
    def from_head(cls, head: dict, *extra: bytes) -> "Message":
        return cls(**{f.name: head.get(f.name) for f in fields(cls) if f.name != "payload"}, **cls._extra(extra))

    @classmethod
    def _extra(cls, extra: tuple) -> dict:
        return {}

    @classmethod
    def decode(cls, frames: list, hint: str = "") -> "Message":
        """The message in `frames` (after the tag); FrameError if it is not one valid message of this type.
        hint: appended to a frame-count error when there is exactly one frame too many (an unexpected tag)."""
        head = read_head(frames[0]) if frames else {}
        room = room_of(head)
        if head.get("type") != cls.TYPE:
            raise FrameError(f"expected a {cls.TYPE} message, got {str(head.get('type'))[:64]!r}", room)
        check_frame_count(cls, frames, hint, room)
        return cls.from_head(head, *frames[1:])


@dataclass(frozen=True)
class TransferInfo(Message):
    """decode -> every prefill stage: send room's parts to decode_host:decode_port."""

    TYPE: ClassVar[str] = "TRANSFER_INFO"
    RULES: ClassVar[tuple] = (("room", _room), ("schema", _map), ("decode_host", _str(255)),
                              ("decode_port", _int(1, 65535)), ("prompt_len", _int(0, 1 << 40)),
                              ("landing", _opt_map), ("prefix", _opt_int(0, 1 << 40)))
    room: int
    decode_host: str
    decode_port: int
    prompt_len: int
    schema: dict
    landing: Optional[dict] = None  # where a one-sided backend writes the parts; {} (None reads as {}) for zmq
    prefix: int = 0  # leading prompt tokens the decode holds already (its prefix cache): not sent (None reads as 0)

    @property
    def dest(self) -> tuple[str, int]:
        return self.decode_host, self.decode_port


@dataclass(frozen=True)
class Abort(Message):
    """decode -> every prefill stage: the decode gave up on the room, and why."""

    TYPE: ClassVar[str] = "ABORT"
    RULES: ClassVar[tuple] = (("room", _room), ("reason", _lenient_reason))
    room: int
    reason: str = ""


@dataclass(frozen=True)
class Status(Message):
    """prefill stage -> decode: the stage finished the room (every DATA frame went before it) or failed it."""

    TYPE: ClassVar[str] = "STATUS"
    RULES: ClassVar[tuple] = (("room", _room), ("pp_rank", _int(0, 1 << 16)), ("status", _int(0, 4)),
                              ("reason", _str(MAX_REASON_CHARS)))
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
    RULES: ClassVar[tuple] = (("room", _room), ("pp_rank", _int(0, 1 << 16)), ("name", _str(255)),
                              ("dtype", _dtype), ("layer_ids", _int_list), ("shape", _int_list))
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


# ---- reading frames -------------------------------------------------------------------------------------------

def pack(head: dict) -> bytes:
    return msgpack.packb(head, use_bin_type=True)


def read_head(frame: bytes) -> dict:
    """The msgpack map of a control frame or data header, with a str 'type'; FrameError otherwise."""
    if len(frame) > MAX_CONTROL_BYTES:
        raise FrameError(f"control frame of {len(frame)} bytes exceeds {MAX_CONTROL_BYTES}")
    try:
        head = msgpack.unpackb(frame, raw=False, strict_map_key=True, **UNPACK_LIMITS)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise FrameError(f"undecodable msgpack ({type(e).__name__}{': ' if str(e) else ''}{e})") from None
    if not isinstance(head, dict) or not isinstance(head.get("type"), str):
        raise FrameError("not a msgpack map with a str 'type'")
    return head


def room_of(head: dict) -> Optional[int]:
    """The head's room when it is a valid one, else None."""
    return head.get("room") if check_room(head.get("room")) is None else None


def check_frame_count(kind: type[Message], frames: list, hint: str, room: Optional[int]) -> None:
    n = kind.FRAMES
    if len(frames) != n:
        extra = hint if hint and len(frames) == n + 1 else ""
        raise FrameError(f"{kind.TYPE} needs {n} frame{'s' if n > 1 else ''}, got {len(frames)}{extra}", room)


def read_at_prefill(frames: list, hint: str = "") -> ToPrefill:
    """A TRANSFER_INFO or ABORT. The frame count is checked first (every message to a prefill is one frame); an
    unknown type names no room (the prefill fails no room for it)."""
    if len(frames) != 1:
        extra = hint if hint and len(frames) == 2 else ""
        raise FrameError(f"expected one control frame, got {len(frames)}{extra}")
    head = read_head(frames[0])
    kind = _TO_PREFILL.get(head["type"])
    if kind is None:
        raise FrameError(f"unknown message type {head['type'][:64]!r}")
    return kind.from_head(head)


def read_at_decode(frames: list, hint: str = "") -> ToDecode:
    """A DATA or STATUS; a frame-count or type error names the room when the head named a valid one."""
    head = read_head(frames[0])
    room = room_of(head)
    kind = _TO_DECODE.get(head["type"])
    if kind is None:
        raise FrameError(f"unknown message type {head['type'][:64]!r}", room)
    check_frame_count(kind, frames, hint, room)
    return kind.from_head(head, *frames[1:])
