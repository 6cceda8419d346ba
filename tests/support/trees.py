"""A directory tree's contents, to compare a mount with its source."""

from __future__ import annotations

import hashlib
import os


def snapshot(root) -> dict:
    """relative path (bytes) -> ('d',) | ('l', target) | ('f', size, sha256)."""
    root = os.fsencode(root)
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root)
            if os.path.islink(full):
                out[rel] = ("l", os.readlink(full))
            elif os.path.isdir(full):
                out[rel] = ("d",)
            else:
                with open(full, "rb") as f:
                    data = f.read()
                out[rel] = ("f", len(data), hashlib.sha256(data).hexdigest())
    return out
