"""tests/e2e: runs across processes through the real entry points (launch_server, launch_router, the
SGLang router): PD per transfer backend, faults and refusals, start-up errors, listening sockets.
Every test here is marked `e2e`, so `pytest -m e2e` runs them and `-m "not e2e"` the in-process
rest."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.e2e)
