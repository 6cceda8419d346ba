"""Skips for tests that need root, or root and /dev/fuse (a real FUSE mount)."""

from __future__ import annotations

import os

import pytest


def fuse_usable() -> bool:
    return os.geteuid() == 0 and os.path.exists("/dev/fuse")


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
needs_fuse = pytest.mark.skipif(not fuse_usable(), reason="needs root and /dev/fuse")
