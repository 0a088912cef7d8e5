"""DecodeAgent: the decode side of the ZMQ transfer backend, one per decode server.

    engine thread               bootstrap workers (4)                 sender thread (owns every PUSH, never blocks)
    begin(room, host, port) --> the prefill's record (cached, or GET
                                /route info + every stage endpoint,
                                one fetch per prefill at a time),
                                compare schemas, expected_parts  -->  TRANSFER_INFO to every stage (outbox.py:
                                                                      one queue per destination, 5 s each)
    listener thread (PULL): DATA / STATUS, each checked against the room's expected PartSpecs
    monitor thread: waiting timeout (ABORT to the prefill) every 50 ms; GET /health per known prefill every interval
    poll(room) / take(room) after Success / abort(room) --> ABORT with the reason to every stage / clear(room)

Room state: Bootstrapping -> WaitingForInput (TRANSFER_INFO sent) -> Transferring (first DATA) -> Success
(every stage's STATUS success, every expected part present), or Failed (always wins).

Prefill records are dropped whenever a room fails against them (schema or auth mismatch, waiting timeout, STATUS
failed, bad frame, undeliverable TRANSFER_INFO, lost heartbeat), so the next room reads /route again and a fixed
or restarted prefill serves it. A prefill found dead (heartbeat, send timeout) or republished with other stage
endpoints has its old endpoints retired: their sockets closed with linger 0, the messages queued for them dropped.

With auth_token set, the bootstrap requests carry `Authorization: Bearer`, every message carries an HMAC tag
(frames.FrameAuth), and a message without a valid tag is dropped and counted before it is parsed, never failing
a room. A duplicate of a part already received (a replay: a real prefill sends each part once) is dropped too.
Without a token a bad frame for a live room fails that room.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import OrderedDict
from typing import Optional

import zmq

from sparkrelay.transfer import frames
from sparkrelay.transfer.base import (SCHEMA_MISMATCH, ExpectedParts, KVPoll, Part, PartSpec, PollResult,
                                      SchemaCompare, TransferError, check_room)
from sparkrelay.transfer.bootstrap_client import bootstrap_url, check_health
from sparkrelay.transfer.decode_rooms import (LIVE, Addr, Dest, PrefillRecord, RoomRecord, part_problem, plan,
                                              success_problem)
from sparkrelay.transfer.frames import FrameError, start_loop
from sparkrelay.transfer.outbox import MAX_QUEUED, Outbox
from sparkrelay.transfer.prefill_book import PrefillBook

logger = logging.getLogger(__name__)

MAX_ROOMS = 1 << 16
MAX_JOBS = 4 * MAX_ROOMS
CONTROL_SEND_TIMEOUT_S = 5.0  # a stage that takes none of its queued control messages for this long loses them
N_WORKERS = 4


class DecodeAgent(frames.AgentHealth):
    def __init__(self, schema: dict, compare: SchemaCompare, expected_parts: ExpectedParts, bind_host: str,
                 bootstrap_timeout: float, waiting_timeout: float, heartbeat_interval: float,
                 heartbeat_max_failures: int, default_bootstrap_port: int, max_part_bytes: int = 1 << 31,
                 auth_token: Optional[str] = None) -> None:
        self._schema = json.loads(json.dumps(schema))  # the form the peer sees: tuples become lists
        self._compare, self._expected_parts = compare, expected_parts
        self.bind_host, self.host = bind_host, frames.advertise_host(bind_host)
        self.bootstrap_timeout, self.waiting_timeout = bootstrap_timeout, waiting_timeout
        self.heartbeat_interval, self.heartbeat_max_failures = heartbeat_interval, heartbeat_max_failures
        self.default_bootstrap_port, self.max_part_bytes = default_bootstrap_port, max_part_bytes
        self._token, self._auth = auth_token or None, frames.FrameAuth(auth_token)
        self._rejects = frames.RejectLog(logger)
        self.port: Optional[int] = None
        self._lock = threading.Lock()
        self._rooms: dict[int, RoomRecord] = {}
        self._waiting: OrderedDict[int, RoomRecord] = OrderedDict()  # by waiting_since; stale entries skipped
        self._book = PrefillBook(self._token)
        self._work: queue.Queue = queue.Queue(MAX_ROOMS)  # (room, rec) to bootstrap
        # ("send", dest, frames, tag) | ("drop", dests); tag: room (ABORT) or (room, rec) (TRANSFER_INFO)
        self._jobs: queue.Queue = queue.Queue(MAX_JOBS)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._ctx: Optional[zmq.Context] = None
        self._next_heartbeat = 0.0
        self._misses: dict[Addr, int] = {}  # failed heartbeats in a row, per prefill
        self._closed = False

    # ---- lifecycle ----

    def start(self) -> None:
        self._ctx = zmq.Context()
        inbox = frames.Inbox(self._ctx, self.bind_host, max(self.max_part_bytes, frames.MAX_CONTROL_BYTES), "decode",
                             self._rejects)
        self.port = inbox.port
        frames.warn_if_exposed(self.bind_host, self._auth.enabled, "the decode transfer socket")
        out = Outbox(self._ctx, CONTROL_SEND_TIMEOUT_S, self._auth)
        self._threads = [start_loop("decode-listener", self._stop, lambda: self._listen_step(inbox), inbox.close),
                         start_loop("decode-sender", self._stop, lambda: self._send_step(out), out.close),
                         start_loop("decode-monitor", self._stop, self._monitor_step)]
        self._threads += [start_loop(f"decode-bootstrap-{i}", self._stop, self._work_step) for i in range(N_WORKERS)]
        logger.info("decode: transfer agent on %s:%d", self.host, self.port)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        deadline = time.monotonic() + 5.0
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if self._ctx is None:
            return
        if any(t.is_alive() for t in self._threads):
            self._ctx.destroy(linger=0)  # a stuck thread still holds a socket: do not wait on it
        else:
            self._ctx.term()

    # ---- engine-facing API ----

    def begin(self, room: int, bootstrap_host: str, bootstrap_port: Optional[int], prompt_len: int) -> None:
        """Start receiving `room` from the prefill whose bootstrap server is bootstrap_host:bootstrap_port."""
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
        rec = RoomRecord((bootstrap_host.strip("[]"), port), prompt_len, time.monotonic())
        with self._lock:
            if room in self._rooms:
                raise ValueError(f"room {room} is already in use on this decode server")
            if len(self._rooms) >= MAX_ROOMS:
                raise RuntimeError(f"the decode transfer agent tracks {MAX_ROOMS} rooms; clear() finished ones")
            self._rooms[room] = rec
        try:
            self._work.put_nowait((room, rec))
        except queue.Full:
            self._fail(room, rec, "decode bootstrap queue is full")

    def poll(self, room: int) -> PollResult:
        with self._lock:
            rec = self._rooms.get(room)
            if rec is None:
                return PollResult(KVPoll.Failed, f"room {room} is not known to the decode (never begun, or cleared)")
            return PollResult(rec.state, rec.reason, rec.permanent)

    def take(self, room: int) -> dict[int, dict[str, Part]]:
        """pp_rank -> name -> Part, once the room is Success; the agent drops its reference (one take per room)."""
        with self._lock:
            rec = self._rooms.get(room)
            if rec is None:
                raise TransferError(room, "take() on a room the decode does not know")
            if rec.state != KVPoll.Success:
                raise TransferError(room, f"take() needs Success, the room is {rec.state.name}")
            if rec.taken:
                raise TransferError(room, "take() called twice")
            parts, rec.received, rec.taken = rec.received, {}, True
        return parts

    def abort(self, room: int, reason: str) -> None:
        with self._lock:
            rec = self._rooms.get(room)
        if rec is not None:
            self._fail(room, rec, reason, force=True)

    def clear(self, room: int) -> None:
        with self._lock:
            self._rooms.pop(room, None)
            self._waiting.pop(room, None)

    def stats(self) -> dict[str, int]:
        """Rooms held (begun, not cleared) per state name."""
        counts = {s.name: 0 for s in KVPoll}
        with self._lock:
            for rec in self._rooms.values():
                counts[rec.state.name] += 1
        return counts

    # ---- state changes ----

    def _fail(self, room: int, rec: RoomRecord, reason: str, notify: bool = True, skip: Optional[Dest] = None,
              force: bool = False, permanent: bool = False) -> None:
        """Failed (wins over everything but an earlier Failed; over Success only when `force`), and an ABORT
        with the reason to every live stage endpoint of the room (still bootstrapping: of its prefill's cached
        record, if any) unless notify is False."""
        with self._lock:
            if self._rooms.get(room) is not rec or rec.state == KVPoll.Failed:
                return
            if rec.state == KVPoll.Success and not force:
                return
            rec.state, rec.reason, rec.received, rec.permanent = KVPoll.Failed, reason, {}, permanent
            endpoints = dict(rec.endpoints)
        logger.warning("decode: room %d failed: %s", room, reason)
        if notify and not endpoints:
            known = self._book.cached(rec.addr)
            endpoints = {} if known is None else known.endpoints
        if notify and endpoints:
            rec.told = True
            self._send_abort(room, [d for d in endpoints.values() if d != skip], reason)

    def _send_abort(self, room: int, dests: list[Dest], reason: str) -> None:
        """ABORT(room, reason) to each of dests not retired, so the prefill's log and answer say why."""
        msg = frames.abort(room, reason)
        for dest in self._book.live(dests):
            self._enqueue(("send", dest, msg, room))

    def _enqueue(self, job: tuple) -> bool:
        try:
            self._jobs.put_nowait(job)
            return True
        except queue.Full:
            logger.error("decode: send queue full, dropped a %s job", job[0])
            return False

    def _current(self, room: int, rec: RoomRecord) -> bool:
        with self._lock:
            return self._rooms.get(room) is rec

    # ---- bootstrap workers ----

    def _work_step(self) -> None:
        try:
            room, rec = self._work.get(timeout=0.1)
        except queue.Empty:
            return
        try:
            self._bootstrap(room, rec)
        except Exception as e:  # keep the worker; the room fails with the cause
            logger.exception("decode: bootstrap of room %d raised", room)
            self._fail(room, rec, f"bootstrap failed: {type(e).__name__}: {e}")

    def _bootstrap(self, room: int, rec: RoomRecord) -> None:
        if not self._current(room, rec) or rec.state != KVPoll.Bootstrapping:
            return  # aborted before its turn (_fail told the stages of a cached prefill)
        known = self._record(room, rec)
        if known is None:
            return  # parked behind another room's fetch of the same prefill, or failed
        refusal, expected = self._refusal(known.info, rec)
        with self._lock:
            rec.endpoints = dict(known.endpoints)
            current, failed = self._rooms.get(room) is rec, rec.state == KVPoll.Failed
            if current and not failed and not refusal:
                rec.expected, rec.received = expected, {pp: {} for pp in expected}
                rec.state, rec.waiting_since = KVPoll.WaitingForInput, time.monotonic()
                self._waiting[room] = rec
        if failed and not rec.told:  # aborted while bootstrapping: the stages learn why now that they are known
            self._send_abort(room, list(rec.endpoints.values()), rec.reason)
        elif refusal and current:  # a mismatch: read /route again next time (the prefill may be fixed)
            self._forget_prefill(rec.addr, dead=False)
            self._fail(room, rec, refusal, permanent=True)  # with an ABORT naming both values to every stage
        elif current:
            msg = frames.transfer_info(room, self.host, self.port, rec.prompt_len, self._schema)
            for pp in sorted(rec.endpoints, reverse=True):
                if not self._enqueue(("send", rec.endpoints[pp], msg, (room, rec))):
                    self._fail(room, rec, "decode send queue is full")

    def _refusal(self, info: dict, rec: RoomRecord) -> tuple[str, dict[int, dict[str, PartSpec]]]:
        """(why this decode refuses the prefill's rooms, or "", pp_rank -> name -> PartSpec)."""
        if self._auth.enabled and info.get("auth_required") is not True:
            host, port = rec.addr
            return (f"the prefill's bootstrap server at {host}:{port} runs without --disaggregation-auth-token, "
                    "this decode with one (it would drop every message of this decode): set the same "
                    "--disaggregation-auth-token on both servers"), {}
        return plan(self._compare, self._expected_parts, info, self._schema, rec.prompt_len, self.max_part_bytes)

    # ---- prefill records ----

    def _record(self, room: int, rec: RoomRecord) -> Optional[PrefillRecord]:
        """The cached record of the room's prefill, else fetched by this worker; None when another worker is
        fetching it (the room is parked and queued again once that fetch ends) or when the fetch failed."""
        known, mine = self._book.claim(rec.addr, (room, rec))
        if not mine:
            return known
        try:
            return self._fetch(room, rec)
        finally:
            for item in self._book.release(rec.addr):
                try:
                    self._work.put_nowait(item)
                except queue.Full:
                    self._fail(*item, "decode bootstrap queue is full")

    def _fetch(self, room: int, rec: RoomRecord) -> Optional[PrefillRecord]:
        """GET /route until the room's bootstrap deadline, or until neither this room nor a room parked behind
        it is live any more; endpoints the fresh record no longer lists are retired."""
        (host, port), deadline = rec.addr, rec.begun + self.bootstrap_timeout

        def wanted() -> bool:
            waiting = [(room, rec), *self._book.parked(rec.addr)]
            with self._lock:
                return any(self._rooms.get(r) is w and w.state in LIVE for r, w in waiting)

        try:
            known, gone = self._book.fetch(rec.addr, deadline, wanted)
        except Exception as e:
            hint = f" (SPARKRELAY_DISAGGREGATION_BOOTSTRAP_TIMEOUT={self.bootstrap_timeout:g})" \
                if isinstance(e, TimeoutError) else ""
            self._fail(room, rec, f"bootstrap with the prefill at {host}:{port} failed: {e}{hint}")
            return None
        if gone:
            logger.info("decode: the prefill at %s:%d now lists stage endpoints %s; retiring %s", host, port,
                        sorted(known.endpoints.values()), gone)
            self._enqueue(("drop", gone))
        return known

    def _forget_prefill(self, addr: Addr, dead: bool, listing: Optional[Dest] = None) -> None:
        """A room failed against this prefill: the next room reads /route again (PrefillBook.forget)."""
        gone = self._book.forget(addr, dead, listing)
        if gone:
            self._enqueue(("drop", gone))

    # ---- sender thread ----

    def _send_step(self, out: Outbox) -> None:
        """Hand new jobs to the outbox, then let queued messages go out: nothing here waits on one peer."""
        for dest, tag in out.pump(2):
            self._undelivered(dest, tag, f"no progress within {CONTROL_SEND_TIMEOUT_S:g} s (never connected, or "
                                               "it stopped reading)", dead=True)
        try:
            job = self._jobs.get(timeout=0.0 if out.queues else 0.05)
        except queue.Empty:
            return
        for _ in range(256):
            self._run_job(out, job)
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return

    def _run_job(self, out: Outbox, job: tuple) -> None:
        if job[0] == "drop":
            for dest in job[1]:
                for tag in out.drop(dest):
                    self._undelivered(dest, tag, "its prefill restarted or stopped answering")
            return
        _, dest, msg, tag = job
        if self._book.is_dead(dest):
            self._undelivered(dest, tag, "its prefill restarted or stopped answering")
        elif not out.put(dest, msg, tag):
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

    def _listen_step(self, inbox: frames.Inbox) -> None:
        for msg in inbox.poll(50):
            self._handle(msg)

    def _handle(self, msg: list[bytes]) -> None:
        try:
            msg = self._auth.open(msg)
            head = frames.unpack(msg[0])
            room = head.get("room") if check_room(head.get("room")) is None else None
            hint = "" if self._auth.enabled else f" ({frames.TOKEN_HINT})"
            if head["type"] == "DATA":
                if len(msg) != 2:
                    raise FrameError(f"DATA needs 2 frames, got {len(msg)}{hint if len(msg) == 3 else ''}", room)
                self._on_data(head, msg[1])
            elif head["type"] == "STATUS":
                if len(msg) != 1:
                    raise FrameError(f"STATUS needs 1 frame, got {len(msg)}{hint if len(msg) == 2 else ''}", room)
                self._on_status(*frames.parse_status(head))
            else:
                raise FrameError(f"unknown message type {head['type'][:64]!r}", room)
        except FrameError as e:
            self._bad_frame(e)
        except Exception:
            logger.exception("decode: error while handling a message (the listener keeps running)")

    def _bad_frame(self, e: FrameError) -> None:
        with self._lock:
            rec = None if e.room is None else self._rooms.get(e.room)
        kind = "auth" if isinstance(e, frames.AuthError) else "protocol"
        if rec is None:
            self._rejects.note(kind, "decode: dropped a bad frame%s: %s",
                               "" if e.room is None else f" for unknown room {e.room}", e.reason)
            return
        self._rejects.note(kind, "decode: bad frame for room %d: %s", e.room, e.reason)
        self._forget_prefill(rec.addr, dead=False)
        self._fail(e.room, rec, f"bad frame from the prefill: {e.reason}")

    def _on_data(self, head: dict, payload: bytes) -> None:
        room, pp, spec = frames.parse_data_header(head)
        with self._lock:
            rec = self._rooms.get(room)
            if rec is None:
                raise FrameError(f"DATA for unknown room {room}")  # room=None: logged, nothing to fail
            if rec.state in (KVPoll.Failed, KVPoll.Success):
                logger.info("decode: DATA %r for room %d, already %s, dropped", spec.name, room, rec.state.name)
                return
            replay = self._auth.enabled and (pp in rec.done or spec.name in rec.received.get(pp, ()))
            problem = None if replay else part_problem(rec, pp, spec, len(payload))
            if problem is None and not replay:
                rec.received[pp][spec.name] = Part(spec, payload)
                rec.state = max(rec.state, KVPoll.Transferring)
                return
        if replay:  # authentic but already seen: someone replays captured traffic; the room goes on
            self._rejects.note("replay", "decode: room %d: a second copy of part %r from pp_rank %d dropped "
                               "(a replay)", room, spec.name, pp)
            return
        raise FrameError(problem, room)

    def _on_status(self, room: int, pp: int, status: int, reason: str) -> None:
        with self._lock:
            rec = self._rooms.get(room)
            if rec is None:
                logger.info("decode: STATUS from pp_rank %d for unknown room %d dropped", pp, room)
                return
            if rec.state in (KVPoll.Failed, KVPoll.Success):
                return
            if status == KVPoll.Success:
                problem = success_problem(rec, pp)
                if problem is None:
                    rec.done.add(pp)
                    if len(rec.done) == len(rec.expected):
                        rec.state = KVPoll.Success
                    return
        if status in (KVPoll.Failed, KVPoll.Success):  # the prefill failed the room: read /route again next time
            self._forget_prefill(rec.addr, dead=False)
        if status == KVPoll.Failed:
            self._fail(room, rec, f"prefill pp_rank {pp} failed: {reason}", permanent=SCHEMA_MISMATCH in reason)
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
        late = []
        with self._lock:
            while self._waiting:
                room, rec = next(iter(self._waiting.items()))
                if self._rooms.get(room) is rec and rec.state in LIVE:
                    if now - rec.waiting_since <= self.waiting_timeout:
                        break
                    late.append((room, rec, sorted(set(rec.expected) - rec.done)))
                del self._waiting[room]
        t = self.waiting_timeout
        for room, rec, stages in late:
            self._forget_prefill(rec.addr, dead=False)
            self._fail(room, rec, f"the prefill did not finish within {t:g} s "
                                  f"(SPARKRELAY_DISAGGREGATION_WAITING_TIMEOUT={t:g}); waiting for pp_rank(s) {stages}")

    def _heartbeat(self) -> None:
        """GET /health of every cached prefill and of every prefill a room waits on; max_failures misses in a
        row fail its rooms and retire its record (a restarted prefill is read afresh)."""
        known = self._book.addrs()
        with self._lock:
            addrs = set(known) | {r.addr for r in self._rooms.values()
                                  if r.state in (KVPoll.WaitingForInput, KVPoll.Transferring)}
            self._misses = {a: n for a, n in self._misses.items() if a in addrs}
        for addr in addrs:
            ok = check_health(bootstrap_url(*addr), timeout=min(1.0, self.heartbeat_interval))
            with self._lock:
                self._misses[addr] = 0 if ok else self._misses.get(addr, 0) + 1
                if self._misses[addr] < self.heartbeat_max_failures:
                    continue
                del self._misses[addr]
                victims = [(room, r) for room, r in self._rooms.items() if r.addr == addr and r.state in LIVE
                           and r.state != KVPoll.Bootstrapping]  # bootstrapping rooms: the fetch's deadline
            self._forget_prefill(addr, dead=True)
            for room, rec in victims:
                self._fail(room, rec, f"lost connection with prefill at {addr[0]}:{addr[1]} "
                                      f"({self.heartbeat_max_failures} failed /health checks in a row)", notify=False)
