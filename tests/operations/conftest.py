"""Fixtures for operations tests: a source tree and a volume key (a real
daemon is `daemon` from tests/conftest.py). Running the real CLIs over them:
tests/support/cli_runs.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from blockcache_client.volumekey import generate_key_file
from tests.support.cli_runs import make_tree


@pytest.fixture
def tree(tmp_path) -> tuple[Path, dict[str, int]]:
    root = tmp_path / "remote"
    return root, make_tree(root)


@pytest.fixture
def key_file(tmp_path) -> Path:
    path = tmp_path / "volume.key"
    generate_key_file(str(path))
    return path
