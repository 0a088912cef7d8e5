"""DecodeAgent: the decode side of the ZMQ transfer backend, one per decode server.

    engine thread               bootstrap workers (4)                 sender thread (owns every PUSH, never blocks)
    begin(room, host, port) --> the prefill's record (cached, or GET
                                /route info + every stage endpoint,
                                one fetch per prefill at a time),
                                compare schemas, expected_parts  -->  TRANSFER_INFO to every stage (wire.Outbox:
                                                                      one queue per destination, 5 s each)
    listener thread (PULL): DATA / STATUS, each checked against the room's expected PartSpecs
    monitor thread: waiting timeout (ABORT to the prefill) every 50 ms; GET /health per known prefill every interval
    poll(room) / take(room) after Success / abort(room) --> ABORT with the reason to every stage / clear(room)

The room state machine is in transfer/decode_room.py; the bootstrap workers and the heartbeat in
transfer/decode_bootstrap.py. With auth_token set, the bootstrap requests carry `Authorization: Bearer`, every
message carries an HMAC tag (wire.FrameAuth), and a message without a valid tag is dropped and counted before it is
parsed, never failing a room. A duplicate of a part already received (a replay: a real prefill sends each part
once) is dropped too. Without a token a bad frame for a live room fails that room.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Optional

from sparkrelay.transfer import protocol
from sparkrelay.transfer.agent import start_loop
from sparkrelay.transfer.base import (SCHEMA_MISMATCH, Dest, DecodeTransfer, ExpectedParts, KVPoll, Part,
                                      SchemaCompare, TransferError, check_room)
from sparkrelay.transfer.bootstrap.prefill_book import PrefillBook
from sparkrelay.transfer.decode_bootstrap import DecodeBootstrap
from sparkrelay.transfer.decode_room import MAX_ROOMS, DecodeRoom, DecodeRooms
from sparkrelay.transfer.landing import Landing
from sparkrelay.transfer.protocol import Data, FrameError, Status
from sparkrelay.transfer.wire import MAX_QUEUED, Outbox, advertise_host

logger = logging.getLogger(__name__)

CONTROL_SEND_TIMEOUT_S = 5.0  # a stage that takes none of its queued control messages for this long loses them
N_WORKERS = 4


class DecodeAgent(DecodeBootstrap, DecodeTransfer):
    who = thread_name = "decode"

    def __init__(self, schema: dict, compare: SchemaCompare, expected_parts: ExpectedParts, bind_host: str,
                 bootstrap_timeout: float, waiting_timeout: float, heartbeat_interval: float,
                 heartbeat_max_failures: int, default_bootstrap_port: int, max_part_bytes: int = 1 << 31,
                 auth_token: Optional[str] = None) -> None:
        super().__init__(schema, bind_host, auth_token, logger)
        self._compare, self._expected_parts = compare, expected_parts
        self.host = advertise_host(bind_host)
        self.bootstrap_timeout, self.waiting_timeout = bootstrap_timeout, waiting_timeout
        self.heartbeat_interval, self.heartbeat_max_failures = heartbeat_interval, heartbeat_max_failures
        self.default_bootstrap_port, self.max_part_bytes = default_bootstrap_port, max_part_bytes
        self._table = DecodeRooms()
        self._book = PrefillBook(self._token)
        self._work: queue.Queue = queue.Queue(MAX_ROOMS)  # (room, rec) to bootstrap
        self._next_heartbeat = 0.0
        self._misses: dict[tuple[str, int], int] = {}  # failed heartbeats in a row, per prefill
        self._listener: Callable[[], None] = lambda: None

    # ---- lifecycle ----

    def _max_msg_size(self) -> int:
        return max(self.max_part_bytes, protocol.MAX_CONTROL_BYTES)

    def _send_timeout_s(self) -> float:
        return CONTROL_SEND_TIMEOUT_S

    def _socket_name(self) -> str:
        return "the decode transfer socket"

    def _more_threads(self) -> list[threading.Thread]:
        return [start_loop("decode-monitor", self._stop, self._monitor_step),
                *[start_loop(f"decode-bootstrap-{i}", self._stop, self._work_step) for i in range(N_WORKERS)]]

    def _unknown(self, room: int) -> str:
        return f"room {room} is not known to the decode (never begun, or cleared)"

    # ---- engine-facing API ----

    def begin(self, room: int, bootstrap_host: str, bootstrap_port: Optional[int], prompt_len: int,
              landing: Optional[Landing] = None, prefix: int = 0) -> None:
        why = check_room(room)
        if why:
            raise ValueError(why)
        port = self.default_bootstrap_port if bootstrap_port is None else bootstrap_port
        if not isinstance(bootstrap_host, str) or not bootstrap_host.strip("[]"):
            raise ValueError(f"bootstrap_host must be a non-empty string, got {bootstrap_host!r}")
        if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
            raise ValueError(f"bootstrap_port must be an int in 1..65535 or None, got {bootstrap_port!r}")
        if not isinstance(prompt_len, int) or prompt_len < 0:
            raise ValueError(f"prompt_len must be a non-negative int, got {prompt_len!r}")
        if not isinstance(prefix, int) or not (prefix == 0 or 0 < prefix < prompt_len):
            raise ValueError(f"prefix must be 0 or an int below prompt_len {prompt_len}, got {prefix!r}")
        rec = DecodeRoom((bootstrap_host.strip("[]"), port), prompt_len, time.monotonic(), prefix=prefix)
        try:
            rec.landing = self._landing(landing)
        except ValueError as e:  # the room fails (poll says why); the engine goes on
            rec.fail(str(e), permanent=True)
        with self._lock:
            self._table.add(room, rec)
        if rec.state == KVPoll.Failed:
            return
        try:
            self._work.put_nowait((room, rec))
        except queue.Full:
            self._fail(room, rec, "decode bootstrap queue is full")

    def _landing(self, landing: Optional[Landing]) -> Optional[dict]:
        """What TRANSFER_INFO carries as the room's landing: nothing here, the parts come as DATA frames."""
        return None

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
            self._fail(room, rec, reason, force=True)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return self._table.stats()

    # ---- sender thread ----
    # Jobs: ("send", dest, message, tag) | ("drop", dests); tag: room (ABORT) or (room, rec) (TRANSFER_INFO).

    def _pumped(self, out: Outbox, expired: list) -> None:
        for dest, tag in expired:
            self._undelivered(dest, tag, f"no progress within {CONTROL_SEND_TIMEOUT_S:g} s (never connected, or "
                                         "it stopped reading)", dead=True)

    def _run_job(self, out: Outbox, job: tuple) -> None:
        if job[0] == "drop":
            for dest in job[1]:
                for tag in out.drop(dest):
                    self._undelivered(dest, tag, "its prefill restarted or stopped answering")
            return
        _, dest, msg, tag = job
        if self._book.is_dead(dest):
            self._undelivered(dest, tag, "its prefill restarted or stopped answering")
        elif not out.put(dest, msg.encode(), tag):
            self._undelivered(dest, tag, f"{MAX_QUEUED} messages already wait for it")

    def _undelivered(self, dest: Dest, tag, why: str, dead: bool = False) -> None:
        """A message given up. An ABORT (tag: its room) is only logged; a TRANSFER_INFO fails its room and, when
        the stage never connected (dead), retires its prefill's record."""
        if not isinstance(tag, tuple):
            logger.warning("decode: ABORT of room %s not delivered to %s:%d: %s", tag, *dest, why)
            return
        room, rec = tag
        if dead:
            self._forget_prefill(rec.addr, dead=True, listing=dest)
        self._fail(room, rec, f"could not send TRANSFER_INFO to the prefill stage at {dest[0]}:{dest[1]}: {why}",
                   skip=dest)

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
            self._rejects.note(kind, "decode: dropped a bad frame%s: %s",
                               "" if e.room is None else f" for unknown room {e.room}", e.reason)
            return
        self._rejects.note(kind, "decode: bad frame for room %d: %s", e.room, e.reason)
        self._forget_prefill(rec.addr, dead=False)
        self._fail(e.room, rec, f"bad frame from the prefill: {e.reason}")

    def _on_data(self, msg: Data) -> None:
        room, pp, spec = msg.room, msg.pp_rank, msg.spec
        with self._lock:
            rec = self._table.rooms.get(room)
            if rec is None:
                raise FrameError(f"DATA for unknown room {room}")  # room=None: logged, nothing to fail
            if rec.finished:
                logger.info("decode: DATA %r for room %d, already %s, dropped", spec.name, room, rec.state.name)
                return
            replay = self._auth.enabled and rec.is_replay(pp, spec)
            problem = None if replay else rec.accept(pp, spec, msg.payload)
        if replay:  # authentic but already seen: someone replays captured traffic; the room goes on
            self._rejects.note("replay", "decode: room %d: a second copy of part %r from pp_rank %d dropped "
                               "(a replay)", room, spec.name, pp)
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
            problem = rec.stage_done(pp) if status == KVPoll.Success else None
            if status == KVPoll.Success and problem is None:
                success = rec.state == KVPoll.Success
        if status == KVPoll.Success and problem is None:
            if success:
                self._news()
            return
        if status in (KVPoll.Failed, KVPoll.Success):  # the prefill failed the room: read /route again next time
            self._forget_prefill(rec.addr, dead=False)
        if status == KVPoll.Failed:
            self._fail(room, rec, f"prefill pp_rank {pp} failed: {msg.reason}",
                       permanent=SCHEMA_MISMATCH in msg.reason)
        elif status == KVPoll.Success:
            self._fail(room, rec, problem)
        else:
            raise FrameError(f"STATUS {status} from pp_rank {pp} is neither Success nor Failed", room)

    # ---- monitor thread ----

    def _monitor_step(self) -> None:
        now = time.monotonic()
        self._expire_waiting(now)
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.heartbeat_interval
            self._heartbeat()
        self._stop.wait(0.05)

    def _expire_waiting(self, now: float) -> None:
        with self._lock:
            late = self._table.expire(now, self.waiting_timeout)
        t = self.waiting_timeout
        for room, rec, stages in late:
            self._forget_prefill(rec.addr, dead=False)
            self._fail(room, rec, f"the prefill did not finish within {t:g} s "
                                  f"(SPARKRELAY_DISAGGREGATION_WAITING_TIMEOUT={t:g}); waiting for pp_rank(s) {stages}")
