"""Speculative verification as a pure function: tensors in, accepted counts and next tokens out.

Acceptance rule (docs/dspark.md §2.3, standard speculative sampling): row r proposed n_r drafts
d_1..d_n sampled from the draft distributions q_0..q_{n-1}; p_0..p_n are the target distributions at
the verified positions.
  - draft i+1 is accepted iff u_i < min(1, p_i(d_{i+1}) / max(q_i(d_{i+1}), 1e-8)), u_i ~ U[0, 1);
    a = the length of the all-accepted prefix;
  - if a < n the next token is drawn from the residual normalize(max(p_a - q_a, 0)) (from p_a when the
    residual has no mass), else it is the bonus token drawn from p_n.
Greedy rows (p and q one-hot) reduce to: accept while d_{i+1} == argmax p_i; next = argmax p_a.
The committed tokens d_1..d_a, next are then distributed exactly as sampling from the target one token at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sparkrelay.models.argmax import argmax
from sparkrelay.models.draw import draw_rows, row_uniforms


@dataclass
class VerifyResult:
    accepted: torch.Tensor  # [R] a: drafts accepted per row (0..n_r)
    next_ids: torch.Tensor  # [R] the correction or bonus token


def verify(
    draft_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    greedy: torch.Tensor,
    generators: list[Optional[torch.Generator]],
    shared: torch.Generator,
) -> VerifyResult:
    """draft_ids [R, N] (padded past num_drafts [R]); draft_probs q [R, N, V]; target_probs p [R, N
    + 1, V] (rows already temperature-scaled and filtered the way the request samples); greedy [R]
    bool."""
    rows, n_max = draft_ids.shape
    dev = draft_ids.device
    slot = torch.arange(n_max, device=dev).unsqueeze(0)  # [1, N]
    valid = slot < num_drafts.unsqueeze(1)  # [R, N]
    # no randomness: compare with the target's argmax (draft_probs are not read)
    if bool(greedy.all()):
        target_ids = argmax(target_probs)  # [R, N + 1]
        accepted = ((draft_ids == target_ids[:, :n_max]) & valid).int().cumprod(dim=1).sum(dim=1)
        return VerifyResult(accepted, target_ids.gather(1, accepted.unsqueeze(1)).squeeze(1))
    # [R, N] p_i(d_{i+1})
    p_d = target_probs[:, :n_max].gather(2, draft_ids.unsqueeze(2)).squeeze(2)
    q_d = draft_probs.gather(2, draft_ids.unsqueeze(2)).squeeze(2)  # [R, N] q_i(d_{i+1})
    u = row_uniforms(generators, shared, n_max, device=dev)  # [R, N]
    ok_sampled = u < torch.clamp(p_d / q_d.clamp(min=1e-8), max=1.0)
    ok_greedy = draft_ids == argmax(target_probs[:, :n_max])
    ok = torch.where(greedy.unsqueeze(1), ok_greedy, ok_sampled) & valid
    accepted = ok.int().cumprod(dim=1).sum(dim=1)  # [R] a
    next_ids = _next_tokens(
        accepted, num_drafts, draft_probs, target_probs, greedy, generators, shared
    )
    return VerifyResult(accepted, next_ids)


def _next_tokens(
    accepted, num_drafts, draft_probs, target_probs, greedy, generators, shared
) -> torch.Tensor:
    rows = torch.arange(accepted.shape[0], device=accepted.device)
    p_a = target_probs[
        rows, accepted
    ]  # [R, V] target distribution at the first unaccepted position
    n_max = draft_probs.shape[1]
    q_a = (
        draft_probs[rows, accepted.clamp(max=max(n_max - 1, 0))] if n_max else torch.zeros_like(p_a)
    )
    # [R, 1]: residual rows; others take the bonus from p_a
    rejected = (accepted < num_drafts).unsqueeze(1)
    residual = torch.clamp(p_a - q_a, min=0.0)
    mass = residual.sum(dim=1, keepdim=True)
    use_residual = rejected & (mass > 1e-8)
    dist = torch.where(use_residual, residual / mass.clamp(min=1e-30), p_a)
    drawn = draw_rows(dist.contiguous(), generators, shared)
    return torch.where(greedy, argmax(p_a), drawn)
