"""Sampler: the filters keep the right tokens and the draws follow the filtered distribution."""

import torch

from sparkrelay.runner.sampler import SamplingBatch, filter_probs, sample


def batch(rows, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, greedy=False, generators=None):
    full = lambda v, dt=torch.float32: torch.full((rows,), v, dtype=dt)
    return SamplingBatch(
        full(temperature),
        full(top_k, torch.long),
        full(top_p),
        full(min_p),
        full(greedy, torch.bool),
        generators or [None] * rows,
    )


LOGITS = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))


def test_top_k_top_p_min_p_filters():
    p = filter_probs(LOGITS, batch(1, top_k=2))
    torch.testing.assert_close(p, torch.tensor([[5 / 7, 2 / 7, 0, 0, 0]]))
    p = filter_probs(LOGITS, batch(1, top_p=0.7))  # 0.5 + 0.2 reaches 0.7
    torch.testing.assert_close(p, torch.tensor([[5 / 7, 2 / 7, 0, 0, 0]]))
    p = filter_probs(LOGITS, batch(1, top_p=0.1))  # the top token always stays
    torch.testing.assert_close(p, torch.tensor([[1.0, 0, 0, 0, 0]]))
    p = filter_probs(LOGITS, batch(1, min_p=0.3))  # keep p >= 0.3 * 0.5
    torch.testing.assert_close(p, torch.tensor([[0.5, 0.2, 0.15, 0, 0]]) / 0.85)
    p = filter_probs(LOGITS, batch(1, temperature=0.5))
    torch.testing.assert_close(p, torch.softmax(LOGITS * 2, -1))


def test_draws_follow_the_distribution():
    n = 20000
    logits = LOGITS.expand(n, -1)
    ids = sample(logits, batch(n), torch.Generator().manual_seed(0))
    freq = torch.bincount(ids, minlength=5).float() / n
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]), atol=0.015, rtol=0)
    ids = sample(logits, batch(n, top_k=3), torch.Generator().manual_seed(0))
    assert int(ids.max()) <= 2


def test_greedy_rows_and_seeds():
    logits = torch.randn(3, 50)
    gens = [torch.Generator().manual_seed(7), None, torch.Generator().manual_seed(7)]
    sb = batch(3, greedy=False, generators=gens)
    sb.greedy[1] = True
    ids = sample(logits, sb, torch.Generator().manual_seed(1))
    assert int(ids[1]) == int(logits[1].argmax())
    again = sample(
        logits, batch(3, generators=[torch.Generator().manual_seed(7)] * 3), torch.Generator()
    )
    assert int(ids[0]) == int(again[0])  # the same seed gives the same draw in another batch


def test_ranking_the_batch_top_k_equals_sorting_the_vocabulary():
    # row 0 alone ranks its 20 best (topk); beside a row without top-k the batch sorts all 400
    logits = torch.randn(2, 400, generator=torch.Generator().manual_seed(3)) * 3
    for top_p in (1.0, 0.8, 0.3):
        alone = filter_probs(logits[:1], batch(1, temperature=0.7, top_k=20, top_p=top_p))
        both = batch(2, temperature=0.7, top_k=20, top_p=top_p)
        both.top_k[1] = 0
        sorted_rows = filter_probs(logits, both)
        torch.testing.assert_close(alone[0], sorted_rows[0])
        assert int((alone[0] > 0).sum()) <= 20
        assert abs(float(alone.sum()) - 1) < 1e-5


def test_a_seeded_row_draws_its_uniform_from_its_own_generator():
    """Row 1's uniform is its generator's first draw wherever it sits in the batch; the other rows
    come from the shared generator."""
    from sparkrelay.models.draw import row_uniforms

    gens = [None, torch.Generator().manual_seed(5), None]
    u = row_uniforms(gens, torch.Generator().manual_seed(1), 4)
    own = torch.empty(4).uniform_(generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(u[1], own)
    shared = torch.empty(3, 4).uniform_(generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(u[[0, 2]], shared[[0, 2]])
