"""PrefillBook: what the decode agent knows about each prefill server, and when it must read it
again.

    record(addr)  -- cached -->  PrefillRecord (server info with the schema, every stage's PULL endpoint)
                  -- missing --> one caller fetches GET /route (info, then each stage); the others park their
                                 rooms behind that fetch, so a dead prefill holds one bootstrap worker, not all
    forget(addr)  -- a room failed against it: the next room reads /route again. Soft (a mismatch, a timeout,
                     a failed STATUS): its endpoints are kept aside and retired only if the fresh record lists
                     others (a restarted prefill's stages listen on new ports). Dead (lost heartbeat, a stage
                     that took nothing): its endpoints are retired at once.

A retired endpoint is dead: nothing more is sent there, and the caller closes its socket (linger 0)
and drops what was queued for it. Thread safe; never calls back into the agent.

A record says when its stages are unreachable from here: the prefill is remote (its bootstrap host
is not loopback) but published a loopback (or wildcard) stage endpoint, which would reach this
decode's own host; its rooms fail with that reason, and nothing is ever sent to those endpoints.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Optional

from sparkrelay.transfer.base import Addr, Dest
from sparkrelay.transfer.bootstrap.client import bootstrap_url, fetch_prefill_info, fetch_rank
from sparkrelay.transfer.wire import dials_itself

MAX_PREFILLS = 1024  # cached records (and kept-aside endpoint lists)
MAX_DEAD = 4096  # retired endpoints remembered


@dataclass
class PrefillRecord:
    """What the decode caches about one prefill (its bootstrap /route answers) until a room fails
    against it."""

    info: dict  # the server info, with "schema" and "pp_size"
    # pp_rank -> PULL endpoint, every stage
    endpoints: dict[int, Dest] = field(default_factory=dict)
    unreachable: str = ""  # why its stages must not be dialed from here ("": they may)


def stages_unreachable(addr: Addr, endpoints: dict[int, Dest]) -> str:
    """Why a prefill reached at addr (its bootstrap host, port) cannot be sent to: a stage endpoint
    that would reach this decode's own host while the prefill is on another one; "" otherwise. Once
    per fetch: it may ask the resolver."""
    looped = {pp: dest for pp, dest in endpoints.items() if dials_itself(dest[0], resolve=True)}
    if not looped or dials_itself(addr[0], resolve=True):
        return ""  # loopback to loopback: one host
    pp, (ip, port) = min(looped.items())
    return (
        f"the prefill at {addr[0]}:{addr[1]} advertised {ip}:{port} for pp_rank {pp}, a loopback "
        "address, which from this host is the decode itself: start the prefill with "
        "SPARKRELAY_HOST_IP (or --disaggregation-bootstrap-host) set to the address this host "
        "reaches it at"
    )


class PrefillBook:
    def __init__(self, token: Optional[str]) -> None:
        self._token = token
        self._lock = threading.Lock()
        self._records: OrderedDict[Addr, PrefillRecord] = OrderedDict()  # least recently used first
        self._fetching: dict[Addr, list] = {}  # addr -> the items parked behind its fetch
        # endpoints of a softly forgotten record
        self._aside: OrderedDict[Addr, list[Dest]] = OrderedDict()
        self._dead: OrderedDict[Dest, None] = OrderedDict()

    def addrs(self) -> list[Addr]:
        with self._lock:
            return list(self._records)

    def cached(self, addr: Addr) -> Optional[PrefillRecord]:
        with self._lock:
            return self._records.get(addr)

    def claim(self, addr: Addr, item: object) -> tuple[Optional[PrefillRecord], bool]:
        """(record, False) when cached; (None, True) when the caller must fetch() then release();
        (None, False) when another caller is fetching: `item` is parked and comes back from that
        caller's release()."""
        with self._lock:
            known = self._records.get(addr)
            if known is not None:
                self._records.move_to_end(addr)
                return known, False
            if addr in self._fetching:
                self._fetching[addr].append(item)
                return None, False
            self._fetching[addr] = []
            return None, True

    def parked(self, addr: Addr) -> list:
        with self._lock:
            return list(self._fetching.get(addr, ()))

    def release(self, addr: Addr) -> list:
        """End the caller's fetch of addr; the items parked behind it (to be tried again)."""
        with self._lock:
            return self._fetching.pop(addr, [])

    def fetch(
        self, addr: Addr, deadline: float, wanted: Callable[[], bool]
    ) -> tuple[PrefillRecord, list[Dest]]:
        """GET /route until `deadline` (monotonic) or until wanted() is False; the fresh record,
        cached, and the endpoints it retires. Raises what bootstrap/client.py raises (TimeoutError,
        BootstrapError, ...)."""
        url = bootstrap_url(*addr)
        info = fetch_prefill_info(url, deadline, self._token, wanted)
        endpoints = {
            pp: fetch_rank(url, pp, deadline, self._token, wanted)
            for pp in reversed(range(info["pp_size"]))
        }
        known = PrefillRecord(info, endpoints, stages_unreachable(addr, endpoints))
        fresh = set(endpoints.values())
        with self._lock:
            old = self._aside.pop(addr, [])
            self._records[addr] = known
            self._records.move_to_end(addr)
            while len(self._records) > MAX_PREFILLS:
                self._records.popitem(last=False)
            for dest in fresh:
                self._dead.pop(dest, None)  # a port the OS handed out again
            gone = [d for d in old if d not in fresh]
            self._mark_dead_locked(gone)
        return known, gone

    def forget(self, addr: Addr, dead: bool, listing: Optional[Dest] = None) -> list[Dest]:
        """Drop addr's record (the next room fetches it again); the endpoints retired now (only when
        dead).
        listing: only if the record still lists this endpoint (a fresher record is left alone)."""
        with self._lock:
            known = self._records.get(addr)
            if known is None or (listing is not None and listing not in known.endpoints.values()):
                return []
            del self._records[addr]
            dests = list(known.endpoints.values())
            if dead:
                self._mark_dead_locked(dests)
                return dests
            self._aside[addr] = dests
            self._aside.move_to_end(addr)
            while len(self._aside) > MAX_PREFILLS:
                self._aside.popitem(last=False)
            return []

    def live(self, dests: list[Dest]) -> list[Dest]:
        """dests without the retired ones (and without duplicates)."""
        with self._lock:
            return [d for d in dict.fromkeys(dests) if d not in self._dead]

    def is_dead(self, dest: Dest) -> bool:
        with self._lock:
            return dest in self._dead

    def _mark_dead_locked(self, dests: list[Dest]) -> None:
        for dest in dests:
            self._dead[dest] = None
            self._dead.move_to_end(dest)
        while len(self._dead) > MAX_DEAD:
            self._dead.popitem(last=False)
