"""The engine step: schedule -> run -> postprocess, over continuous batches of requests.

Synchronous and single-threaded; the HTTP server runs it in its own thread (server/async_engine.py) and the
offline API (llm.py) calls it directly.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Optional

import torch

from sparkrelay.config import Config, ConfigError
from sparkrelay.scheduler.block_manager import BlockManager
from sparkrelay.scheduler.request import Bootstrap, Request, RequestError, RequestOutput, SamplingParams, Status
from sparkrelay.scheduler.scheduler import Batch, Scheduler
from sparkrelay.scheduler.stop import StopChecker
from sparkrelay.kvcache.pool import KVPool
from sparkrelay.models.loader import read_config
from sparkrelay.models.dspark import load_dspark
from sparkrelay.models.qwen3 import load_qwen3
from sparkrelay.pipeline.partition import pp_partition
from sparkrelay.runner.model_runner import ModelRunner, RunResult
from sparkrelay.runner.spec_runner import SpecRunner
from sparkrelay.spec.proposer import DSparkProposer
from sparkrelay.spec.stats import SpecStats

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    return DTYPES[name]


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class Engine:
    def __init__(self, config: Config) -> None:
        mc = config.model
        self.config = config
        self.device = torch.device(mc.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"--device {mc.device}: CUDA is not available on this machine")
        self.dtype = resolve_dtype(mc.dtype, mc.device)
        self.hf_config = read_config(mc.model_path)
        self.model = load_qwen3(mc.model_path, 0, self._stage0_end(), dtype=self.dtype, device=mc.device)
        self.tokenizer = load_tokenizer(mc.tokenizer_path or mc.model_path)
        spec = self.model.spec
        self.vocab_size = spec.vocab_size
        self.context_length = self._context_length(spec.max_position_embeddings)
        self.eos_token_ids = self._eos_ids(mc.model_path)
        page = config.cache.page_size
        total = config.cache.max_total_tokens or min(64 * self.context_length, 1 << 17)
        self.max_total_tokens = total // page * page
        if self.max_total_tokens < page:
            raise ConfigError(f"--max-total-tokens {total} is smaller than one page ({page})")
        num_blocks = self.max_total_tokens // page
        self.blocks = BlockManager(num_blocks, page)
        self.pool = KVPool(range(self.model.start, self.model.end), num_blocks, page, spec.num_kv_heads, spec.head_dim,
                           self.dtype, self.device)
        sc = config.scheduler
        self.proposer = self._build_proposer(num_blocks, page) if config.spec.speculative_algorithm else None
        lookahead = 1 if self.proposer is None else self.proposer.max_drafts + 1
        self.scheduler = Scheduler(self.blocks, sc.max_running_requests, sc.chunked_prefill_size, lookahead)
        if self.proposer is None and (config.parallel.pp_size > 1 or config.disagg.disaggregation_mode == "prefill"):
            from sparkrelay.pipeline.runner import PipelineRunner  # stage processes only when a pipeline is asked for

            # a prefill engine binds its stages' status socket before this (PrefillEngine.status_address)
            self.runner = PipelineRunner(config, self.model, self.pool,
                                         status_address=getattr(self, "status_address", ""))
            self.spec_stats = None
        elif self.proposer is None:
            self.runner = ModelRunner(self.model, self.pool, self.device, mc.seed)
            self.spec_stats = None
        else:
            self.runner = SpecRunner(self.model, self.pool, self.device, mc.seed, proposer=self.proposer,
                                     context_length=self.context_length)
            self.spec_stats = SpecStats(self.proposer.max_drafts)
        if mc.enable_torch_compile:
            self._compile()
        self.stop = StopChecker(self.tokenizer)
        self.requests: dict[str, Request] = {}
        self._ready: list[RequestOutput] = []
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "finished": 0}

    # -- set-up helpers --------------------------------------------------------------------------------------
    def _build_proposer(self, num_blocks: int, page: int) -> DSparkProposer:
        sp = self.config.spec
        head = self.model.lm_head.weight
        try:
            drafter = load_dspark(sp.speculative_draft_model_path, self.model.spec, self.dtype,
                                  self.config.model.device, share_embedding_from=self.model.model.embed_tokens.weight, share_lm_head_from=head)
        except ValueError as e:
            raise ConfigError(f"--speculative-draft-model-path {sp.speculative_draft_model_path}: {e}") from e
        cap = sp.speculative_num_draft_tokens or drafter.spec.block_size
        return DSparkProposer(drafter, num_blocks, page, self.device, cap, sp.speculative_dspark_confidence_threshold,
                              head_t=self.model.head_t)

    def _stage0_end(self) -> int:
        """With --pp-size N this process is stage 0: it loads (and caches KV for) only the first stage's layers."""
        layers = int(self.hf_config["num_hidden_layers"])
        try:
            return pp_partition(layers, self.config.parallel.pp_size)[0][1]
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def _context_length(self, model_max: int) -> int:
        asked = self.config.model.context_length
        if asked is not None and asked > model_max:
            raise ConfigError(f"--context-length {asked} exceeds the model's max_position_embeddings {model_max}")
        return asked or model_max

    def _eos_ids(self, folder: str) -> tuple[int, ...]:
        ids: list[int] = []
        gen_cfg = Path(folder) / "generation_config.json"
        for source in (json.loads(gen_cfg.read_text()) if gen_cfg.is_file() else {}, self.hf_config):
            eos = source.get("eos_token_id")
            ids.extend(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return tuple(dict.fromkeys(ids))

    def _compile(self) -> None:
        """torch.compile the forwards, shapes dynamic (token counts and context lengths change every step).
        Prefill, one-sequence decode and batched decode trace different graphs; the cache limit leaves room."""
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 32)
        self.model.body = torch.compile(self.model.body, dynamic=True)
        if self.proposer is not None:
            drafter = self.proposer.drafter
            drafter.block_forward = torch.compile(drafter.block_forward, dynamic=True)

    @property
    def model_info(self) -> dict:
        mc = self.config.model
        return {
            "model_path": os.path.abspath(mc.model_path),
            "tokenizer_path": os.path.abspath(mc.tokenizer_path or mc.model_path),
            "is_generation": True,
            "architectures": self.hf_config.get("architectures", ["Qwen3ForCausalLM"]),
            "model_type": self.hf_config.get("model_type", "qwen3"),
        }

    # -- requests --------------------------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError (-> HTTP 400) for a request this engine cannot serve."""
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        bad = [t for t in prompt_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"token ids out of vocabulary [0, {self.vocab_size}): {bad[:5]}")
        n = len(prompt_ids)
        if n >= self.context_length:
            raise RequestError(f"the prompt has {n} tokens; the context length is {self.context_length}")
        if n + params.max_new_tokens > self.context_length:
            raise RequestError(f"prompt ({n} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the "
                               f"context length {self.context_length}")
        if n + params.max_new_tokens + self.scheduler.decode_lookahead > self.max_total_tokens:
            raise RequestError(f"prompt ({n} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the KV "
                               f"cache capacity {self.max_total_tokens}")
        if any(not 0 <= t < self.vocab_size for t in params.stop_token_ids):
            raise RequestError(f"stop_token_ids out of vocabulary: {list(params.stop_token_ids)[:5]}")
        if params.return_logprob and params.logprob_start_len >= 0:
            self.validate_input_logprobs(n, params.logprob_start_len)

    def validate_input_logprobs(self, n: int, start: int) -> None:
        """Prompt logprobs are scored where the prompt runs: this runner, a pipeline's last stage, or (PD) the
        prefill server; a decode server leaves them empty and the PD router fills them from the prefill's answer."""
        if start >= n:
            raise RequestError(f"logprob_start_len {start} must be smaller than the prompt length ({n} tokens)")

    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams,
                    bootstrap: Optional[Bootstrap] = None) -> None:
        """`bootstrap` (the router's PD fields) is ignored by an aggregated engine."""
        if rid in self.requests:
            raise RequestError(f"request id {rid!r} is already in use")
        self.validate(prompt_ids, params)
        req = Request(rid, list(prompt_ids), params, self.eos_token_ids, arrival_time=time.monotonic())
        self.requests[rid] = req
        self.counters["prompt_tokens"] += len(prompt_ids)
        if params.max_new_tokens == 0 and not (req.logprobs is not None and req.logprobs.input_start >= 0):
            req.finish({"type": "length", "length": 0})
            self._release(req)
            return
        self.scheduler.add(req)  # max_new_tokens 0 with prompt logprobs: the prefill scores the prompt

    def abort(self, rid: str) -> None:
        req = self.requests.get(rid)
        if req is None:
            return
        req.finish({"type": "abort", "message": "aborted"})
        self.scheduler.remove(req)
        self.runner.release(rid)
        self.requests.pop(rid, None)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._ready)

    # -- the step ----------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if batch is None:
            return self._take_ready()
        self._postprocess(batch, self.runner.run(batch))
        return self._take_ready()

    def _postprocess(self, batch: Batch, result: RunResult) -> None:
        now = time.monotonic()
        rounds = result.rounds or [None] * len(batch.seqs)
        for i, (seq, tokens, computed, rnd) in enumerate(zip(batch.seqs, result.tokens, result.computed, rounds)):
            req = seq.req
            req.num_computed = computed
            if result.prompt_logprobs and result.prompt_logprobs[i] is not None:
                req.logprobs.add_input(*result.prompt_logprobs[i])
            if not tokens:
                continue
            if req.params.max_new_tokens == 0:  # only the prompt's logprobs were asked for
                req.finish({"type": "length", "length": 0})
                self._release(req)
                continue
            if req.first_token_time is None:
                req.first_token_time = now
            committed = self._append(req, tokens)
            if req.logprobs is not None and result.logprobs:
                req.logprobs.add_output(result.logprobs[i][:committed])
            if rnd is not None:
                self._record_round(req, rnd, committed)
            self._emit(req, new_ids=req.output_ids[len(req.output_ids) - committed :])
            if req.is_finished:
                self._release(req)

    def _append(self, req: Request, tokens: list[int]) -> int:
        """Append tokens one at a time until a stop condition holds; returns how many were appended."""
        for i, tok in enumerate(tokens):
            req.output_ids.append(tok)
            self.counters["generation_tokens"] += 1
            self.stop.update(req, self.context_length)
            if req.is_finished:
                return i + 1
        return len(tokens)

    def _record_round(self, req: Request, rnd: tuple[int, int], committed: int) -> None:
        proposed, accepted = rnd
        req.spec_verify_ct += 1
        req.spec_committed += committed
        self.spec_stats.record(proposed, committed, min(accepted, committed))

    def _emit(self, req: Request, new_ids: list[int]) -> None:
        tau = req.spec_committed / req.spec_verify_ct if req.spec_verify_ct else None
        lp = req.logprobs.snapshot() if req.logprobs is not None else None
        self._ready.append(RequestOutput(req.rid, new_ids, list(req.output_ids), req.is_finished, req.finish_reason,
                                         len(req.prompt_ids), req.output_text, req.spec_verify_ct, tau, lp))

    def _release(self, req: Request) -> None:
        if req.status == Status.FINISHED and not any(o.rid == req.rid and o.finished for o in self._ready):
            self._emit(req, new_ids=[])
        self.scheduler.remove(req)
        self.runner.release(req.rid)
        self.requests.pop(req.rid, None)
        self.counters["finished"] += 1

    def _take_ready(self) -> list[RequestOutput]:
        out, self._ready = self._ready, []
        return out

    # -- introspection ---------------------------------------------------------------------------------------
    def stats(self) -> dict:
        used = self.blocks.num_used * self.blocks.page_size
        return {"num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
                "kv_used_tokens": used, "kv_total_tokens": self.max_total_tokens,
                "kv_usage": used / self.max_total_tokens, "num_preemptions": self.scheduler.num_preemptions,
                **(self.spec_stats.summary() if self.spec_stats else {})}

    def check(self) -> None:
        self.blocks.check()

    def fatal_error(self) -> Optional[str]:
        """Why this engine can no longer step (a pipeline stage died), or None. The server then shuts down."""
        return getattr(self.runner, "failure", None)

    def close(self) -> None:
        """Shut the pipeline stages down (their processes exit); a no-op without a pipeline. Idempotent."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()
