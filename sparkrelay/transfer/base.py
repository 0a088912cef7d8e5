"""The transfer layer's interface: per-room state (KVPoll), typed payload parts, the two agents'
contract, and the backend registry.

A *room* (`bootstrap_room`, 1..2^63-1, never 0) is the identity of one request's transfer on both
sides.

    prefill stage s                                     decode
    ---------------                                     ------
    PrefillTransfer.start(): listen, PUT /route  <----  DecodeTransfer.begin(room, host, port, ...):
                                                          GET /route (503 = retry), check the schema,
    add_room(room, prompt_len)                            TRANSFER_INFO to every stage  ------------->
    send(room, parts)  -- after TRANSFER_INFO -->       the parts, checked against expected_parts
                       -- STATUS success/failed -->     Success once every stage said success and every
                                                          expected part arrived
    <---------------------------- ABORT (decode abort / waiting timeout)
    STATUS failed (bootstrap timeout / abort) ------->  Failed, with the prefill's reason

A backend is a (PrefillTransfer, DecodeTransfer) pair of classes, looked up by name with
get_backend(). The control messages (TRANSFER_INFO, ABORT, STATUS) always travel on the
authenticated control channel (transfer/protocol.py, transfer/wire/); what a backend chooses is how
the parts' bytes move. "zmq" pushes them as DATA frames on that same channel. A one-sided backend
(Mooncake, NIXL) writes them straight into memory the decode registered for the room and then sends
STATUS success on the control channel; its decode's take() hands out views of that memory. Both keep
the room life cycle, the states and the reasons below, so the engines cannot tell them apart.

Nothing here is unpickled: control messages are msgpack maps, payload bytes are checked against the
PartSpec the decode side expects before they are kept.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import IntEnum
from typing import Callable, Optional

DTYPE_SIZES = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "int32": 4,
    "int64": 8,
    "uint8": 1,
    "bool": 1,
}
Addr = tuple[str, int]  # a prefill's bootstrap server
Dest = tuple[
    str, int
]  # a transfer endpoint (host, port): a prefill stage's or a decode's control socket


class KVPoll(IntEnum):
    """Monotonic per-room state (new = max(old, new)), except that Failed always wins."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class TransferError(Exception):
    def __init__(self, room: int, reason: str) -> None:
        super().__init__(f"room {room}: {reason}")
        self.room, self.reason = room, reason


@dataclass(frozen=True)
class PartSpec:
    """One named region of a room's payload. layer_ids: global layer ids it covers (KV: target
    layers; draft_kv: draft layers), () for per-request rows (hidden, meta)."""

    name: str
    layer_ids: tuple[int, ...]
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]

    def header(self) -> dict:
        return {
            "name": self.name,
            "layer_ids": list(self.layer_ids),
            "dtype": self.dtype,
            "shape": list(self.shape),
        }


@dataclass
class Part:
    spec: PartSpec
    data: bytes  # exactly spec.nbytes bytes, C order


# A part streamed in pieces: "kv@256" holds positions 256.. of the whole part "kv" (as many as its
# shape says); a name without "@" is a whole part, from position 0.
PIECE_SEP = "@"


def piece_name(base: str, start: int) -> str:
    return f"{base}{PIECE_SEP}{start}"


def split_piece(name: str) -> tuple[str, int]:
    """'kv@256' -> ('kv', 256); 'meta' -> ('meta', 0). ValueError for a malformed position."""
    base, sep, start = name.partition(PIECE_SEP)
    if not sep:
        return name, 0
    if not start.isdigit() or len(start) > 10:
        raise ValueError(f"part name {name!r}: {start!r} is not a position")
    return base, int(start)


# (ours, theirs) schema dicts -> a list of "field: prefill=X decode=Y" mismatches (empty when they agree)
SchemaCompare = Callable[[dict, dict], list[str]]
# (the prefill's schema dict, prompt_len) -> {pp_rank: [PartSpec, ...]} the decode side must receive
ExpectedParts = Callable[
    [dict, int, int], dict[int, list[PartSpec]]
]  # (schema, prompt_len, decode's prefix)
# (room, state, reason) reported by a prefill agent when a room reaches Success or Failed
StatusCallback = Callable[[int, KVPoll, str], None]


# Starts the reason of a room refused because the two servers' handoff schemas differ; it travels
# inside the reasons both sides report (ABORT, STATUS), so each server can tell this deterministic
# failure from a transient one.
SCHEMA_MISMATCH = "schema mismatch: "


@dataclass(frozen=True)
class PollResult:
    state: KVPoll
    reason: str = ""
    permanent: bool = (
        False  # Failed for a reason a retry cannot cure (the servers' configurations disagree)
    )


def check_room(room: object) -> Optional[str]:
    """None if `room` is a valid bootstrap room, else why not."""
    if not isinstance(room, int) or isinstance(room, bool):
        return f"bootstrap_room must be an integer, got {type(room).__name__}"
    if not 0 < room < 1 << 63:
        return f"bootstrap_room {room} is outside 1..2^63-1 (0 is the not-landed sentinel)"
    return None


class TransferAgent(ABC):
    """What both sides share. Every method is thread safe; none blocks on a peer."""

    port: Optional[int]  # the control socket's port, once started

    @abstractmethod
    def start(self) -> None:
        """Bind the control socket and start the agent's threads (and register, on a prefill stage).
        Raises OSError or BootstrapError, having released what it took."""

    @abstractmethod
    def poll(self, room: int) -> PollResult:
        """The room's state and reason; Failed with "not known" for a room never added or already
        cleared."""

    @abstractmethod
    def abort(self, room: int, reason: str) -> None:
        """Fail the room (unless already Failed) and tell the peer why. Calls back at most once."""

    @abstractmethod
    def clear(self, room: int) -> None:
        """Forget the room: poll() says "not known", late messages for it are dropped. The room id
        may be reused."""

    @abstractmethod
    def close(self) -> None:
        """Stop the threads and close every socket; idempotent. Rooms still live are left as they
        are."""

    @abstractmethod
    def threads_alive(self) -> bool:
        """Every agent thread is running (False before start() and after close())."""

    @abstractmethod
    def rejected(self) -> dict[str, int]:
        """Messages and connections refused so far, by kind (auth, protocol, replay, overflow,
        connection)."""


class PrefillTransfer(TransferAgent):
    """One per prefill pipeline stage. Constructor: (pp_rank, pp_size, schema, compare,
    bootstrap_url, bind_host, bootstrap_timeout, on_status, prefill_http_port=None, auth_token=None,
    failure_prob=0.0, host_ip=None); host_ip (SPARKRELAY_HOST_IP): the address it registers, when
    not its bind address.

    Room: Bootstrapping -> WaitingForInput (the decode's TRANSFER_INFO, schema and prompt_len agree) -> Transferring
    (the parts are going out) -> Success (the last of them, then STATUS success, left this process), or Failed.
    on_status(room, Success|Failed, reason) is called once per room, never from inside add_room() or send() and
    never with the agent's lock held."""

    @abstractmethod
    def add_room(self, room: int, prompt_len: int) -> None:
        """A request exists: the room is Bootstrapping, or WaitingForInput / Failed if the decode's
        TRANSFER_INFO / ABORT already came. ValueError for a bad or duplicate room, RuntimeError
        when the room table is full."""

    @abstractmethod
    def send(self, room: int, parts: list[Part], last: bool = True) -> None:
        """Hand over some of the room's parts (each exactly spec.nbytes bytes; the agent keeps
        references, copies nothing); they go out once the decode's TRANSFER_INFO is there, in
        hand-over order, and STATUS success follows the parts of the hand-over flagged `last`. Never
        blocks. KeyError for a room not added, ValueError for a send after the last, a part name
        sent before, or a part whose size does not match its spec."""


class DecodeTransfer(TransferAgent):
    one_sided = False  # True: the prefill writes the parts into registered memory named by begin()'s landing
    """One per decode server. Constructor: (schema, compare, expected_parts, bind_host,
    bootstrap_timeout, waiting_timeout, heartbeat_interval, heartbeat_max_failures,
    default_bootstrap_port, max_part_bytes=2^31, auth_token=None, host_ip=None); host_ip
    (SPARKRELAY_HOST_IP): the address its TRANSFER_INFO names, when not its bind address (a
    wildcard bind needs it: ConfigError otherwise).

    Room: Bootstrapping (reading the prefill's /route) -> WaitingForInput (TRANSFER_INFO sent to every stage) ->
    Transferring (the first part arrived) -> Success (every stage's STATUS success, every expected part present),
    or Failed, which always wins (PollResult.permanent when a retry cannot cure it)."""

    def set_listener(self, callback: Callable[[], None]) -> None:
        """callback() is called, from an agent thread, whenever a room reaches Success or Failed (so
        an engine can sleep until then instead of polling)."""

    def register(self, regions: list[tuple[int, int]]) -> None:
        """Memory (address, bytes) the prefill may write into, before start() (one-sided backends;
        else unused)."""

    @abstractmethod
    def begin(
        self,
        room: int,
        bootstrap_host: str,
        bootstrap_port: Optional[int],
        prompt_len: int,
        landing=None,
        prefix: int = 0,
    ) -> None:
        """Start receiving `room` from the prefill whose bootstrap server is
        bootstrap_host:bootstrap_port (None: the default port). landing (transfer/landing.py, a
        one-sided backend's, which needs it): where in the registered memory each part goes. prefix:
        leading prompt tokens this decode holds already (its prefix cache), which the prefill does
        not send. ValueError for a bad argument or a room in use, RuntimeError when the table is
        full."""

    @abstractmethod
    def take(self, room: int) -> dict[int, dict[str, Part]]:
        """pp_rank -> part name -> Part, once the room is Success; the agent drops its reference, so take() works
        once per room (one-sided: the Parts have no data, the bytes are in the landing). TransferError otherwise."""

    @abstractmethod
    def stats(self) -> dict[str, int]:
        """Rooms held (begun, not cleared) per KVPoll state name."""
