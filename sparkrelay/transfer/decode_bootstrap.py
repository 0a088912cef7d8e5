"""The decode agent's bootstrap half: the workers that read each prefill's /route and start a room, the record of
each prefill (bootstrap/prefill_book.py), the heartbeat, and failing a room with an ABORT to its prefill's stages.

Prefill records are dropped whenever a room fails against them (schema or auth mismatch, waiting timeout, STATUS
failed, bad frame, undeliverable TRANSFER_INFO, lost heartbeat), so the next room reads /route again and a fixed
or restarted prefill serves it. A prefill found dead (heartbeat, send timeout) or republished with other stage
endpoints has its old endpoints retired: their sockets closed with linger 0, the messages queued for them dropped.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Optional

from sparkrelay.transfer import protocol
from sparkrelay.transfer.agent import Agent
from sparkrelay.transfer.base import Addr, Dest, KVPoll, PartSpec
from sparkrelay.transfer.bootstrap.client import bootstrap_url, check_health
from sparkrelay.transfer.bootstrap.prefill_book import PrefillBook, PrefillRecord
from sparkrelay.transfer.decode_room import LIVE, DecodeRoom, DecodeRooms, plan
from sparkrelay.transfer.protocol import Abort, TransferInfo

logger = logging.getLogger(__name__)


class DecodeBootstrap(Agent):
    """Needs, from the DecodeAgent: _table, _book, _work, _compare, _expected_parts, host, bootstrap_timeout,
    heartbeat_interval, heartbeat_max_failures, max_part_bytes, _misses."""

    _table: DecodeRooms
    _book: PrefillBook
    _work: queue.Queue

    # ---- failing a room ----

    def _fail(self, room: int, rec: DecodeRoom, reason: str, notify: bool = True, skip: Optional[Dest] = None,
              force: bool = False, permanent: bool = False) -> None:
        """Failed (wins over everything but an earlier Failed; over Success only when `force`), and an ABORT
        with the reason to every live stage endpoint of the room (still bootstrapping: of its prefill's cached
        record, if any) unless notify is False."""
        with self._lock:
            if not self._table.current(room, rec) or not rec.fail(reason, force, permanent):
                return
            endpoints = dict(rec.endpoints)
        logger.warning("decode: room %d failed: %s", room, reason)
        self._news()
        if notify and not endpoints:
            known = self._book.cached(rec.addr)
            endpoints = {} if known is None else known.endpoints
        if notify and endpoints:
            rec.told = True
            self._send_abort(room, [d for d in endpoints.values() if d != skip], reason)

    def _news(self) -> None:
        """A room reached Success or Failed (the decode agent tells its listener)."""

    def _send_abort(self, room: int, dests: list[Dest], reason: str) -> None:
        """ABORT(room, reason) to each of dests not retired, so the prefill's log and answer say why."""
        msg = Abort(room, protocol.clip(reason))
        for dest in self._book.live(dests):
            self._enqueue(("send", dest, msg, room))

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

    def _bootstrap(self, room: int, rec: DecodeRoom) -> None:
        if not self._current(room, rec) or rec.state != KVPoll.Bootstrapping:
            return  # aborted before its turn (_fail told the stages of a cached prefill)
        known = self._record(room, rec)
        if known is None:
            return  # parked behind another room's fetch of the same prefill, or failed
        refusal, expected = self._refusal(known.info, rec)
        with self._lock:
            rec.endpoints = dict(known.endpoints)
            current, failed = self._table.current(room, rec), rec.state == KVPoll.Failed
            if current and not failed and not refusal:
                self._table.ready(room, rec, expected, time.monotonic())
        if failed and not rec.told:  # aborted while bootstrapping: the stages learn why now that they are known
            self._send_abort(room, list(rec.endpoints.values()), rec.reason)
        elif refusal and current:  # a mismatch: read /route again next time (the prefill may be fixed)
            self._forget_prefill(rec.addr, dead=False)
            self._fail(room, rec, refusal, permanent=True)  # with an ABORT naming both values to every stage
        elif current:
            msg = self._transfer_info(room, rec)
            for pp in sorted(rec.endpoints, reverse=True):
                if not self._enqueue(("send", rec.endpoints[pp], msg, (room, rec))):
                    self._fail(room, rec, "decode send queue is full")

    def _transfer_info(self, room: int, rec: DecodeRoom) -> TransferInfo:
        return TransferInfo(room, self.host, self.port, rec.prompt_len, self._schema, prefix=rec.prefix)

    def _refusal(self, info: dict, rec: DecodeRoom) -> tuple[str, dict[int, dict[str, PartSpec]]]:
        """(why this decode refuses the prefill's rooms, or "", pp_rank -> name -> PartSpec)."""
        if self._auth.enabled and info.get("auth_required") is not True:
            host, port = rec.addr
            return (f"the prefill's bootstrap server at {host}:{port} runs without --disaggregation-auth-token, "
                    "this decode with one (it would drop every message of this decode): set the same "
                    "--disaggregation-auth-token on both servers"), {}
        return plan(self._compare, self._expected_parts, info, self._schema, rec.prompt_len, self.max_part_bytes,
                    rec.prefix)

    # ---- prefill records ----

    def _record(self, room: int, rec: DecodeRoom) -> Optional[PrefillRecord]:
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

    def _fetch(self, room: int, rec: DecodeRoom) -> Optional[PrefillRecord]:
        """GET /route until the room's bootstrap deadline, or until neither this room nor a room parked behind
        it is live any more; endpoints the fresh record no longer lists are retired."""
        (host, port), deadline = rec.addr, rec.begun + self.bootstrap_timeout

        def wanted() -> bool:
            waiting = [(room, rec), *self._book.parked(rec.addr)]
            with self._lock:
                return any(self._table.current(r, w) and w.state in LIVE for r, w in waiting)

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

    # ---- heartbeat (monitor thread) ----

    def _heartbeat(self) -> None:
        """GET /health of every cached prefill and of every prefill a room waits on; max_failures misses in a
        row fail its rooms and retire its record (a restarted prefill is read afresh)."""
        known = self._book.addrs()
        with self._lock:
            addrs = set(known) | {r.addr for r in self._table.rooms.values()
                                  if r.state in (KVPoll.WaitingForInput, KVPoll.Transferring)}
            self._misses = {a: n for a, n in self._misses.items() if a in addrs}
        for addr in addrs:
            ok = check_health(bootstrap_url(*addr), timeout=min(1.0, self.heartbeat_interval))
            with self._lock:
                self._misses[addr] = 0 if ok else self._misses.get(addr, 0) + 1
                if self._misses[addr] < self.heartbeat_max_failures:
                    continue
                del self._misses[addr]
                victims = [(room, r) for room, r in self._table.rooms.items() if r.addr == addr and r.state in LIVE
                           and r.state != KVPoll.Bootstrapping]  # bootstrapping rooms: the fetch's deadline
            self._forget_prefill(addr, dead=True)
            for room, rec in victims:
                self._fail(room, rec, f"lost connection with prefill at {addr[0]}:{addr[1]} "
                                      f"({self.heartbeat_max_failures} failed /health checks in a row)", notify=False)
