"""Turns a scheduled batch into tensors, runs the target model once, samples the next tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sparkrelay.engine.request import Request
from sparkrelay.engine.scheduler import Batch
from sparkrelay.kvcache.pool import KVPool
from sparkrelay.models.attention import AttnMeta
from sparkrelay.models.qwen3 import Qwen3ForCausalLM
from sparkrelay.runner.sampler import SamplingBatch, sample


@dataclass
class RunResult:
    """next_ids[i] is the token sampled for the i-th sampling sequence of the batch (in batch order)."""

    next_ids: list[int]


class ModelRunner:
    def __init__(self, model: Qwen3ForCausalLM, pool: KVPool, device: torch.device, seed: int) -> None:
        self.model, self.pool, self.device = model, pool, device
        self.shared_gen = torch.Generator(device=device).manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def release(self, rid: str) -> None:
        self._generators.pop(rid, None)

    @torch.inference_mode()
    def run(self, batch: Batch) -> RunResult:
        seqs = batch.seqs
        ids = [t for s in seqs for t in s.req.all_ids[s.start : s.end]]
        meta = AttnMeta.build([s.start for s in seqs], [s.end for s in seqs], [s.req.block_ids for s in seqs],
                              self.pool.page_size, self.device)
        ends = torch.tensor([s.end - s.start for s in seqs]).cumsum(0) - 1  # [B] last fed row of each sequence
        rows = [i for i, s in enumerate(seqs) if s.sample]
        if not rows:
            self.model(meta, self.pool.layers, input_ids=torch.tensor(ids, device=self.device), logits_index=ends[:0])
            return RunResult([])
        out = self.model(meta, self.pool.layers, input_ids=torch.tensor(ids, device=self.device),
                         logits_index=ends[rows].to(self.device))
        reqs = [seqs[i].req for i in rows]
        if all(r.params.greedy for r in reqs):
            return RunResult(out.logits.argmax(-1).tolist())
        next_ids = sample(out.logits, self._sampling_batch(reqs), self.shared_gen)  # [R]
        return RunResult(next_ids.tolist())

    def _sampling_batch(self, reqs: list[Request]) -> SamplingBatch:
        ps = [r.params for r in reqs]
        dev = self.device
        return SamplingBatch(
            temperature=torch.tensor([p.temperature for p in ps], device=dev),
            top_k=torch.tensor([max(p.top_k, 0) for p in ps], device=dev),
            top_p=torch.tensor([p.top_p for p in ps], device=dev),
            min_p=torch.tensor([p.min_p for p in ps], device=dev),
            greedy=torch.tensor([p.greedy for p in ps], device=dev),
            generators=[self._generator(r) for r in reqs],
        )

    def _generator(self, req: Request) -> Optional[torch.Generator]:
        if req.params.seed is None:
            return None
        if req.rid not in self._generators:
            self._generators[req.rid] = torch.Generator(device=self.device).manual_seed(req.params.seed)
        return self._generators[req.rid]
