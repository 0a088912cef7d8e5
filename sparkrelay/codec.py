"""The one codec of every typed message that crosses a process or host boundary: frozen dataclasses
whose RULES check every field on construction, so a message built here and one read off the wire
pass the same checks, and a frame is a msgpack map (never a pickle) read under size limits.
Transport lives elsewhere (transfer/wire/, disagg/stage_report.py); the messages are defined by
their users (transfer/protocol.py, disagg/stage_report.py).

A rule is `(field name, value, key) -> the value to keep`, raising FrameError naming the field (and the message's
key, e.g. its room, once the key field itself was valid, so a receiver can fail exactly that room)."""

from __future__ import annotations

from array import array
from dataclasses import fields, is_dataclass
from typing import Any, Callable, ClassVar, Optional

import msgpack

# a map frame larger than this is refused (a message may lower or raise it)
MAX_CONTROL_BYTES = 64 << 10
MAX_LIST_LEN = 4096  # list fields, and any msgpack array


class FrameError(ValueError):
    """A message that breaks its protocol. `room` is the message's key when its key field was
    valid."""

    def __init__(self, reason: str, room: Optional[int] = None) -> None:
        super().__init__(reason)
        self.reason, self.room = reason, room


Rule = Callable[[str, Any, Optional[int]], Any]


def unpack_limits(max_bytes: int, max_list: int = MAX_LIST_LEN) -> dict:
    """msgpack's limits for a frame of at most `max_bytes`: every object costs at least one byte, so
    a frame makes at most ~max_bytes objects; without them a small frame of empty arrays unpacks
    into far more memory and time than its size. Nesting is capped by msgpack's stack
    (StackError)."""
    return dict(
        max_str_len=max_bytes,
        max_bin_len=max_bytes,
        max_array_len=max_list,
        max_map_len=max(256, max_list),
        max_ext_len=0,
    )


# ---- field rules ---------------------------------------------------------------------------------


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
            raise FrameError(
                f"{name} must be a str of at most {max_len} chars, got {type(v).__name__}", key
            )
        return v

    return rule


def int_list(name: str, v: Any, key: Optional[int]) -> tuple[int, ...]:
    if (
        not isinstance(v, (list, tuple))
        or len(v) > MAX_LIST_LEN
        or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)
    ):
        raise FrameError(f"{name} must be a list of non-negative ints", key)
    return tuple(v)


def opt_str(max_len: int) -> Rule:
    """None stays None."""
    check = str_max(max_len)

    def rule(name: str, v: Any, key: Optional[int]) -> Optional[str]:
        return None if v is None else check(name, v, key)

    return rule


def ints(max_len: int) -> Rule:
    """A list of int64 values, at most max_len of them (checked at C speed: a generation's token ids
    cross with every step's output)."""

    def rule(name: str, v: Any, key: Optional[int]) -> list[int]:
        if not isinstance(v, (list, tuple)) or len(v) > max_len:
            raise FrameError(f"{name} must be a list of at most {max_len} ints", key)
        try:
            array("q", v)
        except (TypeError, OverflowError):
            raise FrameError(f"{name} must be a list of at most {max_len} ints", key) from None
        return v if isinstance(v, list) else list(v)

    return rule


def a_list(max_len: int) -> Rule:
    """A list of at most max_len entries (what they are is its reader's business)."""

    def rule(name: str, v: Any, key: Optional[int]) -> list:
        if not isinstance(v, (list, tuple)) or len(v) > max_len:
            raise FrameError(f"{name} must be a list of at most {max_len} entries", key)
        return v if isinstance(v, list) else list(v)

    return rule


def record(cls: type, optional: bool = False, **field_rules: Rule) -> Rule:
    """A nested dataclass: an instance as it is, or its fields in order (how `pack` sends it), each
    checked by its rule in `field_rules` (nested records among them) and given to the constructor,
    whose own checks apply (a ValueError or TypeError from it is a FrameError). `optional`: None
    stays None."""
    names = [f.name for f in fields(cls)]

    def rule(name: str, v: Any, key: Optional[int]) -> Any:
        if v is None and optional or isinstance(v, cls):
            return v
        if not isinstance(v, (list, tuple)) or len(v) > len(names):
            raise FrameError(
                f"{name} must be a {cls.__name__} (a list of its {len(names)} fields)", key
            )
        given = [
            field_rules[n](f"{name}.{n}", x, key) if n in field_rules else x
            for n, x in zip(names, v)
        ]
        try:
            return cls(*given)
        except (TypeError, ValueError) as e:
            raise FrameError(f"{name}: not a {cls.__name__}: {e}"[:300], key) from None

    return rule


def records(cls: type, max_len: int = MAX_LIST_LEN, **field_rules: Rule) -> Rule:
    """A list of nested dataclasses (see `record`), kept as a tuple."""
    one = record(cls, **field_rules)

    def rule(name: str, v: Any, key: Optional[int]) -> tuple:
        if not isinstance(v, (list, tuple)) or len(v) > max_len:
            raise FrameError(f"{name} must be a list of at most {max_len} {cls.__name__}", key)
        return tuple(one(f"{name}[{i}]", x, key) for i, x in enumerate(v))

    return rule


def a_map(name: str, v: Any, key: Optional[int]) -> dict:
    if not isinstance(v, dict):
        raise FrameError(f"{name} must be a map", key)
    return v


def opt_map(name: str, v: Any, key: Optional[int]) -> dict:
    """None reads as {}."""
    return {} if v is None else a_map(name, v, key)


# ---- messages ------------------------------------------------------------------------------------


class Message:
    """A typed message: TYPE on the wire, RULES checked in order on construction, FRAMES frames on
    the wire (a map, then raw byte frames for a field named `payload`), KEY the field that names
    what an error is about."""

    TYPE: ClassVar[str]
    RULES: ClassVar[tuple]  # ((field name, rule), ...) in the order they are checked
    FRAMES: ClassVar[int] = 1
    KEY: ClassVar[str] = "room"
    MAX_BYTES: ClassVar[int] = MAX_CONTROL_BYTES
    MAX_LIST: ClassVar[int] = MAX_LIST_LEN

    def __post_init__(self) -> None:
        key = None
        for name, rule in self.RULES:
            object.__setattr__(self, name, rule(name, getattr(self, name), key))
            if name == self.KEY:
                key = getattr(self, name)

    def head(self) -> dict:
        return {
            "type": self.TYPE,
            **{f.name: getattr(self, f.name) for f in fields(self) if f.name != "payload"},
        }

    def encode(self) -> list:
        return [pack(self.head())]

    @classmethod
    def from_head(cls, head: dict, *extra: bytes) -> "Message":
        return cls(
            **{f.name: head.get(f.name) for f in fields(cls) if f.name != "payload"},
            **cls._extra(extra),
        )

    @classmethod
    def _extra(cls, extra: tuple) -> dict:
        return {}

    @classmethod
    def decode(cls, frames: list, hint: str = "") -> "Message":
        """The message in `frames` (after any tag); FrameError if it is not one valid message of
        this type.
        hint: appended to a frame-count error when there is exactly one frame too many (an
        unexpected tag)."""
        head = read_head(frames[0], cls.MAX_BYTES, cls.MAX_LIST) if frames else {}
        if head.get("type") != cls.TYPE:
            raise FrameError(
                f"expected a {cls.TYPE} message, got {str(head.get('type'))[:64]!r}",
                key_of(cls, head),
            )
        check_frame_count(cls, frames, hint, key_of(cls, head))
        return cls.from_head(head, *frames[1:])


_FIELDS: dict[type, tuple[str, ...]] = {}


def _as_list(obj: Any) -> list:
    """msgpack's hook for what it cannot pack itself: a nested dataclass goes as the list of its
    fields."""
    cls = type(obj)
    names = _FIELDS.get(cls)
    if names is None:
        if not is_dataclass(obj):
            raise TypeError(f"cannot send a {cls.__name__}")
        names = _FIELDS[cls] = tuple(f.name for f in fields(obj))
    return [getattr(obj, n) for n in names]


def read_message(
    frames: list, kinds: dict[str, type[Message]], max_bytes: int, max_list: int, hint: str = ""
) -> Message:
    """One message of any of `kinds` (TYPE -> class) from `frames`; FrameError otherwise."""
    if not frames:
        raise FrameError("no frame")
    head = read_head(frames[0], max_bytes, max_list)
    kind = kinds.get(head["type"])
    if kind is None:
        raise FrameError(f"unknown message type {head['type'][:64]!r}")
    check_frame_count(kind, frames, hint, key_of(kind, head))
    return kind.from_head(head, *frames[1:])


def key_of(kind: type[Message], head: dict) -> Optional[int]:
    """The head's key (e.g. room) when its rule accepts it, else None."""
    rule = dict(kind.RULES).get(kind.KEY)
    try:
        return None if rule is None else rule(kind.KEY, head.get(kind.KEY), None)
    except FrameError:
        return None


# ---- frames --------------------------------------------------------------------------------------


def pack(head: dict) -> bytes:
    """A map frame; a nested dataclass in it goes as the list of its fields (what `record` reads
    back)."""
    return msgpack.packb(head, use_bin_type=True, default=_as_list)


def read_head(
    frame: bytes, max_bytes: int = MAX_CONTROL_BYTES, max_list: int = MAX_LIST_LEN
) -> dict:
    """The msgpack map of a frame, with a str 'type'; FrameError otherwise."""
    if len(frame) > max_bytes:
        raise FrameError(f"control frame of {len(frame)} bytes exceeds {max_bytes}")
    try:
        head = msgpack.unpackb(
            frame, raw=False, strict_map_key=True, **unpack_limits(max_bytes, max_list)
        )
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise FrameError(
            f"undecodable msgpack ({type(e).__name__}{': ' if str(e) else ''}{e})"
        ) from None
    if not isinstance(head, dict) or not isinstance(head.get("type"), str):
        raise FrameError("not a msgpack map with a str 'type'")
    return head


def check_frame_count(kind: type[Message], frames: list, hint: str, key: Optional[int]) -> None:
    n = kind.FRAMES
    if len(frames) != n:
        extra = hint if hint and len(frames) == n + 1 else ""
        raise FrameError(
            f"{kind.TYPE} needs {n} frame{'s' if n > 1 else ''}, got {len(frames)}{extra}", key
        )
