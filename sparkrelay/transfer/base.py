"""The transfer layer's interface: per-room state (KVPoll), typed payload parts, and the two agents.

A *room* (`bootstrap_room`, 1..2^63-1, never 0) is the identity of one request's transfer on both sides.

    prefill stage s                                     decode
    ---------------                                     ------
    PrefillAgent.start(): bind PULL, PUT /route  <----  DecodeAgent.begin(room, host, port, ...):
                                                          GET /route (503 = retry), check the schema,
    add_room(room, prompt_len)                            TRANSFER_INFO to every stage  ------------->
    send(room, parts)  -- after TRANSFER_INFO -->       DATA frames, checked against expected_parts
                       -- STATUS success/failed -->     Success once every stage said success and every
                                                          expected part arrived
    <---------------------------- ABORT (decode abort / waiting timeout)
    STATUS failed (bootstrap timeout / abort) ------->  Failed, with the prefill's reason

Nothing here is unpickled: control messages are msgpack maps, payload frames are raw bytes whose size is checked
against the PartSpec the decode side expects before they are kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum
from typing import Callable, Optional

DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2, "int32": 4, "int64": 8, "uint8": 1, "bool": 1}


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
    """One named region of a room's payload. layer_ids: global layer ids it covers (KV: target layers; draft_kv:
    draft layers), () for per-request rows (hidden, meta)."""

    name: str
    layer_ids: tuple[int, ...]
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]

    def header(self) -> dict:
        return {"name": self.name, "layer_ids": list(self.layer_ids), "dtype": self.dtype, "shape": list(self.shape)}


@dataclass
class Part:
    spec: PartSpec
    data: bytes  # exactly spec.nbytes bytes, C order


# (ours, theirs) schema dicts -> a list of "field: prefill=X decode=Y" mismatches (empty when they agree)
SchemaCompare = Callable[[dict, dict], list[str]]
# (the prefill's schema dict, prompt_len) -> {pp_rank: [PartSpec, ...]} the decode side must receive
ExpectedParts = Callable[[dict, int], dict[int, list[PartSpec]]]
# (room, state, reason) reported by a prefill agent when a room reaches Success or Failed
StatusCallback = Callable[[int, KVPoll, str], None]


# Starts the reason of a room refused because the two servers' handoff schemas differ; it travels inside the
# reasons both sides report (ABORT, STATUS), so each server can tell this deterministic failure from a transient one.
SCHEMA_MISMATCH = "schema mismatch: "


@dataclass(frozen=True)
class PollResult:
    state: KVPoll
    reason: str = ""
    permanent: bool = False  # Failed for a reason a retry cannot cure (the servers' configurations disagree)


def check_room(room: object) -> Optional[str]:
    """None if `room` is a valid bootstrap room, else why not."""
    if not isinstance(room, int) or isinstance(room, bool):
        return f"bootstrap_room must be an integer, got {type(room).__name__}"
    if not 0 < room < 1 << 63:
        return f"bootstrap_room {room} is outside 1..2^63-1 (0 is the not-landed sentinel)"
    return None
