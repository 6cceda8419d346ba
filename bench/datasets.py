"""Workload data: generated deterministically, uploaded to the remote, copied to local disk.

Every byte is a function of (seed, path), so any file can be regenerated and
checked (`expected_bytes`) without keeping the dataset around, and two runs of
the suite read the same data. Three trees live under one bucket:

- `imagenet/train/nXXXXXXXX/NNNNNNNN.JPEG`: small files, 80-200 KiB (most
  near 110 KiB), spread over a few dozen directories (workloads 1, 4, 5).
- `shards/shard-NNN.tfrecord`: large files (workloads 2 and 3). Kept to tens
  of MiB each because moto copies a whole object for every ranged GET.
- `pkgtree/benchpkg/...`: a Python package tree (workload 4's import case).

The local copy (same relative paths under `local_root`) feeds the local-disk
and passthrough-FUSE systems.
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass

log = logging.getLogger(__name__)

SEED = "blockcache-bench-1"
KIB = 1024
MIB = 1024 * 1024


@dataclass(frozen=True)
class Size:
    """How big each workload's data and run is."""
    name: str
    files: int            # small files (workload 1)
    dirs: int             # directories they spread over
    shards: int           # large files (workloads 2, 3)
    shard_bytes: int
    subpackages: int      # workload 4's package tree: subpackages x modules
    modules: int
    random_4k: int        # workload 3: reads per epoch of each size
    random_128k: int
    clients: int          # workload 5: clients sharing one cache
    shared_files: int     # workload 5: files each client reads
    shared_rounds: int    # workload 5: rounds of (restart client 0, add new clients)
    stat_files: int       # workload 4: files stat'ed (the first of the small set)
    readers: tuple[int, ...]   # workload 1: reader process counts
    warm_epochs: int      # workload 1: warm epochs, while they are short (< 1 s)


SIZES = {
    "tiny": Size("tiny", files=48, dirs=4, shards=2, shard_bytes=2 * MIB, subpackages=2,
                 modules=3, random_4k=20, random_128k=10, clients=2, shared_files=16,
                 shared_rounds=2, stat_files=48, readers=(1, 2), warm_epochs=2),
    "small": Size("small", files=600, dirs=12, shards=8, shard_bytes=16 * MIB, subpackages=4,
                  modules=10, random_4k=300, random_128k=100, clients=2, shared_files=300,
                  shared_rounds=2, stat_files=600, readers=(1, 4), warm_epochs=3),
    # Bounded by moto, whose CPU per request makes every cold epoch
    # remote-bound: sized so the whole suite runs in about a quarter hour.
    "default": Size("default", files=1500, dirs=15, shards=32, shard_bytes=32 * MIB,
                    subpackages=10, modules=20, random_4k=500, random_128k=200, clients=3,
                    shared_files=500, shared_rounds=3, stat_files=1000, readers=(1, 4),
                    warm_epochs=3),
    "large": Size("large", files=12000, dirs=100, shards=64, shard_bytes=64 * MIB,
                  subpackages=20, modules=40, random_4k=4000, random_128k=1000, clients=4,
                  shared_files=3000, shared_rounds=3, stat_files=12000, readers=(1, 4),
                  warm_epochs=3),
}

PKG_ROOT = "pkgtree"
PKG_NAME = "benchpkg"


def _rng(*parts) -> random.Random:
    return random.Random(":".join(map(str, (SEED,) + parts)))


def small_file_size(i: int) -> int:
    """80-200 KiB, most near 110 KiB (a triangular distribution, mode 95 KiB)."""
    return int(_rng("size", i).triangular(80 * KIB, 200 * KIB, 95 * KIB))


def small_files(size: Size) -> list[str]:
    """Paths of the small-file set, in directory order."""
    return [f"imagenet/train/n{i % size.dirs:08d}/{i:08d}.JPEG" for i in range(size.files)]


def small_dirs(size: Size) -> list[str]:
    """The small-file set's directories (ImageFolder's class dirs)."""
    return [f"imagenet/train/n{d:08d}" for d in range(size.dirs)]


def shards(size: Size) -> list[str]:
    return [f"shards/shard-{i:03d}.tfrecord" for i in range(size.shards)]


def package_files(size: Size) -> dict[str, bytes]:
    """The package tree: path -> source. Each module defines a few functions and a table."""
    files = {f"{PKG_ROOT}/{PKG_NAME}/__init__.py": b'"""Benchmark package."""\n'}
    for s in range(size.subpackages):
        files[f"{PKG_ROOT}/{PKG_NAME}/sub{s:02d}/__init__.py"] = f'"""Subpackage {s}."""\n'.encode()
        for m in range(size.modules):
            body = [f'"""Module {s}.{m}."""', "import math", ""]
            for f in range(12):
                body += [f"def f{f}(x, y={f}):",
                         f"    '''Return a value derived from x ({s}.{m}.{f}).'''",
                         f"    return math.sqrt(abs(x * {f + 1} + y)) + {s * 100 + m}", ""]
            body.append(f"TABLE = {list(range(m, m + 64))!r}")
            files[f"{PKG_ROOT}/{PKG_NAME}/sub{s:02d}/mod{m:02d}.py"] = "\n".join(body).encode()
    return files


def module_names(size: Size) -> list[str]:
    """Every module of the package tree, in import order."""
    names = [PKG_NAME]
    for s in range(size.subpackages):
        names.append(f"{PKG_NAME}.sub{s:02d}")
        names += [f"{PKG_NAME}.sub{s:02d}.mod{m:02d}" for m in range(size.modules)]
    return names


def file_sizes(size: Size) -> dict[str, int]:
    """Every data file (not the package tree) and its size."""
    out = {p: small_file_size(i) for i, p in enumerate(small_files(size))}
    out.update({p: size.shard_bytes for p in shards(size)})
    return out


def expected_bytes(path: str, length: int) -> bytes:
    """The content of a data file: pseudo-random (incompressible, like JPEG or TFRecord)."""
    return _rng("data", path).randbytes(length)


def all_files(size: Size) -> dict[str, int]:
    sizes = file_sizes(size)
    sizes.update({p: len(b) for p, b in package_files(size).items()})
    return sizes


def manifest_name(size: Size) -> str:
    """A marker object whose presence says the dataset of this size is complete."""
    return f"manifest-{size.name}-{SEED}.txt"


def upload(size: Size, remote, local_root: str) -> dict:
    """Put the dataset on the remote (uploading direct, not through the delay) and
    on local disk; skips what is already there. Returns counts for the results file."""
    import s3fs
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **remote.storage_options(direct=True))
    marker = f"{remote.bucket}/{manifest_name(size)}"
    files = all_files(size)
    total = sum(files.values())
    have_remote = fs.exists(marker)
    pkg = package_files(size)
    batch: dict[str, bytes] = {}
    batch_bytes = 0
    for path, length in files.items():
        data = pkg[path] if path in pkg else expected_bytes(path, length)
        local = os.path.join(local_root, path)
        if not (os.path.exists(local) and os.path.getsize(local) == length):
            os.makedirs(os.path.dirname(local), exist_ok=True)
            with open(local + ".tmp", "wb") as f:
                f.write(data)
            os.replace(local + ".tmp", local)
        if have_remote:
            continue
        batch[f"{remote.bucket}/{path}"] = data
        batch_bytes += length
        if batch_bytes >= 64 * MIB or len(batch) >= 256:
            fs.pipe(batch)
            batch, batch_bytes = {}, 0
    if batch:
        fs.pipe(batch)
    if not have_remote:
        fs.pipe(marker, "\n".join(files).encode())
    log.info("dataset %s: %d files, %.1f MiB (remote %s)", size.name, len(files),
             total / MIB, "reused" if have_remote else "uploaded")
    return {"files": len(files), "bytes": total, "small_files": size.files,
            "small_bytes": sum(small_file_size(i) for i in range(size.files)),
            "shards": size.shards, "shard_bytes": size.shard_bytes,
            "modules": len(module_names(size))}


def shuffled(paths: list[str], epoch: int, salt: str = "") -> list[str]:
    """The epoch's read order: a deterministic shuffle (a DataLoader with shuffle=True)."""
    out = list(paths)
    _rng("shuffle", salt, epoch).shuffle(out)
    return out


def random_reads(size: Size) -> list[tuple[str, int, int]]:
    """Workload 3's reads: (path, offset, length), 4 KiB and 128 KiB, aligned to their size.

    4 KiB reads go to the even shards, 128 KiB reads to the odd ones, so one
    size's cold epoch is not warmed by the other's."""
    rng = _rng("random-reads")
    reads = []
    for names, length, count in ((shards(size)[0::2], 4 * KIB, size.random_4k),
                                 (shards(size)[1::2], 128 * KIB, size.random_128k)):
        for _ in range(count):
            slot = rng.randrange(size.shard_bytes // length)
            reads.append((rng.choice(names), slot * length, length))
    rng.shuffle(reads)
    return reads
