"""DecodeAgent: the decode side of every transfer backend, one per decode server; how the parts'
bytes arrive is its carrier's (transfer/frames.py: DATA frames on this channel;
transfer/onesided.py: written into registered memory, a stage's STATUS success saying its writes
completed).

    engine thread               bootstrap workers (4)                 sender thread (owns every PUSH, never blocks)
    begin(room, host, port) --> the prefill's record (cached, or GET
                                /route info + every stage endpoint,
                                one fetch per prefill at a time),
                                compare schemas, expected_parts  -->  TRANSFER_INFO to every stage (wire.Outbox:
                                                                      one queue per destination, 5 s each)
    listener thread (PULL): DATA / STATUS, each checked against the room's expected PartSpecs
    monitor thread: waiting timeout (ABORT to the prefill) every 50 ms; GET /health per known prefill every interval
    poll(room) / take(room) after Success / abort(room) --> ABORT with the reason to every stage / clear(room)

The room state machine is in transfer/decode_room.py; the bootstrap workers and the heartbeat are a
member, transfer/decode_bootstrap.py's Bootstrapper. With auth_token set, the bootstrap requests
carry `Authorization: Bearer`, every message carries an HMAC tag (wire.FrameAuth), and a message
without a valid tag is dropped and counted before it is parsed, never failing a room. A duplicate of
a part already received (a replay: a real prefill sends each part once) is dropped too. Without a
token a bad frame for a live room fails that room.

The address in its TRANSFER_INFO (and its one-sided engine's name) is wire.check_advertised's:
host_ip (SPARKRELAY_HOST_IP) when set, else the bind address; a wildcard bind without host_ip is a
ConfigError. A room whose bootstrap host is remote but whose prefill published loopback stage
endpoints fails without dialing them (bootstrap/prefill_book.py finds it): this decode would reach
itself.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Union

from sparkrelay.transfer import protocol
from sparkrelay.transfer.agent import Agent, start_loop
from sparkrelay.transfer.base import (
    SCHEMA_MISMATCH,
    Addr,
    DecodeTransfer,
    Dest,
    ExpectedParts,
    KVPoll,
    Part,
    PartSpec,
    SchemaCompare,
    TransferError,
    check_room,
)
from sparkrelay.transfer.bootstrap.prefill_book import PrefillBook, PrefillRecord
from sparkrelay.transfer.decode_bootstrap import Bootstrapper
from sparkrelay.transfer.decode_room import LIVE, DecodeRoom, DecodeRooms, plan
from sparkrelay.transfer.frames import FramesCarrier
from sparkrelay.transfer.landing import Landing
from sparkrelay.transfer.protocol import Abort, Data, FrameError, Status, TransferInfo
from sparkrelay.transfer.wire import MAX_QUEUED, Outbox, check_advertised

logger = logging.getLogger(__name__)

CONTROL_SEND_TIMEOUT_S = (
    5.0  # a stage that takes none of its queued control messages for this long loses them
)


# ---- the sender thread's jobs ----


@dataclass(frozen=True)
class Send:
    """One control message to a stage; tag: the room (an ABORT) or (room, rec) (a TRANSFER_INFO)."""

    dest: Dest
    msg: Union[TransferInfo, Abort]
    tag: object


@dataclass(frozen=True)
class Drop:
    """Retire stage endpoints: close their sockets, give up what is queued for them."""

    dests: list[Dest]


class DecodeAgent(Agent, DecodeTransfer):
    who = thread_name = "decode"

    def __init__(
        self,
        schema: dict,
        compare: SchemaCompare,
        expected_parts: ExpectedParts,
        bind_host: str,
        bootstrap_timeout: float,
        waiting_timeout: float,
        heartbeat_interval: float,
        heartbeat_max_failures: int,
        default_bootstrap_port: int,
        max_part_bytes: int = 1 << 31,
        auth_token: Optional[str] = None,
        carrier=None,
        host_ip: Optional[str] = None,
    ) -> None:
        super().__init__(schema, bind_host, auth_token, logger)
        self._compare, self._expected_parts = compare, expected_parts
        self.host = check_advertised(bind_host, host_ip)  # what TRANSFER_INFO tells the prefill
        self.bootstrap_timeout, self.waiting_timeout = bootstrap_timeout, waiting_timeout
        self.default_bootstrap_port, self.max_part_bytes = default_bootstrap_port, max_part_bytes
        self._table = DecodeRooms()
        self._book = PrefillBook(self._token)
        self._boot = Bootstrapper(
            self, self._book, bootstrap_timeout, heartbeat_interval, heartbeat_max_failures
        )
        self._listener: Callable[[], None] = lambda: None
        self._carrier = FramesCarrier() if carrier is None else carrier
        self._carrier.open(self.host)  # a one-sided engine (EngineMissing names what to install)
        self.one_sided = self._carrier.one_sided

    # ---- lifecycle ----

    def _max_msg_size(self) -> int:
        return max(self.max_part_bytes, protocol.MAX_CONTROL_BYTES)

    def _send_timeout_s(self) -> float:
        return CONTROL_SEND_TIMEOUT_S

    def _socket_name(self) -> str:
        return "the decode transfer socket"

    def _more_threads(self) -> list[threading.Thread]:
        return [
            start_loop("decode-monitor", self._stop, self._monitor_step),
            *self._boot.threads(self._stop),
        ]

    def register(self, regions: list[tuple[int, int]]) -> None:
        self._carrier.register(regions)

    def close(self) -> None:
        super().close()
        self._carrier.close()

    def _unknown(self, room: int) -> str:
        return f"room {room} is not known to the decode (never begun, or cleared)"

    def _started(self) -> None:
        self._log.info(
            "decode: transfer agent on %s:%d, advertised as %s",
            self.bind_host,
            self.port,
            self.host,
        )

    # ---- engine-facing API ----

    def begin(
        self,
        room: int,
        bootstrap_host: str,
        bootstrap_port: Optional[int],
        prompt_len: int,
        landing: Optional[Landing] = None,
        prefix: int = 0,
    ) -> None:
        why = check_room(room)
        if why:
            raise ValueError(why)
        port = self.default_bootstrap_port if bootstrap_port is None else bootstrap_port
        if not isinstance(bootstrap_host, str) or not bootstrap_host.strip("[]"):
            raise ValueError(f"bootstrap_host must be a non-empty string, got {bootstrap_host!r}")
        if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
            raise ValueError(
                f"bootstrap_port must be an int in 1..65535 or None, got {bootstrap_port!r}"
            )
        if not isinstance(prompt_len, int) or prompt_len < 0:
            raise ValueError(f"prompt_len must be a non-negative int, got {prompt_len!r}")
        if not isinstance(prefix, int) or not (prefix == 0 or 0 < prefix < prompt_len):
            raise ValueError(
                f"prefix must be 0 or an int below prompt_len {prompt_len}, got {prefix!r}"
            )
        rec = DecodeRoom(
            (bootstrap_host.strip("[]"), port), prompt_len, time.monotonic(), prefix=prefix
        )
        try:
            rec.landing = self._carrier.landing(landing, self._schema, self.host)
        except ValueError as e:  # the room fails (poll says why); the engine goes on
            rec.fail(str(e), permanent=True)
        with self._lock:
            self._table.add(room, rec)
        if rec.state != KVPoll.Failed and not self._boot.submit(room, rec):
            self.fail_room(room, rec, "decode bootstrap queue is full")

    def set_listener(self, callback: Callable[[], None]) -> None:
        self._listener = callback

    def _news(self) -> None:
        try:
            self._listener()
        except Exception:
            logger.exception("decode: the room listener raised")

    def take(self, room: int) -> dict[int, dict[str, Part]]:
        with self._lock:
            rec = self._table.rooms.get(room)
            if rec is None:
                raise TransferError(room, "take() on a room the decode does not know")
            return rec.take(room)

    def abort(self, room: int, reason: str) -> None:
        with self._lock:
            rec = self._table.rooms.get(room)
        if rec is not None:
            self.fail_room(room, rec, reason, force=True)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return self._table.stats()

    # ---- failing a room ----

    def fail_room(
        self,
        room: int,
        rec: DecodeRoom,
        reason: str,
        notify: bool = True,
        skip: Optional[Dest] = None,
        force: bool = False,
        permanent: bool = False,
    ) -> None:
        """Failed (wins over everything but an earlier Failed; over Success only when `force`), and
        an ABORT with the reason to every live stage endpoint of the room (still bootstrapping: of
        its prefill's cached record, if any) unless notify is False."""
        with self._lock:
            if not self._table.current(room, rec) or not rec.fail(reason, force, permanent):
                return
            endpoints = dict(rec.endpoints)
        logger.warning("decode: room %d failed: %s", room, reason)
        self._news()
        if notify and not endpoints:
            known = self._book.cached(rec.addr)
            endpoints = {} if known is None or known.unreachable else known.endpoints
        if notify and endpoints:
            rec.told = True
            self._send_abort(room, [d for d in endpoints.values() if d != skip], reason)

    def _send_abort(self, room: int, dests: list[Dest], reason: str) -> None:
        """ABORT(room, reason) to each of dests not retired, so the prefill's log and answer say
        why."""
        msg = Abort(room, protocol.clip(reason))
        for dest in self._book.live(dests):
            self._enqueue(Send(dest, msg, room))

    # ---- the bootstrapper's calls ----

    def bootstrapping(self, room: int, rec: DecodeRoom) -> bool:
        with self._lock:
            return self._table.current(room, rec) and rec.state == KVPoll.Bootstrapping

    def wanted(self, items: list[tuple[int, DecodeRoom]]) -> bool:
        """Some of these rooms are still live (a fetch for them goes on)."""
        with self._lock:
            return any(self._table.current(r, w) and w.state in LIVE for r, w in items)

    def drop(self, dests: list[Dest]) -> None:
        self._enqueue(Drop(dests))

    def waiting_addrs(self) -> set[Addr]:
        """The prefills that rooms wait on (the heartbeat checks them)."""
        with self._lock:
            return {
                r.addr
                for r in self._table.rooms.values()
                if r.state in (KVPoll.WaitingForInput, KVPoll.Transferring)
            }

    def rooms_at(self, addr: Addr) -> list[tuple[int, DecodeRoom]]:
        """The rooms past bootstrapping that wait on the prefill at addr."""
        with self._lock:
            return [
                (room, r)
                for room, r in self._table.rooms.items()
                if r.addr == addr and r.state in LIVE and r.state != KVPoll.Bootstrapping
            ]

    def bootstrapped(self, room: int, rec: DecodeRoom, known: PrefillRecord) -> None:
        """The prefill's record is known: the room waits for its parts (TRANSFER_INFO to every
        stage), or fails with the reason this decode refuses that prefill (stage endpoints it cannot
        reach are never dialed, not even for an ABORT)."""
        refusal, expected = self._refusal(known, rec)
        reachable = not known.unreachable
        with self._lock:
            if reachable:
                rec.endpoints = dict(known.endpoints)
            current, failed = self._table.current(room, rec), rec.state == KVPoll.Failed
            if current and not failed and not refusal:
                self._table.ready(room, rec, expected, time.monotonic())
        # aborted while bootstrapping: the stages learn why now that they are known
        if failed and not rec.told:
            self._send_abort(room, list(rec.endpoints.values()), rec.reason)
        # a mismatch: read /route again next time (the prefill may be fixed)
        elif refusal and current:
            self._boot.forget(rec.addr, dead=False)
            # with an ABORT naming both values to every stage it can reach
            self.fail_room(room, rec, refusal, permanent=True, notify=reachable)
        elif current:
            msg = TransferInfo(
                room, self.host, self.port, rec.prompt_len, self._schema, rec.landing, rec.prefix
            )
            for pp in sorted(rec.endpoints, reverse=True):
                if not self._enqueue(Send(rec.endpoints[pp], msg, (room, rec))):
                    self.fail_room(room, rec, "decode send queue is full")

    def _refusal(
        self, known: PrefillRecord, rec: DecodeRoom
    ) -> tuple[str, dict[int, dict[str, PartSpec]]]:
        """(why this decode refuses the prefill's rooms, or "", pp_rank -> name -> PartSpec)."""
        info = known.info
        if known.unreachable:
            return known.unreachable, {}
        if self._auth.enabled and info.get("auth_required") is not True:
            host, port = rec.addr
            return (
                f"the prefill's bootstrap server at {host}:{port} runs without --disaggregation-auth-token, "
                "this decode with one (it would drop every message of this decode): set the same "
                "--disaggregation-auth-token on both servers"
            ), {}
        return plan(
            self._compare,
            self._expected_parts,
            info,
            self._schema,
            rec.prompt_len,
            self.max_part_bytes,
            rec.prefix,
        )

    # ---- sender thread ----

    def _pumped(self, out: Outbox, expired: list) -> None:
        for dest, tag in expired:
            self._undelivered(
                dest,
                tag,
                f"no progress within {CONTROL_SEND_TIMEOUT_S:g} s (never connected, or "
                "it stopped reading)",
                dead=True,
            )

    def _run_job(self, out: Outbox, job: Union[Send, Drop]) -> None:
        if isinstance(job, Drop):
            for dest in job.dests:
                for tag in out.drop(dest):
                    self._undelivered(dest, tag, "its prefill restarted or stopped answering")
        elif self._book.is_dead(job.dest):
            self._undelivered(job.dest, job.tag, "its prefill restarted or stopped answering")
        elif not out.put(job.dest, job.msg.encode(), job.tag):
            self._undelivered(job.dest, job.tag, f"{MAX_QUEUED} messages already wait for it")

    def _undelivered(self, dest: Dest, tag, why: str, dead: bool = False) -> None:
        """A message given up. An ABORT (tag: its room) is only logged; a TRANSFER_INFO fails its
        room and, when the stage never connected (dead), retires its prefill's record."""
        if not isinstance(tag, tuple):
            logger.warning("decode: ABORT of room %s not delivered to %s:%d: %s", tag, *dest, why)
            return
        room, rec = tag
        if dead:
            self._boot.forget(rec.addr, dead=True, listing=dest)
        self.fail_room(
            room,
            rec,
            f"could not send TRANSFER_INFO to the prefill stage at {dest[0]}:{dest[1]}: {why}",
            skip=dest,
        )

    # ---- listener thread ----

    def _receive(self, frames: list) -> None:
        msg = protocol.read_at_decode(frames, self._auth.hint())
        if isinstance(msg, Data):
            self._on_data(msg)
        else:
            self._on_status(msg)

    def _bad_message(self, e: FrameError, kind: str) -> None:
        with self._lock:
            rec = None if e.room is None else self._table.rooms.get(e.room)
        if rec is None:
            self._rejects.note(
                kind,
                "decode: dropped a bad frame%s: %s",
                "" if e.room is None else f" for unknown room {e.room}",
                e.reason,
            )
            return
        self._rejects.note(kind, "decode: bad frame for room %d: %s", e.room, e.reason)
        self._boot.forget(rec.addr, dead=False)
        self.fail_room(e.room, rec, f"bad frame from the prefill: {e.reason}")

    def _on_data(self, msg: Data) -> None:
        room, pp, spec = msg.room, msg.pp_rank, msg.spec
        if self.one_sided:
            raise FrameError(
                f"DATA frame for room {room} on the {self._carrier.engine_name} backend (the prefill "
                "sends bytes over zmq: --disaggregation-transfer-backend differs between the two "
                "servers)",
                room,
            )
        with self._lock:
            rec = self._table.rooms.get(room)
            if rec is None:
                # room=None: logged, nothing to fail
                raise FrameError(f"DATA for unknown room {room}")
            if rec.finished:
                logger.info(
                    "decode: DATA %r for room %d, already %s, dropped",
                    spec.name,
                    room,
                    rec.state.name,
                )
                return
            replay = self._auth.enabled and rec.is_replay(pp, spec)
            problem = None if replay else rec.accept(pp, spec, msg.payload)
        if replay:  # authentic but already seen: someone replays captured traffic; the room goes on
            self._rejects.note(
                "replay",
                "decode: room %d: a second copy of part %r from pp_rank %d dropped (a replay)",
                room,
                spec.name,
                pp,
            )
        elif problem is not None:
            raise FrameError(problem, room)

    def _on_status(self, msg: Status) -> None:
        room, pp, status = msg.room, msg.pp_rank, msg.status
        with self._lock:
            rec = self._table.rooms.get(room)
            if rec is None:
                logger.info("decode: STATUS from pp_rank %d for unknown room %d dropped", pp, room)
                return
            if rec.finished:
                return
            # its writes completed: its parts are in the landing
            if self.one_sided and status == KVPoll.Success:
                rec.landed(pp)
            problem = rec.stage_done(pp) if status == KVPoll.Success else None
            if status == KVPoll.Success and problem is None:
                success = rec.state == KVPoll.Success
        if status == KVPoll.Success and problem is None:
            if success:
                self._news()
            return
        if status in (
            KVPoll.Failed,
            KVPoll.Success,
        ):  # the prefill failed the room: read /route again next time
            self._boot.forget(rec.addr, dead=False)
        if status == KVPoll.Failed:
            self.fail_room(
                room,
                rec,
                f"prefill pp_rank {pp} failed: {msg.reason}",
                permanent=SCHEMA_MISMATCH in msg.reason,
            )
        elif status == KVPoll.Success:
            self.fail_room(room, rec, problem)
        else:
            raise FrameError(
                f"STATUS {status} from pp_rank {pp} is neither Success nor Failed", room
            )

    # ---- monitor thread ----

    def _monitor_step(self) -> None:
        now = time.monotonic()
        self._expire_waiting(now)
        self._boot.heartbeat_step(now)
        self._stop.wait(0.05)

    def _expire_waiting(self, now: float) -> None:
        with self._lock:
            late = self._table.expire(now, self.waiting_timeout)
        t = self.waiting_timeout
        for room, rec, stages in late:
            self._boot.forget(rec.addr, dead=False)
            self.fail_room(
                room,
                rec,
                f"the prefill did not finish within {t:g} s "
                f"(SPARKRELAY_DISAGGREGATION_WAITING_TIMEOUT={t:g}); waiting for pp_rank(s) {stages}",
            )
