"""The drafter's offline evaluation (python -m sparkrelay.tools.train.drafter): greedy speculative
decoding simulated along the target's greedy continuation of held-out prompts, giving the acceptance
length and the per-slot rates without a serving engine."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from sparkrelay.models.dspark import Qwen3DSparkModel
from sparkrelay.tools.train.drafter_data import greedy_continue, target_pass


@torch.no_grad()
def eval_set(target, held: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Held-out prompts + the target's greedy continuations: seqs [n, P + new], ends [n] (exclusive;
    a continuation ends at its first <|endoftext|>, id 0)."""
    n, p = args.eval_prompts, args.eval_prompt_len
    offsets = torch.linspace(0, held.numel() - p - 1, n).long().tolist()
    seqs = greedy_continue(
        target, torch.stack([held[o : o + p] for o in offsets]).long(), args.eval_new
    )
    gen_part = seqs[:, p:] == 0
    return seqs, torch.where(gen_part.any(1), p + gen_part.int().argmax(1) + 1, seqs.shape[1])


def chat_eval_set(
    path: str | Path, max_len: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per prompt set, from chat_data.py's eval_greedy.jsonl (evaluation-split prompts + the
    target's greedy answers): seqs [n, L] right-padded, ends [n] (exclusive), starts [n] (the prompt
    lengths: the first answer token is the prefill's, the first anchor)."""
    by_set: dict[str, list[dict]] = {}
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        by_set.setdefault(row["set"], []).append(row)
    out = {}
    for name, rows in by_set.items():
        full = [(r["prompt_ids"] + r["answer_ids"])[:max_len] for r in rows]
        seqs = torch.zeros(len(full), max(map(len, full)), dtype=torch.long)
        for i, ids in enumerate(full):
            seqs[i, : len(ids)] = torch.tensor(ids)
        out[name] = (
            seqs,
            torch.tensor([len(f) for f in full]),
            torch.tensor([len(r["prompt_ids"]) for r in rows]),
        )
    return out


@torch.no_grad()
def acceptance(
    model: Qwen3DSparkModel,
    target,
    seqs: torch.Tensor,
    ends: torch.Tensor,
    p: int | torch.Tensor,
    use_markov: bool = True,
    feats: torch.Tensor | None = None,
) -> dict:
    """Greedy speculative decoding simulated offline (propose, verify with the greedy acceptance
    rule, commit: docs/dspark.md, decoding): the target's greedy continuation of held-out prompts is
    the committed text; each round drafts B tokens from the context < start and accepts the longest
    prefix equal to the target's tokens, plus the bonus. seqs [n, L] with prompts of length p (an
    int, or per row [n]), ends [n] from `eval_set`; `feats` the target's features of seqs when
    already at hand. Returns τ (mean acceptance length incl. bonus) and per-slot rates."""
    (n, length), b = seqs.shape, model.spec.block_size
    if feats is None:
        feats, _ = target_pass(target, seqs, list(model.spec.target_layer_ids))
    # a bfloat16 target's features into the drafter's dtype
    feats = feats.to(model.norm.weight.dtype)
    kv = model.context_kv(
        model.project_context(feats.reshape(n * length, -1)), torch.arange(length).repeat(n)
    )
    ks = [k.view(n, length, *k.shape[1:]) for k, _ in kv]
    vs = [v.view(n, length, *v.shape[1:]) for _, v in kv]
    # anchor = the prefill's token
    starts = torch.full((n,), p) if isinstance(p, int) else p.clone()
    rounds, tau_sum = 0, 0
    proposed, accepted, cond_n, cond_hit, conf_sum = (torch.zeros(b) for _ in range(5))
    while True:
        rows = (starts < ends - 1).nonzero().flatten()
        if rows.numel() == 0:
            break
        st = starts[rows]
        ids = torch.full((rows.numel(), b), model.spec.mask_token_id)
        ids[:, 0] = seqs[rows, st]
        pos = st[:, None] + torch.arange(b)
        h = model.block_forward(ids, pos, [k[rows] for k in ks], [v[rows] for v in vs], ctx_len=st)
        u = model.base_logits(h)
        if use_markov:
            ones = torch.ones(rows.numel(), dtype=torch.bool)
            drafts = model.markov_sample(u, ids[:, 0], torch.zeros(rows.numel()), ones)[0]
        else:
            drafts = u.argmax(-1)
        conf = torch.sigmoid(model.confidence(h, torch.cat([ids[:, :1], drafts[:, :-1]], 1)))
        truth = seqs[rows].gather(1, (pos + 1).clamp(max=length - 1))
        # drafts that can be checked against the committed text
        m = (ends[rows] - 1 - st).clamp(max=b)
        live = torch.arange(b) < m[:, None]
        acc = ((drafts == truth) & live).int().cumprod(1).sum(1)  # a: accepted drafts
        rounds, tau_sum = rounds + rows.numel(), tau_sum + int((acc + 1).sum())
        k = torch.arange(b)
        proposed += live.sum(0)
        accepted += (acc[:, None] > k).sum(0)
        reached = live & (acc[:, None] >= k)  # slot k verified with all earlier drafts accepted
        cond_n += reached.sum(0)
        cond_hit += (reached & (acc[:, None] > k)).sum(0)
        conf_sum += (conf * reached).sum(0)
        starts[rows] = st + acc + 1
    r3 = lambda t: [round(float(x), 3) for x in t]
    return {
        "tau": round(tau_sum / max(rounds, 1), 3),
        "rounds": rounds,
        "accept_rate_at_k": r3(accepted / proposed.clamp(min=1)),
        "conditional_accept_k": r3(cond_hit / cond_n.clamp(min=1)),
        "mean_confidence_k": r3(conf_sum / cond_n.clamp(min=1)),
        "committed_tokens": int((ends - p).sum()),
    }
