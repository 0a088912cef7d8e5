"""PrefillAgent: the prefill side of every transfer backend, one per prefill pipeline stage; how the
parts' bytes travel is its carrier's (transfer/frames.py: DATA frames; transfer/onesided.py: engine
writes).

    engine thread             listener thread (PULL)                    sender thread (owns the wire.Outbox)
    add_room(room, len)  -->  TRANSFER_INFO(room) validated, stored -->  carrier.deliver, then STATUS success
    send(room, parts)    -->  (either order; the sender starts once both are there)
    abort(room, reason)  -->  STATUS failed ---------------------------> decode
                              ABORT from decode -> Failed
                              bootstrap timeout (checked every 50 ms) -> Failed, STATUS failed to the decode

The room state machine and its timeouts are in transfer/prefill_room.py. Sends never block: each
decode has its own queue in the outbox, so a slow or dead decode only delays its own rooms. A room
is Success once zmq took its STATUS success (after all its DATA); a decode that takes nothing for
SEND_TIMEOUT_S fails every room queued for it and is marked dead until it sends a TRANSFER_INFO
again. An aborted room's frames still queued are dropped unsent. on_status(room, Success|Failed,
reason) is called once per room, from an agent thread, or from abort() in the caller's thread; never
from inside add_room() or send(), and never with the agent's lock held.

With auth_token set, every message in and out carries an HMAC tag (wire.FrameAuth); an untagged or
forged message is dropped and counted (rejected()) before it is parsed. failure_prob > 0
(SPARKRELAY_TEST_DISAGG_FAILURE_PROB) fails that fraction of rooms just before their data is sent,
through the ordinary failure path. The draw is a function of the room id, so every stage of a room
makes the same one: a room fails with probability failure_prob whatever the PP size, and a retry
under a new room id draws again.

A stage registers (rank_ip) and names its one-sided engine with host_ip (SPARKRELAY_HOST_IP) when
given, else its bind address; a wildcard bind registers as is and the bootstrap server stores the
address peers reach it at (bootstrap/server.py). A stage bound beyond loopback refuses a
TRANSFER_INFO whose decode address is loopback (or a wildcard): sending there would reach this
host, not the decode; the room fails and nothing is sent to that address.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Optional, Union

import zmq

from sparkrelay.transfer import protocol
from sparkrelay.transfer.agent import Agent
from sparkrelay.transfer.base import (
    Dest,
    KVPoll,
    Part,
    PrefillTransfer,
    SchemaCompare,
    StatusCallback,
    check_room,
)
from sparkrelay.transfer.bootstrap.client import register_rank
from sparkrelay.transfer.decode_room import schema_mismatches
from sparkrelay.transfer.frames import FramesCarrier
from sparkrelay.transfer.prefill_room import PrefillRoom, PrefillRooms
from sparkrelay.transfer.protocol import Abort, FrameError, Status, TransferInfo
from sparkrelay.transfer.wire import Outbox, advertised_host, dials_itself, resolves_to_loopback

logger = logging.getLogger(__name__)

SEND_TIMEOUT_S = 30.0  # a decode that takes no data for this long is marked dead
INJECTED_FAILURE = "injected failure (SPARKRELAY_TEST_DISAGG_FAILURE_PROB)"


# ---- the sender thread's jobs ----


@dataclass(frozen=True)
class Push:
    """Deliver the room's parts handed over so far."""

    room: int
    rec: PrefillRoom


@dataclass(frozen=True)
class Notify:
    """Call on_status (deferred out of add_room / send)."""

    room: int
    state: KVPoll
    reason: str


@dataclass(frozen=True)
class Tell:
    """Drop the room's frames still queued for dest, then send `msg` (None: only drop)."""

    dest: Dest
    msg: Optional[Status]
    room: int


@dataclass(frozen=True)
class Written:
    """A carrier wrote the room's last hand-over: STATUS success may go."""

    room: int
    rec: PrefillRoom
    dest: Dest


Job = Union[Push, Notify, Tell, Written]


class PrefillAgent(Agent, PrefillTransfer):
    thread_name = "prefill"
    close_timeout_s = 4.0
    # messages waiting per decode; they reference the rooms' parts, which exist anyway
    max_queued = 1 << 16

    def __init__(
        self,
        pp_rank: int,
        pp_size: int,
        schema: dict,
        compare: SchemaCompare,
        bootstrap_url: str,
        bind_host: str,
        bootstrap_timeout: float,
        on_status: StatusCallback,
        prefill_http_port: Optional[int] = None,
        auth_token: Optional[str] = None,
        failure_prob: float = 0.0,
        carrier=None,
        host_ip: Optional[str] = None,
    ) -> None:
        if not 0 <= pp_rank < pp_size:
            raise ValueError(f"pp_rank {pp_rank} is outside 0..{pp_size - 1}")
        if not 0.0 <= failure_prob <= 1.0:
            raise ValueError(f"failure_prob must be in [0, 1], got {failure_prob}")
        missing = [k for k in ("page_size", "dtype") if k not in schema]
        if missing:
            raise ValueError(
                f"the transfer schema needs {missing} (registered with the bootstrap server)"
            )
        super().__init__(schema, bind_host, auth_token, logger)
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self.who, self.thread_name = f"prefill pp_rank {pp_rank}", f"prefill-pp{pp_rank}"
        self._compare, self._on_status = compare, on_status
        self.bootstrap_url, self.prefill_http_port = bootstrap_url, prefill_http_port
        self.bootstrap_timeout, self.failure_prob = bootstrap_timeout, failure_prob
        self._table = PrefillRooms(self.who)
        self._carrier = FramesCarrier() if carrier is None else carrier
        # what this stage registers: a wildcard without host_ip is the bootstrap server's to resolve
        self.host = advertised_host(bind_host, host_ip) or bind_host
        self._exposed = not resolves_to_loopback(bind_host)  # peers on other hosts may reach it

    # ---- lifecycle ----

    def start(self) -> None:
        # a one-sided engine first (EngineMissing names what to install)
        self._carrier.open(self.host)
        super().start()

    def close(self) -> None:
        super().close()
        self._carrier.close()

    def _more_threads(self) -> list:
        return self._carrier.threads(self.thread_name, self._stop, self)

    def _max_msg_size(self) -> int:
        return protocol.MAX_CONTROL_BYTES

    def _send_timeout_s(self) -> float:
        return SEND_TIMEOUT_S

    def _socket_name(self) -> str:
        return f"prefill pp_rank {self.pp_rank}'s transfer socket"

    def _started(self) -> None:
        """Register with PUT /route (BootstrapError, after closing, if the server refuses)."""
        try:
            register_rank(self.bootstrap_url, self._registration(), token=self._token)
        except Exception:
            self.close()
            raise
        self._log.info(
            "%s: transfer agent on %s:%d, registered as %s",
            self.who,
            self.bind_host,
            self.port,
            self.host,
        )

    def _registration(self) -> dict:
        return {
            "attn_tp_size": 1,
            "attn_tp_rank": 0,
            "attn_cp_size": 1,
            "attn_cp_rank": 0,
            "attn_dp_size": 1,
            "attn_dp_rank": 0,
            "pp_size": self.pp_size,
            "pp_rank": self.pp_rank,
            "system_dp_size": 1,
            "system_dp_rank": 0,
            "rank_ip": self.host,
            "rank_port": self.port,
            "page_size": self._schema["page_size"],
            "kv_cache_dtype": self._schema["dtype"],
            "load_balance_method": "round_robin",
            "enable_dsa_cache_layer_split": False,
            "prefill_http_port": self.prefill_http_port,
        }

    # ---- engine-facing API ----

    def add_room(self, room: int, prompt_len: int) -> None:
        why = check_room(room)
        if why:
            raise ValueError(why)
        if not isinstance(prompt_len, int) or prompt_len < 0:
            raise ValueError(f"prompt_len must be a non-negative int, got {prompt_len!r}")
        with self._lock:
            early = self._table.add(room, prompt_len, time.monotonic())
        if early is not None and early.aborted is not None:
            self._fail(room, early.aborted, tell_decode=False, defer=True)
        elif early is not None and early.info is not None:
            self._apply_info(early.info, defer=True)

    def send(self, room: int, parts: list[Part], last: bool = True) -> None:
        names = [p.spec.name for p in parts]
        if len(set(names)) != len(names):
            raise ValueError(f"room {room}: duplicate part names {names}")
        for p in parts:
            if len(p.data) != p.spec.nbytes:
                raise ValueError(
                    f"room {room}: part {p.spec.name!r} has {len(p.data)} bytes, its spec "
                    f"{p.spec.shape} {p.spec.dtype} needs {p.spec.nbytes}"
                )
        with self._lock:
            rec = self._table.rooms.get(room)
            if rec is None:
                raise KeyError(
                    f"room {room} was never added to prefill pp_rank {self.pp_rank} (or was cleared)"
                )
            rec.hand_over(room, parts, last)
            full = self._queue_push_locked(room, rec)
        if full:
            self._fail(room, "prefill send queue is full", defer=True)

    def abort(self, room: int, reason: str) -> None:
        self._fail(room, reason)

    # ---- state changes ----

    def _fail(self, room: int, reason: str, tell_decode: bool = True, defer: bool = False) -> None:
        """Failed unless already terminal; STATUS failed to the decode if known; on_status, from the
        sender thread when `defer` (add_room / send never call back into the engine from inside
        themselves)."""
        with self._lock:
            rec = self._table.rooms.get(room)
            if rec is None or not rec.fail(reason):
                return
            dest = rec.dest
        logger.warning("prefill pp_rank %d: room %d failed: %s", self.pp_rank, room, reason)
        # the sender drops the room's frames still queued, then tells the decode
        if dest is not None:
            msg = Status.failed(room, self.pp_rank, reason) if tell_decode else None
            self._enqueue(Tell(dest, msg, room))
        if not defer or not self._enqueue(Notify(room, KVPoll.Failed, reason)):
            self._notify(room, KVPoll.Failed, reason)

    def _notify(self, room: int, state: KVPoll, reason: str) -> None:
        try:
            self._on_status(room, state, reason)
        except Exception:
            logger.exception(
                "prefill pp_rank %d: on_status(%d, %s) raised", self.pp_rank, room, state.name
            )

    def _queue_push_locked(self, room: int, rec: PrefillRoom) -> bool:
        """Queue the push once both the parts and the destination are known; True if the queue was
        full."""
        return rec.take_push() and not self._enqueue(Push(room, rec))

    def _unreachable(self, info: TransferInfo) -> str:
        """Why this stage must not send to the decode named in info ("" when it may): a loopback or
        wildcard address while this stage is bound beyond loopback is this host, not the decode."""
        if not self._exposed or not dials_itself(info.decode_host):
            return ""
        return (
            f"the decode advertised {info.decode_host}:{info.decode_port}, a loopback address, and "
            f"this prefill stage is bound to {self.bind_host}: sending there would reach this host, "
            "not the decode. Start the decode with SPARKRELAY_HOST_IP (or "
            "--disaggregation-bootstrap-host) set to the address the prefill reaches it at"
        )

    def _apply_info(self, info: TransferInfo, defer: bool = False) -> None:
        unreachable = self._unreachable(info)
        if unreachable:  # the room fails here only: telling the decode would dial this host
            self._fail(info.room, unreachable, tell_decode=False, defer=defer)
            return
        room, full, reply, reason = info.room, False, None, ""
        mismatches = schema_mismatches(self._compare, self._schema, info.schema)
        with self._lock:
            rec = self._table.rooms.get(room)
            if rec is None:
                return
            duplicate = rec.dest is not None
            if not duplicate:
                reason = self._table.accept(
                    room, rec, info, mismatches, int(self._schema.get("stream_tokens") or 1)
                )
                # failed before: tell the decode now
                reply = rec.reason if rec.state == KVPoll.Failed else None
                full = not reason and reply is None and self._queue_push_locked(room, rec)
        if duplicate:
            self._rejects.note(
                "replay",
                "prefill pp_rank %d: room %d: duplicate TRANSFER_INFO from %s ignored",
                self.pp_rank,
                room,
                info.dest,
            )
        elif reply is not None:
            self._enqueue(Tell(info.dest, Status.failed(room, self.pp_rank, reply), room))
        elif reason or full:
            self._fail(room, reason or "prefill send queue is full", defer=defer)

    # ---- listener thread ----

    def _receive(self, frames: list) -> None:
        msg = protocol.read_at_prefill(frames, self._auth.hint())
        if isinstance(msg, TransferInfo):
            self._on_info(msg)
        else:
            logger.warning(
                "prefill pp_rank %d: room %d aborted by the decode server: %s",
                self.pp_rank,
                msg.room,
                msg.reason or "(no reason given)",
            )
            self._on_abort(msg)

    def _bad_message(self, e: FrameError, kind: str) -> None:
        self._rejects.note(
            kind, "prefill pp_rank %d: dropped a bad message: %s", self.pp_rank, e.reason
        )
        if e.room is not None:
            self._fail(e.room, f"bad message from the decode server: {e.reason}")

    def _on_info(self, info: TransferInfo) -> None:
        with self._lock:
            known, cleared = info.room in self._table.rooms, info.room in self._table.cleared
            if not known and not cleared:
                self._hold_early_locked(info.room, info=info)
        if known:
            self._apply_info(info)
        elif cleared:
            self._rejects.note(
                "replay",
                "prefill pp_rank %d: TRANSFER_INFO for cleared room %d dropped",
                self.pp_rank,
                info.room,
                level=logging.INFO,
            )

    def _on_abort(self, msg: Abort) -> None:
        full = "aborted by the decode server" + (f": {msg.reason}" if msg.reason else "")
        with self._lock:
            if msg.room not in self._table.rooms:
                if msg.room not in self._table.cleared:
                    self._hold_early_locked(msg.room, aborted=full)
                return
        self._fail(msg.room, full, tell_decode=False)

    def _hold_early_locked(
        self, room: int, info: Optional[TransferInfo] = None, aborted: Optional[str] = None
    ) -> None:
        for dropped in self._table.hold_early(room, time.monotonic(), info, aborted):
            self._rejects.note(
                "overflow",
                "prefill pp_rank %d: early-message buffer full, dropped room %d",
                self.pp_rank,
                dropped,
            )

    def _tick(self, now: float) -> None:
        timeout = self.bootstrap_timeout
        with self._lock:
            late, unclaimed = self._table.expire(now, timeout)
        for room in late:
            self._fail(
                room,
                f"no TRANSFER_INFO from the decode server within {timeout:g} s "
                f"(SPARKRELAY_DISAGGREGATION_BOOTSTRAP_TIMEOUT={timeout:g}); raise it if a "
                "higher TTFT is acceptable",
            )
        for info in unclaimed:
            reason = (
                f"prefill pp_rank {self.pp_rank} never admitted room {info.room} within {timeout:g} s "
                f"(SPARKRELAY_DISAGGREGATION_BOOTSTRAP_TIMEOUT)"
            )
            self._enqueue(
                Tell(info.dest, Status.failed(info.room, self.pp_rank, reason), info.room)
            )

    # ---- the carrier's calls ----

    def landing_of(self, room: int, rec: PrefillRoom) -> Optional[tuple[dict, int]]:
        """(the decode's landing map, prompt_len) of a room still live; None once it failed or was
        cleared."""
        with self._lock:
            if self._table.rooms.get(room) is not rec or rec.state == KVPoll.Failed:
                return None
            return rec.landing, rec.prompt_len

    def written(self, room: int, rec: PrefillRoom, dest: Dest) -> None:
        """The carrier wrote the room's last hand-over (from its thread): STATUS success follows."""
        self._enqueue(Written(room, rec, dest))

    # ---- sender thread ---- Outbox tags: ("data", room, rec) a DATA frame, ("done", room, rec) the
    # STATUS success (reported once zmq took it), ("status", room, None) a STATUS failed.

    def _pumped(self, out: Outbox, expired: list) -> None:
        if expired:
            self._expired(expired)
        self._settle(out.take_sent())

    def _run_job(self, out: Outbox, job: Job) -> None:
        if isinstance(job, Push):
            self._push_room(out, job.room, job.rec)
        elif isinstance(job, Notify):
            self._notify(job.room, job.state, job.reason)
        elif isinstance(job, Written):
            if self.landing_of(job.room, job.rec) is not None:
                self.put(
                    out,
                    job.dest,
                    Status.success(job.room, self.pp_rank),
                    ("done", job.room, job.rec),
                )
        else:
            out.discard(job.dest, lambda tag: tag[1] == job.room and tag[0] != "status")
            with self._lock:
                if job.msg is None or job.dest in self._table.dead:
                    return  # its last send timed out; the STATUS could only wait and expire
            self.put(out, job.dest, job.msg, ("status", job.room, None))

    def _push_room(self, out: Outbox, room: int, rec: PrefillRoom) -> None:
        with self._lock:
            if self._table.rooms.get(room) is not rec or rec.state == KVPoll.Failed:
                return
            dest, dead = rec.dest, rec.dest in self._table.dead
            parts, last = rec.take_parts()
            rec.start_push()
        if dead:
            self._fail(
                room,
                f"decode at {dest[0]}:{dest[1]} is unreachable (an earlier send to it timed out)",
            )
            return
        # the same draw on every stage
        if self.failure_prob and random.Random(room).random() < self.failure_prob:
            self._fail(room, INJECTED_FAILURE)
            return
        self._carrier.deliver(self, out, room, rec, dest, parts, last)

    def put(self, out: Outbox, dest: Dest, msg: protocol.Message, tag: tuple) -> bool:
        """Queue or send one message; a refused one fails its room (False)."""
        try:
            if out.put(dest, msg.encode(), tag, notify=tag[0] == "done"):
                return True
            why = f"{self.max_queued} messages already wait for it"
        except zmq.ZMQError as e:
            why = str(e)
        if tag[0] == "status":
            logger.warning(
                "prefill pp_rank %d: could not send a STATUS to %s:%d: %s", self.pp_rank, *dest, why
            )
        else:
            self._fail(tag[1], f"sending to the decode at {dest[0]}:{dest[1]} failed: {why}")
        return False

    def _settle(self, sent: list[tuple]) -> None:
        """A room whose STATUS success zmq took (after all its DATA) is Success, unless it failed
        meanwhile."""
        for _, room, rec in sent:
            with self._lock:
                if self._table.rooms.get(room) is not rec or not rec.succeed():
                    continue
            self._notify(room, KVPoll.Success, "")

    def _expired(self, expired: list[tuple[Dest, tuple]]) -> None:
        """A decode took nothing for SEND_TIMEOUT_S: it is dead until its next TRANSFER_INFO, its
        rooms fail."""
        with self._lock:
            self._table.mark_dead([dest for dest, _ in expired], time.monotonic())
        for dest, (kind, room, _) in expired:
            if kind == "status":
                logger.warning(
                    "prefill pp_rank %d: STATUS of room %d not delivered to %s:%d (no progress within "
                    "%g s)",
                    self.pp_rank,
                    room,
                    *dest,
                    SEND_TIMEOUT_S,
                )
            else:
                self._fail(
                    room,
                    f"sending to the decode at {dest[0]}:{dest[1]} failed: no progress within "
                    f"{SEND_TIMEOUT_S:g} s",
                )
