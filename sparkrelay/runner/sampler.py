"""Batched sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Sampling uses the exponential race (argmax of p / E with E ~ Exp(1) is a draw from p), so a request with its own
seed gets its noise from its own generator and draws the same tokens whatever batch it shares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class SamplingBatch:
    """Per-row parameters, [R] each."""

    temperature: torch.Tensor
    top_k: torch.Tensor   # 0 = off
    top_p: torch.Tensor
    min_p: torch.Tensor
    greedy: torch.Tensor  # bool
    generators: list[Optional[torch.Generator]]  # a row's own generator, or None for the shared one

    @property
    def all_greedy(self) -> bool:
        return bool(self.greedy.all())


def filter_probs(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """logits [R, V] -> probabilities [R, V] after temperature, top-k, top-p and min-p (float32)."""
    logits = logits.float() / sb.temperature.clamp(min=1e-5).unsqueeze(1)
    if bool((sb.top_k > 0).any()) or bool((sb.top_p < 1).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [R, V]
        rank = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
        k = torch.where(sb.top_k > 0, sb.top_k, logits.shape[1]).unsqueeze(1)
        drop = rank >= k
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        # top-p keeps the smallest prefix whose mass reaches top_p (the first token always stays)
        drop |= (probs.cumsum(-1) - probs) >= sb.top_p.unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    probs = logits.softmax(-1)
    if bool((sb.min_p > 0).any()):
        floor = sb.min_p.unsqueeze(1) * probs.max(-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def exponential_noise(shape: tuple[int, int], generators: list[Optional[torch.Generator]],
                      shared: torch.Generator, device: torch.device) -> torch.Tensor:
    noise = torch.empty(shape, device=device).exponential_(generator=shared)
    for row, gen in enumerate(generators):
        if gen is not None:
            noise[row].exponential_(generator=gen)
    return noise


def sample(logits: torch.Tensor, sb: SamplingBatch, shared: torch.Generator) -> torch.Tensor:
    """logits [R, V] -> token ids [R]."""
    greedy_ids = logits.argmax(-1)
    if sb.all_greedy:
        return greedy_ids
    probs = filter_probs(logits, sb)
    noise = exponential_noise(tuple(probs.shape), sb.generators, shared, probs.device)
    drawn = (probs / noise).argmax(-1)
    return torch.where(sb.greedy, greedy_ids, drawn)
