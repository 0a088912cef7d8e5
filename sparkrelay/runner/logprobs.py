"""Logprobs as SGLang and vLLM report them: the log-softmax of the target's raw logits (before
temperature, penalties and top-k/p filtering), float32, of the chosen token and of the k most likely
tokens."""

from __future__ import annotations

from typing import Optional

import torch

from sparkrelay.scheduler.request import TopLogprobs

Entry = tuple[
    float, TopLogprobs
]  # (logprob of the chosen token, top-k (logprob, id) most likely first)


def token_logprobs(logits: torch.Tensor, ids: list[int], ks: list[int]) -> list[Entry]:
    """logits [R, V] (raw), ids [R] the chosen tokens, ks [R] top-k per row (0: none) -> one entry per row.
    Top-k runs once, up to max(ks)."""
    if not ids:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    # [R]
    chosen = lp.gather(1, torch.tensor(ids, device=lp.device).unsqueeze(1)).squeeze(1).tolist()
    k = max(ks)
    if k <= 0:
        return [(c, []) for c in chosen]
    vals, top_ids = lp.topk(k, dim=-1)  # [R, k] each, sorted descending
    vals, top_ids = vals.tolist(), top_ids.tolist()
    return [(c, list(zip(v[:n], t[:n]))) for c, v, t, n in zip(chosen, vals, top_ids, ks)]


def to_rows(entries: list[Entry], k: int) -> torch.Tensor:
    """Entries -> float64 [R, 1 + 2k]: logprob, then k (logprob, id) pairs, zero-padded (ids are exact in
    float64). The inverse is `from_rows`; the pipeline's last stage sends this to rank 0."""
    out = torch.zeros(len(entries), 1 + 2 * k, dtype=torch.float64)
    for i, (lp, top) in enumerate(entries):
        out[i, 0] = lp
        for j, (v, t) in enumerate(top):
            out[i, 1 + 2 * j], out[i, 2 + 2 * j] = v, t
    return out


def from_rows(rows: list[list[float]], ks: list[int]) -> list[Entry]:
    """Rows of `to_rows` (each 1 + 2k floats) and each row's own k -> entries."""
    return [(r[0], [(r[1 + 2 * j], int(r[2 + 2 * j])) for j in range(n)]) for r, n in zip(rows, ks)]


Scored = tuple[
    int, int, int, int
]  # prompt logprobs of one sequence: (index, first position, first flat row, count)


def score_rows(
    scored: list[Scored], targets: list[int], ks: list[int], logits: torch.Tensor, num_seqs: int
) -> list[Optional[tuple[int, list[Entry]]]]:
    """logits [E, V] of the `scored` rows (in order), targets [E] the prompt tokens they score, ks [E] each row's
    top-k -> per sequence (first position, entries) or None."""
    out: list[Optional[tuple[int, list[Entry]]]] = [None] * num_seqs
    if not scored:
        return out
    entries, cursor = token_logprobs(logits, targets, ks), 0
    for i, first, _, n in scored:
        out[i] = (first, entries[cursor : cursor + n])
        cursor += n
    return out
