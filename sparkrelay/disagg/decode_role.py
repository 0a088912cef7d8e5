"""The decode role (--disaggregation-mode decode, --pp-size 1, DSpark optional). A request moves through two named
queues before it joins the scheduler's batch, as in SGLang's decode scheduler:

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
With a one-sided backend (Mooncake, NIXL) the prefill writes into the decode's registered memory
(disagg/landing_buffers.py): begin() names the room's landing, the target KV is in place on Success, and a failed
room's blocks stay out of use for QUARANTINE_S (a stage may still be writing) before they are freed.
A request with the fake bootstrap host contacts no peer: its prompt KV (and draft context) is zeros, its first token
is its prompt's last token, and it decodes from there (a /health_generate that exercises the model).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Optional

import torch

from sparkrelay.config import Config
from sparkrelay.disagg.handoff import expected_parts, inject_context, read_meta, write_kv
from sparkrelay.disagg.landing_buffers import LandingBuffers
from sparkrelay.disagg.metadata import MetadataRow
from sparkrelay.disagg.roles import NEWS_WAIT_S, EngineParts, Event, HandoffFailed, KVArrived, KVWritten, PDRole
from sparkrelay.disagg.schema import compare
from sparkrelay.kvcache.pool import KVPool
from sparkrelay.models.attention import slot_index
from sparkrelay.scheduler.request import Bootstrap, Request
from sparkrelay.trace import timeline
from sparkrelay.transfer.base import DecodeTransfer, KVPoll, get_backend, split_piece


QUARANTINE_S = 5.0  # a failed one-sided room's blocks wait this long before reuse (its writes may be in flight)


@dataclass
class _Pending:
    req: Request
    bootstrap: Bootstrap


@dataclass
class _Landed:
    """Every part of a room arrived and its metadata row checked out; not yet written into the pools."""
    req: Request
    parts: dict
    row: MetadataRow


class DecodeRole(PDRole):
    role = "decode"

    def __init__(self, config: Config, dtype: torch.dtype) -> None:
        super().__init__(config, dtype)
        self.prealloc: dict[str, _Pending] = {}  # rid -> waiting for blocks, in arrival order
        self.transferring: dict[str, _Pending] = {}  # rid -> blocks reserved, parts on their way
        self.landed: dict[str, _Landed] = {}  # rid -> first token out, parts to write before it decodes
        self.agent: Optional[DecodeTransfer] = None
        self.landings: Optional[LandingBuffers] = None  # one-sided backends only
        self.quarantine: list[tuple[float, str]] = []  # (release time, block owner), oldest first
        self.news = threading.Event()  # set by the agent (a room finished) and by wake() (a request arrived)
        self.parts: Optional[EngineParts] = None
        self.handoff_bytes = 0  # bytes received from prefill stages (KV + handoff + metadata rows)
        self.context_bytes = 0  # of which DSpark context and metadata rows (everything but the target KV)
        self.landed_rooms = 0  # rooms whose parts a one-sided backend wrote into this decode's memory

    def attach(self, parts: EngineParts) -> None:
        self.parts = parts
        dc, e = self.config.disagg, self.env
        decode_agent = get_backend(dc.disaggregation_transfer_backend)[1]  # --disaggregation-transfer-backend
        self.agent = decode_agent(self.schema.to_dict(), compare, expected_parts, dc.disaggregation_bootstrap_host,
                                  e.bootstrap_timeout, e.waiting_timeout, e.heartbeat_interval,
                                  e.heartbeat_max_failures, dc.disaggregation_bootstrap_port,
                                  auth_token=e.token(dc.disaggregation_auth_token),
                                  max_part_bytes=self._largest_part(parts.context_length))
        if self.agent.one_sided:
            draft_pool = parts.proposer.pool if parts.proposer is not None else None
            self.landings = LandingBuffers(self.schema, parts.pool, draft_pool)
            self.agent.register(self.landings.regions())
        self.agent.set_listener(self.news.set)
        self.agent.start()

    def _largest_part(self, context_length: int) -> int:
        """The biggest part a prompt this server accepts can need (all target layers' KV at the context length,
        or the hidden rows / draft KV): frames above it are refused before they are buffered."""
        parts = expected_parts(self.schema.to_dict(), context_length)
        return max(p.nbytes for stage in parts.values() for p in stage)

    def take(self, req: Request, bootstrap: Bootstrap) -> bool:
        self._register(req, bootstrap)
        self.prealloc[req.rid] = _Pending(req, bootstrap)  # even max_new_tokens 0: the prefill's KV must be received
        return True

    # -- receive: prealloc -> transferring -> (the engine's) running ----------------------------------------------
    def receive(self) -> list[Event]:
        self._release_quarantined()
        events = [self._write(self.landed.pop(rid)) for rid in list(self.landed)]
        self._reserve()
        for p in list(self.transferring.values()):
            events += self._poll(p)
        return events

    def _reserve(self) -> None:
        """Blocks for each new request's prompt, in arrival order; a request that does not fit waits (deferred,
        never failed: docs/pd_protocol.md, failure modes)."""
        for p in list(self.prealloc.values()):
            n = len(p.req.prompt_ids)
            prefix = self.parts.scheduler.reserve(p.req, n, *self._match_rule(p))
            if prefix is None:
                return
            del self.prealloc[p.req.rid]
            if not p.bootstrap.is_fake:
                landing = self.landings.landing(p.req.block_ids) if self.landings is not None else None
                self.agent.begin(p.bootstrap.room, p.bootstrap.host, p.bootstrap.port, n, landing, prefix)
            self.transferring[p.req.rid] = p

    def _match_rule(self, p: _Pending) -> tuple[int, int, bool]:
        """(align, keep, needs_draft) of the prefix cache match for a new room: whole pieces (the prefill cuts its
        handoff there); `tail`: the tail rows land outside the cached pages, which need no drafter context (the
        drafter reads from the tail on); hidden / draft-kv: only pages with the drafter's context. A fake-bootstrap
        request (zero KV written at every slot) takes no cached page."""
        if p.bootstrap.is_fake:
            return 0, 1, True
        tail = self.schema.handoff == "tail"
        align = math.lcm(self.parts.scheduler.blocks.page_size, self.schema.stream_tokens)
        return align, max(1, self.schema.tail_tokens) if tail else 1, not tail

    def _poll(self, p: _Pending) -> list[Event]:
        req = p.req
        if p.bootstrap.is_fake:
            del self.transferring[req.rid]
            return self._fake_arrival(req)
        res = self.agent.poll(req.bootstrap_room)
        if res.state == KVPoll.Success:
            del self.transferring[req.rid]
            timeline.mark("decode", "arrived", room=req.bootstrap_room)
            return [self._arrive(req)]
        if res.state == KVPoll.Failed:
            del self.transferring[req.rid]
            self.agent.clear(req.bootstrap_room)
            self._quarantine(req)
            code = 400 if res.permanent else 502  # 400: deterministic (a schema mismatch), a retry fails the same way
            return [HandoffFailed(req, f"KV transfer of room {req.bootstrap_room} failed: {res.reason}", code)]
        return []

    def _slots(self, req: Request) -> torch.Tensor:
        page = self.parts.scheduler.blocks.page_size
        return slot_index([req.block_ids], len(req.prompt_ids), page)[0].to(self.parts.device)  # [n]

    def _arrive(self, req: Request) -> Event:
        """Take the room's parts and check its metadata row -> KVArrived (the parts wait in `landed`)."""
        room = req.bootstrap_room
        parts = self.agent.take(room)
        self.agent.clear(room)
        sizes = [(name, part.spec.nbytes) for stage in parts.values() for name, part in stage.items()]
        req.handoff_bytes = sum(n for _, n in sizes)
        self.handoff_bytes += req.handoff_bytes
        self.context_bytes += sum(n for name, n in sizes if split_piece(name)[0] != "kv")
        try:  # a one-sided backend landed the row in this decode's memory: read it back
            landed = parts if self.landings is None else self.landings.meta_row(parts, req.block_ids)
            row = read_meta(self.schema, landed, room)
        except Exception as e:  # whatever the bytes were, only this request fails; the engine keeps serving
            return HandoffFailed(req, f"handoff of room {room} rejected: {type(e).__name__}: {e}", 502)
        self.landed[req.rid] = _Landed(req, parts, row)
        # the prefill scored the first token when this request asked for logprobs
        return KVArrived(req, row.first_token, (row.first_logprob, row.top_logprobs[: req.params.top_logprobs_num]))

    def _write(self, landed: _Landed) -> Event:
        """The target KV (unless a one-sided backend put it in place) and the drafter's context into the pools at
        the request's slots -> KVWritten, or HandoffFailed."""
        req, parts = landed.req, landed.parts
        room, slots, proposer = req.bootstrap_room, self._slots(req), self.parts.proposer
        try:
            if self.landings is not None:  # the target KV is in the pool already; the context is read back
                parts = self.landings.parts(parts, slots, req.cached_tokens)
                self.landed_rooms += 1
            else:
                write_kv(self.parts.pool, parts, slots)
            if proposer is not None:
                req.draft_ctx_start = inject_context(proposer, self.schema, parts, landed.row, slots)
        except Exception as e:  # whatever the bytes were, only this request fails; the engine keeps serving
            return HandoffFailed(req, f"handoff of room {room} rejected: {type(e).__name__}: {e}", 502)
        timeline.mark("decode", "committed", room=room)
        return KVWritten(req)

    def _fake_arrival(self, req: Request) -> list[Event]:
        slots = self._slots(req)
        _zero(self.parts.pool, slots)
        if self.parts.proposer is not None:
            _zero(self.parts.proposer.pool, slots)
            req.draft_ctx_start = 0
        return [KVArrived(req, req.prompt_ids[-1]), KVWritten(req)]

    def wait(self, idle: bool) -> None:
        """No polling sleep: until a room finishes or a request arrives (NEWS_WAIT_S at most, for the
        quarantine's clock). receive() then polls every room, so a wake-up that lands after clear() is not lost."""
        if idle and self.has_work():
            self.news.wait(NEWS_WAIT_S)
            self.news.clear()

    def wake(self) -> None:
        self.news.set()

    def drop(self, req: Request) -> None:
        self.landed.pop(req.rid, None)  # ended at its first token, or aborted, before its KV was written
        p = self.transferring.pop(req.rid, None)
        if p is not None and not p.bootstrap.is_fake:
            self.agent.abort(req.bootstrap_room, "aborted by the decode server's client")
            self.agent.clear(req.bootstrap_room)
            self._quarantine(req)
        self.prealloc.pop(req.rid, None)
        super().drop(req)

    def _quarantine(self, req: Request) -> None:
        if self.landings is not None and req.block_ids:
            owner = self.parts.scheduler.quarantine(req)
            self.quarantine.append((time.monotonic() + QUARANTINE_S, owner))

    def _release_quarantined(self) -> None:
        now = time.monotonic()
        while self.quarantine and self.quarantine[0][0] <= now:
            self.parts.scheduler.release_quarantined(self.quarantine.pop(0)[1])

    def has_work(self) -> bool:
        return bool(self.prealloc or self.transferring or self.landed or self.quarantine)

    def stats(self) -> dict:
        return {"num_prealloc": len(self.prealloc), "num_transfers_inflight": len(self.transferring),
                "num_quarantined": len(self.quarantine), "landed_rooms_total": self.landed_rooms,
                "handoff_bytes_total": self.handoff_bytes, "context_bytes_total": self.context_bytes}

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()


def _zero(pool: KVPool, slots: torch.Tensor) -> None:
    """K and V of every layer of `pool` at `slots` [n] set to zero (a fake request's prompt, no transfer)."""
    for k, v in pool.layers.values():
        k.index_fill_(0, slots, 0)
        v.index_fill_(0, slots, 0)
