"""DecodeAgent: the decode side of the ZMQ transfer backend, one per decode server.

    engine thread               bootstrap workers (4)                 sender thread (owns every PUSH)
    begin(room, host, port) --> GET /route info (503: retry), compare
                                schemas, expected_parts, stage
                                endpoints (highest pp first)    -->   TRANSFER_INFO to every stage
    listener thread (PULL): DATA / STATUS, each checked against the room's expected PartSpecs
    monitor thread: waiting timeout (ABORT to the prefill) every 50 ms; GET /health per prefill every interval
    poll(room) / take(room) after Success / abort(room) --> ABORT to every stage / clear(room)

Room state: Bootstrapping -> WaitingForInput (TRANSFER_INFO sent) -> Transferring (first DATA) -> Success
(every stage's STATUS success, every expected part present), or Failed (always wins).

With auth_token set, the bootstrap requests carry `Authorization: Bearer`, every message carries an HMAC tag
(frames.FrameAuth), and a message without a valid tag is dropped and counted before it is parsed, never failing
a room. A duplicate of a part already received (a replay: a real prefill sends each part once) is dropped too.
Without a token a bad frame for a live room fails that room (PD_PROTOCOL.md §5 item 27).
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
from sparkrelay.transfer.base import (ExpectedParts, KVPoll, Part, PartSpec, PollResult, SchemaCompare,
                                      TransferError, check_room)
from sparkrelay.transfer.bootstrap_client import bootstrap_url, check_health, fetch_prefill_info, fetch_rank
from sparkrelay.transfer.decode_rooms import LIVE, Addr, Dest, PrefillRecord, RoomRecord, part_problem, success_problem
from sparkrelay.transfer.frames import FrameError, start_loop

logger = logging.getLogger(__name__)

MAX_ROOMS = 1 << 16
MAX_JOBS = 4 * MAX_ROOMS
MAX_PREFILLS = 1024  # cached bootstrap addresses
CONTROL_SEND_TIMEOUT_S = 5.0
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
        self._prefills: OrderedDict[Addr, PrefillRecord] = OrderedDict()
        self._work: queue.Queue = queue.Queue(MAX_ROOMS)  # (room, rec) to bootstrap
        self._jobs: queue.Queue = queue.Queue(MAX_JOBS)  # ("send", dest, frames, room|None, rec|None) | ("drop", dests)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._ctx: Optional[zmq.Context] = None
        self._next_heartbeat = 0.0
        self._closed = False

    # ---- lifecycle ----

    def start(self) -> None:
        self._ctx = zmq.Context()
        inbox = frames.Inbox(self._ctx, self.bind_host, max(self.max_part_bytes, frames.MAX_CONTROL_BYTES), "decode",
                             self._rejects)
        self.port = inbox.port
        frames.warn_if_exposed(self.bind_host, self._auth.enabled, "the decode transfer socket")
        pool = frames.PushPool(self._ctx, CONTROL_SEND_TIMEOUT_S, self._auth)
        self._threads = [start_loop("decode-listener", self._stop, lambda: self._listen_step(inbox), inbox.close),
                         start_loop("decode-sender", self._stop, lambda: self._send_step(pool), pool.close),
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
            return PollResult(rec.state, rec.reason)

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
              force: bool = False) -> None:
        """Failed (wins over everything but an earlier Failed; over Success only when `force`), and an ABORT
        with the reason to every stage endpoint the room knows unless notify is False."""
        with self._lock:
            if self._rooms.get(room) is not rec or rec.state == KVPoll.Failed:
                return
            if rec.state == KVPoll.Success and not force:
                return
            rec.state, rec.reason, rec.received = KVPoll.Failed, reason, {}
            dests = [d for d in rec.endpoints.values() if d != skip] if notify else []
        logger.warning("decode: room %d failed: %s", room, reason)
        msg = frames.abort(room, reason)
        for dest in dict.fromkeys(dests):
            self._enqueue(("send", dest, msg, None, None))

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
            return
        host, port = rec.addr
        url, deadline = bootstrap_url(host, port), rec.begun + self.bootstrap_timeout
        try:
            info = self._prefill_info(rec.addr, url, deadline)
        except Exception as e:
            hint = f" (SPARKRELAY_DISAGGREGATION_BOOTSTRAP_TIMEOUT={self.bootstrap_timeout:g})" \
                if isinstance(e, TimeoutError) else ""
            self._fail(room, rec, f"bootstrap with the prefill at {host}:{port} failed: {e}{hint}")
            return
        if self._auth.enabled and info.get("auth_required") is not True:
            self._fail(room, rec, f"the prefill's bootstrap server at {host}:{port} runs without "
                                  "--disaggregation-auth-token, this decode with one (it would drop every message "
                                  "of this decode): set the same --disaggregation-auth-token on both servers")
            return
        refusal, expected = self._plan(info, rec.prompt_len)
        if refusal:
            self._fail(room, rec, refusal)  # no endpoints yet: the ABORT goes out once they are known
        try:
            endpoints = {pp: self._endpoint(rec.addr, url, pp, deadline) for pp in reversed(range(info["pp_size"]))}
        except Exception as e:
            self._fail(room, rec, f"could not resolve the stages of the prefill at {host}:{port}: {e}")
            return
        with self._lock:
            if self._rooms.get(room) is not rec:
                return
            rec.endpoints = endpoints
            failed = rec.state == KVPoll.Failed
            if not failed:
                rec.expected, rec.received = expected, {pp: {} for pp in expected}
                rec.state, rec.waiting_since = KVPoll.WaitingForInput, time.monotonic()
                self._waiting[room] = rec
        if failed:  # schema mismatch or an abort while bootstrapping: tell every stage why
            for dest in dict.fromkeys(endpoints.values()):
                self._enqueue(("send", dest, frames.abort(room, rec.reason), None, None))
            return
        msg = frames.transfer_info(room, self.host, self.port, rec.prompt_len, self._schema)
        for pp in sorted(endpoints, reverse=True):
            if not self._enqueue(("send", endpoints[pp], msg, room, rec)):
                self._fail(room, rec, "decode send queue is full")

    def _plan(self, info: dict, prompt_len: int) -> tuple[str, dict[int, dict[str, PartSpec]]]:
        """(refusal reason or "", pp_rank -> name -> PartSpec) for one room of this prefill."""
        mismatches = frames.schema_mismatches(self._compare, info["schema"], self._schema)
        if mismatches:
            return "schema mismatch: " + "; ".join(mismatches), {}
        try:
            wanted = self._expected_parts(info["schema"], prompt_len)
        except ValueError as e:
            return str(e), {}
        except Exception as e:
            return f"expected_parts raised {type(e).__name__}: {e}", {}
        expected: dict[int, dict[str, PartSpec]] = {pp: {} for pp in range(info["pp_size"])}
        for pp, specs in wanted.items():
            if pp not in expected:
                return f"expected_parts names pp_rank {pp}, the prefill has pp_size {info['pp_size']}", {}
            for spec in specs:
                if spec.name in expected[pp]:
                    return f"expected_parts lists part {spec.name!r} of pp_rank {pp} twice", {}
                if spec.nbytes > self.max_part_bytes:
                    return (f"part {spec.name!r} of pp_rank {pp} is {spec.nbytes} bytes, over max_part_bytes "
                            f"{self.max_part_bytes}"), {}
                expected[pp][spec.name] = spec
        return "", expected

    def _prefill_info(self, addr: Addr, url: str, deadline: float) -> dict:
        with self._lock:
            known = self._prefills.get(addr)
            if known is not None:
                self._prefills.move_to_end(addr)
                return known.info
        info = fetch_prefill_info(url, deadline, token=self._token)
        with self._lock:
            self._prefills.setdefault(addr, PrefillRecord(info))
            while len(self._prefills) > MAX_PREFILLS:
                self._prefills.popitem(last=False)
        return info

    def _endpoint(self, addr: Addr, url: str, pp_rank: int, deadline: float) -> Dest:
        with self._lock:
            known = self._prefills.get(addr)
            if known is not None and pp_rank in known.endpoints:
                return known.endpoints[pp_rank]
        dest = fetch_rank(url, pp_rank, deadline, token=self._token)
        with self._lock:
            if addr in self._prefills:
                self._prefills[addr].endpoints[pp_rank] = dest
        return dest

    def _forget_prefill(self, addr: Addr) -> list[Dest]:
        with self._lock:
            known = self._prefills.pop(addr, None)
        dests = [] if known is None else list(known.endpoints.values())
        if dests:
            self._enqueue(("drop", dests))
        return dests

    # ---- sender thread ----

    def _send_step(self, pool: frames.PushPool) -> None:
        try:
            job = self._jobs.get(timeout=0.05)
        except queue.Empty:
            return
        if job[0] == "drop":
            for dest in job[1]:
                pool.drop(dest)
            return
        _, dest, msg, room, rec = job
        try:
            pool.send(dest, msg)
        except zmq.ZMQError as e:
            why = f"no progress within {CONTROL_SEND_TIMEOUT_S:g} s" if isinstance(e, zmq.Again) else str(e)
            if room is None:
                logger.warning("decode: could not send an ABORT to %s: %s", dest, why)
                return
            self._forget_prefill(rec.addr)  # its cached endpoints may be stale (a restarted prefill)
            self._fail(room, rec, f"could not send TRANSFER_INFO to the prefill stage at {dest[0]}:{dest[1]}: "
                                  f"{why}", skip=dest)

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
        if status == KVPoll.Failed:
            self._fail(room, rec, f"prefill pp_rank {pp} failed: {reason}")
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
            self._fail(room, rec, f"the prefill did not finish within {t:g} s "
                                  f"(SPARKRELAY_DISAGGREGATION_WAITING_TIMEOUT={t:g}); waiting for pp_rank(s) {stages}")

    def _heartbeat(self) -> None:
        with self._lock:
            addrs = {r.addr for r in self._rooms.values() if r.state in LIVE and r.addr in self._prefills}
        for addr in addrs:
            ok = check_health(bootstrap_url(*addr), timeout=min(1.0, self.heartbeat_interval))
            with self._lock:
                known = self._prefills.get(addr)
                if known is None:
                    continue
                known.misses = 0 if ok else known.misses + 1
                if known.misses < self.heartbeat_max_failures:
                    continue
                victims = [(room, r) for room, r in self._rooms.items() if r.addr == addr and r.state in LIVE]
            self._forget_prefill(addr)
            for room, rec in victims:
                self._fail(room, rec, f"lost connection with prefill at {addr[0]}:{addr[1]} "
                                      f"({self.heartbeat_max_failures} failed /health checks in a row)", notify=False)
