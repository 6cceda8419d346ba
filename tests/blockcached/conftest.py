"""Fixtures of the daemon's unit tests."""

import pytest

from tests.support.cache_engine import Engine


@pytest.fixture
def engines(tmp_path):
    made = []

    def make(sizes=(1 << 20,), sub="e", **values):
        e = Engine(tmp_path / sub, list(sizes), **values)
        made.append(e)
        return e
    yield make
    for e in made:
        e.close()
