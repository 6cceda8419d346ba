"""Fixtures for the reliability suite: a volume key. The suite's helpers (real
daemons and mounts that are always stopped, a child dropped to `nobody` or
another uid, datasets, figures) live in tests/support."""

from __future__ import annotations

import pytest

from blockcache_client.volumekey import generate_key_file


@pytest.fixture
def key_file(tmp_path) -> str:
    path = str(tmp_path / "volume.key")
    generate_key_file(path)
    return path
