"""Fixtures shared by the test folders: the bundled pair, a small random Qwen3, the tiny model
folder. Each folder mirrors a package of sparkrelay/ (tests/e2e: runs across processes) and keeps
its own fixtures in its conftest.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from testkit.http import build_tiny_model
from testkit.models import BUNDLED, BUNDLED_DRAFTER, make_random_qwen3


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory) -> Path:
    """GQA (4 query heads over 2 KV heads), untied embeddings, 4 layers."""
    return make_random_qwen3(tmp_path_factory.mktemp("random_qwen3"))


@pytest.fixture(scope="session")
def bundled_model_dir() -> Path:
    assert (BUNDLED / "config.json").is_file(), f"the bundled model {BUNDLED} is missing"
    return BUNDLED


@pytest.fixture(scope="session")
def bundled_drafter_dir() -> Path:
    assert (BUNDLED_DRAFTER / "config.json").is_file(), (
        f"the bundled drafter {BUNDLED_DRAFTER} is missing"
    )
    return BUNDLED_DRAFTER


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"))
