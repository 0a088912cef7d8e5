"""Paged attention against a dense float64 reference, for every call shape it takes (causal, masked,
decode, a chunk after a long prefix in two calls)."""

import pytest
import torch

from sparkrelay.models.attention import (
    SPLIT_MIN_PREFIX,
    SPLIT_MIN_QUERIES,
    AttnMeta,
    paged_attention,
)

H, KV, D, PAGE = 4, 2, 16, 4


def reference(q_rows, keys, values, positions) -> torch.Tensor:
    """q_rows [T, H, D] at absolute `positions` over keys/values [L, KV, D] (positions 0..L-1) -> [T, H, D]."""
    k = keys.double().repeat_interleave(H // KV, dim=1)  # [L, H, D]
    v = values.double().repeat_interleave(H // KV, dim=1)
    scores = torch.einsum("thd,lhd->htl", q_rows.double(), k) / D**0.5  # [H, T, L]
    visible = torch.arange(k.shape[0])[None, :] <= torch.tensor(positions)[:, None]  # [T, L]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("htl,lhd->thd", probs, v)


def run(starts, ends, dtype, seed=0):
    """Feed positions [start, end) of each sequence (earlier positions already cached); -> (output, references)."""
    g = torch.Generator().manual_seed(seed)
    span = max(16, -(-max(ends) // PAGE))  # pages per sequence
    pages = [
        list(range(i * span, i * span + -(-e // PAGE))) for i, e in enumerate(ends)
    ]  # disjoint tables
    k_pool, v_pool = torch.zeros(2, span * len(ends) * PAGE, KV, D, dtype=dtype)
    seqs = [
        (
            torch.randn(e, KV, D, generator=g).to(dtype),
            torch.randn(e, KV, D, generator=g).to(dtype),
            torch.randn(e - s, H, D, generator=g).to(dtype),
        )
        for s, e in zip(starts, ends)
    ]
    meta = AttnMeta.build(starts, ends, pages, PAGE, "cpu")
    # the cached prefix, written as earlier steps did
    for (k, v, _), s, table in zip(seqs, starts, pages):
        slots = torch.tensor(
            [table[j // PAGE] * PAGE + j % PAGE for j in range(s)], dtype=torch.long
        )
        k_pool.index_copy_(0, slots, k[:s])
        v_pool.index_copy_(0, slots, v[:s])
    fed = lambda i: torch.cat([x[s:] if i < 2 else x for x, s in zip((t[i] for t in seqs), starts)])  # noqa: E731
    out = paged_attention(fed(2), fed(0), fed(1), k_pool, v_pool, meta, D**-0.5)
    refs = [reference(q, k, v, list(range(s, e))) for (k, v, q), s, e in zip(seqs, starts, ends)]
    return meta, out, torch.cat(refs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "starts,ends,causal",
    [
        ([0, 0], [9, 9], True),  # whole prompts of one length: SDPA's own causal mask
        ([0], [13], True),
        ([0, 0], [9, 5], False),  # unequal lengths: padded, masked
        ([4, 0], [11, 7], False),  # a cached prefix: masked
        (
            [3, 3],
            [9, 9],
            False,
        ),  # a cached prefix, equal lengths: still masked (is_causal is top-left aligned)
        (
            [8, 5, 12],
            [9, 6, 13],
            False,
        ),  # decode, one query per sequence (bfloat16: the query fed twice)
        ([12], [13], False),
        (
            [4],
            [11],
            False,
        ),  # one sequence's later chunk (or a prompt after its cached prefix): masked
        (
            [SPLIT_MIN_PREFIX],
            [SPLIT_MIN_PREFIX + SPLIT_MIN_QUERIES],
            False,
        ),  # ... after a long prefix: split_prefix
        ([SPLIT_MIN_PREFIX + 77], [SPLIT_MIN_PREFIX + 77 + 130], False),
        (
            [SPLIT_MIN_PREFIX],
            [SPLIT_MIN_PREFIX + SPLIT_MIN_QUERIES - 1],
            False,
        ),  # too few queries: masked
    ],
)
@torch.inference_mode()
def test_paged_attention_equals_dense_reference(dtype, starts, ends, causal):
    meta, out, ref = run(starts, ends, dtype)
    assert meta.causal == causal and (meta.mask is None or not causal)
    split = (
        len(starts) == 1
        and starts[0] >= SPLIT_MIN_PREFIX
        and ends[0] - starts[0] >= SPLIT_MIN_QUERIES
    )
    assert meta.prefix == (starts[0] if split else 0) and (meta.mask is None or not split)
    tol = dict(rtol=0, atol=2e-5) if dtype == torch.float32 else dict(rtol=0, atol=2e-2)
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, **tol)


@pytest.mark.parametrize("seed", range(20))
def test_one_sequence_metadata_equals_the_batched_build(seed):
    """AttnMeta.single (what build() takes for one sequence) gives exactly the padded, batched
    build's fields."""
    g = torch.Generator().manual_seed(seed)
    end = int(torch.randint(1, 40, (1,), generator=g))
    start = [0, end - 1, int(torch.randint(0, end, (1,), generator=g))][seed % 3]
    pages = -(-end // PAGE)
    table = (
        list(range(5, 5 + pages)) if seed % 2 else torch.randperm(50, generator=g)[:pages].tolist()
    ) + [49]
    one, ref = (
        AttnMeta.single(start, end, table, PAGE, "cpu"),
        AttnMeta.batched([start], [end], [table], PAGE, "cpu"),
    )
    for field in ("positions", "slot_mapping", "q_pad_index", "kv_index"):
        assert torch.equal(getattr(one, field), getattr(ref, field)), field
    assert (one.mask is None) == (ref.mask is None) and (
        one.mask is None or torch.equal(one.mask, ref.mask)
    )
    assert (one.batch, one.max_q, one.kv_range, one.causal) == (
        ref.batch,
        ref.max_q,
        ref.kv_range,
        ref.causal,
    )
