"""Acceptance statistics of speculative rounds (docs/dspark.md §2.6), server-wide (plain Python)."""

from __future__ import annotations


class SpecStats:
    """One round = one target verify pass of one request: proposal length n, committed tokens (the
    acceptance length: accepted drafts + the correction/bonus token, or up to the stop token),
    accepted drafts."""

    def __init__(self, max_drafts: int) -> None:
        self.max_drafts = max_drafts
        self.reset()

    def reset(self) -> None:
        """Every count back to zero (a benchmark's fresh count starts here)."""
        self.rounds = 0
        self.committed = 0
        self.proposed = 0
        self.proposed_at = [0] * self.max_drafts  # rounds that proposed slot k
        self.accepted_at = [0] * self.max_drafts  # rounds whose accepted prefix reached slot k
        self.plain_steps = 0  # decode steps without drafting (--speculative-disable-by-batch-size)

    def record(self, proposed: int, committed: int, accepted: int) -> None:
        self.rounds += 1
        self.committed += committed
        self.proposed += proposed
        for k in range(proposed):
            self.proposed_at[k] += 1
        for k in range(min(accepted, proposed)):
            self.accepted_at[k] += 1

    def summary(self) -> dict:
        r = max(self.rounds, 1)
        return {
            "spec_rounds": self.rounds,
            "spec_plain_steps": self.plain_steps,
            "spec_accept_length": self.committed / r,
            "spec_mean_proposal": self.proposed / r,
            "spec_verify_rate": self.committed / max(self.proposed + self.rounds, 1),
            "spec_accept_rate_per_position": [
                a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at)
            ],
        }

    def take(self) -> dict:
        """The summary since the last reset, then a reset: a benchmark's per-run figures."""
        out = self.summary()
        self.reset()
        return out
