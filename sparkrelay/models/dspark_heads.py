"""The DSpark drafter's two small heads (docs/dspark.md §1.6): the Markov head, a low-rank logit bias
from the previous draft token, and the confidence head that scores each slot."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from sparkrelay.models import cpu_kernels
from sparkrelay.models.kernels import KERNEL_ROWS, add_linear, frozen_linear


class MarkovHead(nn.Module):
    """Low-rank token-transition logit bias β_k = W2 · m_k (§1.6); m_k = W1[x_{k-1}] (vanilla),
    gated, or RNN."""

    def __init__(self, kind: str, vocab: int, rank: int, dim: int) -> None:
        super().__init__()
        self.kind = kind
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(dim + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + dim, 3 * rank)

    def step(
        self, h: torch.Tensor, prev: torch.Tensor, state: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """h [..., d], prev [...] -> β [..., V] and the RNN state [..., r] (None for the other kinds)."""
        m, state = self.mix(h, prev, state)
        return self.markov_w2(m), state

    def add_step(
        self,
        u: torch.Tensor,
        h: Optional[torch.Tensor],
        prev: torch.Tensor,
        state: Optional[torch.Tensor],
        out: torch.Tensor,
        in_vocab: bool = False,
    ) -> Optional[torch.Tensor]:
        """Serving: out [R, V] (float32) = u [R, V] + β(h [R, d], prev [R]) in one pass where the kernel
        serves (kernels.add_linear); `in_vocab`: over the draft vocabulary (V = Vh). Returns the RNN
        state."""
        m, state = self.mix(h, prev, state)
        add_linear(self.vocab_w2 if in_vocab else self.markov_w2, m, u, out)
        return state

    def greedy_block(
        self, u: torch.Tensor, anchors: torch.Tensor, vocab: Optional[torch.Tensor]
    ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """Serving, an all-greedy block without a grammar: (drafts [R, B] token ids, Z [R, B, V]
        float32) from u [R, B, V] (V = Vh over the draft vocabulary `vocab` [Vh], else every token),
        in one call of the CPU kernels (csrc/cpu_markov.cpp), bit-equal to the slot-by-slot loop of
        markov_sample; None where they do not serve (another head, W2 off the kernels, more rows
        than they take). Why:
        each slot's Python-level calls cost several times its two small kernels."""
        w2 = self.markov_w2 if vocab is None else self.vocab_w2
        w1 = self.markov_w1.weight
        # W2 on a kernel (AvxLinear, Int8Linear), for as many rows as add_linear gives it
        kernel = getattr(w2, "kernel", None)
        if self.kind != "vanilla" or kernel is None or u.shape[0] > KERNEL_ROWS:
            return None
        if u.dtype != torch.bfloat16 or w1.dtype != torch.bfloat16 or u.stride(-1) != 1:
            return None
        ext = cpu_kernels.portable()  # the build whose KernelLinear W2 is
        if ext is None:
            return None
        return tuple(ext.markov_greedy(u, w1.detach(), kernel, vocab, anchors.long()))

    def mix(
        self, h: Optional[torch.Tensor], prev: torch.Tensor, state: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """h [..., d], prev [...] -> m [..., r] (β = W2 m) and the RNN state [..., r] (None for the
        other kinds)."""
        e = self.markov_w1(prev)  # [..., r]
        if self.kind == "gated":
            e = torch.sigmoid(self.gate_proj(torch.cat([h, e.to(h.dtype)], -1))) * e
        elif self.kind == "rnn":
            s = torch.zeros_like(e) if state is None else state
            # 3 x [..., r]
            gate, cand, out = self.joint_proj(torch.cat([s, e, h.to(e.dtype)], -1)).chunk(3, dim=-1)
            g = torch.sigmoid(gate)
            state, e = g * s + (1 - g) * torch.tanh(cand), torch.tanh(out)
        return e, state

    def fuse(self) -> None:
        """After loading: W2 [V, r] in its fast layout (it is read B times per draft round, once per
        slot)."""
        self.markov_w2 = frozen_linear(self.markov_w2.weight)

    def restrict(self, ids: torch.Tensor) -> None:
        """Serving with a draft vocabulary (Qwen3DSparkModel.restrict_vocab): a copy of W2's rows of
        `ids` [Vh], whose β covers those tokens only; W1 still takes any previous token."""
        self.vocab_w2 = frozen_linear(self.markov_w2.weight[ids].contiguous())

    def teacher_forced(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """h [R, B, d], prev [R, B] (slot k's previous token) -> β [R, B, V]; the RNN state runs left to right."""
        if self.kind != "rnn":
            return self.step(h, prev, None)[0]
        state, out = None, []
        for k in range(h.shape[1]):
            beta, state = self.step(h[:, k], prev[:, k], state)
            out.append(beta)
        return torch.stack(out, dim=1)


class ConfidenceHead(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, 1)
