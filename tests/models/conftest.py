"""tests/models: the model code (sparkrelay/models/): attention, families against transformers,
GGUF, dummy loads, kernels, the DSpark drafter and its context projection."""

import pytest

from sparkrelay.models import cpu_kernels, kernels


@pytest.fixture
def cpu_kernels_off(monkeypatch):
    """The oneDNN fallback, as with SPARKRELAY_CPU_KERNELS=0 (the load decision is made afresh)."""
    monkeypatch.setenv(cpu_kernels.ENV, "0")
    monkeypatch.setattr(cpu_kernels, "_state", {})
    yield
    monkeypatch.setattr(cpu_kernels, "_state", {})


@pytest.fixture(params=["onednn", "float32"])
def bf16_fallback(request, monkeypatch):
    """The layer kind a bfloat16 weight gets with the kernels off, both ways on every host: oneDNN's
    packed product where it runs bfloat16, a float32 copy where it does not (forced here, so a CPU
    with oneDNN bfloat16 tests that path too)."""
    if request.param == "onednn":
        if not kernels.onednn_bf16():
            pytest.skip("oneDNN has no bfloat16 product on this CPU")
        return kernels.PackedLinear
    monkeypatch.setattr(kernels, "onednn_bf16", lambda: False)
    return kernels.WideLinear
