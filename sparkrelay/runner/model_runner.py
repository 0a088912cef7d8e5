"""Turns a scheduled batch into tensors, runs the target model once, samples the next tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch

from sparkrelay.grammar.rows import masks
from sparkrelay.kvcache.pool import KVPool
from sparkrelay.models.attention import AttnMeta
from sparkrelay.models.decoder import CausalLM, StageOutput
from sparkrelay.runner.logprobs import Entry, Scored, score_rows, token_logprobs
from sparkrelay.runner.sampler import SamplingBatch, SeededGenerators, draw
from sparkrelay.scheduler.request import Request
from sparkrelay.scheduler.scheduler import Batch


@dataclass
class RunResult:
    """Per scheduled sequence, in batch order: the tokens to append (empty when it does not sample),
    the number of its tokens whose KV is now cached, and for a speculative round (drafts proposed,
    drafts accepted)."""

    tokens: list[list[int]]
    computed: list[int]
    rounds: list[Optional[tuple[int, int]]] = field(default_factory=list)
    # return_logprob only (else empty): per sequence, one entry per token of `tokens`; and the
    # prompt positions this forward scored, as (first position, entries)
    logprobs: list[list[Entry]] = field(default_factory=list)
    prompt_logprobs: list[Optional[tuple[int, list[Entry]]]] = field(default_factory=list)


class Runner(Protocol):
    """What the engine asks of its runner (this ModelRunner, SpecRunner, pipeline/runner.py's
    PipelineRunner)."""

    def run(self, batch: Batch) -> RunResult: ...

    def release(self, rid: str) -> None: ...

    @property
    def failure(self) -> Optional[str]:
        """Why the runner can no longer run (a pipeline stage died), or None."""

    @property
    def rendezvous_port(self) -> Optional[int]:
        """The pipeline stages' rendezvous port (--pp-size > 1), or None."""

    def close(self) -> None: ...


class ModelRunner:
    """One forward per batch in this process (no pipeline stages): it cannot fail apart and has
    nothing to close."""

    failure: Optional[str] = None
    rendezvous_port: Optional[int] = None

    def __init__(self, model: CausalLM, pool: KVPool, device: torch.device, seed: int) -> None:
        self.model, self.pool, self.device = model, pool, device
        self.shared_gen = torch.Generator(device=device).manual_seed(seed)
        self.generators = SeededGenerators(device)
        self.taps: tuple[int, ...] = ()

    def release(self, rid: str) -> None:
        self.generators.drop(rid)

    def close(self) -> None:
        pass

    @torch.inference_mode()
    def run(self, batch: Batch) -> RunResult:
        seqs = batch.seqs
        meta = self.attn_meta(
            [s.start for s in seqs], [s.end for s in seqs], [s.req.block_ids for s in seqs]
        )
        ids = [t for s in seqs for t in s.req.all_ids[s.start : s.end]]
        # [B] last fed row of each sequence
        ends = torch.tensor([s.end - s.start for s in seqs]).cumsum(0) - 1
        rows = [i for i, s in enumerate(seqs) if s.sample]
        scored = prompt_rows(seqs)  # input logprobs: extra logits rows after the sampling ones
        extra = [start + j for _, _, start, n in scored for j in range(n)]
        logits_rows = ends[rows]
        if extra:  # only a request with logprob_start_len >= 0 scores prompt rows
            logits_rows = torch.cat([logits_rows, torch.tensor(extra, dtype=torch.long)])
        out = self.forward(meta, ids, logits_rows)
        self.after_forward(meta, out)
        logits = out.logits[: len(rows)]  # [R, V]
        next_ids = self.sample([seqs[i].req for i in rows], logits) if rows else []
        tokens: list[list[int]] = [[] for _ in seqs]
        for i, t in zip(rows, next_ids):
            tokens[i] = [t]
        res = RunResult(tokens, [s.end for s in seqs])
        if any(s.req.params.return_logprob for s in seqs):
            res.logprobs = output_logprobs(
                [seqs[i].req for i in rows], rows, logits, next_ids, len(seqs)
            )
            res.prompt_logprobs = score_prompts(seqs, scored, out.logits[len(rows) :])
        return res

    def attn_meta(self, starts: list[int], ends: list[int], tables: list[list[int]]) -> AttnMeta:
        return AttnMeta.build(starts, ends, tables, self.pool.page_size, self.device)

    def forward(self, meta: AttnMeta, ids: list[int], logits_rows: torch.Tensor) -> StageOutput:
        return self.model(
            meta,
            self.pool.layers,
            input_ids=torch.tensor(ids, device=self.device),
            logits_index=logits_rows.to(self.device),
            taps=self.taps,
        )

    def after_forward(self, meta: AttnMeta, out: StageOutput) -> None:
        """Hook for work on every fed row (the speculative runner writes the drafter's context
        here)."""

    def sample(self, reqs: list[Request], logits: torch.Tensor) -> list[int]:
        """logits [R, V] (raw, left untouched) -> one token per request, drawn from the penalised logits
        under each request's grammar."""
        return draw(
            logits,
            [r.params for r in reqs],
            [r.rid for r in reqs],
            self.generators,
            self.shared_gen,
            [r.prompt_ids for r in reqs],
            [r.output_ids for r in reqs],
            masks([r.grammar for r in reqs], logits.shape[1], [r.params.greedy for r in reqs]),
        )

    def sampling_batch(
        self, reqs: list[Request], repeats: Optional[list[int]] = None
    ) -> SamplingBatch:
        """Per-row sampling parameters; with `repeats`, request i fills repeats[i] consecutive
        rows."""
        return SamplingBatch.build(
            [r.params for r in reqs], [r.rid for r in reqs], self.generators, repeats
        )


def output_logprobs(
    reqs: list[Request], rows: list[int], logits: torch.Tensor, next_ids: list[int], num_seqs: int
) -> list[list[Entry]]:
    """The sampled tokens' logprobs from the raw logits [R, V], for the requests that asked (empty
    lists else)."""
    out: list[list[Entry]] = [[] for _ in range(num_seqs)]
    asked = [j for j, r in enumerate(reqs) if r.params.return_logprob]
    if asked:
        idx = torch.tensor(asked, device=logits.device)
        entries = token_logprobs(
            logits.index_select(0, idx),
            [next_ids[j] for j in asked],
            [reqs[j].params.top_logprobs_num for j in asked],
        )
        for j, e in zip(asked, entries):
            out[rows[j]] = [e]
    return out


def prompt_rows(seqs) -> list[Scored]:
    """Fed rows whose logits score a prompt token (logprob_start_len >= 0): per sequence (index,
    first scored position, first flat row, count). Row of position p scores the token at p + 1;
    positions already recorded (a recomputed prompt) are not scored again."""
    out, offset = [], 0
    for i, s in enumerate(seqs):
        lp = s.req.logprobs
        if lp is not None and lp.input_start >= 0:
            first = max(s.start + 1, lp.input_start, 1, lp.input_start + len(lp.input))
            # the last scored position (row p = last - 1)
            last = min(s.end, len(s.req.prompt_ids) - 1)
            if last >= first:
                out.append((i, first, offset + first - 1 - s.start, last - first + 1))
        offset += s.end - s.start
    return out


def score_prompts(
    seqs, scored: list[Scored], logits: torch.Tensor
) -> list[Optional[tuple[int, list[Entry]]]]:
    """logits [E, V] of the rows `prompt_rows` chose -> per sequence (first position, entries) or None."""
    targets = [seqs[i].req.prompt_ids[first + j] for i, first, _, n in scored for j in range(n)]
    ks = [seqs[i].req.params.top_logprobs_num for i, _, _, n in scored for _ in range(n)]
    return score_rows(scored, targets, ks, logits, len(seqs))
