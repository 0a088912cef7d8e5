"""The decode side's room state machine, and the plan of the parts a room must receive. Pure: no
sockets, no threads, no clock (callers pass `now`); the agent (transfer/decode_agent.py) holds its
lock around every call.

    DecodeRooms.add ─> Bootstrapping ──ready(plan)──> WaitingForInput ──accept(first part)──> Transferring
                                                              │                                    │
                         stage_done(pp) for every stage, every expected part present ──────> Success
    fail(reason) from any live state (from Success too when forced: an abort after the fact) ──> Failed

A DATA frame must fit the plan (part_problem): the right stage, a part the room expects, its header
equal to the expected PartSpec, exactly its bytes, once. A STATUS success must come after every part
of its stage.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

from sparkrelay.transfer.base import (
    SCHEMA_MISMATCH,
    Addr,
    Dest,
    ExpectedParts,
    KVPoll,
    Part,
    PartSpec,
    PollResult,
    SchemaCompare,
    TransferError,
)

LIVE = (KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring)
MAX_ROOMS = 1 << 16
Plan = dict[int, dict[str, PartSpec]]  # pp_rank -> name -> the PartSpec the room must receive


@dataclass
class DecodeRoom:
    addr: Addr
    prompt_len: int
    begun: float
    prefix: int = (
        0  # leading prompt tokens the decode holds (its prefix cache): the prefill sends the rest
    )
    state: KVPoll = KVPoll.Bootstrapping
    reason: str = ""
    expected: Plan = field(default_factory=dict)
    received: dict[int, dict[str, Part]] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)  # stages whose STATUS success arrived
    endpoints: dict[int, Dest] = field(default_factory=dict)
    waiting_since: float = 0.0
    taken: bool = False
    permanent: bool = False  # refused for a reason a retry cannot cure (schema or auth mismatch, unplannable parts)
    told: bool = False  # an ABORT went to the prefill's stages
    landing: Optional[dict] = (
        None  # one-sided backends: where the prefill writes the parts (transfer/landing.py)
    )

    def result(self) -> PollResult:
        return PollResult(self.state, self.reason, self.permanent)

    @property
    def finished(self) -> bool:
        return self.state in (KVPoll.Failed, KVPoll.Success)

    def fail(self, reason: str, force: bool = False, permanent: bool = False) -> bool:
        """Failed, dropping what arrived; False (nothing changed) when already Failed, or Success
        unless forced."""
        if self.state == KVPoll.Failed or (self.state == KVPoll.Success and not force):
            return False
        self.state, self.reason, self.received, self.permanent = (
            KVPoll.Failed,
            reason,
            {},
            permanent,
        )
        return True

    def ready(self, expected: Plan, now: float) -> None:
        """The prefill's record is known and the plan made: TRANSFER_INFO goes to every stage."""
        self.expected, self.received = expected, {pp: {} for pp in expected}
        self.state, self.waiting_since = KVPoll.WaitingForInput, now

    def is_replay(self, pp: int, spec: PartSpec) -> bool:
        """A part already received, or one after its stage's success (a real prefill sends each part
        once)."""
        return pp in self.done or spec.name in self.received.get(pp, ())

    def accept(self, pp: int, spec: PartSpec, payload: bytes) -> Optional[str]:
        """Keep the part (Transferring), or why it does not fit the room."""
        problem = self.part_problem(pp, spec, len(payload))
        if problem is None:
            self.received[pp][spec.name] = Part(spec, payload)
            self.state = max(self.state, KVPoll.Transferring)
        return problem

    def part_problem(self, pp: int, spec: PartSpec, nbytes: int) -> Optional[str]:
        """Why a DATA frame does not fit the room, or None."""
        if self.state == KVPoll.Bootstrapping:
            return "DATA before this decode sent its TRANSFER_INFO"
        stage = self.expected.get(pp)
        if stage is None:
            return f"DATA from pp_rank {pp}, the room expects pp_rank(s) {sorted(self.expected)}"
        if pp in self.done:
            return f"DATA from pp_rank {pp} after its success STATUS"
        want = stage.get(spec.name)
        if want is None:
            return f"unexpected part {spec.name!r} from pp_rank {pp} (expected {sorted(stage)})"
        if spec.name in self.received[pp]:
            return f"part {spec.name!r} from pp_rank {pp} arrived twice"
        if spec != want:
            return f"part {spec.name!r} from pp_rank {pp}: header {spec.header()} != expected {want.header()}"
        if nbytes != want.nbytes:
            return f"part {spec.name!r} from pp_rank {pp}: {nbytes} bytes, expected {want.nbytes}"
        return None

    def landed(self, pp: int) -> None:
        """Stage pp's parts were written into the landing (a one-sided carrier): they count as
        received."""
        if (
            self.state in (KVPoll.WaitingForInput, KVPoll.Transferring)
            and pp in self.expected
            and pp not in self.done
        ):
            self.received[pp] = {name: Part(spec, b"") for name, spec in self.expected[pp].items()}
            self.state = max(self.state, KVPoll.Transferring)

    def stage_done(self, pp: int) -> Optional[str]:
        """Stage pp's STATUS success: Success once every stage is done; why it cannot be (a problem)
        or None."""
        if pp not in self.expected:
            return f"bad frame from the prefill: STATUS success from pp_rank {pp}, expected {sorted(self.expected)}"
        missing = [n for n in self.expected[pp] if n not in self.received[pp]]
        if missing:
            return f"prefill pp_rank {pp} reported success but part(s) {missing} never arrived"
        self.done.add(pp)
        if len(self.done) == len(self.expected):
            self.state = KVPoll.Success
        return None

    def take(self, room: int) -> dict[int, dict[str, Part]]:
        """The parts of a Success room, once; the room drops its reference."""
        if self.state != KVPoll.Success:
            raise TransferError(room, f"take() needs Success, the room is {self.state.name}")
        if self.taken:
            raise TransferError(room, "take() called twice")
        parts, self.received, self.taken = self.received, {}, True
        return parts


class DecodeRooms:
    """The decode's room table and its waiting-timeout queue."""

    def __init__(self) -> None:
        self.rooms: dict[int, DecodeRoom] = {}
        # by waiting_since; stale entries skipped
        self.waiting: OrderedDict[int, DecodeRoom] = OrderedDict()

    def add(self, room: int, rec: DecodeRoom) -> None:
        if room in self.rooms:
            raise ValueError(f"room {room} is already in use on this decode server")
        if len(self.rooms) >= MAX_ROOMS:
            raise RuntimeError(
                f"the decode transfer agent tracks {MAX_ROOMS} rooms; clear() finished ones"
            )
        self.rooms[room] = rec

    def current(self, room: int, rec: DecodeRoom) -> bool:
        return self.rooms.get(room) is rec

    def ready(self, room: int, rec: DecodeRoom, expected: Plan, now: float) -> None:
        rec.ready(expected, now)
        self.waiting[room] = rec

    def clear(self, room: int, now: float) -> None:
        self.rooms.pop(room, None)
        self.waiting.pop(room, None)

    def expire(self, now: float, timeout: float) -> list[tuple[int, DecodeRoom, list[int]]]:
        """(room, record, stages not done) of every live room waiting longer than timeout."""
        late = []
        while self.waiting:
            room, rec = next(iter(self.waiting.items()))
            if self.current(room, rec) and rec.state in LIVE:
                if now - rec.waiting_since <= timeout:
                    break
                late.append((room, rec, sorted(set(rec.expected) - rec.done)))
            del self.waiting[room]
        return late

    def stats(self) -> dict[str, int]:
        counts = {s.name: 0 for s in KVPoll}
        for rec in self.rooms.values():
            counts[rec.state.name] += 1
        return counts


def schema_mismatches(compare: SchemaCompare, prefill: dict, decode: dict) -> list[str]:
    try:
        return list(compare(prefill, decode))
    # a compare that cannot read the peer's schema is a mismatch, not a dead thread
    except Exception as e:
        return [f"schema compare failed ({type(e).__name__}: {e})"]


def plan(
    compare: SchemaCompare,
    expected_parts: ExpectedParts,
    info: dict,
    ours: dict,
    prompt_len: int,
    max_part_bytes: int,
    prefix: int = 0,
) -> tuple[str, Plan]:
    """(why the decode refuses a room of this prefill, or "", the parts it expects) from the
    prefill's server info. A schema mismatch starts with SCHEMA_MISMATCH and names each field with
    both values."""
    mismatches = schema_mismatches(compare, info["schema"], ours)
    if mismatches:
        return SCHEMA_MISMATCH + "; ".join(mismatches), {}
    try:
        wanted = expected_parts(info["schema"], prompt_len, prefix)
    except ValueError as e:
        return str(e), {}
    except Exception as e:
        return f"expected_parts raised {type(e).__name__}: {e}", {}
    expected: Plan = {pp: {} for pp in range(info["pp_size"])}
    for pp, specs in wanted.items():
        if pp not in expected:
            return (
                f"expected_parts names pp_rank {pp}, the prefill has pp_size {info['pp_size']}",
                {},
            )
        for spec in specs:
            if spec.name in expected[pp]:
                return f"expected_parts lists part {spec.name!r} of pp_rank {pp} twice", {}
            if spec.nbytes > max_part_bytes:
                return (
                    f"part {spec.name!r} of pp_rank {pp} is {spec.nbytes} bytes, over max_part_bytes "
                    f"{max_part_bytes}"
                ), {}
            expected[pp][spec.name] = spec
    return "", expected
