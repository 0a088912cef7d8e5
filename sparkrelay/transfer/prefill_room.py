"""A prefill stage's room state machine and its timeouts. Pure: no sockets, no threads, no clock
(callers pass `now`); the agent (transfer/prefill_agent.py) holds its lock around every call.

    add ─> Bootstrapping ──accept(TRANSFER_INFO)──> WaitingForInput ──start_push──> Transferring ──succeed──> Success
    fail(reason) from any live state ──> Failed   (no TRANSFER_INFO within bootstrap_timeout: expire() names it)

The parts come in one or more hand-overs (a prefill stage streams its KV chunk by chunk), the last
one flagged: each push takes every part handed over so far, and the push that takes the last
hand-over ends with the STATUS success. At most one push per room waits in the sender's queue at a
time; parts handed over meanwhile ride on it.

The decode usually sends its TRANSFER_INFO (or ABORT) before this stage schedules the request: such
a message waits in `early` until add() (at most MAX_EARLY of them, for at most bootstrap_timeout). A
cleared room's late messages are dropped for a while (`cleared`). A decode whose sends timed out is
`dead` until it sends a TRANSFER_INFO again.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

from sparkrelay.transfer.base import (
    PIECE_SEP,
    SCHEMA_MISMATCH,
    Dest,
    KVPoll,
    Part,
    PollResult,
    split_piece,
)
from sparkrelay.transfer.protocol import TransferInfo

MAX_ROOMS = 1 << 16
MAX_EARLY = 4096  # TRANSFER_INFO / ABORT that arrived before add_room
MAX_DEAD = 1024


@dataclass
class Early:
    """What arrived for a room before add(): its TRANSFER_INFO, or an ABORT (with the reason the
    room fails with)."""

    at: float
    info: Optional[TransferInfo] = None
    aborted: Optional[str] = None


@dataclass
class PrefillRoom:
    prompt_len: int
    added: float
    state: KVPoll = KVPoll.Bootstrapping
    reason: str = ""
    dest: Optional[Dest] = None  # the decode's PULL endpoint, from its TRANSFER_INFO
    landing: Optional[dict] = (
        None  # its landing map (one-sided backends write there; zmq ignores it)
    )
    prefix: int = (
        0  # the decode holds positions [0, prefix): pieces that start before it are not sent
    )
    pending: list[Part] = field(default_factory=list)  # handed over, not taken by a push yet
    names: set[str] = field(default_factory=set)  # every part name handed over (each is sent once)
    final: bool = False  # the last hand-over happened
    queued: bool = False  # a push is waiting in the sender's queue
    closing: bool = (
        False  # the push of the last hand-over was taken: its STATUS success is on the way
    )

    def result(self) -> PollResult:
        return PollResult(self.state, self.reason)

    @property
    def finished(self) -> bool:
        return self.state in (KVPoll.Failed, KVPoll.Success)

    def fail(self, reason: str) -> bool:
        """Failed, dropping the parts; False (nothing changed) when already Failed or Success."""
        if self.finished:
            return False
        self.state, self.reason, self.pending = KVPoll.Failed, reason, []
        return True

    def accept(self, info: TransferInfo, mismatches: list[str], align: int = 1) -> str:
        """The decode's TRANSFER_INFO, first of its kind (the caller checks dest is None). Returns
        why the room must fail, or "" (WaitingForInput, or still Failed if it failed before: the
        caller tells the decode).
        align: the positions per piece; a decode's prefix is a whole number of pieces."""
        self.dest, self.landing = info.dest, info.landing
        if self.state == KVPoll.Failed:
            return ""
        if mismatches:
            return SCHEMA_MISMATCH + "; ".join(mismatches)
        if info.prompt_len != self.prompt_len:
            return (
                f"prompt_len mismatch: prefill={self.prompt_len} decode={info.prompt_len} "
                "(the two servers tokenized the request differently)"
            )
        if info.prefix and (info.prefix % align or info.prefix >= self.prompt_len):
            return (
                f"the decode's cached prefix {info.prefix} is not a multiple of {align} positions below the "
                f"prompt length {self.prompt_len}"
            )
        self.prefix = info.prefix
        self.state = max(self.state, KVPoll.WaitingForInput)
        return ""

    def hand_over(self, room: int, parts: list[Part], last: bool) -> None:
        """ValueError for a hand-over after the last one, or a part name handed over before."""
        if self.final:
            raise ValueError(f"room {room}: send() after its last send")
        twice = sorted(self.names.intersection(p.spec.name for p in parts))
        if twice:
            raise ValueError(f"room {room}: part(s) {twice} were sent before")
        self.names.update(p.spec.name for p in parts)
        self.final = last
        if self.state != KVPoll.Failed:  # failed: already reported, send nothing
            self.pending.extend(parts)

    def take_push(self) -> bool:
        """True when a push is due (the destination known, something handed over and no push
        waiting): the caller queues it."""
        if self.dest is None or self.queued or self.closing or self.state == KVPoll.Failed:
            return False
        if not self.pending and not self.final:
            return False
        self.queued = True
        return True

    def take_parts(self) -> tuple[list[Part], bool]:
        """The queued push runs: (every part handed over so far but the pieces the decode holds,
        whether the last hand-over is among them)."""
        parts, self.pending, self.queued = self.pending, [], False
        if self.prefix:
            parts = [
                p
                for p in parts
                if PIECE_SEP not in p.spec.name or split_piece(p.spec.name)[1] >= self.prefix
            ]
        self.closing = self.final
        return parts, self.final

    def start_push(self) -> None:
        self.state = max(self.state, KVPoll.Transferring)

    def succeed(self) -> bool:
        """Its last frame (STATUS success) went out: Success, unless it failed meanwhile."""
        if self.state == KVPoll.Failed:
            return False
        self.state, self.pending = KVPoll.Success, []
        return True


class PrefillRooms:
    """One stage's room table, the rooms waiting for a TRANSFER_INFO, early messages, cleared rooms,
    dead decodes."""

    def __init__(self, who: str) -> None:
        self.who = who
        self.rooms: dict[int, PrefillRoom] = {}
        # rooms waiting for TRANSFER_INFO, by add time
        self.pending: OrderedDict[int, float] = OrderedDict()
        self.early: OrderedDict[int, Early] = OrderedDict()
        # recently cleared: late messages are ignored
        self.cleared: OrderedDict[int, float] = OrderedDict()
        self.dead: dict[Dest, float] = {}

    def add(self, room: int, prompt_len: int, now: float) -> Optional[Early]:
        """A new Bootstrapping room; what arrived for it early, if anything (the caller applies
        it)."""
        if room in self.rooms:
            raise ValueError(f"room {room} is already in use on {self.who}")
        if len(self.rooms) >= MAX_ROOMS:
            raise RuntimeError(f"{self.who} tracks {MAX_ROOMS} rooms; clear() finished ones")
        self.cleared.pop(room, None)
        self.rooms[room] = PrefillRoom(prompt_len, now)
        self.pending[room] = now
        return self.early.pop(room, None)

    def clear(self, room: int, now: float) -> None:
        self.rooms.pop(room, None)
        self.pending.pop(room, None)
        self.early.pop(room, None)
        self.cleared.pop(room, None)
        self.cleared[room] = now
        while len(self.cleared) > MAX_ROOMS:
            self.cleared.popitem(last=False)

    def accept(
        self, room: int, rec: PrefillRoom, info: TransferInfo, mismatches: list[str], align: int = 1
    ) -> str:
        """rec.accept, and the room no longer waits for a TRANSFER_INFO; its decode is alive."""
        self.dead.pop(info.dest, None)
        self.pending.pop(room, None)
        return rec.accept(info, mismatches, align)

    def hold_early(
        self,
        room: int,
        now: float,
        info: Optional[TransferInfo] = None,
        aborted: Optional[str] = None,
    ) -> list[int]:
        """Keep a message for a room not added yet (an ABORT keeps an earlier TRANSFER_INFO); the
        rooms dropped to stay within MAX_EARLY."""
        old = self.early.pop(room, None)
        if old is not None and info is None:
            info = old.info
        self.early[room] = Early(now, info, aborted)
        dropped = []
        while len(self.early) > MAX_EARLY:
            dropped.append(self.early.popitem(last=False)[0])
        return dropped

    def expire(self, now: float, timeout: float) -> tuple[list[int], list[TransferInfo]]:
        """(rooms with no TRANSFER_INFO within timeout, TRANSFER_INFOs of rooms never added within
        timeout); cleared rooms are forgotten after max(2 * timeout, 60 s)."""
        late, unclaimed = [], []
        while self.pending:
            room, added = next(iter(self.pending.items()))
            if now - added <= timeout:
                break
            del self.pending[room]
            rec = self.rooms.get(room)
            if rec is not None and rec.added == added and rec.dest is None:
                late.append(room)
        while self.early and now - next(iter(self.early.values())).at > timeout:
            _, early = self.early.popitem(last=False)
            if early.info is not None and early.aborted is None:
                unclaimed.append(early.info)
        while self.cleared and now - next(iter(self.cleared.values())) > max(2 * timeout, 60.0):
            self.cleared.popitem(last=False)
        return late, unclaimed

    def mark_dead(self, dests: list[Dest], now: float) -> None:
        for dest in dests:
            self.dead[dest] = now
        while len(self.dead) > MAX_DEAD:
            self.dead.pop(next(iter(self.dead)))
