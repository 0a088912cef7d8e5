"""Bootstrapper: the decode agent's member that learns where each prefill's stages are and whether
that prefill is
alive: the workers that read /route for a begun room (one fetch per prefill at a time, the record
cached in bootstrap/prefill_book.py) and the heartbeat (GET /health of every known prefill).

Prefill records are dropped whenever a room fails against them (schema or auth mismatch, waiting
timeout, STATUS failed, bad frame, undeliverable TRANSFER_INFO, lost heartbeat), so the next room
reads /route again and a fixed or restarted prefill serves it. A prefill found dead (heartbeat, send
timeout) or republished with other stage endpoints has its old endpoints retired: their sockets
closed with linger 0, the messages queued for them dropped.

The owner (decode_agent.DecodeAgent) keeps the room table; the Bootstrapper reaches it through five
calls: bootstrapping(room, rec), wanted(items), fail_room(room, rec, reason, ...),
bootstrapped(room, rec, record) and drop(dests), plus rooms_at(addr) / waiting_addrs() for the
heartbeat.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Optional

from sparkrelay.transfer.agent import start_loop
from sparkrelay.transfer.base import Addr, Dest
from sparkrelay.transfer.bootstrap.client import bootstrap_url, check_health
from sparkrelay.transfer.bootstrap.prefill_book import PrefillBook, PrefillRecord
from sparkrelay.transfer.decode_room import MAX_ROOMS, DecodeRoom

logger = logging.getLogger(__name__)

N_WORKERS = 4


class Bootstrapper:
    """Bootstrap workers and heartbeat for one decode agent (`owner`)."""

    def __init__(
        self,
        owner,
        book: PrefillBook,
        timeout_s: float,
        heartbeat_interval: float,
        heartbeat_max_failures: int,
    ) -> None:
        self.owner, self.book = owner, book
        self.timeout_s = timeout_s
        self.heartbeat_interval, self.heartbeat_max_failures = (
            heartbeat_interval,
            heartbeat_max_failures,
        )
        self._work: queue.Queue = queue.Queue(MAX_ROOMS)  # (room, rec) to bootstrap
        self._misses: dict[
            Addr, int
        ] = {}  # failed heartbeats in a row, per prefill (monitor thread only)
        self._next_heartbeat = 0.0

    def threads(self, stop: threading.Event) -> list[threading.Thread]:
        return [
            start_loop(f"decode-bootstrap-{i}", stop, self._work_step) for i in range(N_WORKERS)
        ]

    def submit(self, room: int, rec: DecodeRoom) -> bool:
        """Queue a begun room; False when the queue is full."""
        try:
            self._work.put_nowait((room, rec))
            return True
        except queue.Full:
            return False

    def forget(self, addr: Addr, dead: bool, listing: Optional[Dest] = None) -> None:
        """A room failed against this prefill: the next room reads /route again
        (PrefillBook.forget); endpoints retired by it are dropped from the outbox."""
        gone = self.book.forget(addr, dead, listing)
        if gone:
            self.owner.drop(gone)

    # ---- workers ----

    def _work_step(self) -> None:
        try:
            room, rec = self._work.get(timeout=0.1)
        except queue.Empty:
            return
        try:
            if self.owner.bootstrapping(room, rec):  # else aborted before its turn
                known = self._record(room, rec)
                # None: parked behind another room's fetch of the same prefill, or failed
                if known is not None:
                    self.owner.bootstrapped(room, rec, known)
        except Exception as e:  # keep the worker; the room fails with the cause
            logger.exception("decode: bootstrap of room %d raised", room)
            self.owner.fail_room(room, rec, f"bootstrap failed: {type(e).__name__}: {e}")

    def _record(self, room: int, rec: DecodeRoom) -> Optional[PrefillRecord]:
        """The cached record of the room's prefill, else fetched by this worker; None when another
        worker is fetching it (the room is parked and queued again once that fetch ends) or when the
        fetch failed."""
        known, mine = self.book.claim(rec.addr, (room, rec))
        if not mine:
            return known
        try:
            return self._fetch(room, rec)
        finally:
            for item in self.book.release(rec.addr):
                if not self.submit(*item):
                    self.owner.fail_room(*item, "decode bootstrap queue is full")

    def _fetch(self, room: int, rec: DecodeRoom) -> Optional[PrefillRecord]:
        """GET /route until the room's bootstrap deadline, or until neither this room nor a room
        parked behind it is live any more; endpoints the fresh record no longer lists are
        retired."""
        (host, port), deadline = rec.addr, rec.begun + self.timeout_s
        try:
            known, gone = self.book.fetch(
                rec.addr,
                deadline,
                lambda: self.owner.wanted([(room, rec), *self.book.parked(rec.addr)]),
            )
        except Exception as e:
            hint = (
                f" (SPARKRELAY_DISAGGREGATION_BOOTSTRAP_TIMEOUT={self.timeout_s:g})"
                if isinstance(e, TimeoutError)
                else ""
            )
            self.owner.fail_room(
                room, rec, f"bootstrap with the prefill at {host}:{port} failed: {e}{hint}"
            )
            return None
        if gone:
            logger.info(
                "decode: the prefill at %s:%d now lists stage endpoints %s; retiring %s",
                host,
                port,
                sorted(known.endpoints.values()),
                gone,
            )
            self.owner.drop(gone)
        return known

    # ---- heartbeat (the owner's monitor thread) ----

    def heartbeat_step(self, now: float) -> None:
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.heartbeat_interval
            self._heartbeat()

    def _heartbeat(self) -> None:
        """GET /health of every cached prefill and of every prefill a room waits on; max_failures
        misses in a row fail its rooms and retire its record (a restarted prefill is read
        afresh)."""
        addrs = set(self.book.addrs()) | self.owner.waiting_addrs()
        self._misses = {a: n for a, n in self._misses.items() if a in addrs}
        for addr in addrs:
            ok = check_health(bootstrap_url(*addr), timeout=min(1.0, self.heartbeat_interval))
            self._misses[addr] = 0 if ok else self._misses.get(addr, 0) + 1
            if self._misses[addr] < self.heartbeat_max_failures:
                continue
            del self._misses[addr]
            # bootstrapping rooms are left to the fetch's deadline
            victims = self.owner.rooms_at(addr)
            self.forget(addr, dead=True)
            for room, rec in victims:
                self.owner.fail_room(
                    room,
                    rec,
                    f"lost connection with prefill at {addr[0]}:{addr[1]} "
                    f"({self.heartbeat_max_failures} failed /health checks in a row)",
                    notify=False,
                )
