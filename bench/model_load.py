"""The model-loading workload: a safetensors checkpoint of many tensors, read whole and loaded.

A transformer-shaped checkpoint (per layer: four d x d attention weights, two
d x 4d MLP weights, two norms; float16, pseudo-random bytes) of about
`total_bytes`, made once with the `safetensors` package's numpy API. Loading
it is what a training or serving job does at start, in one of two ways:
- mapped (`load_mapped`, the worker command `mapped`): `safetensors.safe_open(path,
  framework="np")`, which maps the file, then every tensor copied out in
  `keys()` order, as serving and training code load from a path: the file's
  pages come in by page faults (a mount: FUSE reads the kernel's readahead
  sends);
- read then loaded (the worker command `safetensors`): the file's bytes, then
  `safetensors.numpy.load`, for a reader with no path (`Volume`, the CRT
  client's GET).

`bench.model_runs` loads it through each system for `bench.large_files`.
"""

from __future__ import annotations

import math
import os

MIB = 1 << 20
MODEL_PATH = "model/model.safetensors"


def _layer_shapes(d: int) -> list[tuple[str, tuple[int, ...]]]:
    return [("attn.q", (d, d)), ("attn.k", (d, d)), ("attn.v", (d, d)), ("attn.o", (d, d)),
            ("mlp.up", (d, 4 * d)), ("mlp.down", (4 * d, d)), ("norm1", (d,)), ("norm2", (d,))]


def layout(total_bytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """Tensor names and shapes of a checkpoint of about `total_bytes` (at least one layer)."""
    d = 1024 if total_bytes >= 256 * MIB else 128
    per_layer = sum(2 * math.prod(shape) for _, shape in _layer_shapes(d))
    layers = max(1, round(total_bytes / per_layer))
    return [(f"layers.{i}.{name}", shape) for i in range(layers)
            for name, shape in _layer_shapes(d)]


def load_mapped(path: str) -> tuple[int, int]:
    """Load the checkpoint at `path` as serving code does (see the module):
    (tensor bytes copied, tensors). The tensors are kept until the end, as a
    state dict is: each copy lands in fresh memory."""
    from safetensors import safe_open

    kept = []
    with safe_open(path, framework="np") as f:
        for name in f.keys():
            kept.append(f.get_tensor(name))
    return sum(t.nbytes for t in kept), len(kept)


def drop_file_cache(path: str) -> None:
    """Drop the page cache of one file (clean pages: it was written and
    synced), so the next load reads it from the disk: the rest of the
    host's cache, other users' included, is left alone."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def make(path: str, total_bytes: int, seed: int = 33) -> int:
    """Write the checkpoint to `path` unless one of this layout is there;
    returns its tensor count."""
    import numpy as np
    from safetensors.numpy import save_file

    shapes = layout(total_bytes)
    stamp = f"{path}.{len(shapes)}-{total_bytes}.ok"
    if os.path.exists(path) and os.path.exists(stamp):
        return len(shapes)
    rng = np.random.default_rng(seed)
    tensors = {name: np.frombuffer(rng.bytes(2 * math.prod(shape)), np.float16).reshape(shape)
               for name, shape in shapes}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file(tensors, path)
    open(stamp, "w").close()
    return len(shapes)
