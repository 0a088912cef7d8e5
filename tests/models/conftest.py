"""tests/models: the model code (sparkrelay/models/): attention, families against transformers,
GGUF, dummy loads, kernels, the DSpark drafter and its context projection."""

import pytest

from sparkrelay.models import cpu_kernels


@pytest.fixture
def cpu_kernels_off(monkeypatch):
    """The oneDNN fallback, as with SPARKRELAY_CPU_KERNELS=0 (the load decision is made afresh)."""
    monkeypatch.setenv(cpu_kernels.ENV, "0")
    monkeypatch.setattr(cpu_kernels, "_state", {})
    yield
    monkeypatch.setattr(cpu_kernels, "_state", {})
