"""Batched sampling: repetition / frequency / presence penalties, greedy, temperature, top-k, top-p,
min-p, per-request seeds. The one path from a batch's SamplingParams to its tokens, for the plain
and speculative runners and the last pipeline stage alike: `penalize`, `SamplingBatch.build` and
`draw`.

Penalties act on the raw logits before anything else (vLLM's rule, Hugging Face's for repetition); a
batch whose requests all leave them at their defaults never calls `apply_penalties`. A grammar's
mask comes next (banned tokens at -inf), then temperature and the filters.

A row is drawn by models/draw.py (the inverse CDF, one uniform per row), so a request with its own
seed takes its uniform from its own generator and draws the same tokens whatever batch it shares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Optional

import torch

from sparkrelay.grammar.rows import Masks
from sparkrelay.models.argmax import argmax
from sparkrelay.models.draw import draw_rows
from sparkrelay.scheduler.request import SamplingParams


class SeededGenerators:
    """Each seeded request's own generator: made from its seed at its first sampled row, kept until
    the request is released, so its draws do not depend on the batch it shares. Keyed by the
    request's handle in the process that samples (the rid in a runner, rank 0's req_index in a
    pipeline stage)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._gens: dict[Hashable, torch.Generator] = {}

    def get(self, key: Hashable, seed: Optional[int]) -> Optional[torch.Generator]:
        if seed is None:
            return None
        if key not in self._gens:
            self._gens[key] = torch.Generator(device=self.device).manual_seed(seed)
        return self._gens[key]

    def drop(self, key: Hashable) -> None:
        self._gens.pop(key, None)


@dataclass
class SamplingBatch:
    """Per-row parameters, [R] each."""

    temperature: torch.Tensor
    top_k: torch.Tensor  # 0 = off
    top_p: torch.Tensor
    min_p: torch.Tensor
    greedy: torch.Tensor  # bool
    generators: list[Optional[torch.Generator]]  # a row's own generator, or None for the shared one

    @property
    def all_greedy(self) -> bool:
        return bool(self.greedy.all())

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        keys: list[Hashable],
        gens: SeededGenerators,
        repeats: Optional[list[int]] = None,
    ) -> "SamplingBatch":
        """Per-row tensors [R] for requests with `params` and `keys`; with `repeats`, request i
        fills repeats[i] consecutive rows (a DSpark verify's rows), all drawing from the request's
        one generator."""
        reps = repeats or [1] * len(params)
        ps = [p for p, n in zip(params, reps) for _ in range(n)]
        dev = gens.device
        return SamplingBatch(
            temperature=torch.tensor([p.temperature for p in ps], device=dev),
            top_k=torch.tensor([max(p.top_k, 0) for p in ps], device=dev),
            top_p=torch.tensor([p.top_p for p in ps], device=dev),
            min_p=torch.tensor([p.min_p for p in ps], device=dev),
            greedy=torch.tensor([p.greedy for p in ps], device=dev),
            generators=[
                gens.get(k, p.seed) for p, k, n in zip(params, keys, reps) for _ in range(n)
            ],
        )


@dataclass
class PenaltyRows:
    """Per-row penalties and token histories, [R] each: `prompts[i]` and `outputs[i]` are the tokens
    that precede row i's next token (the prompt, then what was generated so far, drafts assumed
    accepted included)."""

    repetition: list[float]
    frequency: list[float]
    presence: list[float]
    prompts: list[list[int]]
    outputs: list[list[int]]


def _token_counts(histories: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """Token id histories (R lists) -> counts [R, V] float32."""
    width = max((len(h) for h in histories), default=0)
    # [R, W], padded with the spare id V
    ids = torch.full((len(histories), width), vocab, dtype=torch.int64)
    for i, h in enumerate(histories):
        ids[i, : len(h)] = torch.tensor(h, dtype=torch.int64)
    # [R, V + 1]: column V soaks up the padding
    counts = torch.zeros(len(histories), vocab + 1, device=device)
    counts.scatter_add_(1, ids.to(device), torch.ones(ids.shape, device=device))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, pr: PenaltyRows) -> torch.Tensor:
    """logits [R, V] -> penalised float32 logits [R, V] (a new tensor; `logits` is left as it was).

    repetition r, on every id seen in the prompt or the output: logit / r if logit > 0 else logit *
    r; then frequency f and presence p, on output ids only: logit -= f * count + p * (count > 0). A
    row at the defaults (1, 0, 0) comes back equal to its input."""
    vocab, dev = logits.shape[1], logits.device
    out_counts = _token_counts(pr.outputs, vocab, dev)  # [R, V]
    seen = (_token_counts(pr.prompts, vocab, dev) > 0) | (out_counts > 0)  # [R, V]
    # [R, 1]; an extreme r (1e-300, 1e300) would be 0 or inf in float32 and turn logits into inf /
    # nan
    rep = (
        torch.tensor(pr.repetition, device=dev, dtype=torch.float64)
        .clamp(1e-30, 1e30)
        .float()
        .unsqueeze(1)
    )
    rep = torch.where(seen, rep, torch.ones_like(rep))  # [R, V]: 1 where the id was never seen
    x = logits.float()
    x = torch.where(x > 0, x / rep, x * rep)
    freq = torch.tensor(pr.frequency, device=dev, dtype=torch.float32).unsqueeze(1)  # [R, 1]
    pres = torch.tensor(pr.presence, device=dev, dtype=torch.float32).unsqueeze(1)  # [R, 1]
    return x - freq * out_counts - pres * (out_counts > 0).float()


def penalize(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompts: list[list[int]],
    outputs: list[list[int]],
) -> torch.Tensor:
    """logits [R, V] -> the same tensor when no row has a penalty, else penalised float32 logits [R, V]; row i's
    history is prompts[i] then outputs[i] (for a DSpark verify row, the drafts before it count as output)."""
    if not any(p.penalized for p in params):
        return logits
    rows = PenaltyRows(
        [p.repetition_penalty for p in params],
        [p.frequency_penalty for p in params],
        [p.presence_penalty for p in params],
        prompts,
        outputs,
    )
    return apply_penalties(logits, rows)


def _keep_ranked(ranked: torch.Tensor, sb: SamplingBatch, vocab: int) -> torch.Tensor:
    """ranked [R, C] logits in descending order (C <= V) -> the same with the ranks that top-k and
    top-p drop at -inf."""
    rank = torch.arange(ranked.shape[1], device=ranked.device).unsqueeze(0)  # [1, C]
    k = torch.where(sb.top_k > 0, sb.top_k, vocab).unsqueeze(1)  # [R, 1]
    drop = rank >= k
    probs = ranked.masked_fill(drop, float("-inf")).softmax(-1)
    # top-p keeps the smallest prefix whose mass reaches top_p (the first token always stays)
    drop |= (probs.cumsum(-1) - probs) >= sb.top_p.unsqueeze(1)
    return ranked.masked_fill(drop, float("-inf"))


def filter_probs(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """logits [R, V] -> probabilities [R, V] after temperature, top-k, top-p and min-p (float32).

    When every row has a top-k, only the largest k of the batch are ranked (`topk`, not a sort of
    the vocabulary: a batch of 48 at top-k 20 ranks 48 x 20 logits instead of 48 x 49,152)."""
    logits = logits.float() / sb.temperature.clamp(min=1e-5).unsqueeze(1)
    vocab = logits.shape[1]
    if bool((sb.top_k > 0).any()) or bool((sb.top_p < 1).any()):
        # every row ranked: its candidates' probabilities, zero elsewhere
        k_max = int(torch.where(sb.top_k > 0, sb.top_k, vocab).clamp(max=vocab).max())
        if k_max * 8 <= vocab:
            ranked, order = logits.topk(k_max, dim=-1)  # [R, k_max], descending
        else:
            ranked, order = logits.sort(dim=-1, descending=True)  # [R, V]
        kept = _keep_ranked(ranked, sb, vocab).softmax(-1)  # [R, C]
        probs = torch.zeros_like(logits).scatter(1, order, kept)
    else:
        probs = logits.softmax(-1)
    if bool((sb.min_p > 0).any()):
        floor = sb.min_p.unsqueeze(1) * probs.max(-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(logits: torch.Tensor, sb: SamplingBatch, shared: torch.Generator) -> torch.Tensor:
    """logits [R, V] -> token ids [R]."""
    greedy_ids = argmax(logits)
    if sb.all_greedy:
        return greedy_ids
    drawn = draw_rows(filter_probs(logits, sb), sb.generators, shared)
    return torch.where(sb.greedy, greedy_ids, drawn)


def draw(
    logits: torch.Tensor,
    params: list[SamplingParams],
    keys: list[Hashable],
    gens: SeededGenerators,
    shared: torch.Generator,
    prompts: list[list[int]],
    outputs: list[list[int]],
    masks: Optional[Masks] = None,
) -> list[int]:
    """logits [R, V] (raw, left untouched) -> one token per row, drawn from the penalised logits with
    each grammar's banned tokens at -inf (`masks`: one row per logits row)."""
    scores = penalize(logits, params, prompts, outputs)
    if masks is not None:
        scores = masks.apply(scores, writable=scores is not logits)
    if all(p.greedy for p in params):
        return argmax(scores).tolist()
    return sample(scores, SamplingBatch.build(params, keys, gens), shared).tolist()
