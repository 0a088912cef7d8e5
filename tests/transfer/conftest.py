"""The `make_cluster` fixture: transfer clusters closed after each test."""

import pytest

from testkit.transfer import Cluster


@pytest.fixture
def make_cluster():
    made = []

    def make(**kw) -> Cluster:
        made.append(Cluster(**kw))
        return made[-1]

    yield make
    for c in reversed(made):
        c.close()
