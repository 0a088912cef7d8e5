"""Turns a scheduled batch into tensors, runs the target model once, samples the next tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from sparkrelay.engine.request import Request
from sparkrelay.engine.scheduler import Batch
from sparkrelay.kvcache.pool import KVPool
from sparkrelay.models.attention import AttnMeta
from sparkrelay.models.qwen3 import Qwen3ForCausalLM, StageOutput
from sparkrelay.runner.sampler import SamplingBatch, sample


@dataclass
class RunResult:
    """Per scheduled sequence, in batch order: the tokens to append (empty when it does not sample), the number
    of its tokens whose KV is now cached, and for a speculative round (drafts proposed, drafts accepted)."""

    tokens: list[list[int]]
    computed: list[int]
    rounds: list[Optional[tuple[int, int]]] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model: Qwen3ForCausalLM, pool: KVPool, device: torch.device, seed: int) -> None:
        self.model, self.pool, self.device = model, pool, device
        self.shared_gen = torch.Generator(device=device).manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}
        self.taps: tuple[int, ...] = ()

    def release(self, rid: str) -> None:
        self._generators.pop(rid, None)

    @torch.inference_mode()
    def run(self, batch: Batch) -> RunResult:
        seqs = batch.seqs
        meta = self.attn_meta([s.start for s in seqs], [s.end for s in seqs], [s.req.block_ids for s in seqs])
        ids = [t for s in seqs for t in s.req.all_ids[s.start : s.end]]
        ends = torch.tensor([s.end - s.start for s in seqs]).cumsum(0) - 1  # [B] last fed row of each sequence
        rows = [i for i, s in enumerate(seqs) if s.sample]
        out = self.forward(meta, ids, ends[rows])
        self.after_forward(meta, out)
        next_ids = self.sample([seqs[i].req for i in rows], out.logits) if rows else []
        tokens: list[list[int]] = [[] for _ in seqs]
        for i, t in zip(rows, next_ids):
            tokens[i] = [t]
        return RunResult(tokens, [s.end for s in seqs])

    def attn_meta(self, starts: list[int], ends: list[int], tables: list[list[int]]) -> AttnMeta:
        return AttnMeta.build(starts, ends, tables, self.pool.page_size, self.device)

    def forward(self, meta: AttnMeta, ids: list[int], logits_rows: torch.Tensor) -> StageOutput:
        return self.model(meta, self.pool.layers, input_ids=torch.tensor(ids, device=self.device),
                          logits_index=logits_rows.to(self.device), taps=self.taps)

    def after_forward(self, meta: AttnMeta, out: StageOutput) -> None:
        """Hook for work on every fed row (the speculative runner writes the drafter's context here)."""

    def sample(self, reqs: list[Request], logits: torch.Tensor) -> list[int]:
        """logits [R, V] -> one token per request."""
        if all(r.params.greedy for r in reqs):
            return logits.argmax(-1).tolist()
        return sample(logits, self.sampling_batch(reqs), self.shared_gen).tolist()

    def sampling_batch(self, reqs: list[Request], repeats: Optional[list[int]] = None) -> SamplingBatch:
        """Per-row sampling parameters; with `repeats`, request i fills repeats[i] consecutive rows."""
        reps = repeats or [1] * len(reqs)
        ps = [r.params for r, n in zip(reqs, reps) for _ in range(n)]
        dev = self.device
        return SamplingBatch(
            temperature=torch.tensor([p.temperature for p in ps], device=dev),
            top_k=torch.tensor([max(p.top_k, 0) for p in ps], device=dev),
            top_p=torch.tensor([p.top_p for p in ps], device=dev),
            min_p=torch.tensor([p.min_p for p in ps], device=dev),
            greedy=torch.tensor([p.greedy for p in ps], device=dev),
            generators=[self.generator(r) for r, n in zip(reqs, reps) for _ in range(n)],
        )

    def generator(self, req: Request) -> Optional[torch.Generator]:
        if req.params.seed is None:
            return None
        if req.rid not in self._generators:
            self._generators[req.rid] = torch.Generator(device=self.device).manual_seed(req.params.seed)
        return self._generators[req.rid]
