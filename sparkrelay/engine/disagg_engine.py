"""The two PD roles of the engine (--disaggregation-mode prefill | decode).

Prefill (rank 0 of a pipeline of --pp-size stages, each with its own transfer agent, see disagg/prefill_sink.py):
    add_request(bootstrap)  -> scheduled as usual (chunked prefill), the room travels with the step descriptor
    first token sampled     -> the request leaves the scheduler but keeps its blocks ("inflight")
    every stage reports     -> Success: the request finishes with its one token; Failed: it fails with the reason;
                               its blocks are freed either way
Decode (--pp-size 1, DSpark optional):
    add_request(bootstrap)  -> prealloc: blocks for the prompt (deferred while the cache is full), then
                               DecodeAgent.begin: handshake with the prefill's bootstrap server, TRANSFER_INFO
    Success                 -> target KV written at the request's slots (paired by global layer id), the room of
                               the metadata row checked, the first token appended as the anchor, the drafter's
                               context injected at absolute positions (hidden / tail / draft-kv), then decoding
    Failed                  -> the request fails with the reason (never decodes with a cold drafter)
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

from sparkrelay.config import Config, ConfigError
from sparkrelay.disagg.handoff import build_schema, expected_parts, inject_context, read_meta, write_kv
from sparkrelay.disagg.schema import HandoffSchema, compare
from sparkrelay.disagg.stage_report import StageReportInbox
from sparkrelay.engine.engine import Engine, resolve_dtype
from sparkrelay.scheduler.request import Bootstrap, Request, RequestError, SamplingParams, Status
from sparkrelay.envs import DisaggEnv
from sparkrelay.models.attention import slot_index
from sparkrelay.models.loader import read_config
from sparkrelay.models.qwen3 import Qwen3Spec
from sparkrelay.transfer.base import SCHEMA_MISMATCH, KVPoll, check_room
from sparkrelay.transfer.bootstrap import BootstrapServer
from sparkrelay.transfer.zmq_backend import DecodeAgent

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.005  # how long a step with only transfers in flight waits for news


def _schema(config: Config, env: DisaggEnv) -> HandoffSchema:
    spec = Qwen3Spec.from_hf(read_config(config.model.model_path))
    return build_schema(config, spec, resolve_dtype(config.model.dtype, config.model.device), env)


def _check_bootstrap(bootstrap: Optional[Bootstrap], role: str) -> Bootstrap:
    if bootstrap is None or bootstrap.room is None:
        raise RequestError(f"a {role} server needs `bootstrap_host` and `bootstrap_room` on every request (send "
                           "requests through the PD router)")
    bad = check_room(bootstrap.room)
    if bad:
        raise RequestError(bad)
    if role == "decode" and not bootstrap.host:
        raise RequestError("`bootstrap_host` is empty")
    return bootstrap


class _PDEngine(Engine):
    """What both roles share: a request table keyed by room as well as by rid."""

    role = ""

    def _new_request(self, rid: str, prompt_ids: list[int], params: SamplingParams,
                     bootstrap: Optional[Bootstrap]) -> Request:
        if rid in self.requests:
            raise RequestError(f"request id {rid!r} is already in use")
        b = _check_bootstrap(bootstrap, self.role)
        if b.room in self.by_room:
            raise RequestError(f"bootstrap_room {b.room} is already in use by a request in flight")
        self.validate(prompt_ids, params)
        req = Request(rid, list(prompt_ids), params, self.eos_token_ids, arrival_time=time.monotonic())
        req.bootstrap_room = b.room
        self.requests[rid] = req
        self.by_room[b.room] = req
        self.counters["prompt_tokens"] += len(prompt_ids)
        return req

    def _fail(self, req: Request, reason: str, status_code: int = 500) -> None:
        logger.warning("request %s (room %d) failed: %s", req.rid, req.bootstrap_room, reason)
        req.finish({"type": "abort", "message": reason, "status_code": status_code})
        self._release(req)

    def _release(self, req: Request) -> None:
        self.by_room.pop(req.bootstrap_room, None)
        super()._release(req)


class PrefillEngine(_PDEngine):
    role = "prefill"

    def __init__(self, config: Config) -> None:
        self.env = DisaggEnv.read()
        self.schema = _schema(config, self.env)
        self._status = StageReportInbox()
        self.status_address = self._status.address  # every stage's sink reports here (read by the runner)
        dc = config.disagg
        self.bootstrap = BootstrapServer(dc.disaggregation_bootstrap_host, dc.disaggregation_bootstrap_port,
                                         config.parallel.pp_size, self.schema.to_dict(), config.server.port,
                                         config.cache.page_size, self.schema.dtype,
                                         auth_token=self.env.token(dc.disaggregation_auth_token))
        self.bootstrap.start()  # before the stages load: they register with it
        self.by_room: dict[int, Request] = {}
        self.inflight: dict[int, set[int]] = {}  # room -> stages that reported Success
        try:
            super().__init__(config)
        except BaseException:
            self.bootstrap.stop()
            raise
        if self.proposer is not None:
            raise ConfigError("--speculative-algorithm: a prefill server runs no drafter")

    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams,
                    bootstrap: Optional[Bootstrap] = None) -> None:
        req = self._new_request(rid, prompt_ids, params, bootstrap)
        self.scheduler.add(req)  # max_new_tokens 0 still prefills: the decode peer waits for this room's KV

    def has_work(self) -> bool:
        return super().has_work() or bool(self.inflight)

    def step(self):
        batch = self.scheduler.schedule()
        if batch is not None:
            self._postprocess(batch, self.runner.run(batch))
        self._poll_status(wait=batch is None)
        return self._take_ready()

    def _postprocess(self, batch, result) -> None:
        """A sampled first token ends the prefill's compute: the request waits, holding its blocks, until every
        stage has sent its part."""
        now = time.monotonic()
        for i, (seq, tokens, computed) in enumerate(zip(batch.seqs, result.tokens, result.computed)):
            req = seq.req
            req.num_computed = computed
            if result.prompt_logprobs and result.prompt_logprobs[i] is not None:  # in this server's answer
                req.logprobs.add_input(*result.prompt_logprobs[i])
            if not tokens:
                continue
            req.first_token_time = now
            req.output_ids.append(tokens[0])
            if req.logprobs is not None and result.logprobs:  # also in the metadata row, for the decode
                req.logprobs.add_output(result.logprobs[i])
            self.counters["generation_tokens"] += 1
            self.scheduler.running.remove(req)  # blocks stay allocated until the transfer ends
            self.inflight[req.bootstrap_room] = self.inflight.get(req.bootstrap_room, set())

    def _poll_status(self, wait: bool) -> None:
        if wait and self.inflight and not self._status.wait(IDLE_WAIT_S):
            return
        for r in self._status.drain():
            self._on_status(r.room, r.stage, r.state, r.reason)

    def _on_status(self, room: int, stage: int, state: KVPoll, reason: str) -> None:
        req = self.by_room.get(room)
        if req is None or req.is_finished:
            return
        if state == KVPoll.Failed:
            self.inflight.pop(room, None)
            code = 400 if SCHEMA_MISMATCH in reason else 500  # 400: deterministic, the router must not retry
            self._fail(req, f"KV transfer of room {room} failed on prefill stage {stage}: {reason}", code)
            return
        done = self.inflight.setdefault(room, set())
        done.add(stage)
        if len(done) == self.config.parallel.pp_size and req.output_ids:
            self.inflight.pop(room)
            req.finish({"type": "length", "length": len(req.output_ids)})
            self._emit(req, new_ids=list(req.output_ids))
            self._release(req)

    def abort(self, rid: str) -> None:
        req = self.requests.get(rid)
        if req is not None:
            self.inflight.pop(req.bootstrap_room, None)
            self.by_room.pop(req.bootstrap_room, None)
        super().abort(rid)

    def stats(self) -> dict:
        return super().stats() | {"num_transfers_inflight": len(self.inflight)}

    def close(self) -> None:
        super().close()
        self.bootstrap.stop()
        self._status.close()


@dataclass
class _Pending:
    req: Request
    bootstrap: Bootstrap
    begun: bool = False


class DecodeEngine(_PDEngine):
    role = "decode"

    def __init__(self, config: Config) -> None:
        self.env = DisaggEnv.read()
        self.by_room: dict[int, Request] = {}
        self.pending: dict[str, _Pending] = {}  # rid -> waiting for blocks or for its transfer
        self.handoff_bytes = 0  # bytes received from prefill stages (KV + handoff + metadata rows)
        self.context_bytes = 0  # of which DSpark context and metadata rows (everything but the target KV)
        super().__init__(config)
        self.schema = _schema(config, self.env)
        dc, e = config.disagg, self.env
        self.agent = DecodeAgent(self.schema.to_dict(), compare, expected_parts, dc.disaggregation_bootstrap_host,
                                 e.bootstrap_timeout, e.waiting_timeout, e.heartbeat_interval,
                                 e.heartbeat_max_failures, dc.disaggregation_bootstrap_port,
                                 auth_token=e.token(dc.disaggregation_auth_token),
                                 max_part_bytes=self._largest_part())
        self.agent.start()

    def _largest_part(self) -> int:
        """The biggest part a prompt this server accepts can need (all target layers' KV at the context length,
        or the hidden rows / draft KV): frames above it are refused before they are buffered."""
        parts = expected_parts(self.schema.to_dict(), self.context_length)
        return max(p.nbytes for stage in parts.values() for p in stage)

    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams,
                    bootstrap: Optional[Bootstrap] = None) -> None:
        req = self._new_request(rid, prompt_ids, params, bootstrap)
        self.pending[rid] = _Pending(req, bootstrap)  # even max_new_tokens 0: the prefill's KV must be received

    def has_work(self) -> bool:
        return super().has_work() or bool(self.pending)

    def step(self):
        self._prealloc()
        self._poll_transfers()
        batch = self.scheduler.schedule()
        if batch is not None:
            self._postprocess(batch, self.runner.run(batch))
        elif self.pending and not self._ready:
            time.sleep(IDLE_WAIT_S)
        return self._take_ready()

    def _prealloc(self) -> None:
        """Blocks for each new request's prompt, in arrival order; a request that does not fit waits (deferred,
        never failed, PD_PROTOCOL.md §5 item 25)."""
        for p in self.pending.values():
            if p.begun:
                continue
            n = len(p.req.prompt_ids)
            if not self.blocks.can_allocate(p.req.rid, n):
                return
            self.blocks.allocate(p.req.rid, n)
            p.req.block_ids = self.blocks.table(p.req.rid)
            b = p.bootstrap
            self.agent.begin(b.room, b.host, b.port, n)
            p.begun = True

    def _poll_transfers(self) -> None:
        for p in [p for p in self.pending.values() if p.begun]:
            res = self.agent.poll(p.req.bootstrap_room)
            if res.state == KVPoll.Success:
                self._commit(p.req)
            elif res.state == KVPoll.Failed:
                self.pending.pop(p.req.rid, None)
                self.agent.clear(p.req.bootstrap_room)
                # 400: deterministic (a schema mismatch), a retry fails the same way
                code = 400 if res.permanent else 502
                self._fail(p.req, f"KV transfer of room {p.req.bootstrap_room} failed: {res.reason}", code)

    def _commit(self, req: Request) -> None:
        room, n = req.bootstrap_room, len(req.prompt_ids)
        self.pending.pop(req.rid, None)
        parts = self.agent.take(room)
        self.agent.clear(room)
        sizes = [(name, len(part.data)) for stage in parts.values() for name, part in stage.items()]
        self.handoff_bytes += sum(n for _, n in sizes)
        self.context_bytes += sum(n for name, n in sizes if name != "kv")
        slots = slot_index([req.block_ids], n, self.blocks.page_size)[0].to(self.device)  # [n]
        try:
            row = read_meta(self.schema, parts, room)
            write_kv(self.pool, parts, slots)
            if self.proposer is not None:
                req.draft_ctx_start = inject_context(self.proposer, self.schema, parts, row, slots)
        except Exception as e:  # whatever the bytes were, only this request fails; the engine keeps serving
            self._fail(req, f"handoff of room {room} rejected: {type(e).__name__}: {e}", 502)
            return
        req.num_computed = n
        req.first_token_time = time.monotonic()
        if req.params.max_new_tokens == 0:
            req.finish({"type": "length", "length": 0})
            self._release(req)
            return
        committed = self._append(req, [row.first_token])
        if req.logprobs is not None:  # the prefill scored the first token (the same request asked it to)
            req.logprobs.add_output([(row.first_logprob, row.top_logprobs[: req.params.top_logprobs_num])])
        self._emit(req, new_ids=req.output_ids[len(req.output_ids) - committed:])
        if req.is_finished:
            self._release(req)
            return
        req.status = Status.RUNNING
        self.scheduler.running.append(req)

    def abort(self, rid: str) -> None:
        p = self.pending.pop(rid, None)
        if p is not None and p.begun:
            self.agent.abort(p.req.bootstrap_room, "aborted by the decode server's client")
            self.agent.clear(p.req.bootstrap_room)
        req = self.requests.get(rid)
        if req is not None:
            self.by_room.pop(req.bootstrap_room, None)
            self.blocks.free(rid)
        super().abort(rid)

    def stats(self) -> dict:
        waiting = sum(not p.begun for p in self.pending.values())
        return super().stats() | {"num_prealloc": waiting, "num_transfers_inflight": len(self.pending) - waiting,
                                  "handoff_bytes_total": self.handoff_bytes, "context_bytes_total": self.context_bytes}

    def close(self) -> None:
        super().close()
        self.agent.close()


def build_engine(config: Config) -> Engine:
    mode = config.disagg.disaggregation_mode
    if mode == "prefill":
        return PrefillEngine(config)
    if mode == "decode":
        return DecodeEngine(config)
    return Engine(config)
