"""Statistics for the distribution tests."""

import math


def chi2_critical(df, alpha=1e-4):
    # Wilson-Hilferty approximation of the chi-square quantile
    z = 3.719  # one-sided normal quantile for 1e-4
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def second_token_counts(engines: dict, prompt: list, params: list, first: int, vocab: int) -> dict:
    """Per engine (name -> LLM): how often each token was drawn second, over the draws whose first
    token was `first` (the first one comes from the prefill; the second is a decode step's, or the
    first a DSpark verify round commits)."""
    import torch

    counts = {name: torch.zeros(vocab) for name in engines}
    for name, llm in engines.items():
        for i in range(0, len(params), 250):
            for o in llm.generate([prompt] * len(params[i : i + 250]), params[i : i + 250]):
                if o["output_ids"][0] == first:
                    counts[name][o["output_ids"][1]] += 1
    return counts


def assert_follows(counts: dict, probs, what: str) -> None:
    """Chi-square of each engine's counts [V] against the exact distribution probs [V]: no draw
    outside its support, and the statistic under the 1e-4 critical value."""
    for name, c in counts.items():
        m = float(c.sum())
        assert m > 100, (name, m)
        support = probs > 0
        assert not c[~support].any(), f"{name}: a token outside the {what} was drawn"
        chi = float(((c[support] - m * probs[support]) ** 2 / (m * probs[support])).sum())
        df = int(support.sum()) - 1
        print(f"\n{name}: chi-square {chi:.1f} over {m:.0f} draws, {df} degrees of freedom")
        assert chi < chi2_critical(df), (name, chi, df)


def target_distribution(llm, prompt: list[int], first: list[int], params):
    """The bundled target's next-token distribution after prompt + first (transformers, float32),
    penalised and filtered as `params` (SamplingParams) asks -> probs [V]."""
    import torch
    from transformers import AutoModelForCausalLM

    from sparkrelay.runner.sampler import PenaltyRows, SamplingBatch, apply_penalties, filter_probs
    from testkit.models import BUNDLED

    hf = AutoModelForCausalLM.from_pretrained(str(BUNDLED), dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + first])).logits[0, -1:].float()  # [1, V]
    pen = apply_penalties(
        logits,
        PenaltyRows(
            [params.repetition_penalty],
            [params.frequency_penalty],
            [params.presence_penalty],
            [prompt],
            [first],
        ),
    )
    sb = SamplingBatch(
        torch.tensor([params.temperature]),
        torch.tensor([params.top_k]),
        torch.tensor([1.0]),
        torch.tensor([0.0]),
        torch.tensor([False]),
        [None],
    )
    return filter_probs(pen, sb)[0]
