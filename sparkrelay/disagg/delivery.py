"""How a room's parts reach a decode's pools, one class per way, chosen per room: frames (the ZMQ
backend: the parts arrive as bytes and are written at the request's slots), one-sided (Mooncake,
NIXL: the prefill writes into this decode's registered memory, disagg/landing_buffers.py) and fake
(SGLang's fake bootstrap host of /health_generate: no peer, zero KV). The decode role
(disagg/decode_role.py) calls them and branches on neither the backend nor the host; a new way to
deliver is one class here.

A delivery's `arrive` turns a room whose parts are all in into events: KVArrived (the first token streams now) and
a writer the role runs at the start of the next step (the KV and the drafter's context into the pools ->
KVWritten), or, when nothing is left to write, both events at once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from sparkrelay.disagg.handoff import inject_context, read_meta, write_kv
from sparkrelay.disagg.landing_buffers import LandingBuffers
from sparkrelay.disagg.roles import Event, HandoffFailed, KVArrived, KVWritten
from sparkrelay.disagg.schema import HandoffSchema
from sparkrelay.kvcache.pool import KVPool
from sparkrelay.models.attention import slot_index
from sparkrelay.scheduler.request import Bootstrap, Request
from sparkrelay.spec.proposer import DSparkProposer
from sparkrelay.trace import timeline
from sparkrelay.transfer.base import DecodeTransfer, KVPoll, Part, PollResult, split_piece

QUARANTINE_S = 5.0  # a failed one-sided room's blocks wait this long before reuse (its writes may be in flight)
Parts = dict[int, dict[str, Part]]
Writer = Callable[[], Event]


@dataclass
class Pools:
    """What a delivery writes into: the target's pool, the drafter (None: plain decoding), the page
    size."""

    pool: KVPool
    proposer: Optional[DSparkProposer]
    page_size: int
    device: torch.device

    def slots(self, req: Request) -> torch.Tensor:
        """The request's prompt slots [n]."""
        return slot_index([req.block_ids], len(req.prompt_ids), self.page_size)[0].to(self.device)


class FramesDelivery:
    """The parts come as frames through the transfer agent and are written into the pools here."""

    hold_s = 0.0  # a failed or aborted room's blocks are free at once

    def __init__(self, agent: DecodeTransfer, schema: HandoffSchema, pools: Pools) -> None:
        self.agent, self.schema, self.pools = agent, schema, pools
        self.handoff_bytes = 0  # bytes received from prefill stages (KV + handoff + metadata rows)
        self.context_bytes = (
            0  # of which DSpark context and metadata rows (everything but the target KV)
        )
        self.landed_rooms = (
            0  # rooms whose parts a one-sided backend wrote into this decode's memory
        )

    def match_rule(self, rule: tuple[int, int, bool]) -> tuple[int, int, bool]:
        """The prefix cache's match rule for a room (align, keep, needs_draft): the handoff's."""
        return rule

    def begin(self, bootstrap: Bootstrap, req: Request, prefix: int) -> None:
        self.agent.begin(
            bootstrap.room,
            bootstrap.host,
            bootstrap.port,
            len(req.prompt_ids),
            self._landing(req.block_ids),
            prefix,
        )

    def _landing(self, block_ids: list[int]):
        return None

    def poll(self, room: int) -> PollResult:
        return self.agent.poll(room)

    def arrive(self, req: Request) -> tuple[list[Event], Optional[Writer]]:
        """Take the room's parts and check its metadata row -> ([KVArrived], the writer), or a HandoffFailed."""
        room = req.bootstrap_room
        timeline.mark("decode", "arrived", room=room)
        parts = self.agent.take(room)
        self.agent.clear(room)
        sizes = [
            (name, part.spec.nbytes) for stage in parts.values() for name, part in stage.items()
        ]
        req.handoff_bytes = sum(n for _, n in sizes)
        self.handoff_bytes += req.handoff_bytes
        self.context_bytes += sum(n for name, n in sizes if split_piece(name)[0] != "kv")
        try:
            row = read_meta(self.schema, self._meta_parts(parts, req.block_ids), room)
        # whatever the bytes were, only this request fails; the engine keeps serving
        except Exception as e:
            return [
                HandoffFailed(req, f"handoff of room {room} rejected: {type(e).__name__}: {e}", 502)
            ], None
        # the prefill scored the first token when this request asked for logprobs
        first = KVArrived(
            req,
            row.first_token,
            (row.first_logprob, row.top_logprobs[: req.params.top_logprobs_num]),
        )
        return [first], lambda: self._write(req, parts, row)

    def _meta_parts(self, parts: Parts, block_ids: list[int]) -> Parts:
        return parts

    def _write(self, req: Request, parts: Parts, row) -> Event:
        """The target KV and the drafter's context into the pools at the request's slots -> KVWritten, or
        HandoffFailed."""
        room, slots, proposer = req.bootstrap_room, self.pools.slots(req), self.pools.proposer
        try:
            parts = self._place(parts, slots, req.cached_tokens)
            if proposer is not None:
                req.draft_ctx_start = inject_context(proposer, self.schema, parts, row, slots)
        # whatever the bytes were, only this request fails; the engine keeps serving
        except Exception as e:
            return HandoffFailed(
                req, f"handoff of room {room} rejected: {type(e).__name__}: {e}", 502
            )
        timeline.mark("decode", "committed", room=room)
        return KVWritten(req)

    def _place(self, parts: Parts, slots: torch.Tensor, cached_tokens: int) -> Parts:
        """The target KV into the pool at `slots` [n] -> the parts the drafter's context is read from."""
        write_kv(self.pools.pool, parts, slots)
        return parts

    def failed(self, room: int) -> None:
        self.agent.clear(room)

    def abort(self, room: int, reason: str) -> None:
        self.agent.abort(room, reason)
        self.agent.clear(room)


class OneSidedDelivery(FramesDelivery):
    """The prefill writes the target KV, the drafter's context and the metadata row into this
    decode's registered
    memory: the room names its landing, the context and the row are read back, and a failed room's
    blocks wait QUARANTINE_S before reuse (a stage may still be writing)."""

    hold_s = QUARANTINE_S

    def __init__(
        self, agent: DecodeTransfer, schema: HandoffSchema, pools: Pools, landings: LandingBuffers
    ) -> None:
        super().__init__(agent, schema, pools)
        self.landings = landings
        agent.register(landings.regions())

    def _landing(self, block_ids: list[int]):
        return self.landings.landing(block_ids)

    def _meta_parts(self, parts: Parts, block_ids: list[int]) -> Parts:
        return self.landings.meta_row(parts, block_ids)

    def _place(self, parts: Parts, slots: torch.Tensor, cached_tokens: int) -> Parts:
        self.landed_rooms += 1
        return self.landings.parts(parts, slots, cached_tokens)


class FakeDelivery:
    """SGLang's fake bootstrap host: no peer hears of the room; its prompt KV (and draft context) is
    zeros, its first token its prompt's last, and it takes no cached page."""

    hold_s = 0.0
    handoff_bytes = context_bytes = landed_rooms = 0

    def __init__(self, pools: Pools) -> None:
        self.pools = pools

    def match_rule(self, rule: tuple[int, int, bool]) -> tuple[int, int, bool]:
        return 0, 1, True

    def begin(self, bootstrap: Bootstrap, req: Request, prefix: int) -> None:
        pass

    def poll(self, room: int) -> PollResult:
        return PollResult(KVPoll.Success)

    def arrive(self, req: Request) -> tuple[list[Event], Optional[Writer]]:
        slots = self.pools.slots(req)
        _zero(self.pools.pool, slots)
        if self.pools.proposer is not None:
            _zero(self.pools.proposer.pool, slots)
            req.draft_ctx_start = 0
        return [KVArrived(req, req.prompt_ids[-1]), KVWritten(req)], None

    def failed(self, room: int) -> None:
        pass

    def abort(self, room: int, reason: str) -> None:
        pass


def _zero(pool: KVPool, slots: torch.Tensor) -> None:
    """K and V of every layer of `pool` at `slots` [n] set to zero."""
    for k, v in pool.layers.values():
        k.index_fill_(0, slots, 0)
        v.index_fill_(0, slots, 0)


def deliveries(
    agent: DecodeTransfer, schema: HandoffSchema, pools: Pools
) -> dict[Optional[str], FramesDelivery | FakeDelivery]:
    """Bootstrap host -> its delivery: SGLang's fake host its own, every other host (key None) the backend's."""
    from sparkrelay.scheduler.request import FAKE_BOOTSTRAP_HOST

    if agent.one_sided:  # Mooncake, NIXL
        draft_pool = pools.proposer.pool if pools.proposer is not None else None
        real = OneSidedDelivery(
            agent, schema, pools, LandingBuffers(schema, pools.pool, draft_pool)
        )
    else:
        real = FramesDelivery(agent, schema, pools)
    return {FAKE_BOOTSTRAP_HOST: FakeDelivery(pools), None: real}
