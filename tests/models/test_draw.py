"""models/draw.py: one draw per row by the inverse CDF, through the kernel (csrc/cpu_draw.cpp, the
AVX-512 or the AVX2 build) and torch's float64 cumsum alike: the index whose running sum first
exceeds u * total, never a zero weight (u at 0 and next to 1 included), weights of any scale, and
the drawn frequencies those of the weights (chi-square)."""

from __future__ import annotations

import pytest
import torch

from sparkrelay.models import cpu_kernels
from sparkrelay.models.draw import draw_rows, row_uniforms

_FLAGS = cpu_kernels.cpu_flags()
HAS_ROWS = any(
    all(f in _FLAGS for f in need) for need in (cpu_kernels.NEEDED, cpu_kernels.AVX2_NEEDED)
)
needs_rows = pytest.mark.skipif(not HAS_ROWS, reason="this CPU has neither AVX-512 bf16 nor AVX2")


def _reference(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """float64 [R, V], u [R] -> the first index whose running sum exceeds u * total."""
    cdf = weights.double().cumsum(-1)
    return torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)


@needs_rows
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (8, 49152), (2, 49157), (4, 17)])
def test_the_kernel_draws_the_first_index_past_u_times_the_total(shape):
    ext = cpu_kernels.portable()  # the AVX-512 build, or the AVX2 one
    g = torch.Generator().manual_seed(0)
    w = torch.rand(shape, generator=g) ** 4  # uneven rows
    w[:, ::3] = 0.0  # zeros in between
    if shape[1] == 1:
        w.fill_(0.5)
    for _ in range(20):
        u = torch.rand(shape[0], dtype=torch.float64, generator=g)
        got, want = ext.draw_rows(w, u), _reference(w, u)
        assert torch.equal(got, want)
        assert bool((w.gather(1, got[:, None]) > 0).all())
    rows = torch.rand(shape[0], 2 * shape[1], generator=g)[:, : shape[1]]  # rows at a stride
    u = torch.rand(shape[0], dtype=torch.float64, generator=g)
    assert torch.equal(ext.draw_rows(rows, u), _reference(rows, u))


@pytest.fixture
def cpu_kernels_off_if(monkeypatch):
    """A function: off(True) turns the kernels off for the test (the torch path)."""

    def off(yes: bool) -> None:
        if yes:
            monkeypatch.setenv(cpu_kernels.ENV, "0")
            monkeypatch.setattr(cpu_kernels, "_state", {})
        elif not HAS_ROWS:
            pytest.skip("this CPU has neither AVX-512 bf16 nor AVX2")

    yield off
    monkeypatch.setattr(cpu_kernels, "_state", {})


@pytest.mark.parametrize("kernel", [True, False])
def test_a_zero_weight_is_never_drawn_even_at_the_ends_of_u(kernel, cpu_kernels_off_if):
    cpu_kernels_off_if(not kernel)
    w = torch.tensor([[0.0, 0.0, 1e-30, 0.0, 3.0, 0.0, 0.0]] * 3)
    w[2] = torch.tensor([0.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    for u in (0.0, 0.5, 1.0 - 2**-53):
        gens = [torch.Generator().manual_seed(1)] * 3
        picked = _with_u(w, u, gens)
        assert bool((w.gather(1, picked[:, None]) > 0).all()), (u, picked)


def _with_u(w: torch.Tensor, u: float, gens) -> torch.Tensor:
    """draw_rows with every row's uniform forced to u."""
    import sparkrelay.models.draw as draw

    real = draw.row_uniforms
    draw.row_uniforms = lambda g, s, width, dtype, device: torch.full((len(g), 1), u, dtype=dtype)
    try:
        return draw_rows(w, gens, None)
    finally:
        draw.row_uniforms = real


@pytest.mark.parametrize("kernel", [True, False])
def test_drawn_frequencies_follow_the_weights(kernel, cpu_kernels_off_if):
    """20,000 draws of a 6-token row (weights not summing to one): chi-square against the weights,
    five degrees of freedom, p > 0.001; the same seed draws the same tokens."""
    cpu_kernels_off_if(not kernel)
    w = torch.tensor([[0.5, 0.0, 2.0, 1.0, 0.25, 0.25, 4.0]])
    p = (w / w.sum())[0]
    gen = torch.Generator().manual_seed(7)
    counts = torch.zeros(7)
    for _ in range(200):
        picked = draw_rows(w.expand(100, 7).contiguous(), [None] * 100, gen)
        counts += torch.bincount(picked, minlength=7)
    assert counts[1] == 0
    keep = p > 0
    expected = p[keep] * counts.sum()
    chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
    assert chi2 < 20.5, (counts, chi2)  # the 0.999 quantile of chi-square with 5 dof
    same = [draw_rows(w, [torch.Generator().manual_seed(3)], None) for _ in range(2)]
    assert torch.equal(same[0], same[1])


def test_row_uniforms_are_in_the_unit_interval():
    u = row_uniforms([None] * 4, torch.Generator().manual_seed(0), 1000, torch.float64)
    assert u.shape == (4, 1000) and float(u.min()) >= 0.0 and float(u.max()) < 1.0
