"""The decode role (--disaggregation-mode decode, --pp-size 1, DSpark optional). A request moves
through two named queues before it joins the scheduler's batch, as in SGLang's decode scheduler:

    prealloc      (DecodePreallocQueue)  waits, in arrival order, for blocks for its prompt (deferred while the
                                         cache is full, never failed); the first are its prefix cache's when it
                                         holds the prompt's start (whole pieces); once reserved: DecodeAgent.begin,
                                         the handshake with the prefill's bootstrap server and TRANSFER_INFO, which
                                         names that prefix: the prefill sends only the pieces after it
    transferring  (DecodeTransferQueue)  waits for every prefill stage's parts
        Success -> the metadata row's room checked -> KVArrived: the engine streams the prefill's first token now
                   (the time to first token does not wait for the writes below)
                -> landed: at the start of the next step, before anything is scheduled, the target KV is written
                   at the request's slots (paired by global layer id) and the drafter's context injected at
                   absolute positions (hidden / tail / draft-kv) -> KVWritten: the engine admits it to the batch
                   (a request that ends at its first token, or is aborted first, is never written: it computed
                   nothing, so none of its pages joins the prefix cache)
        Failed  -> HandoffFailed (never decodes with a cold drafter); a write that fails -> HandoffFailed too,
                   after the first token
How the parts reach the pools is the room's delivery (disagg/delivery.py), chosen by its bootstrap host: the
backend's (frames for ZMQ; one-sided for Mooncake and NIXL, which write into this decode's registered memory, and
whose failed rooms' blocks stay out of use for a while) or the fake host's (no peer: zero KV, the prompt's last
token first, a /health_generate that exercises the model).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Optional

import torch

from sparkrelay.config import Config
from sparkrelay.disagg.delivery import FakeDelivery, FramesDelivery, Pools, Writer, deliveries
from sparkrelay.disagg.handoff import expected_parts
from sparkrelay.disagg.roles import NEWS_WAIT_S, EngineParts, Event, HandoffFailed, PDRole
from sparkrelay.disagg.schema import compare
from sparkrelay.scheduler.request import Bootstrap, Request
from sparkrelay.transfer.backends import get_backend
from sparkrelay.transfer.base import DecodeTransfer, KVPoll
from sparkrelay.transfer.wire import check_advertised


@dataclass
class _Pending:
    req: Request
    bootstrap: Bootstrap
    delivery: FramesDelivery | FakeDelivery


class DecodeRole(PDRole):
    name = "decode"

    def __init__(self, config: Config, dtype: torch.dtype) -> None:
        super().__init__(config, dtype)
        # the address TRANSFER_INFO names: a wildcard bind without SPARKRELAY_HOST_IP is refused
        # now, before the model loads (docs/pd_across_hosts.md)
        check_advertised(config.disagg.disaggregation_bootstrap_host, self.env.host_ip)
        self.prealloc: dict[str, _Pending] = {}  # rid -> waiting for blocks, in arrival order
        self.transferring: dict[str, _Pending] = {}  # rid -> blocks reserved, parts on their way
        self.landed: dict[
            str, Writer
        ] = {}  # rid -> first token out, parts to write before it decodes
        self.agent: Optional[DecodeTransfer] = None
        self.deliveries: dict[
            Optional[str], FramesDelivery | FakeDelivery
        ] = {}  # bootstrap host -> (None: any)
        self.quarantine: list[tuple[float, str]] = []  # (release time, block owner), oldest first
        # set by the agent (a room finished) and by wake() (a request arrived)
        self.news = threading.Event()
        self.parts: Optional[EngineParts] = None

    def attach(self, parts: EngineParts) -> None:
        self.parts = parts
        dc, e = self.config.disagg, self.env
        # --disaggregation-transfer-backend
        decode_agent = get_backend(dc.disaggregation_transfer_backend).decode
        self.agent = decode_agent(
            self.schema.to_dict(),
            compare,
            expected_parts,
            dc.disaggregation_bootstrap_host,
            e.bootstrap_timeout,
            e.waiting_timeout,
            e.heartbeat_interval,
            e.heartbeat_max_failures,
            dc.disaggregation_bootstrap_port,
            auth_token=e.token(dc.disaggregation_auth_token),
            max_part_bytes=self._largest_part(parts.context_length),
            host_ip=e.host_ip,
        )
        pools = Pools(parts.pool, parts.proposer, parts.scheduler.blocks.page_size, parts.device)
        self.deliveries = deliveries(self.agent, self.schema, pools)
        self.agent.set_listener(self.news.set)
        self.agent.start()

    def _largest_part(self, context_length: int) -> int:
        """The biggest part a prompt this server accepts can need (all target layers' KV at the
        context length, or the hidden rows / draft KV): frames above it are refused before they are
        buffered."""
        parts = expected_parts(self.schema.to_dict(), context_length)
        return max(p.nbytes for stage in parts.values() for p in stage)

    def take(self, req: Request, bootstrap: Bootstrap) -> bool:
        self._register(req, bootstrap)
        delivery = self.deliveries.get(bootstrap.host, self.deliveries[None])
        # even max_new_tokens 0: the KV must arrive
        self.prealloc[req.rid] = _Pending(req, bootstrap, delivery)
        return True

    # -- receive: prealloc -> transferring -> (the engine's) running -------------------------------
    def receive(self) -> list[Event]:
        self._release_quarantined()
        events = [self.landed.pop(rid)() for rid in list(self.landed)]
        self._reserve()
        for p in list(self.transferring.values()):
            events += self._poll(p)
        return events

    def _reserve(self) -> None:
        """Blocks for each new request's prompt, in arrival order; a request that does not fit waits
        (deferred, never failed: docs/pd_protocol.md, failure modes)."""
        for p in list(self.prealloc.values()):
            n = len(p.req.prompt_ids)
            prefix = self.parts.scheduler.reserve(p.req, n, *self._match_rule(p))
            if prefix is None:
                return
            del self.prealloc[p.req.rid]
            p.delivery.begin(p.bootstrap, p.req, prefix)
            self.transferring[p.req.rid] = p

    def _match_rule(self, p: _Pending) -> tuple[int, int, bool]:
        """(align, keep, needs_draft) of the prefix cache match for a new room: whole pieces (the
        prefill cuts its handoff there); `tail`: the tail rows land outside the cached pages, which
        need no drafter context (the drafter reads from the tail on); hidden / draft-kv: only pages
        with the drafter's context. The room's delivery may ask otherwise (the fake one takes no
        cached page)."""
        tail = self.schema.handoff == "tail"
        align = math.lcm(self.parts.scheduler.blocks.page_size, self.schema.stream_tokens)
        return p.delivery.match_rule(
            (align, max(1, self.schema.tail_tokens) if tail else 1, not tail)
        )

    def _poll(self, p: _Pending) -> list[Event]:
        req = p.req
        res = p.delivery.poll(req.bootstrap_room)
        if res.state == KVPoll.Success:
            del self.transferring[req.rid]
            events, writer = p.delivery.arrive(req)
            if writer is not None:
                self.landed[req.rid] = writer
            return events
        if res.state == KVPoll.Failed:
            del self.transferring[req.rid]
            p.delivery.failed(req.bootstrap_room)
            self._quarantine(req, p.delivery.hold_s)
            # 400: deterministic (a schema mismatch), a retry fails the same way
            code = 400 if res.permanent else 502
            return [
                HandoffFailed(
                    req, f"KV transfer of room {req.bootstrap_room} failed: {res.reason}", code
                )
            ]
        return []

    def wait(self, idle: bool) -> None:
        """No polling sleep: until a room finishes or a request arrives (NEWS_WAIT_S at most, for
        the quarantine's clock). receive() then polls every room, so a wake-up that lands after
        clear() is not lost."""
        if idle and self.has_work():
            self.news.wait(NEWS_WAIT_S)
            self.news.clear()

    def wake(self) -> None:
        self.news.set()

    def drop(self, req: Request) -> None:
        # ended at its first token, or aborted, before its KV was written
        self.landed.pop(req.rid, None)
        p = self.transferring.pop(req.rid, None)
        if p is not None:
            p.delivery.abort(req.bootstrap_room, "aborted by the decode server's client")
            self._quarantine(req, p.delivery.hold_s)
        self.prealloc.pop(req.rid, None)
        super().drop(req)

    def _quarantine(self, req: Request, hold_s: float) -> None:
        """A failed or aborted room's blocks stay out of use for `hold_s` (its delivery's; 0: freed
        at once)."""
        if hold_s > 0 and req.block_ids:
            owner = self.parts.scheduler.quarantine(req)
            self.quarantine.append((time.monotonic() + hold_s, owner))

    def _release_quarantined(self) -> None:
        now = time.monotonic()
        while self.quarantine and self.quarantine[0][0] <= now:
            self.parts.scheduler.release_quarantined(self.quarantine.pop(0)[1])

    def has_work(self) -> bool:
        return bool(self.prealloc or self.transferring or self.landed or self.quarantine)

    def stats(self) -> dict:
        total = {
            name: sum(getattr(d, name) for d in self.deliveries.values())
            for name in ("landed_rooms", "handoff_bytes", "context_bytes")
        }
        return {
            "num_prealloc": len(self.prealloc),
            "num_transfers_inflight": len(self.transferring),
            "num_quarantined": len(self.quarantine),
            "landed_rooms_total": total["landed_rooms"],
            "handoff_bytes_total": total["handoff_bytes"],
            "context_bytes_total": total["context_bytes"],
        }

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()
