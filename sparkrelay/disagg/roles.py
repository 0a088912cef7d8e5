"""The PD role an Engine is composed with, chosen by --disaggregation-mode: aggregated (every hook a
no-op), prefill or decode.

The engine (engine/engine.py, one rank above) calls its role at fixed points of every step and of a
request's life; the role never calls the engine back. What it has to say comes back as typed events,
which the engine applies to its own request table:

    engine                                       role
    ------                                       ----
    add_request   -- check(bootstrap) ------->   raises RequestError for bad or missing PD fields
                  -- take(req, bootstrap) --->   True: the role holds the request (decode: prealloc queue)
    step          -- receive() -------------->   [KVArrived | KVWritten | HandedOff | HandoffFailed]
                  -- send(reqs) ------------->   prefill: requests whose first token was sampled leave
                  -- wait(idle) ------------->   an idle step waits briefly for transfer news
    release/abort -- drop(req) -------------->   forget it; a transfer still in flight is aborted
    stats / close -- stats(), has_work(), close()

The roles use only what is below them: the scheduler's verbs (reserve, admit_transferred), the KV
pools, the drafter; `attach(EngineParts)` hands them over once the engine has built them.
disagg/factory.py picks the role.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sparkrelay.config import Config
from sparkrelay.disagg.handoff import build_schema
from sparkrelay.envs import DisaggEnv
from sparkrelay.kvcache.pool import KVPool
from sparkrelay.models.decoder import DecoderSpec
from sparkrelay.models.loader import read_config
from sparkrelay.pipeline.needs import RunnerNeeds
from sparkrelay.scheduler.request import Bootstrap, Request, RequestError, TopLogprobs
from sparkrelay.scheduler.scheduler import Scheduler
from sparkrelay.spec.proposer import DSparkProposer
from sparkrelay.transfer.base import check_room

NEWS_WAIT_S = (
    0.05  # an idle PD step with transfers in flight waits at most this long; news and wake() end it
)


# -- events: what a receive() reports --------------------------------------------------------------
@dataclass(frozen=True)
class KVArrived:
    """Decode: every part of the prompt arrived and its metadata row checked out: the prefill's
    first token (its logprob entry when the request asked for logprobs) is the request's first
    output, streamed now. The KV and the drafter's context are written into the pools next
    (KVWritten), before the request's first decode step."""

    req: Request
    first_token: int
    first_logprob: tuple[float, TopLogprobs] = (0.0, [])


@dataclass(frozen=True)
class KVWritten:
    """Decode: the prompt's KV (and the drafter's context) is in the pools at req.block_ids; the
    request joins the batch and decodes on from its first token."""

    req: Request


@dataclass(frozen=True)
class HandedOff:
    """Prefill: every stage sent its part of the room; the request finishes with its one sampled
    token."""

    req: Request


@dataclass(frozen=True)
class HandoffFailed:
    """The transfer failed: the request fails with `reason` (status 400: deterministic, a retry
    fails the same)."""

    req: Request
    reason: str
    status_code: int


Event = KVArrived | HandedOff | HandoffFailed


@dataclass(frozen=True)
class EngineParts:
    """What a role may use of the engine it is composed into (all of a lower rank than the
    engine)."""

    scheduler: Scheduler
    pool: KVPool
    proposer: Optional[DSparkProposer]
    device: torch.device
    context_length: int


class Role:
    """Aggregated serving: every hook is a no-op. The PD roles override what they need."""

    name = "aggregated"  # what the engine serves as: aggregated, prefill or decode
    sends_first_token = (
        False  # True (prefill): a sampled first token ends the request's compute on this server
    )
    needs = RunnerNeeds()  # what the role asks of the runner and the scheduler (pipeline/needs.py)

    @property
    def status_address(self) -> str:
        """Where pipeline stages report their part of a transfer ("": nowhere)."""
        return self.needs.status_address

    def attach(self, parts: EngineParts) -> None:
        """Called once, after the engine built its scheduler, pools and drafter."""

    def check(self, bootstrap: Optional[Bootstrap]) -> None:
        """Raise RequestError when this role cannot serve a request with these PD fields (ignored
        here)."""

    def take(self, req: Request, bootstrap: Optional[Bootstrap]) -> bool:
        """A new request: True when the role holds it until its KV arrives, False when the engine
        schedules it."""
        return False

    def receive(self) -> list[Event]:
        return []

    def send(self, reqs: list[Request]) -> None:
        assert not reqs, "an aggregated engine hands nothing off"

    def wait(self, idle: bool) -> None:
        """An idle step (nothing ran, nothing to report) waits here while transfers are in flight:
        until news arrives or wake() is called, NEWS_WAIT_S at most."""

    def wake(self) -> None:
        """Thread safe: end a wait() now (a request or an abort arrived for the engine)."""

    def drop(self, req: Request) -> None:
        """The engine is done with `req` (finished, failed or aborted): forget it, abort a transfer
        in flight."""

    def has_work(self) -> bool:
        return False

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        """Idempotent; safe before attach."""


class PDRole(Role):
    """What both PD roles share: this side's handoff schema and the table of rooms in flight. A
    request with the fake bootstrap host keeps room 0 (none): no stage captures or sends for it and
    no peer hears of it."""

    def __init__(self, config: Config, dtype: torch.dtype) -> None:
        self.config = config
        self.env = DisaggEnv.read()
        spec = DecoderSpec.from_hf(read_config(config.model.model_path))
        self.schema = build_schema(config, spec, dtype, self.env)
        self.by_room: dict[int, Request] = {}

    def check(self, bootstrap: Optional[Bootstrap]) -> None:
        if bootstrap is None or bootstrap.room is None:
            raise RequestError(
                f"a {self.name} server needs `bootstrap_host` and `bootstrap_room` on every request "
                "(send requests through the PD router)"
            )
        if bootstrap.peer_room is None:  # SGLang's fake host: no room to check or keep
            return
        bad = check_room(bootstrap.room)
        if bad:
            raise RequestError(bad)
        if self.name == "decode" and not bootstrap.host:
            raise RequestError("`bootstrap_host` is empty")
        if bootstrap.room in self.by_room:
            raise RequestError(
                f"bootstrap_room {bootstrap.room} is already in use by a request in flight"
            )

    def _register(self, req: Request, bootstrap: Bootstrap) -> None:
        if bootstrap.peer_room is not None:
            req.bootstrap_room = bootstrap.peer_room
            self.by_room[bootstrap.peer_room] = req

    def drop(self, req: Request) -> None:
        if req.bootstrap_room:
            self.by_room.pop(req.bootstrap_room, None)
