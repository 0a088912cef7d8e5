"""PrefillAgent: the prefill side of the ZMQ transfer backend, one per prefill pipeline stage.

    engine thread             listener thread (PULL)                    sender thread (owns the outbox.Outbox)
    add_room(room, len)  -->  TRANSFER_INFO(room) validated, stored -->  DATA x N, then STATUS success
    send(room, parts)    -->  (either order; the sender starts once both are there)
    abort(room, reason)  -->  STATUS failed ---------------------------> decode
                              ABORT from decode -> Failed
                              bootstrap timeout (checked every 50 ms) -> Failed, STATUS failed to the decode

Room state: Bootstrapping -> WaitingForInput (TRANSFER_INFO ok) -> Transferring (pushing) -> Success, or Failed.
Sends never block: each decode has its own queue in the outbox, so a slow or dead decode only delays its own
rooms. A room is Success once zmq took its STATUS success (after all its DATA); a decode that takes nothing for
SEND_TIMEOUT_S fails every room queued for it and is marked dead until it sends a TRANSFER_INFO again. An
aborted room's frames still queued are dropped unsent.
on_status(room, Success|Failed, reason) is called once per room, from an agent thread, or from abort() in the
caller's thread; never from inside add_room() or send(), and never with the agent's lock held.

With auth_token set, every message in and out carries an HMAC tag (frames.FrameAuth); an untagged or forged
message is dropped and counted (rejected()) before it is parsed. failure_prob > 0 (SPARKRELAY_TEST_DISAGG_FAILURE_PROB)
fails that fraction of rooms just before their data is sent, through the ordinary failure path. The draw is a
function of the room id, so every stage of a room makes the same one: a room fails with probability failure_prob
whatever the PP size, and a retry under a new room id draws again.
"""

from __future__ import annotations

import json
import logging
import queue
import random
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import zmq

from sparkrelay.transfer import frames
from sparkrelay.transfer.base import (SCHEMA_MISMATCH, KVPoll, Part, PollResult, SchemaCompare, StatusCallback,
                                      check_room)
from sparkrelay.transfer.bootstrap_client import register_rank
from sparkrelay.transfer.frames import FrameError, start_loop
from sparkrelay.transfer.outbox import Outbox

logger = logging.getLogger(__name__)

SEND_TIMEOUT_S = 30.0  # a decode that takes no data for this long is marked dead
MAX_QUEUED = 1 << 16  # messages waiting per decode; they reference the rooms' parts, which exist anyway
MAX_ROOMS = 1 << 16
MAX_EARLY = 4096  # TRANSFER_INFO / ABORT that arrived before add_room
MAX_JOBS = 4 * MAX_ROOMS
INJECTED_FAILURE = "injected failure (SPARKRELAY_TEST_DISAGG_FAILURE_PROB)"
Dest = tuple[str, int]


@dataclass
class _Room:
    prompt_len: int
    added: float
    state: KVPoll = KVPoll.Bootstrapping
    reason: str = ""
    dest: Optional[Dest] = None  # the decode's PULL endpoint, from its TRANSFER_INFO
    parts: Optional[list[Part]] = None
    queued: bool = False


class PrefillAgent(frames.AgentHealth):
    def __init__(self, pp_rank: int, pp_size: int, schema: dict, compare: SchemaCompare, bootstrap_url: str,
                 bind_host: str, bootstrap_timeout: float, on_status: StatusCallback,
                 prefill_http_port: Optional[int] = None, auth_token: Optional[str] = None,
                 failure_prob: float = 0.0) -> None:
        if not 0 <= pp_rank < pp_size:
            raise ValueError(f"pp_rank {pp_rank} is outside 0..{pp_size - 1}")
        if not 0.0 <= failure_prob <= 1.0:
            raise ValueError(f"failure_prob must be in [0, 1], got {failure_prob}")
        missing = [k for k in ("page_size", "dtype") if k not in schema]
        if missing:
            raise ValueError(f"the transfer schema needs {missing} (registered with the bootstrap server)")
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self._schema = json.loads(json.dumps(schema))  # the form the peer sees: tuples become lists
        self._compare, self._on_status = compare, on_status
        self.bootstrap_url, self.bind_host, self.prefill_http_port = bootstrap_url, bind_host, prefill_http_port
        self.bootstrap_timeout = bootstrap_timeout
        self._token, self._auth = auth_token or None, frames.FrameAuth(auth_token)
        self.failure_prob = failure_prob
        self._rejects = frames.RejectLog(logger)
        self.port: Optional[int] = None
        self._lock = threading.Lock()
        self._rooms: dict[int, _Room] = {}
        self._pending: OrderedDict[int, float] = OrderedDict()  # rooms waiting for TRANSFER_INFO, by add time
        self._early: OrderedDict[int, tuple[float, Optional[dict], Optional[str]]] = OrderedDict()  # (t, info, abort)
        self._cleared: OrderedDict[int, float] = OrderedDict()  # recently cleared: late messages are ignored
        self._dead: dict[Dest, float] = {}  # decodes whose send timed out, until they send a TRANSFER_INFO again
        self._jobs: queue.Queue = queue.Queue(MAX_JOBS)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._ctx: Optional[zmq.Context] = None
        self._closed = False

    # ---- lifecycle ----

    def start(self) -> None:
        """Bind the PULL socket, start the threads, register with PUT /route (raises BootstrapError)."""
        self._ctx = zmq.Context()
        name = f"prefill-pp{self.pp_rank}"
        inbox = frames.Inbox(self._ctx, self.bind_host, frames.MAX_CONTROL_BYTES, name, self._rejects)
        self.port = inbox.port
        frames.warn_if_exposed(self.bind_host, self._auth.enabled, f"prefill pp_rank {self.pp_rank}'s transfer socket")
        out = Outbox(self._ctx, SEND_TIMEOUT_S, self._auth, max_queued=MAX_QUEUED)
        self._threads = [start_loop(f"{name}-listener", self._stop, lambda: self._listen_step(inbox), inbox.close),
                         start_loop(f"{name}-sender", self._stop, lambda: self._send_step(out), out.close)]
        try:
            register_rank(self.bootstrap_url, self._registration(), token=self._token)
        except Exception:
            self.close()
            raise
        logger.info("prefill pp_rank %d: transfer agent on %s:%d", self.pp_rank, self.bind_host, self.port)

    def _registration(self) -> dict:
        return {"attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0, "attn_dp_size": 1,
                "attn_dp_rank": 0, "pp_size": self.pp_size, "pp_rank": self.pp_rank, "system_dp_size": 1,
                "system_dp_rank": 0, "rank_ip": self.bind_host, "rank_port": self.port,
                "page_size": self._schema["page_size"], "kv_cache_dtype": self._schema["dtype"],
                "load_balance_method": "round_robin", "enable_dsa_cache_layer_split": False,
                "prefill_http_port": self.prefill_http_port}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        for t in self._threads:
            t.join(2.0)
        if self._ctx is None:
            return
        if any(t.is_alive() for t in self._threads):
            self._ctx.destroy(linger=0)  # a stuck thread still holds a socket: do not wait on it
        else:
            self._ctx.term()

    # ---- engine-facing API ----

    def add_room(self, room: int, prompt_len: int) -> None:
        """A request exists: Bootstrapping, or WaitingForInput if its TRANSFER_INFO already came."""
        why = check_room(room)
        if why:
            raise ValueError(why)
        if not isinstance(prompt_len, int) or prompt_len < 0:
            raise ValueError(f"prompt_len must be a non-negative int, got {prompt_len!r}")
        now = time.monotonic()
        with self._lock:
            if room in self._rooms:
                raise ValueError(f"room {room} is already in use on prefill pp_rank {self.pp_rank}")
            if len(self._rooms) >= MAX_ROOMS:
                raise RuntimeError(f"prefill pp_rank {self.pp_rank} tracks {MAX_ROOMS} rooms; clear() finished ones")
            self._cleared.pop(room, None)
            self._rooms[room] = _Room(prompt_len, now)
            self._pending[room] = now
            early = self._early.pop(room, None)
        if early is not None:
            _, info, aborted = early
            if aborted is not None:
                self._fail(room, aborted, tell_decode=False, defer=True)
            elif info is not None:
                self._apply_info(room, info, defer=True)

    def send(self, room: int, parts: list[Part]) -> None:
        """Queue the room's parts; they go out once the decode's TRANSFER_INFO is there. Never blocks."""
        names = [p.spec.name for p in parts]
        if len(set(names)) != len(names):
            raise ValueError(f"room {room}: duplicate part names {names}")
        for p in parts:
            if len(p.data) != p.spec.nbytes:
                raise ValueError(f"room {room}: part {p.spec.name!r} has {len(p.data)} bytes, its spec "
                                 f"{p.spec.shape} {p.spec.dtype} needs {p.spec.nbytes}")
        with self._lock:
            rec = self._rooms.get(room)
            if rec is None:
                raise KeyError(f"room {room} was never added to prefill pp_rank {self.pp_rank} (or was cleared)")
            if rec.parts is not None or rec.queued:
                raise ValueError(f"room {room}: send() called twice")
            rec.parts = list(parts)
            if rec.state == KVPoll.Failed:
                rec.parts = None  # already reported; nothing to send
                return
            full = self._queue_room_locked(room, rec)
        if full:
            self._fail(room, "prefill send queue is full", defer=True)

    def abort(self, room: int, reason: str) -> None:
        self._fail(room, reason)

    def poll(self, room: int) -> PollResult:
        with self._lock:
            rec = self._rooms.get(room)
            if rec is None:
                return PollResult(KVPoll.Failed, f"room {room} is not known to prefill pp_rank {self.pp_rank}")
            return PollResult(rec.state, rec.reason)

    def clear(self, room: int) -> None:
        """Forget the room; later messages for it are ignored."""
        with self._lock:
            self._rooms.pop(room, None)
            self._pending.pop(room, None)
            self._early.pop(room, None)
            self._cleared.pop(room, None)
            self._cleared[room] = time.monotonic()
            while len(self._cleared) > MAX_ROOMS:
                self._cleared.popitem(last=False)

    # ---- state changes ----

    def _fail(self, room: int, reason: str, tell_decode: bool = True, defer: bool = False) -> None:
        """Failed unless already terminal; STATUS failed to the decode if known; on_status, from the sender thread
        when `defer` (add_room / send never call back into the engine from inside themselves)."""
        with self._lock:
            rec = self._rooms.get(room)
            if rec is None or rec.state in (KVPoll.Failed, KVPoll.Success):
                return
            rec.state, rec.reason, rec.parts = KVPoll.Failed, reason, None
            dest = rec.dest
        logger.warning("prefill pp_rank %d: room %d failed: %s", self.pp_rank, room, reason)
        if dest is not None:  # the sender drops the room's frames still queued, then tells the decode
            msg = frames.status(room, self.pp_rank, KVPoll.Failed, reason) if tell_decode else None
            self._enqueue(("status", dest, msg, room))
        if not defer or not self._enqueue(("notify", room, KVPoll.Failed, reason)):
            self._notify(room, KVPoll.Failed, reason)

    def _notify(self, room: int, state: KVPoll, reason: str) -> None:
        try:
            self._on_status(room, state, reason)
        except Exception:
            logger.exception("prefill pp_rank %d: on_status(%d, %s) raised", self.pp_rank, room, state.name)

    def _enqueue(self, job: tuple) -> bool:
        try:
            self._jobs.put_nowait(job)
            return True
        except queue.Full:
            logger.error("prefill pp_rank %d: send queue full, dropped a %s job", self.pp_rank, job[0])
            return False

    def _queue_room_locked(self, room: int, rec: _Room) -> bool:
        """Queue the push once both the parts and the destination are known; True if the queue was full."""
        if rec.dest is None or rec.parts is None or rec.queued or rec.state == KVPoll.Failed:
            return False
        rec.queued = True
        return not self._enqueue(("room", room, rec))

    def _apply_info(self, room: int, info: dict, defer: bool = False) -> None:
        dest = (info["decode_host"], info["decode_port"])
        mismatches = frames.schema_mismatches(self._compare, self._schema, info["schema"])
        reply, reason, full = None, "", False
        with self._lock:
            rec = self._rooms.get(room)
            if rec is None:
                return
            duplicate = rec.dest is not None
            if not duplicate:
                rec.dest = dest
                self._dead.pop(dest, None)
                self._pending.pop(room, None)
                if rec.state == KVPoll.Failed:
                    reply = rec.reason  # failed before the decode showed up: tell it now
                elif mismatches:
                    reason = SCHEMA_MISMATCH + "; ".join(mismatches)
                elif info["prompt_len"] != rec.prompt_len:
                    reason = (f"prompt_len mismatch: prefill={rec.prompt_len} decode={info['prompt_len']} "
                              "(the two servers tokenized the request differently)")
                else:
                    rec.state = max(rec.state, KVPoll.WaitingForInput)
                    full = self._queue_room_locked(room, rec)
        if duplicate:
            self._rejects.note("replay", "prefill pp_rank %d: room %d: duplicate TRANSFER_INFO from %s ignored",
                               self.pp_rank, room, dest)
        elif reply is not None:
            self._enqueue(("status", dest, frames.status(room, self.pp_rank, KVPoll.Failed, reply), room))
        elif reason or full:
            self._fail(room, reason or "prefill send queue is full", defer=defer)

    # ---- listener thread ----

    def _listen_step(self, inbox: frames.Inbox) -> None:
        for msg in inbox.poll(50):
            self._handle(msg)
        self._expire(time.monotonic())

    def _handle(self, msg: list[bytes]) -> None:
        try:
            msg = self._auth.open(msg)
            if len(msg) != 1:
                hint = f" ({frames.TOKEN_HINT})" if len(msg) == 2 and not self._auth.enabled else ""
                raise FrameError(f"expected one control frame, got {len(msg)}{hint}")
            head = frames.unpack(msg[0])
            if head["type"] == "TRANSFER_INFO":
                self._on_info(frames.parse_transfer_info(head))
            elif head["type"] == "ABORT":
                reason = head.get("reason")
                reason = reason[:frames.MAX_REASON_CHARS] if isinstance(reason, str) else ""
                room = frames.get_room(head)
                logger.warning("prefill pp_rank %d: room %d aborted by the decode server: %s", self.pp_rank, room,
                               reason or "(no reason given)")
                self._on_abort(room, reason)
            else:
                raise FrameError(f"unknown message type {head['type'][:64]!r}")
        except FrameError as e:
            kind = "auth" if isinstance(e, frames.AuthError) else "protocol"
            self._rejects.note(kind, "prefill pp_rank %d: dropped a bad message: %s", self.pp_rank, e.reason)
            if e.room is not None:
                self._fail(e.room, f"bad message from the decode server: {e.reason}")
        except Exception:
            logger.exception("prefill pp_rank %d: error while handling a message", self.pp_rank)

    def _on_info(self, info: dict) -> None:
        room = info["room"]
        with self._lock:
            known, cleared = room in self._rooms, room in self._cleared
            if not known and not cleared:
                self._buffer_early_locked(room, info, None)
        if known:
            self._apply_info(room, info)
        elif cleared:
            self._rejects.note("replay", "prefill pp_rank %d: TRANSFER_INFO for cleared room %d dropped",
                               self.pp_rank, room, level=logging.INFO)

    def _on_abort(self, room: int, reason: str) -> None:
        full = "aborted by the decode server" + (f": {reason}" if reason else "")
        with self._lock:
            if room not in self._rooms:
                if room not in self._cleared:
                    self._buffer_early_locked(room, None, full)
                return
        self._fail(room, full, tell_decode=False)

    def _buffer_early_locked(self, room: int, info: Optional[dict], aborted: Optional[str]) -> None:
        old = self._early.pop(room, None)
        if old is not None and info is None:
            info = old[1]
        self._early[room] = (time.monotonic(), info, aborted)
        while len(self._early) > MAX_EARLY:
            dropped, _ = self._early.popitem(last=False)
            self._rejects.note("overflow", "prefill pp_rank %d: early-message buffer full, dropped room %d",
                               self.pp_rank, dropped)

    def _expire(self, now: float) -> None:
        timeout, late, unclaimed = self.bootstrap_timeout, [], []
        with self._lock:
            while self._pending:
                room, added = next(iter(self._pending.items()))
                if now - added <= timeout:
                    break
                del self._pending[room]
                rec = self._rooms.get(room)
                if rec is not None and rec.added == added and rec.dest is None:
                    late.append(room)
            while self._early and now - next(iter(self._early.values()))[0] > timeout:
                room, (_, info, aborted) = self._early.popitem(last=False)
                if info is not None and aborted is None:
                    unclaimed.append(info)
            while self._cleared and now - next(iter(self._cleared.values())) > max(2 * timeout, 60.0):
                self._cleared.popitem(last=False)
        for room in late:
            self._fail(room, f"no TRANSFER_INFO from the decode server within {timeout:g} s "
                             f"(SPARKRELAY_DISAGGREGATION_BOOTSTRAP_TIMEOUT={timeout:g}); raise it if a "
                             "higher TTFT is acceptable")
        for info in unclaimed:
            reason = (f"prefill pp_rank {self.pp_rank} never admitted room {info['room']} within {timeout:g} s "
                      f"(SPARKRELAY_DISAGGREGATION_BOOTSTRAP_TIMEOUT)")
            self._enqueue(("status", (info["decode_host"], info["decode_port"]),
                           frames.status(info["room"], self.pp_rank, KVPoll.Failed, reason), info["room"]))

    # ---- sender thread ----
    # Outbox tags: ("data", room, rec) a DATA frame, ("done", room, rec) the STATUS success (reported once zmq
    # took it), ("status", room, None) a STATUS failed.

    def _send_step(self, out: Outbox) -> None:
        """Hand new jobs to the outbox, let queued frames go out, settle rooms: nothing here waits on one decode."""
        expired = out.pump(2)
        if expired:
            self._expired(expired)
        self._settle(out.take_sent())
        try:
            job = self._jobs.get(timeout=0.0 if out.queues else 0.05)
        except queue.Empty:
            return
        for _ in range(256):
            self._run_job(out, job)
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
        self._settle(out.take_sent())

    def _run_job(self, out: Outbox, job: tuple) -> None:
        if job[0] == "room":
            self._push_room(out, job[1], job[2])
        elif job[0] == "notify":
            self._notify(*job[1:])
        else:
            _, dest, msg, room = job
            out.discard(dest, lambda tag: tag[1] == room and tag[0] != "status")
            with self._lock:
                if msg is None or dest in self._dead:
                    return  # its last send timed out; the STATUS could only wait and expire
            self._put(out, dest, msg, ("status", room, None))

    def _push_room(self, out: Outbox, room: int, rec: _Room) -> None:
        with self._lock:
            if self._rooms.get(room) is not rec or rec.state == KVPoll.Failed:
                return
            dest, parts, dead = rec.dest, rec.parts, rec.dest in self._dead
            rec.state = max(rec.state, KVPoll.Transferring)
        if dead:
            self._fail(room, f"decode at {dest[0]}:{dest[1]} is unreachable (an earlier send to it timed out)")
            return
        if self.failure_prob and random.Random(room).random() < self.failure_prob:  # the same draw on every stage
            self._fail(room, INJECTED_FAILURE)
            return
        msgs = [(frames.data(room, self.pp_rank, p), ("data", room, rec)) for p in parts]
        msgs.append((frames.status(room, self.pp_rank, KVPoll.Success), ("done", room, rec)))
        for msg, tag in msgs:
            if not self._put(out, dest, msg, tag):
                return

    def _put(self, out: Outbox, dest: Dest, msg: list, tag: tuple) -> bool:
        """Queue or send one message; a refused one fails its room (False)."""
        try:
            if out.put(dest, msg, tag, notify=tag[0] == "done"):
                return True
            why = f"{MAX_QUEUED} messages already wait for it"
        except zmq.ZMQError as e:
            why = str(e)
        if tag[0] == "status":
            logger.warning("prefill pp_rank %d: could not send a STATUS to %s:%d: %s", self.pp_rank, *dest, why)
        else:
            self._fail(tag[1], f"sending to the decode at {dest[0]}:{dest[1]} failed: {why}")
        return False

    def _settle(self, sent: list[tuple]) -> None:
        """A room whose STATUS success zmq took (after all its DATA) is Success, unless it failed meanwhile."""
        for _, room, rec in sent:
            with self._lock:
                if self._rooms.get(room) is not rec or rec.state == KVPoll.Failed:
                    continue
                rec.state, rec.parts = KVPoll.Success, None
            self._notify(room, KVPoll.Success, "")

    def _expired(self, expired: list[tuple[Dest, tuple]]) -> None:
        """A decode took nothing for SEND_TIMEOUT_S: it is dead until its next TRANSFER_INFO, its rooms fail."""
        with self._lock:
            for dest, _ in expired:
                self._dead[dest] = time.monotonic()
            while len(self._dead) > 1024:
                self._dead.pop(next(iter(self._dead)))
        for dest, (kind, room, _) in expired:
            if kind == "status":
                logger.warning("prefill pp_rank %d: STATUS of room %d not delivered to %s:%d (no progress within "
                               "%g s)", self.pp_rank, room, *dest, SEND_TIMEOUT_S)
            else:
                self._fail(room, f"sending to the decode at {dest[0]}:{dest[1]} failed: no progress within "
                                 f"{SEND_TIMEOUT_S:g} s")
