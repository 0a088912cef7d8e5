"""The decode agent's per-room record and the checks every incoming frame of a room must pass (pure; used by
transfer/zmq_decode.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from sparkrelay.transfer.base import KVPoll, Part, PartSpec

LIVE = (KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring)
Addr = tuple[str, int]  # a prefill's bootstrap server
Dest = tuple[str, int]  # a prefill stage's PULL endpoint


@dataclass
class RoomRecord:
    addr: Addr
    prompt_len: int
    begun: float
    state: KVPoll = KVPoll.Bootstrapping
    reason: str = ""
    expected: dict[int, dict[str, PartSpec]] = field(default_factory=dict)  # pp_rank -> name -> spec
    received: dict[int, dict[str, Part]] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)  # stages whose STATUS success arrived
    endpoints: dict[int, Dest] = field(default_factory=dict)
    waiting_since: float = 0.0
    taken: bool = False


@dataclass
class PrefillRecord:
    info: dict
    endpoints: dict[int, Dest] = field(default_factory=dict)
    misses: int = 0  # failed heartbeats in a row


def part_problem(rec: RoomRecord, pp: int, spec: PartSpec, nbytes: int) -> Optional[str]:
    """Why a DATA frame does not fit the room, or None."""
    if rec.state == KVPoll.Bootstrapping:
        return "DATA before this decode sent its TRANSFER_INFO"
    stage = rec.expected.get(pp)
    if stage is None:
        return f"DATA from pp_rank {pp}, the room expects pp_rank(s) {sorted(rec.expected)}"
    if pp in rec.done:
        return f"DATA from pp_rank {pp} after its success STATUS"
    want = stage.get(spec.name)
    if want is None:
        return f"unexpected part {spec.name!r} from pp_rank {pp} (expected {sorted(stage)})"
    if spec.name in rec.received[pp]:
        return f"part {spec.name!r} from pp_rank {pp} arrived twice"
    if spec != want:
        return f"part {spec.name!r} from pp_rank {pp}: header {spec.header()} != expected {want.header()}"
    if nbytes != want.nbytes:
        return f"part {spec.name!r} from pp_rank {pp}: {nbytes} bytes, expected {want.nbytes}"
    return None


def success_problem(rec: RoomRecord, pp: int) -> Optional[str]:
    if pp not in rec.expected:
        return f"bad frame from the prefill: STATUS success from pp_rank {pp}, expected {sorted(rec.expected)}"
    missing = [n for n in rec.expected[pp] if n not in rec.received[pp]]
    if missing:
        return f"prefill pp_rank {pp} reported success but part(s) {missing} never arrived"
    return None
