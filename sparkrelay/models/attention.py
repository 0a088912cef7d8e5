"""Paged attention over a flat slot pool, for batches of sequences that feed different numbers of
tokens.

Memory layout (one pool per layer, see kvcache/pool.py):
    k_pool, v_pool: [num_slots, n_kv, D]; slot s = block s // page_size, offset s % page_size.
A batch feeds T tokens in total, `q_len[b]` of them for sequence b, whose keys occupy `kv_len[b]` slots
(the cached context followed by the fed tokens). Queries are scattered into a padded [B, Lq] layout,
keys gathered into a padded [B, Lk] layout, and one SDPA call with a boolean mask does the whole batch.

Three shapes get a faster call from torch's CPU SDPA (figures: speed notes of docs/architecture.md):
- a prefill of whole prompts (every sequence from position 0, all of one length: no padding, no
  cached prefix) runs `is_causal` without a mask, which skips the masked-out half of the work;
- a bfloat16 decode on CPU (one query per sequence) feeds the query twice and keeps the first row:
  torch's kernel has a slow path for a single bfloat16 query that two queries avoid, with identical
  results; float32 has no such slow path.
- a chunk of one sequence after a long cached prefix (a pipelined prefill's later chunks, a prompt
  whose prefix was cached) on CPU runs as two calls of torch's CPU flash kernel, which also returns
  each row's log-sum-exp: the chunk's queries against the prefix's keys with no mask, and against
  its own keys with `is_causal` (square, so the kernel's top-left causal mask is the right one),
  merged by their log-sum-exps (`split_prefix`). The kernel reads a boolean mask as an additive
  float one over every key and skips nothing. Below SPLIT_MIN_PREFIX keys or SPLIT_MIN_QUERIES
  queries the second call costs more than the mask saves (a DSpark block stays masked).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sparkrelay.models import cpu_kernels

SPLIT_MIN_PREFIX, SPLIT_MIN_QUERIES = 512, 64  # split_prefix from here on (module docstring)
# queries per sequence the decode-attention kernel takes: a decode token and a DSpark verify block
# (block 7 + its anchor); longer chunks go to SDPA's blocked kernels (speed notes)
KERNEL_QUERIES = 8


def slot_index(block_tables: list[list[int]], length: int, page_size: int) -> torch.Tensor:
    """[B, length] pool slot of positions 0..length-1 of each sequence (positions past a table point
    at block 0)."""
    bt = torch.zeros(len(block_tables), max(1, -(-length // page_size)), dtype=torch.long)
    for b, table in enumerate(block_tables):
        n = min(len(table), bt.shape[1])
        bt[b, :n] = torch.tensor(table[:n], dtype=torch.long)
    j = torch.arange(length)
    return bt[:, j // page_size] * page_size + j % page_size


@dataclass
class AttnMeta:
    """Built once per forward by the runner; shared by every layer."""

    positions: torch.Tensor  # [T] absolute position of each fed token
    slot_mapping: torch.Tensor  # [T] pool slot each fed token's K/V is written to
    q_pad_index: torch.Tensor  # [T] row of each fed token in the flattened [B * Lq] query layout
    # [B, Lk] pool slot of each key (padding rows point at slot 0, masked out)
    kv_index: torch.Tensor
    # [B, 1, Lq, Lk] True where the query may attend; None when every key is visible
    mask: torch.Tensor | None
    batch: int
    max_q: int
    kv_range: tuple[int, int] | None = (
        None  # one sequence whose key slots are consecutive: read a view, no gather
    )
    causal: bool = (
        False  # whole prompts of one length from position 0: SDPA's is_causal instead of `mask`
    )
    prefix: int = 0  # > 0: one sequence's chunk after this many cached keys, attended in two calls (split_prefix)
    token_seq: torch.Tensor | None = None  # [T] the sequence of each fed token (None: all 0)
    _lengths: torch.Tensor | None = None

    def query_lengths(self) -> torch.Tensor:
        """[T] keys each fed token's query sees (its position + 1), computed once per forward."""
        if self._lengths is None:
            self._lengths = (self.positions + 1).contiguous()
        return self._lengths

    def query_seq(self) -> torch.Tensor:
        """[T] the sequence (row of kv_index) of each fed token."""
        if self.token_seq is None:
            self.token_seq = torch.zeros_like(self.positions)
        return self.token_seq

    @classmethod
    def build(
        cls,
        starts: list[int],
        ends: list[int],
        block_tables: list[list[int]],
        page_size: int,
        device: torch.device | str,
    ) -> "AttnMeta":
        """Sequence b feeds positions [starts[b], ends[b]); its keys are positions 0..ends[b]-1,
        found through its block table; queries are causal."""
        if len(starts) == 1:
            return cls.single(starts[0], ends[0], block_tables[0], page_size, device)
        return cls.batched(starts, ends, block_tables, page_size, device)

    @classmethod
    def batched(
        cls,
        starts: list[int],
        ends: list[int],
        block_tables: list[list[int]],
        page_size: int,
        device: torch.device | str,
    ) -> "AttnMeta":
        """build() for any number of sequences, padded to the longest."""
        batch = len(starts)
        start_t, end_t = torch.tensor(starts), torch.tensor(ends)
        q_lens = end_t - start_t
        max_q, max_k = int(q_lens.max()), int(end_t.max())
        kv_index = slot_index(block_tables, max_k, page_size)  # [B, Lk]
        j = torch.arange(max_k)
        if max_q == 1:
            seq_of_token, positions = torch.arange(batch), start_t
        else:
            seq_of_token = torch.repeat_interleave(torch.arange(batch), q_lens)  # [T]
            offsets = torch.arange(int(q_lens.sum())) - torch.repeat_interleave(
                q_lens.cumsum(0) - q_lens, q_lens
            )
            positions = start_t[seq_of_token] + offsets
        slot_mapping = kv_index[seq_of_token, positions]  # [T]
        pad_index = seq_of_token * max_q + (positions - start_t[seq_of_token])
        # query row i of sequence b sits at position min(start_b + i, end_b - 1) (padding rows
        # repeat the last one so that no softmax row is empty; their outputs are dropped); key j is
        # visible iff j <= that.
        # [B, Lq]
        q_pos = torch.minimum(start_t[:, None] + torch.arange(max_q)[None, :], end_t[:, None] - 1)
        mask = (j.view(1, 1, max_k) <= q_pos.unsqueeze(-1)).unsqueeze(1)  # [B, 1, Lq, Lk]
        if max_q == 1 and bool((end_t == max_k).all()):
            mask = None  # one query per sequence and no padding keys: every key is visible
        causal = max_q > 1 and bool((start_t == 0).all()) and bool((end_t == max_k).all())
        if causal:
            mask = None  # Lq == Lk for every sequence: the causal mask is SDPA's own
        kv_range = None
        if batch == 1 and bool((kv_index[0, 1:] - kv_index[0, :-1] == 1).all()):
            kv_range = (
                int(kv_index[0, 0]),
                int(kv_index[0, 0]) + max_k,
            )  # blocks allocated back to back
        return cls(
            positions=positions.to(device),
            slot_mapping=slot_mapping.to(device),
            q_pad_index=pad_index.to(device),
            kv_index=kv_index.to(device),
            mask=None if mask is None else mask.to(device),
            token_seq=seq_of_token.to(device),
            batch=batch,
            max_q=max_q,
            kv_range=kv_range,
            causal=causal,
        )

    @classmethod
    def single(
        cls, start: int, end: int, table: list[int], page_size: int, device: torch.device | str
    ) -> "AttnMeta":
        """build() for one sequence (a prompt or a chunk of one, a decode row, a DSpark block), from
        Python ints in a few tensor ops: no padding, so query row i is position start + i and sees
        keys 0..start + i."""
        n = end - start
        kv_index = slot_index([table], end, page_size)  # [1, Lk]
        positions = torch.arange(start, end)  # [T]
        mask = None  # one query, or a whole prompt (causal): every key it may see is visible / SDPA's own mask
        prefix = (
            start
            if start >= SPLIT_MIN_PREFIX and n >= SPLIT_MIN_QUERIES and str(device) == "cpu"
            else 0
        )
        if n > 1 and start > 0 and not prefix:
            # [1, 1, Lq, Lk]
            mask = (torch.arange(end).view(1, end) <= positions.view(n, 1)).view(1, 1, n, end)
        pages = table[: -(-end // page_size)]
        consecutive = len(pages) * page_size >= end and all(
            b == a + 1 for a, b in zip(pages, pages[1:])
        )
        kv_range = (pages[0] * page_size, pages[0] * page_size + end) if consecutive else None
        return cls(
            positions=positions.to(device),
            slot_mapping=kv_index[0, start:end].to(device),
            q_pad_index=torch.arange(n).to(device),
            kv_index=kv_index.to(device),
            mask=None if mask is None else mask.to(device),
            batch=1,
            max_q=n,
            kv_range=kv_range,
            causal=n > 1 and start == 0,
            prefix=prefix,
        )

    @classmethod
    def draft_block(
        cls,
        ctx_index: torch.Tensor,
        ctx_len: torch.Tensor,
        scratch: torch.Tensor,
        positions: torch.Tensor,
    ) -> "AttnMeta":
        """A DSpark draft block (docs/dspark.md §1.5): row r's B queries, at block `positions` [R, B], see the
        first ctx_len[r] [R] context slots of ctx_index [R, Lc] and the whole block, whose K/V are written to
        its `scratch` [R, B] slots (never a committed position's: block rows are not cached). No causal
        mask, so every query of a row sees the same keys: its context, then the block."""
        r, b = scratch.shape
        dev, lc = scratch.device, ctx_index.shape[1]
        seen = ctx_len + b  # [R]
        kv_index = torch.cat([ctx_index, scratch.new_zeros(r, b)], dim=1)  # [R, Lc + B]
        kv_index.scatter_(1, ctx_len[:, None] + torch.arange(b, device=dev)[None, :], scratch)
        mask = None  # rows of one context length: every key is visible
        if bool((ctx_len < lc).any()):
            # [R, 1, 1, Lc + B]: padding keys past a row's block hidden
            mask = (torch.arange(lc + b, device=dev)[None, :] < seen[:, None])[:, None, None, :]
        return cls(
            positions=positions.reshape(-1),
            slot_mapping=scratch.reshape(-1),
            q_pad_index=torch.arange(r * b, device=dev),
            kv_index=kv_index,
            mask=mask,
            batch=r,
            max_q=b,
            token_seq=torch.arange(r, device=dev).repeat_interleave(b),
            _lengths=seen.repeat_interleave(b),
        )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    meta: AttnMeta,
    scale: float,
) -> torch.Tensor:
    """q [T, H, D], k/v [T, n_kv, D] of the fed tokens -> attention output [T, H, D]; writes k/v into the pools."""
    # index_copy_/index_select: far cheaper than advanced indexing
    k_pool.index_copy_(0, meta.slot_mapping, k)
    v_pool.index_copy_(0, meta.slot_mapping, v)
    n_heads, dim = q.shape[1], q.shape[2]
    out = kernel_attention(q, k_pool, v_pool, meta, scale)
    if out is not None:
        return out
    if meta.max_q == 1 and n_heads > k_pool.shape[1] and not meta.prefix:
        return grouped_decode(q, k_pool, v_pool, meta, scale)
    # see the module docstring
    twice = meta.max_q == 1 and q.dtype != torch.float32 and q.device.type == "cpu"
    if meta.max_q == 1:
        # [B, 1 | 2, H, D]: decode, one token per sequence
        qp = q.unsqueeze(1).expand(-1, 2 if twice else 1, -1, -1)
    elif meta.batch == 1:
        qp = q.unsqueeze(0)  # [1, T, H, D]: one sequence needs no padding
    else:
        qp = q.new_zeros(meta.batch * meta.max_q, n_heads, dim)
        qp[meta.q_pad_index] = q
        qp = qp.view(meta.batch, meta.max_q, n_heads, dim)  # [B, Lq, H, D]
    if meta.kv_range is not None:
        lo, hi = meta.kv_range
        kp, vp = k_pool[lo:hi].unsqueeze(0), v_pool[lo:hi].unsqueeze(0)  # [1, Lk, n_kv, D] views
    else:
        flat = meta.kv_index.view(-1)
        # [B, Lk, n_kv, D]
        kp = k_pool.index_select(0, flat).view(meta.batch, -1, *k_pool.shape[1:])
        vp = v_pool.index_select(0, flat).view(meta.batch, -1, *v_pool.shape[1:])
    if meta.prefix:
        out = split_prefix(
            qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2), meta.prefix, scale
        )
    else:
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2),
            kp.transpose(1, 2),
            vp.transpose(1, 2),
            attn_mask=meta.mask,
            is_causal=meta.causal,
            scale=scale,
            enable_gqa=True,
        )  # [B, H, Lq (x2 when `twice`), D]
    if twice:
        out = out[:, :, :1]
    out = out.transpose(1, 2).reshape(meta.batch * meta.max_q, n_heads, dim)
    return out if meta.max_q == 1 or meta.batch == 1 else out[meta.q_pad_index]


def decode_kernel(q: torch.Tensor, k_pool: torch.Tensor, meta: AttnMeta):
    """The extension when its decode attention can serve this call (at most KERNEL_QUERIES queries
    per sequence, bf16 pools on CPU: csrc/cpu_attention.cpp reads the keys in place, no gather),
    else None (longer chunks: SDPA's blocked kernels)."""
    if meta.max_q > KERNEL_QUERIES or meta.prefix or q.device.type != "cpu":
        return None
    if q.dtype != torch.bfloat16:
        return None
    if k_pool.dtype != torch.bfloat16 or q.shape[-1] % 2 or q.shape[-1] > 256:
        return None
    if torch.compiler.is_compiling():
        return None
    return cpu_kernels.portable()  # the AVX-512 build or the AVX2 one


def kernel_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttnMeta, scale: float
) -> torch.Tensor | None:
    """The decode-attention kernel's output [T, H, D] for this call, or None where it does not
    serve it (decode_kernel)."""
    ext = decode_kernel(q, k_pool, meta)
    if ext is None:
        return None
    seq, lengths = meta.query_seq(), meta.query_lengths()
    return ext.decode_attention_bf16(
        q.contiguous(), k_pool, v_pool, meta.kv_index, seq, lengths, scale
    )


def grouped_decode(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttnMeta, scale: float
) -> torch.Tensor:
    """Decode (one query per sequence) under GQA: q [B, H, D] -> [B, H, D]. The H / n_kv query heads that share a KV
    head are consecutive, so they attend as the g = H / n_kv queries of one head: q [B, n_kv, g, D] against
    k [B, n_kv, Lk, D], plain multi-head SDPA with no K/V repeated for the groups (enable_gqa expands them)."""
    b, h, d = q.shape
    n_kv = k_pool.shape[1]
    if meta.kv_range is not None:
        lo, hi = meta.kv_range
        kp, vp = k_pool[lo:hi].unsqueeze(0), v_pool[lo:hi].unsqueeze(0)  # [1, Lk, n_kv, D] views
    else:
        flat = meta.kv_index.view(-1)
        kp = k_pool.index_select(0, flat).view(b, -1, n_kv, d)  # [B, Lk, n_kv, D]
        vp = v_pool.index_select(0, flat).view(b, -1, n_kv, d)
    qg = q.view(b, n_kv, h // n_kv, d)  # [B, n_kv, g, D]
    # [B, n_kv, g, D]; mask [B, 1, 1, Lk] or None
    out = F.scaled_dot_product_attention(
        qg, kp.transpose(1, 2), vp.transpose(1, 2), attn_mask=meta.mask, scale=scale
    )
    return out.reshape(b, h, d)


def split_prefix(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, scale: float
) -> torch.Tensor:
    """Causal attention of one sequence's chunk after `prefix` cached keys (CPU): q [1, H, Lq, D], k/v [1, n_kv,
    prefix + Lq, D] -> [1, H, Lq, D]. The prefix part needs no mask, the chunk's own part is square and causal;
    each call gives its rows' log-sum-exp (float32 [1, H, Lq]), and the softmax over all keys weighs the two
    outputs by exp(lse_p) / (exp(lse_p) + exp(lse_c)) = sigmoid(lse_p - lse_c)."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out_p, lse_p = flash(q, k[:, :, :prefix], v[:, :, :prefix], 0.0, False, scale=scale)
    out_c, lse_c = flash(q, k[:, :, prefix:], v[:, :, prefix:], 0.0, True, scale=scale)
    w = torch.sigmoid(lse_p - lse_c).unsqueeze(-1)  # [1, H, Lq, 1]
    return torch.lerp(out_c.float(), out_p.float(), w).to(q.dtype)
