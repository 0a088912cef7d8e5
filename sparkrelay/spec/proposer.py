"""The DSpark proposer: owns the drafter and its paged draft KV cache; writes context, proposes
blocks.

Draft KV layout: the same slots as the target's KV (one pool per draft layer, addressed through the
request's block table), so position p of a request has its target K/V and its draft context K/V at
the same slot. Only committed positions are written (prompt rows at prefill, the anchor and accepted
drafts after a verify); block rows are never cached (docs/dspark.md §1.7): a block's K/V go to scratch
slots past the pages, one block's worth per row, and its queries attend through the target's paged
attention (AttnMeta.draft_block), the context read in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from sparkrelay.kvcache.pool import KVPool
from sparkrelay.models.attention import AttnMeta, slot_index
from sparkrelay.models.dspark import Qwen3DSparkModel


@dataclass
class Proposal:
    drafts: torch.Tensor  # [R, B] draft tokens d_1..d_B (only the first num_drafts[r] are proposed)
    # [R, B, V] q: the distribution each draft was drawn from (float32; for an
    draft_probs: torch.Tensor
    # all-greedy batch the raw corrected logits, which greedy verification never reads)
    # [R] n: drafts proposed per row (confidence truncation and caps applied)
    num_drafts: torch.Tensor


class DSparkProposer:
    def __init__(
        self,
        drafter: Qwen3DSparkModel,
        num_blocks: int,
        page_size: int,
        device: torch.device,
        max_drafts: int,
        confidence_threshold: float,
        head: Optional[nn.Module] = None,
        max_rows: int = 64,
    ) -> None:
        """head: the target's fast LM head copy (`CausalLM.head`), used when the drafter shares the
        head. max_rows: the most requests one propose serves (the scheduler's --max-running-requests);
        the pool keeps that many blocks of scratch slots past the pages, where block K/V are written."""
        body = drafter.spec.body
        self.head = head if "lm_head" in getattr(drafter, "shared_with_target", ()) else None
        self.drafter, self.device, self.page_size = drafter, device, page_size
        self.taps = drafter.spec.target_layer_ids
        self.block_size = drafter.spec.block_size
        self.max_drafts = min(max_drafts, self.block_size)
        self.threshold = confidence_threshold if drafter.confidence_head is not None else 0.0
        # the drafter's activations (fc may be packed or int8)
        self.dtype = dtype = drafter.norm.weight.dtype
        self.pool = KVPool(
            range(body.num_layers),
            num_blocks,
            page_size,
            body.num_kv_heads,
            body.head_dim,
            dtype,
            device,
            extra_slots=max_rows * self.block_size,
        )
        # [max_rows, B]: row r's block K/V slots, past every page (never a position's)
        self.scratch = torch.arange(
            num_blocks * page_size,
            num_blocks * page_size + max_rows * self.block_size,
            device=device,
        ).view(max_rows, self.block_size)
        self.max_position = body.max_position_embeddings - 1

    @torch.inference_mode()
    def write_context(
        self,
        taps: dict[int, torch.Tensor],
        rows: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """Project the target features of committed rows [N] (row indices into the forward's tokens)
        and write each draft layer's context K/V at their absolute `positions` [N] into `slots`
        [N]."""
        if rows.numel() == 0:
            return
        # [N, n_taps * d]
        features = torch.cat([taps[i].index_select(0, rows) for i in self.taps], dim=-1)
        self.write_features(features, positions, slots)

    @torch.inference_mode()
    def write_features(
        self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """features [N, n_taps * d] (the aux rows, taps in target_layer_ids order) at absolute `positions` [N] ->
        each draft layer's context K/V written into `slots` [N] (also the decode side of a PD handoff)."""
        c = self.drafter.project_context(features.to(self.dtype))  # [N, d]
        for layer, (k, v) in enumerate(self.drafter.context_kv(c, positions)):
            k_pool, v_pool = self.pool.layers[layer]
            k_pool.index_copy_(0, slots, k)
            v_pool.index_copy_(0, slots, v)

    @torch.inference_mode()
    def propose(
        self,
        anchors: list[int],
        starts: list[int],
        block_tables: list[list[int]],
        caps: list[int],
        temperature: torch.Tensor,
        greedy: torch.Tensor,
        generators: list[Optional[torch.Generator]],
        shared: torch.Generator,
        ctx_starts: Optional[list[int]] = None,
        constrain: Optional[Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]] = None,
    ) -> Proposal:
        """Row r: anchor token at position starts[r], context = positions ctx_starts[r] (default 0)
        .. starts[r]-1 (a PD `tail` handoff gives the drafter only the prompt's last rows); at most
        caps[r] drafts. `constrain`: masks each slot's logits before it is sampled (markov_sample),
        so the drafts and their distribution q follow the requests' grammars."""
        rows, b, dev = len(anchors), self.block_size, self.device
        anchor_t = torch.tensor(anchors, device=dev)
        block_ids = torch.full((rows, b), self.drafter.spec.mask_token_id, device=dev)
        block_ids[:, 0] = anchor_t  # [R, B]: anchor then mask tokens
        anchor_pos = torch.tensor(starts, device=dev)
        positions = (anchor_pos[:, None] + torch.arange(b, device=dev)[None, :]).clamp(
            max=self.max_position
        )
        meta = self._block_meta(starts, block_tables, ctx_starts, positions)
        pools = list(self.pool.layers.values())
        h = self.drafter.block_forward_paged(block_ids, positions, pools, meta)  # [R, B, d]
        # the draft vocabulary (restrict_vocab) in rounds no grammar constrains: V = Vh
        in_vocab = self.drafter.vocab is not None and constrain is None
        if in_vocab:
            u = self.drafter.vocab_head.forward(h)
        else:
            u = (
                self.drafter.base_logits(h) if self.head is None else self.head.forward(h)
            )  # [R, B, V]
        drafts, z = self.drafter.markov_sample(
            u,
            anchor_t,
            temperature,
            greedy,
            shared,
            h=h,
            generators=generators,
            constrain=constrain,
            in_vocab=in_vocab,
        )
        if bool(greedy.all()):
            q = z  # greedy verification never reads the draft distribution
        else:
            temp = (
                torch.where(greedy, torch.ones_like(temperature), temperature)
                .clamp_min(1e-5)
                .float()
            )
            q = torch.softmax(z / temp[:, None, None], dim=-1)  # [R, B, V or Vh]
            if in_vocab:  # [R, B, V]: zero off the draft vocabulary
                q = q.new_zeros(*q.shape[:2], self.drafter.spec.body.vocab_size).index_copy_(
                    2, self.drafter.vocab, q
                )
        n = torch.tensor([min(c, self.max_drafts) for c in caps], device=dev)
        if self.threshold > 0:
            n = torch.minimum(n, self._confident_prefix(h, anchor_t, drafts))
        return Proposal(drafts, q, n)

    def _block_meta(
        self,
        starts: list[int],
        block_tables: list[list[int]],
        ctx_starts: Optional[list[int]],
        positions: torch.Tensor,
    ) -> AttnMeta:
        """The block's attention metadata: row r's context slots (positions ctx_starts[r]..starts[r]-1,
        left-aligned) then its scratch slots; positions [R, B]."""
        rows, dev = len(starts), self.device
        if rows > self.scratch.shape[0]:
            raise ValueError(
                f"{rows} rows in one proposal; the proposer was sized for {self.scratch.shape[0]}"
            )
        # [R, Lc]: positions 0..Lc-1
        index = slot_index(block_tables, max(starts), self.page_size).to(dev)
        if ctx_starts is not None and any(ctx_starts):
            first = torch.tensor(ctx_starts, device=dev)
            width = max(p - c for p, c in zip(starts, ctx_starts))
            shift = (first[:, None] + torch.arange(width, device=dev)[None, :]).clamp(
                max=index.shape[1] - 1
            )
            # [R, width]: positions ctx_start.. left-aligned, padding after
            index = index.gather(1, shift)
            ctx_len = torch.tensor([p - c for p, c in zip(starts, ctx_starts)], device=dev)
        else:
            ctx_len = torch.tensor(starts, device=dev)
        return AttnMeta.draft_block(index, ctx_len, self.scratch[:rows], positions)

    def _confident_prefix(
        self, h: torch.Tensor, anchors: torch.Tensor, drafts: torch.Tensor
    ) -> torch.Tensor:
        """[R] index of the first slot whose per-step confidence is below the threshold (B when none
        is)."""
        # [R, B]: the token before each slot
        prev = torch.cat([anchors[:, None], drafts[:, :-1]], dim=1)
        low = torch.sigmoid(self.drafter.confidence(h, prev).float()) < self.threshold  # [R, B]
        b = drafts.shape[1]
        first = torch.where(low, torch.arange(b, device=h.device)[None, :], b)
        return first.min(dim=1).values
