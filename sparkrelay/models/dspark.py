"""Qwen3 DSpark drafter (DeepSpec `Qwen3DSparkModel`); DFlash checkpoints (markov_rank 0, no
confidence head) too.

Semantics: docs/dspark.md §1. Module names are the checkpoint keys of §1.3, so DeepSpec checkpoints
load as they are. Every method is a pure tensor function batched over R requests; the caller owns
the draft KV cache (per draft layer, K/V of the context projections of committed positions, §1.7):

    target taps F [N, n_taps*d] --project_context--> C [N, d] --context_kv--> per layer (k, v) [N, n_kv, hd]
    block ids [R, B] + padded context K/V [R, Lc, n_kv, hd] --block_forward--> h [R, B, d]   (training)
    block ids [R, B] + the paged draft pools, AttnMeta.draft_block --block_forward_paged--> h [R, B, d]   (serving)
    h --base_logits--> U [R, B, V] --markov_sample--> drafts [R, B], Z [R, B, V];   (h, prev) --confidence--> [R, B]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from sparkrelay.models.argmax import argmax
from sparkrelay.models.attention import AttnMeta
from sparkrelay.models.decoder import DecoderLayer, DecoderSpec
from sparkrelay.models.draw import draw_rows
from sparkrelay.models.dspark_heads import ConfidenceHead, MarkovHead
from sparkrelay.models.kernels import frozen_linear
from sparkrelay.models.layers import RMSNorm, apply_rope, fuse_linears, rms_norm, transposed

ARCHITECTURE = "Qwen3DSparkModel"
DRAFT_LAYERS = (
    "Qwen3ForCausalLM"  # the family of the draft layers (DeepSpec's Qwen3 drafter): q/k head norms
)
MARKOV_HEADS = ("vanilla", "gated", "rnn")


@dataclass(frozen=True)
class DSparkSpec:
    """The draft config.json (§1.2): `body` holds the layer shapes (num_layers = draft layers), the
    rest the DSpark fields."""

    body: DecoderSpec
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    markov_rank: int
    markov_head_type: Optional[str]  # None when markov_rank == 0 (DFlash)
    enable_confidence_head: bool
    confidence_head_with_markov: bool
    num_target_layers: int
    num_anchors: Optional[int]  # training only

    @classmethod
    def from_hf(cls, cfg: dict, target_spec: DecoderSpec) -> "DSparkSpec":
        missing = [
            k
            for k in ("block_size", "target_layer_ids", "mask_token_id", "num_target_layers")
            if k not in cfg
        ]
        if missing:
            raise ValueError(f"draft config.json lacks the DSpark field(s) {missing}")
        rank = int(cfg.get("markov_rank", 0))
        conf = bool(cfg.get("enable_confidence_head", False))
        spec = cls(
            # Qwen3 layers, whatever the target's family
            body=DecoderSpec.from_hf(cfg, DRAFT_LAYERS),
            block_size=int(cfg["block_size"]),
            target_layer_ids=tuple(int(i) for i in cfg["target_layer_ids"]),
            mask_token_id=int(cfg["mask_token_id"]),
            markov_rank=rank,
            markov_head_type=cfg.get("markov_head_type", "vanilla") if rank > 0 else None,
            enable_confidence_head=conf,
            confidence_head_with_markov=conf
            and bool(cfg.get("confidence_head_with_markov", rank > 0)),
            num_target_layers=int(cfg["num_target_layers"]),
            num_anchors=cfg.get("num_anchors"),
        )
        spec.validate(target_spec)
        return spec

    def validate(self, target: DecoderSpec) -> None:
        """Start-up checks against the target; each error names the field and the value(s)."""
        n, ids = self.num_target_layers, list(self.target_layer_ids)
        if n != target.num_layers:
            raise ValueError(
                f"num_target_layers {n} != the target's num_hidden_layers {target.num_layers}"
            )
        bad = [i for i in ids if not (i == -1 or 0 <= i < n)]
        if not ids or bad:
            raise ValueError(f"target_layer_ids {ids}: id(s) {bad} outside {{-1}} ∪ [0, {n - 1}]")
        if n - 1 in ids:
            raise ValueError(
                f"target_layer_ids {ids}: {n - 1} is the target's last layer (num_target_layers {n}), "
                "whose Hugging Face hidden state is post-norm, never a raw tap (docs/dspark.md §1.8)"
            )
        if any(a >= b for a, b in zip(ids, ids[1:])):
            raise ValueError(f"target_layer_ids {ids} is not strictly increasing")
        for field in (
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "vocab_size",
            "rope_theta",
            "rope_scaling",
        ):
            mine, theirs = getattr(self.body, field), getattr(target, field)
            if mine != theirs:
                raise ValueError(f"{field} {mine} of the drafter != the target's {theirs}")
        if self.block_size < 1:
            raise ValueError(f"block_size {self.block_size} must be >= 1")
        if not 0 <= self.mask_token_id < self.body.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} outside [0, vocab_size {self.body.vocab_size})"
            )
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank {self.markov_rank} must be >= 0")
        if self.markov_head_type is not None and self.markov_head_type not in MARKOV_HEADS:
            raise ValueError(
                f"markov_head_type {self.markov_head_type!r} is not one of {MARKOV_HEADS}"
            )
        if self.confidence_head_with_markov and self.markov_rank == 0:
            raise ValueError(
                "confidence_head_with_markov True needs a Markov head, but markov_rank is 0"
            )


class DraftLayer(DecoderLayer):
    """A Qwen3 layer whose B block queries attend, without a causal mask, over [context K/V ; block
    K/V] (§1.5)."""

    def fuse(self) -> None:
        """After loading: the fused products of the layer (the context rows' K/V: ContextKV)."""
        self.self_attn.fuse()
        self.mlp.fuse()

    def block(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        mask: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """x [R, B, d]; cos/sin [R*B, 1, hd]; ctx_k/ctx_v [R, Lc, n_kv, hd]; mask [R, 1, 1, Lc+B] or
        None."""
        r, b, d = x.shape
        attn = self.self_attn
        # normed + rotated, [R*B, H | n_kv, hd]
        q, k, v = attn.qk_rope(self.input_layernorm(x).reshape(r * b, d), cos, sin)
        q = q.reshape(r, b, attn.n_heads, attn.head_dim)
        k = k.reshape(r, b, attn.n_kv, attn.head_dim)
        # [R, Lc+B, n_kv, hd]: context keys first, then the block's
        k = torch.cat([ctx_k, k], dim=1)
        v = torch.cat([ctx_v, v.view(r, b, attn.n_kv, attn.head_dim)], dim=1)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            scale=attn.scale,
            enable_gqa=True,
        )  # [R, H, B, hd]
        x = x + attn.o_proj(out.transpose(1, 2).reshape(r, b, attn.n_heads * attn.head_dim))
        return x + self.mlp(self.post_attention_layernorm(x))


class ContextKV(nn.Module):
    """C [N, d] -> every draft layer's context (k [N, n_kv, hd] after k_norm and RoPE, v [N, n_kv,
    hd]), from the layers' attentions `attns` (their k_proj, v_proj, k_norm; C bypasses
    input_layernorm, §1.4). Serving computes all layers at once: one frozen product of every k and
    v weight, one k_norm over the L * n_kv heads (each layer's weight), one RoPE; per output column
    and head row these are the per-layer ops, so the layers' K/V are those of a layer-by-layer pass.
    Why: a round writes the accepted rows' context, and five ops a layer cost more than their
    arithmetic. Before `freeze` (training) the layers' own modules run, layer by layer, with
    gradients. The one context projection: the drafter and the prefill's ContextProjector must
    write bit-equal K/V (draft-kv handoff)."""

    def __init__(self, attns: list[nn.Module]) -> None:
        super().__init__()
        self.attns = list(attns)  # a plain list: the layers own them (checkpoint names)
        self.product: Optional[nn.Module] = None  # after `freeze` (a child: int8wo quantizes it)
        # [L * n_kv, hd], layer i's k_norm weight per head, after `freeze`
        self.register_buffer("norm", None, persistent=False)

    def freeze(self) -> None:
        """After loading: the frozen product [2 * L * n_kv * hd, d] (every k weight, then every v
        weight) and the stacked k_norm weights."""
        linears = [a.k_proj for a in self.attns] + [a.v_proj for a in self.attns]
        self.product = fuse_linears(*linears)
        n_kv = self.attns[0].n_kv
        weights = [a.k_norm.weight.detach() for a in self.attns]
        norm = torch.stack(weights).repeat_interleave(n_kv, dim=0)
        self.register_buffer("norm", norm, persistent=False)

    def forward(
        self, c: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """c [N, d], cos/sin [N, 1, hd] -> per draft layer (k, v) [N, n_kv, hd]."""
        n, a0 = c.shape[0], self.attns[0]
        if self.product is None:
            return [_layer_kv(a, c, cos, sin) for a in self.attns]
        heads, hd = len(self.attns) * a0.n_kv, a0.head_dim
        kv = self.product(c)  # [N, 2 * L * n_kv * hd]: every layer's k, then every v
        k = rms_norm(kv[:, : heads * hd].view(n, heads, hd), self.norm, a0.k_norm.eps)
        k = apply_rope(k, cos, sin)  # [N, L * n_kv, hd]
        v = kv[:, heads * hd :].view(n, heads, hd)
        layer = [slice(i * a0.n_kv, (i + 1) * a0.n_kv) for i in range(len(self.attns))]
        return [(k[:, s], v[:, s]) for s in layer]


def _layer_kv(
    attn: nn.Module, c: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One draft layer's context (k, v) [N, n_kv, hd] through its own modules (training)."""
    n = c.shape[0]
    k, v = attn.k_proj(c), attn.v_proj(c)
    k = apply_rope(attn.k_norm(k.view(n, attn.n_kv, attn.head_dim)), cos, sin)
    return k, v.view(n, attn.n_kv, attn.head_dim)


class Qwen3DSparkModel(nn.Module):
    def __init__(self, spec: DSparkSpec, device: torch.device | str = "cpu") -> None:
        super().__init__()
        s = spec.body
        self.spec = spec
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(DraftLayer(s) for _ in range(s.num_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.fc = nn.Linear(len(spec.target_layer_ids) * s.hidden_size, s.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.lm_head = nn.Linear(s.hidden_size, s.vocab_size, bias=False)
        r = spec.markov_rank
        self.markov_head = (
            MarkovHead(spec.markov_head_type, s.vocab_size, r, s.hidden_size) if r > 0 else None
        )
        conf_dim = s.hidden_size + (r if spec.confidence_head_with_markov else 0)
        self.confidence_head = ConfidenceHead(conf_dim) if spec.enable_confidence_head else None
        self.rotary = s.rotary(device)
        self.context = ContextKV([layer.self_attn for layer in self.layers])
        self.head: nn.Module | None = (
            None  # the LM head's fast copy, unless the target's is used (load_dspark)
        )
        self.vocab: Optional[torch.Tensor] = None  # [Vh] the draft vocabulary (restrict_vocab)

    def restrict_vocab(self, ids: torch.Tensor) -> None:
        """Serving: draft only among the token ids `ids` [Vh] (FR-Spec's frequency-ranked hot tokens,
        SGLang's --speculative-token-map). The LM head and Markov W2 keep those rows, so a slot's logits
        cost Vh / V of the full ones; U and Z are then [.., Vh] and markov_sample maps its picks back to
        token ids. Lossless: a draft is still a draw from q (zero off the vocabulary), and verification
        takes the residual over every token. The full heads stay: a round under a grammar drafts over
        every token (the grammar may allow none of the vocabulary)."""
        self.vocab = ids = ids.to(self.lm_head.weight.device)
        self.vocab_head = frozen_linear(self.lm_head.weight[ids].contiguous())  # a copy: Vh rows
        if self.markov_head is not None:
            self.markov_head.restrict(ids)

    def fuse(self) -> None:
        """After loading: every draft layer's products, fc and the Markov head's W2 in their fast
        layouts."""
        self.context.freeze()  # before the layers fuse their own k/v weights away
        for layer in self.layers:
            layer.fuse()
        self.fc = transposed(self.fc)
        if self.markov_head is not None:
            self.markov_head.fuse()

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """features [N, n_taps*d] (taps concatenated in target_layer_ids order) -> C [N, d]."""
        return self.hidden_norm(self.fc(features))

    def context_kv(
        self, c: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """C [N, d] at absolute positions [N] -> per draft layer (k [N, n_kv, hd] post k_norm + RoPE,
        v [N, n_kv, hd])."""
        cos, sin = self.rotary.table(positions, c.dtype)
        return self.context.forward(c, cos, sin)

    def block_forward(
        self,
        block_ids: torch.Tensor,
        block_positions: torch.Tensor,
        ctx_k: list[torch.Tensor],
        ctx_v: list[torch.Tensor],
        ctx_len: Optional[torch.Tensor],
        mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """block_ids, block_positions [R, B]; ctx_k/ctx_v per layer [R, Lc, n_kv, hd], rows >= ctx_len [R] are padding
        (masked) -> h [R, B, d] after the final norm. Block queries see the valid context and the whole block.
        Training passes its own `mask` [R, 1, B, Lc+B] instead of ctx_len (many blocks of one sequence as one row)."""
        r, b = block_ids.shape
        x = self.embed_tokens(block_ids)  # [R, B, d]
        cos, sin = self.rotary.table(block_positions.reshape(-1), x.dtype)  # [R*B, 1, hd]
        lc = ctx_k[0].shape[1] if ctx_k else 0
        if mask is None and bool((ctx_len < lc).any()):
            ctx_ok = torch.arange(lc, device=x.device)[None, :] < ctx_len[:, None]  # [R, Lc]
            mask = torch.cat([ctx_ok, ctx_ok.new_ones(r, b)], dim=1)[
                :, None, None, :
            ]  # [R, 1, 1, Lc+B]
        for layer, k, v in zip(self.layers, ctx_k, ctx_v):
            x = layer.block(x, cos, sin, k, v, mask)
        return self.norm(x)

    def block_forward_paged(
        self,
        block_ids: torch.Tensor,
        block_positions: torch.Tensor,
        pools: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttnMeta,
    ) -> torch.Tensor:
        """Serving: block_ids, block_positions [R, B]; per draft layer its (k_pool, v_pool) holding the context
        K/V; `meta` (AttnMeta.draft_block) -> h [R, B, d] after the final norm. Each layer runs as a target layer
        does (DecoderLayer.forward: paged attention, the decode kernel where it serves), so no context is
        gathered or concatenated per layer; equal to block_forward over the same keys."""
        r, b = block_ids.shape
        x = self.embed_tokens(block_ids).view(r * b, -1)  # [R*B, d]
        cos, sin = self.rotary.table(block_positions.reshape(-1), x.dtype)  # [R*B, 1, hd]
        for layer, kv in zip(self.layers, pools):
            x = layer.forward(x, cos, sin, kv, meta)
        return self.norm(x).view(r, b, -1)

    def base_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [R, B, d] -> U [R, B, V]."""
        return self.lm_head(h) if self.head is None else self.head.forward(h)

    def markov_bias(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Teacher-forced bias (training): h [R, B, d], prev [R, B] -> β [R, B, V] (zeros without a Markov head)."""
        if self.markov_head is None:
            return h.new_zeros(*prev.shape, self.spec.body.vocab_size)
        return self.markov_head.teacher_forced(h, prev)

    def markov_sample(
        self,
        u: torch.Tensor,
        anchors: torch.Tensor,
        temperature: torch.Tensor,
        greedy: torch.Tensor,
        generator: Optional[torch.Generator] = None,
        h: Optional[torch.Tensor] = None,
        generators: Optional[list[Optional[torch.Generator]]] = None,
        constrain: Optional[Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]] = None,
        in_vocab: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequential sampling over the B slots (§2.2 step 3): Z_k = U_k + β(prev); prev_0 = anchor,
        prev_k = draft k-1. `constrain(k, prev [R], Z_k [R, V])` -> Z_k with banned tokens at -inf
        (in place or a new tensor)
        (a grammar's mask), before the slot is sampled.

        u [R, B, V]; anchors [R]; temperature [R] (ignored where greedy [R] is True); h [R, B, d] (needed by the gated
        and RNN heads); a row draws from `generators[row]` when given, else from `generator`.
        -> drafts [R, B] (long), Z [R, B, V] float32 (the draft distribution is softmax(Z_k / T)).
        `in_vocab` (after restrict_vocab, no `constrain`): u is over the draft vocabulary, V = Vh, and
        Z's column i is token vocab[i].
        """
        if in_vocab and (self.vocab is None or constrain is not None):
            raise ValueError("in_vocab needs restrict_vocab first and no constrain")
        if self.markov_head is not None and self.markov_head.kind != "vanilla" and h is None:
            raise ValueError(
                f"markov_head_type {self.markov_head.kind!r} needs the hidden states h"
            )
        temp = (
            torch.where(greedy, torch.ones_like(temperature), temperature)
            .clamp_min(1e-5)[:, None]
            .float()
        )
        all_greedy = bool(greedy.all())
        if all_greedy and constrain is None and self.markov_head is not None:  # one kernel call
            served = self.markov_head.greedy_block(u, anchors, self.vocab if in_vocab else None)
            if served is not None:
                return served
        # [R, B, V]: Z, filled slot by slot
        zs = torch.empty(u.shape, dtype=torch.float32, device=u.device)
        prev, state, drafts = anchors, None, []
        for k in range(u.shape[1]):
            z = zs[:, k]  # [R, V]
            if self.markov_head is None:
                z.copy_(u[:, k])
            else:  # Z_k = U_k + β, summed in float32
                hk = None if h is None else h[:, k]
                state = self.markov_head.add_step(u[:, k], hk, prev, state, z, in_vocab)
            if constrain is not None:
                masked = constrain(
                    k, prev, z
                )  # z itself when it masked z in place (or had nothing to mask)
                if masked is not z:
                    z.copy_(masked)
            pick = argmax(z)
            if not all_greedy:
                own = generators or [None] * z.shape[0]
                drawn = draw_rows(torch.softmax(z / temp, dim=-1), own, generator)
                pick = torch.where(greedy, pick, drawn)
            prev = self.vocab[pick] if in_vocab else pick  # token ids
            drafts.append(prev)
        return torch.stack(drafts, dim=1), zs

    def confidence(self, h: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
        """h [R, B, d], prev_tokens [R, B] (anchor, then drafts 0..B-2) -> logits [R, B];
        sigmoid = P(accept | prefix)."""
        if self.confidence_head is None:
            raise ValueError(
                "this drafter has no confidence head (enable_confidence_head is false)"
            )
        x = h
        if self.spec.confidence_head_with_markov:
            # [R, B, d + r]
            x = torch.cat([h, self.markov_head.markov_w1(prev_tokens).to(h.dtype)], dim=-1)
        return self.confidence_head.proj(x).squeeze(-1)
