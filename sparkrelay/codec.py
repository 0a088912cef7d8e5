"""The one codec of every typed message that crosses a process or host boundary: frozen dataclasses whose RULES
check every field on construction, so a message built here and one read off the wire pass the same checks, and a
frame is a msgpack map (never a pickle) read under size limits. Transport lives elsewhere (transfer/wire/,
disagg/stage_report.py); the messages are defined by their users (transfer/protocol.py, disagg/stage_report.py).

A rule is `(field name, value, key) -> the value to keep`, raising FrameError naming the field (and the message's
key, e.g. its room, once the key field itself was valid, so a receiver can fail exactly that room)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Callable, ClassVar, Optional

import msgpack

MAX_CONTROL_BYTES = 64 << 10  # a map frame larger than this is refused (a message may lower or raise it)
MAX_LIST_LEN = 4096  # list fields, and any msgpack array


class FrameError(ValueError):
    """A message that breaks its protocol. `room` is the message's key when its key field was valid."""

    def __init__(self, reason: str, room: Optional[int] = None) -> None:
        super().__init__(reason)
        self.reason, self.room = reason, room


Rule = Callable[[str, Any, Optional[int]], Any]


def unpack_limits(max_bytes: int) -> dict:
    """msgpack's limits for a frame of at most `max_bytes`: every object costs at least one byte, so a frame makes
    at most ~max_bytes objects; without them a small frame of empty arrays unpacks into far more memory and time
    than its size. Nesting is capped by msgpack's stack (StackError)."""
    return dict(max_str_len=max_bytes, max_bin_len=max_bytes, max_array_len=MAX_LIST_LEN, max_map_len=256,
                max_ext_len=0)


# ---- field rules --------------------------------------------------------------------------------------------------

def int_in(lo: int, hi: int) -> Rule:
    def rule(name: str, v: Any, key: Optional[int]) -> int:
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise FrameError(f"{name} must be an int in {lo}..{hi}, got {v!r}"[:300], key)
        return v
    return rule


def opt_int(lo: int, hi: int) -> Rule:
    """None reads as 0."""
    check = int_in(lo, hi)

    def rule(name: str, v: Any, key: Optional[int]) -> int:
        return 0 if v is None else check(name, v, key)
    return rule


def str_max(max_len: int) -> Rule:
    def rule(name: str, v: Any, key: Optional[int]) -> str:
        if not isinstance(v, str) or len(v) > max_len:
            raise FrameError(f"{name} must be a str of at most {max_len} chars, got {type(v).__name__}", key)
        return v
    return rule


def int_list(name: str, v: Any, key: Optional[int]) -> tuple[int, ...]:
    if (not isinstance(v, (list, tuple)) or len(v) > MAX_LIST_LEN
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)):
        raise FrameError(f"{name} must be a list of non-negative ints", key)
    return tuple(v)


def a_map(name: str, v: Any, key: Optional[int]) -> dict:
    if not isinstance(v, dict):
        raise FrameError(f"{name} must be a map", key)
    return v


def opt_map(name: str, v: Any, key: Optional[int]) -> dict:
    """None reads as {}."""
    return {} if v is None else a_map(name, v, key)


# ---- messages -----------------------------------------------------------------------------------------------------

class Message:
    """A typed message: TYPE on the wire, RULES checked in order on construction, FRAMES frames on the wire (a map,
    then raw byte frames for a field named `payload`), KEY the field that names what an error is about."""

    TYPE: ClassVar[str]
    RULES: ClassVar[tuple]  # ((field name, rule), ...) in the order they are checked
    FRAMES: ClassVar[int] = 1
    KEY: ClassVar[str] = "room"
    MAX_BYTES: ClassVar[int] = MAX_CONTROL_BYTES

    def __post_init__(self) -> None:
        key = None
        for name, rule in self.RULES:
            object.__setattr__(self, name, rule(name, getattr(self, name), key))
            if name == self.KEY:
                key = getattr(self, name)

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
        """The message in `frames` (after any tag); FrameError if it is not one valid message of this type.
        hint: appended to a frame-count error when there is exactly one frame too many (an unexpected tag)."""
        head = read_head(frames[0], cls.MAX_BYTES) if frames else {}
        if head.get("type") != cls.TYPE:
            raise FrameError(f"expected a {cls.TYPE} message, got {str(head.get('type'))[:64]!r}", key_of(cls, head))
        check_frame_count(cls, frames, hint, key_of(cls, head))
        return cls.from_head(head, *frames[1:])


def key_of(kind: type[Message], head: dict) -> Optional[int]:
    """The head's key (e.g. room) when its rule accepts it, else None."""
    rule = dict(kind.RULES).get(kind.KEY)
    try:
        return None if rule is None else rule(kind.KEY, head.get(kind.KEY), None)
    except FrameError:
        return None


# ---- frames -------------------------------------------------------------------------------------------------------

def pack(head: dict) -> bytes:
    return msgpack.packb(head, use_bin_type=True)


def read_head(frame: bytes, max_bytes: int = MAX_CONTROL_BYTES) -> dict:
    """The msgpack map of a frame, with a str 'type'; FrameError otherwise."""
    if len(frame) > max_bytes:
        raise FrameError(f"control frame of {len(frame)} bytes exceeds {max_bytes}")
    try:
        head = msgpack.unpackb(frame, raw=False, strict_map_key=True, **unpack_limits(max_bytes))
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise FrameError(f"undecodable msgpack ({type(e).__name__}{': ' if str(e) else ''}{e})") from None
    if not isinstance(head, dict) or not isinstance(head.get("type"), str):
        raise FrameError("not a msgpack map with a str 'type'")
    return head


def check_frame_count(kind: type[Message], frames: list, hint: str, key: Optional[int]) -> None:
    n = kind.FRAMES
    if len(frames) != n:
        extra = hint if hint and len(frames) == n + 1 else ""
        raise FrameError(f"{kind.TYPE} needs {n} frame{'s' if n > 1 else ''}, got {len(frames)}{extra}", key)
