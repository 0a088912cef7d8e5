"""The engine step, over continuous batches of requests:
    receive handoff -> schedule -> run (propose/verify inside a SpecRunner) -> postprocess -> send handoff.

One Engine serves every --disaggregation-mode; the PD role is composed in (disagg/roles.py):
aggregated, it is a no-op; a prefill hands each request off once its first token is sampled; a
decode receives each request's prompt KV before the request joins the batch. The role reports back
as typed events, applied here.

Synchronous and single-threaded. A server runs it in its own process, the scheduler process, whose
main thread builds and steps it (manager/process.py, manager/loop.py); AsyncEngine runs the same
loop on a thread of the caller's process (tests, embedding the app), and the offline API (llm.py)
calls it directly.
"""

from __future__ import annotations

import logging
import time
from concurrent import futures
from typing import Optional

from sparkrelay.config import Config
from sparkrelay.disagg.factory import build_role
from sparkrelay.disagg.roles import (
    EngineParts,
    Event,
    HandedOff,
    HandoffFailed,
    KVArrived,
    KVWritten,
)
from sparkrelay.engine import setup
from sparkrelay.grammar.backends import Grammar
from sparkrelay.host import reuse_freed_memory
from sparkrelay.kvcache.pool import KVPool
from sparkrelay.models.decoder import load_causal_lm
from sparkrelay.models.loader import SHAPE_FIELDS, read_config
from sparkrelay.models.quant import apply_torchao_config
from sparkrelay.runner.model_runner import RunResult
from sparkrelay.scheduler.block_manager import BlockManager
from sparkrelay.scheduler.radix_cache import RadixCache
from sparkrelay.scheduler.request import (
    Bootstrap,
    Request,
    RequestError,
    RequestOutput,
    SamplingParams,
    Status,
)
from sparkrelay.scheduler.scheduler import Batch, Scheduler
from sparkrelay.scheduler.stop import StopChecker
from sparkrelay.trace import timeline

logger = logging.getLogger(__name__)

COMPILE_POLL_S = 0.005  # an otherwise idle loop's wait for a grammar being compiled


class Engine:
    def __init__(self, config: Config) -> None:
        self.config = config
        reuse_freed_memory()  # activations reuse the heap instead of faulting in fresh pages (host.py)
        self.device = setup.check_device(config.model.device)
        self.dtype = setup.resolve_dtype(config.model.dtype, config.model.device)
        # a prefill's bootstrap server is up before stages load
        self.role = build_role(config, self.dtype)
        try:
            self._build(config)
            self.grammars = setup.build_grammars(
                config, self.tokenizer, self.vocab_size, self.eos_token_ids
            )
            # (request, its PD fields, its grammar, the compile's future) until it is compiled
            self._compiling: list[tuple[Request, Optional[Bootstrap], Grammar, futures.Future]] = []
            self.role.attach(
                EngineParts(
                    self.scheduler, self.pool, self.proposer, self.device, self.context_length
                )
            )
        except BaseException:
            self.role.close()
            raise

    def _build(self, config: Config) -> None:
        mc = config.model
        self.hf_config = read_config(mc.model_path, SHAPE_FIELDS)
        self.model = load_causal_lm(
            mc.model_path,
            0,
            setup.stage0_end(config, self.hf_config),
            dtype=self.dtype,
            device=mc.device,
            load_format=mc.load_format,
        )
        apply_torchao_config(self.model, mc.torchao_config)
        self.tokenizer = setup.load_tokenizer(mc.tokenizer_path or mc.model_path, mc.chat_template)
        spec = self.model.spec
        self.vocab_size = spec.vocab_size
        self.context_length = setup.context_length(config, spec.max_position_embeddings)
        self.eos_token_ids = setup.eos_ids(mc.model_path, self.hf_config, self.tokenizer)
        page = config.cache.page_size
        self.max_total_tokens = setup.kv_capacity(
            config,
            self.context_length,
            KVPool.bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim, self.dtype),
        )
        num_blocks = self.max_total_tokens // page
        self.blocks = BlockManager(num_blocks, page)
        self.pool = KVPool(
            range(self.model.start, self.model.end),
            num_blocks,
            page,
            spec.num_kv_heads,
            spec.head_dim,
            self.dtype,
            self.device,
        )
        self.proposer = None
        if config.spec.speculative_algorithm:
            self.proposer = setup.build_proposer(
                config, self.model, self.dtype, self.device, num_blocks
            )
        lookahead = 1 if self.proposer is None else self.proposer.max_drafts + 1
        sc = config.scheduler
        self.scheduler = Scheduler(
            self.blocks,
            sc.max_running_requests,
            sc.chunked_prefill_size,
            lookahead,
            self._prefix_cache(config),
            self.role.needs.computed_tail,
        )
        self.runner, self.spec_stats = setup.build_runner(
            config,
            self.model,
            self.pool,
            self.device,
            self.proposer,
            self.context_length,
            self.role.needs,
        )
        if mc.enable_torch_compile:
            setup.compile_model(self.model, self.proposer)
        self.stop = StopChecker(self.tokenizer)
        self.requests: dict[str, Request] = {}
        self._ready: list[RequestOutput] = []
        self._leaving: list[Request] = []  # first token sampled on a prefill: handed off this step
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "finished": 0}

    def _prefix_cache(self, config: Config) -> Optional[RadixCache]:
        """The radix cache, on unless --disable-radix-cache, in every role: a prefill keeps the
        drafter's context beside its cached pages (disagg/prefill_sink.py), a decode names the
        prefix it holds in TRANSFER_INFO (disagg/decode_role.py); docs/prefix_cache.md."""
        if config.cache.disable_radix_cache:
            return None
        return RadixCache(self.blocks, needs_draft=self.proposer is not None)

    @property
    def model_info(self) -> dict:
        return setup.model_info(self.config, self.hf_config)

    # -- requests ----------------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError (-> HTTP 400) for a request this engine cannot serve."""
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        bad = [
            t
            for t in prompt_ids
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size
        ]
        if bad:
            raise RequestError(f"token ids out of vocabulary [0, {self.vocab_size}): {bad[:5]}")
        n = len(prompt_ids)
        if n >= self.context_length:
            raise RequestError(
                f"the prompt has {n} tokens; the context length is {self.context_length}"
            )
        if n + params.max_new_tokens > self.context_length:
            raise RequestError(
                f"prompt ({n} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the "
                f"context length {self.context_length}"
            )
        if n + params.max_new_tokens + self.scheduler.decode_lookahead > self.max_total_tokens:
            raise RequestError(
                f"prompt ({n} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the KV "
                f"cache capacity {self.max_total_tokens}"
            )
        if any(not 0 <= t < self.vocab_size for t in params.stop_token_ids):
            raise RequestError(
                f"stop_token_ids out of vocabulary: {list(params.stop_token_ids)[:5]}"
            )
        if params.return_logprob and params.logprob_start_len >= 0:
            self.validate_input_logprobs(n, params.logprob_start_len)
        if params.grammar is not None and self.grammars is None:
            raise RequestError(
                f"`{params.grammar[0]}`: this server runs with --grammar-backend none (no "
                "structured outputs)"
            )

    def validate_input_logprobs(self, n: int, start: int) -> None:
        """Prompt logprobs are scored where the prompt runs: this runner, a pipeline's last stage,
        or (PD) the prefill server; a decode server leaves them empty and the PD router fills them
        from the prefill's answer."""
        if start >= n:
            raise RequestError(
                f"logprob_start_len {start} must be smaller than the prompt length ({n} tokens)"
            )

    def add_request(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        bootstrap: Optional[Bootstrap] = None,
    ) -> None:
        """`bootstrap`: the PD router's fields (required by a PD role, ignored by an aggregated
        engine)."""
        if rid in self.requests:
            raise RequestError(f"request id {rid!r} is already in use")
        self.role.check(bootstrap)
        self.validate(prompt_ids, params)
        req = Request(
            rid, list(prompt_ids), params, self.eos_token_ids, arrival_time=time.monotonic()
        )
        self.requests[rid] = req
        timeline.mark(
            self.role.name,
            "queued",
            t=req.arrival_time,
            rid=rid,
            room=bootstrap.room if bootstrap else 0,
        )
        self.counters["prompt_tokens"] += len(prompt_ids)
        if params.grammar is not None:
            self._compile(req, bootstrap)
            return
        self._admit(req, bootstrap)

    def _admit(self, req: Request, bootstrap: Optional[Bootstrap]) -> None:
        """A request ready to run (its grammar compiled): to the role or the scheduler."""
        if self.role.take(req, bootstrap):
            return  # decode: scheduled once its prompt's KV arrived
        scores_prompt = req.logprobs is not None and req.logprobs.input_start >= 0
        if req.params.max_new_tokens == 0 and not scores_prompt and not self.role.sends_first_token:
            req.finish({"type": "length", "length": 0})
            self._release(req)
            return
        # max_new_tokens 0 with prompt logprobs: the prefill scores the prompt
        self.scheduler.add(req)

    # -- grammars ----------------------------------------------------------------------------------
    def _compile(self, req: Request, bootstrap: Optional[Bootstrap]) -> None:
        """Queue the request until its grammar is compiled (on the compiler's thread, never here)."""
        grammar = Grammar(*req.params.grammar)
        self._compiling.append((req, bootstrap, grammar, self.grammars.submit(grammar)))

    def _admit_compiled(self) -> None:
        """Requests whose grammar compiled start, with their matcher; a refused grammar fails its
        request with a 400."""
        waiting = []
        for item in self._compiling:
            req, bootstrap, grammar, fut = item
            if req.is_finished:
                continue  # aborted while compiling
            if not fut.done():
                waiting.append(item)
                continue
            why = self.grammars.forget_failed(grammar, fut)
            if why is not None:
                self._fail(req, why, 400)
                continue
            req.grammar = self.grammars.matcher(fut)
            self._admit(req, bootstrap)
        self._compiling = waiting

    def _wait_compiling(self) -> None:
        """Nothing else to do: wait a little for a grammar instead of spinning the loop."""
        futures.wait([f for *_, f in self._compiling], COMPILE_POLL_S, futures.FIRST_COMPLETED)

    def wake(self) -> None:
        """Thread safe: end the role's idle wait now (a command is waiting for the engine
        thread)."""
        self.role.wake()

    def abort(self, rid: str) -> None:
        req = self.requests.get(rid)
        if req is None:
            return
        req.finish({"type": "abort", "message": "aborted"})
        self.role.drop(req)
        self.scheduler.remove(req)
        self.runner.release(rid)
        self.requests.pop(rid, None)

    def has_work(self) -> bool:
        return (
            self.scheduler.has_work()
            or bool(self._ready)
            or self.role.has_work()
            or bool(self._compiling)
        )

    # -- the step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        # decode: prealloc -> transferring -> running; prefill: stage reports
        self._apply(self.role.receive())
        if self._compiling:
            self._admit_compiled()
        # a decode's first tokens (and finished handoffs) go out now, not after the next round
        if self._ready:
            return self._take_ready()
        batch = self.scheduler.schedule()
        if batch is not None:
            self._postprocess(batch, self.runner.run(batch))
        self.role.send(self._take_leaving())  # prefill: requests whose first token was sampled
        idle = batch is None and not self._ready
        if idle and self._compiling:  # a short wait for the grammar, not the role's 50 ms
            self._wait_compiling()
            idle = False
        self.role.wait(idle=idle)
        return self._take_ready()

    def _postprocess(self, batch: Batch, result: RunResult) -> None:
        now = time.monotonic()
        if self.spec_stats and batch.kind == "decode" and not result.rounds:
            self.spec_stats.plain_steps += 1  # the runner stepped without drafting
        rounds = result.rounds or [None] * len(batch.seqs)
        for i, (seq, tokens, computed, rnd) in enumerate(
            zip(batch.seqs, result.tokens, result.computed, rounds)
        ):
            req = seq.req
            req.num_computed = computed
            if seq.sample and batch.kind == "prefill":
                # the prompt's pages, for requests that share its prefix
                self.scheduler.cache_computed(req)
            if result.prompt_logprobs and result.prompt_logprobs[i] is not None:
                req.logprobs.add_input(*result.prompt_logprobs[i])
            if not tokens:
                continue
            lps = result.logprobs[i] if req.logprobs is not None and result.logprobs else None
            if self.role.sends_first_token:
                self._leave(req, tokens[0], lps, now)
            else:
                self._commit(req, tokens, lps, rnd, now)

    def _commit(
        self,
        req: Request,
        tokens: list[int],
        lps: Optional[list],
        rnd: Optional[tuple[int, int]],
        now: float,
    ) -> None:
        if req.params.max_new_tokens == 0:  # only the prompt's logprobs were asked for
            req.finish({"type": "length", "length": 0})
            self._release(req)
            return
        if req.first_token_time is None:
            req.first_token_time = now
        committed = self._append(req, tokens)
        if lps is not None:
            req.logprobs.add_output(lps[:committed])
        if rnd is not None:
            self._record_round(req, rnd, committed)
        self._emit(req, new_ids=req.output_ids[len(req.output_ids) - committed :])
        if req.is_finished:
            self._release(req)

    def _leave(self, req: Request, token: int, lps: Optional[list], now: float) -> None:
        """A prefill's first token ends the request's compute here: no stop rule (the decode applies
        them), out of the batch with its blocks held until every stage has sent its part."""
        req.first_token_time = now
        timeline.mark("prefill", "sampled", rid=req.rid, room=req.bootstrap_room)
        req.output_ids.append(token)
        if lps is not None:  # also in the metadata row, for the decode
            req.logprobs.add_output(lps)
        self.counters["generation_tokens"] += 1
        self.scheduler.detach(req)
        self._leaving.append(req)

    # -- what the role reports ---------------------------------------------------------------------
    def _apply(self, events: list[Event]) -> None:
        for ev in events:
            if isinstance(ev, KVArrived):
                self._arrived(ev)
            # a fake-bootstrap request's comes with its KVArrived, which may end it
            elif isinstance(ev, KVWritten):
                if ev.req.rid in self.requests and not ev.req.is_finished:
                    self.scheduler.admit_transferred(ev.req)
            elif isinstance(ev, HandedOff):
                ev.req.finish({"type": "length", "length": len(ev.req.output_ids)})
                self._emit(ev.req, new_ids=list(ev.req.output_ids))
                self._release(ev.req)
            elif isinstance(ev, HandoffFailed):
                self._fail(ev.req, ev.reason, ev.status_code)

    def _arrived(self, ev: KVArrived) -> None:
        """Decode: the prompt's parts are in; the prefill's first token is this request's first
        output, which goes out before the KV is written (KVWritten then admits the request to the
        batch)."""
        req = ev.req
        req.first_token_time = time.monotonic()
        if req.params.max_new_tokens == 0:
            req.finish({"type": "length", "length": 0})
            self._release(req)
            return
        committed = self._append(req, [ev.first_token])
        if req.logprobs is not None:
            req.logprobs.add_output([ev.first_logprob])
        self._emit(req, new_ids=req.output_ids[len(req.output_ids) - committed :])
        if req.is_finished:
            self._release(req)

    def _fail(self, req: Request, reason: str, status_code: int) -> None:
        logger.warning("request %s (room %d) failed: %s", req.rid, req.bootstrap_room, reason)
        req.finish({"type": "abort", "message": reason, "status_code": status_code})
        self._release(req)

    # -- outputs -----------------------------------------------------------------------------------
    def _append(self, req: Request, tokens: list[int]) -> int:
        """Append tokens one at a time until a stop condition holds; returns how many were
        appended."""
        for i, tok in enumerate(tokens):
            req.output_ids.append(tok)
            self.counters["generation_tokens"] += 1
            self.stop.update(req, self.context_length)
            if req.grammar is not None and not req.is_finished:
                self._advance_grammar(req, tok)
            if req.is_finished:
                return i + 1
        return len(tokens)

    def _advance_grammar(self, req: Request, token: int) -> None:
        """The matcher follows every committed token; a complete grammar ends the request (stop),
        as SGLang's does."""
        if not req.grammar.consume(token):
            logger.error("request %s: token %d is outside its grammar", req.rid, token)
            req.finish({"type": "abort", "message": "a token outside the grammar was sampled"})
        elif req.grammar.finished:
            req.finish({"type": "stop", "matched": None})

    def _record_round(self, req: Request, rnd: tuple[int, int], committed: int) -> None:
        proposed, accepted = rnd
        req.spec_verify_ct += 1
        req.spec_committed += committed
        self.spec_stats.record(proposed, committed, min(accepted, committed))

    def _emit(self, req: Request, new_ids: list[int]) -> None:
        if len(new_ids) == len(req.output_ids) and new_ids:
            timeline.mark(self.role.name, "first_token", rid=req.rid, room=req.bootstrap_room)
        tau = req.spec_committed / req.spec_verify_ct if req.spec_verify_ct else None
        lp = req.logprobs.snapshot() if req.logprobs is not None else None
        self._ready.append(
            RequestOutput(
                req.rid,
                new_ids,
                list(req.output_ids),
                req.is_finished,
                req.finish_reason,
                len(req.prompt_ids),
                req.output_text,
                req.spec_verify_ct,
                tau,
                lp,
                req.cached_tokens,
                req.handoff_bytes,
            )
        )

    def _release(self, req: Request) -> None:
        if req.status == Status.FINISHED and not any(
            o.rid == req.rid and o.finished for o in self._ready
        ):
            self._emit(req, new_ids=[])
        self.role.drop(req)
        self.scheduler.remove(req)
        self.runner.release(req.rid)
        self.requests.pop(req.rid, None)
        self.counters["finished"] += 1

    def _take_ready(self) -> list[RequestOutput]:
        out, self._ready = self._ready, []
        return out

    def _take_leaving(self) -> list[Request]:
        out, self._leaving = self._leaving, []
        return out

    # -- introspection -----------------------------------------------------------------------------
    def stats(self) -> dict:
        """kv_used_tokens: held by requests; a cached page no request holds is counted in
        prefix_cache_tokens only."""
        ps, sched = self.blocks.page_size, self.scheduler
        used = self.blocks.num_used * ps
        return {
            "num_running": len(sched.running),
            "num_waiting": len(sched.waiting),
            "kv_used_tokens": used,
            "kv_total_tokens": self.max_total_tokens,
            "kv_usage": used / self.max_total_tokens,
            "num_preemptions": sched.num_preemptions,
            **self._cache_stats(),
            **(self.spec_stats.summary() if self.spec_stats else {}),
            **self.role.stats(),
        }

    def _cache_stats(self) -> dict:
        sched = self.scheduler
        queried = sched.cache_queried_tokens
        return {
            "prefix_cache": "off" if sched.cache is None else "on",
            "prefix_cache_tokens": self.blocks.num_cached * self.blocks.page_size,
            "cache_hit_tokens": sched.cache_hit_tokens,
            "cache_queried_tokens": queried,
            "cache_evicted_tokens": sched.cache.num_evicted * self.blocks.page_size
            if sched.cache
            else 0,
            "cache_hit_rate": sched.cache_hit_tokens / queried if queried else 0.0,
        }

    def flush_cache(self) -> bool:
        """Empty the prefix cache (SGLang's /flush_cache); False, and nothing changes, while
        requests are in flight."""
        return not self.requests and self.scheduler.flush_cache()

    def check(self) -> None:
        self.scheduler.check()

    def fatal_error(self) -> Optional[str]:
        """Why this engine can no longer step (a pipeline stage died), or None. The server then
        shuts down."""
        return self.runner.failure

    def close(self) -> None:
        """Shut the pipeline stages down (their processes exit), then the role's servers and agents.
        Idempotent."""
        self.runner.close()
        self.role.close()
        if self.grammars is not None:
            self.grammars.close()


def build_engine(config: Config) -> Engine:
    """The engine of a server (launch_server.py); its PD role comes from --disaggregation-mode."""
    return Engine(config)
