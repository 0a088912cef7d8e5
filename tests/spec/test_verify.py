"""verify(): greedy rule, and a chi-square test that rejection sampling keeps the target
distribution (and that the same test catches a broken acceptance rule)."""

import torch

from sparkrelay.spec import verify as V
from testkit.stats import chi2_critical


def one_hot(ids, vocab):
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).float()


def test_greedy_accepts_the_matching_prefix():
    vocab = 10
    target = one_hot([[3, 4, 5, 6], [1, 2, 3, 4]], vocab)  # argmax per verified position
    drafts = torch.tensor([[3, 4, 9], [7, 2, 3]])
    res = V.verify(
        drafts,
        torch.tensor([3, 3]),
        one_hot(drafts.tolist(), vocab),
        target,
        torch.tensor([True, True]),
        [None, None],
        torch.Generator(),
    )
    assert res.accepted.tolist() == [2, 0]
    assert res.next_ids.tolist() == [5, 1]
    res = V.verify(
        drafts,
        torch.tensor([2, 0]),
        one_hot(drafts.tolist(), vocab),
        target,
        torch.tensor([True, True]),
        [None, None],
        torch.Generator(),
    )
    assert res.accepted.tolist() == [2, 0] and res.next_ids.tolist() == [
        5,
        1,
    ]  # bonus at n, or p_0 with no drafts


def chi_square_two_tokens(verify_fn, samples=40000, seed=0):
    """Two-step proposals on a 4-token vocabulary; returns the chi-square statistics of the first
    committed token against p0 (df 3) and of the second given the first against p1 (df 4 x 3 =
    12)."""
    g = torch.Generator().manual_seed(seed)
    vocab = 4
    p0 = torch.tensor([0.1, 0.2, 0.3, 0.4])
    p1 = torch.tensor(
        [[0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25], [0.1, 0.1, 0.1, 0.7], [0.4, 0.3, 0.2, 0.1]]
    )
    q0 = torch.tensor([0.4, 0.3, 0.2, 0.1])
    q1 = torch.tensor([0.25, 0.25, 0.25, 0.25])
    d1 = torch.multinomial(q0, samples, replacement=True, generator=g)
    d2 = torch.multinomial(q1, samples, replacement=True, generator=g)
    drafts = torch.stack([d1, d2], 1)
    q = torch.stack([q0.expand(samples, -1), q1.expand(samples, -1)], 1)
    p2 = torch.full((samples, vocab), 0.25)
    target = torch.stack([p0.expand(samples, -1), p1[d1], p2], 1)
    res = verify_fn(
        drafts,
        torch.full((samples,), 2),
        q,
        target,
        torch.zeros(samples, dtype=torch.bool),
        [None] * samples,
        g,
    )
    a, nxt = res.accepted, res.next_ids
    first = torch.where(a >= 1, d1, nxt)  # the first committed token
    # the second committed token exists when a >= 1 (d2 if accepted, else `next`)
    second = torch.where(a >= 2, d2, torch.where(a == 1, nxt, torch.full_like(nxt, -1)))
    counts = torch.bincount(first, minlength=vocab).float()
    chi1 = float(((counts - samples * p0) ** 2 / (samples * p0)).sum())
    # given the first token f, the second must follow p1[f] (rows where a second token was
    # committed)
    chi2 = 0.0
    for f in range(vocab):
        rows = (second >= 0) & (first == f)
        m = int(rows.sum())
        c = torch.bincount(second[rows], minlength=vocab).float()
        chi2 += float(((c - m * p1[f]) ** 2 / (m * p1[f])).sum())
    return chi1, chi2


def test_rejection_sampling_keeps_the_target_distribution():
    chi1, chi2 = chi_square_two_tokens(V.verify)
    assert chi1 < chi2_critical(3), chi1
    assert chi2 < chi2_critical(12), chi2


def broken_verify(draft_ids, num_drafts, draft_probs, target_probs, greedy, generators, shared):
    """Accepts whenever the target gives the draft any mass (a common bug): skews toward the
    draft."""
    p_d = target_probs[:, : draft_ids.shape[1]].gather(2, draft_ids.unsqueeze(2)).squeeze(2)
    ok = (p_d > 0).int().cumprod(dim=1)
    accepted = ok.sum(dim=1).clamp(max=num_drafts)
    nxt = V._next_tokens(
        accepted, num_drafts, draft_probs, target_probs, greedy, generators, shared
    )
    return V.VerifyResult(accepted, nxt)


def test_the_test_catches_a_broken_rule():
    chi1, _ = chi_square_two_tokens(broken_verify)
    assert chi1 > chi2_critical(3), chi1


def test_spec_stats_take_returns_the_counts_since_the_last_take():
    from sparkrelay.spec.stats import SpecStats

    s = SpecStats(3)
    s.record(proposed=3, committed=3, accepted=2)
    s.record(proposed=2, committed=1, accepted=0)
    first = s.take()
    assert first["spec_rounds"] == 2 and first["spec_accept_length"] == 2.0
    assert first["spec_accept_rate_per_position"] == [0.5, 0.5, 0.0]
    s.record(proposed=1, committed=2, accepted=1)
    second = s.take()
    assert second["spec_rounds"] == 1 and second["spec_accept_rate_per_position"] == [1.0, 0.0, 0.0]
    assert s.summary()["spec_rounds"] == 0
