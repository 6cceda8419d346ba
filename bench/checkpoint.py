"""Workload `checkpoint`: a checkpoint saved through a writable mount to the
loopback S3 server, against the CRT client and s3fs uploading the same bytes,
then loaded on the same host through a fresh mount.

    python -m bench.checkpoint [--mib 1024] [--rounds 3] [--out DIR]

The checkpoint is a zip written the way `torch.save` writes one (torch is not
installed here): stored entries, each a tensor's storage of pseudo-random
bytes (`archive/data/N`, 16 MiB each, and a small `data.pkl`), written
sequentially with their local headers, then the central directory. Each
round, on a moto server on 127.0.0.1 (no emulated latency: the upload's own
speed is what is measured), one after the other:
- `mount`: the zip written through `fsclient mount --writable` (staged on
  the node, uploaded as one multipart upload with parts in parallel when
  the file is closed), timed from the open to the close's return;
- `crt`: the same bytes uploaded from memory by AWS's CRT client
  (s3torchconnectorclient's `MountpointS3Client.put_object`, its defaults);
- `s3fs`: the same bytes uploaded by s3fs's `put` from a local file (its
  defaults).
Each object is checked against the bytes. Targets (the best round of each):
the mount >= 0.8x the CRT client's speed and >= 1.0x s3fs's.

Then the load: once the writing mount has put the uploaded blocks in the
host cache, a fresh mount reads every entry of the checkpoint (zipfile, as
`torch.load` reads one) with 0 bytes from the remote, at the warm speed: its
time against a second fresh mount's, which reads a cache the first one
found warm. Both start with the cache's files in the page cache (as the
suite's warm epochs do: the uploads before them filled memory with moto's
objects, which would otherwise make the first load read the cache disk and
the second not). Targets: 0 remote bytes, and the first load >= 0.9x the
second's speed. Results go to stdout and bench/results/checkpoint.json; the
exit code is 0 when the targets are met.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import sys
import time
import zipfile

from bench.fuse_vs_passthrough import RESULTS
from bench.systems import read_into_page_cache
from blockcache_client.volumekey import generate_key_file
from devtools.demo import Demo
from devtools.s3server import S3Server

MIB = 1 << 20
ENTRY_BYTES = 16 * MIB
PATH = "ckpt/step-100/model.pt"
TARGETS = {"mount_vs_crt": 0.8, "mount_vs_s3fs": 1.0, "load_vs_warm": 0.9}


def tensors(total_bytes: int, seed: int = 45) -> list[bytes]:
    """The storages of a checkpoint of about `total_bytes` (pseudo-random)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    sizes = [ENTRY_BYTES] * max(1, total_bytes // ENTRY_BYTES)
    return [rng.bytes(n) for n in sizes]


def write_zip(fobj, storages: list[bytes]) -> None:
    """A zip as torch.save writes one: stored records, sequentially."""
    def info(name: str) -> zipfile.ZipInfo:
        return zipfile.ZipInfo(f"archive/{name}", date_time=(2024, 1, 1, 0, 0, 0))
    with zipfile.ZipFile(fobj, "w", zipfile.ZIP_STORED) as z:
        z.writestr(info("data.pkl"), b"\x80\x02}q\x00." + b"\0" * 4000)
        z.writestr(info("byteorder"), b"little")
        for i, data in enumerate(storages):
            z.writestr(info(f"data/{i}"), data)
        z.writestr(info("version"), b"3\n")


def load_zip(path: str) -> int:
    """Every entry read whole, as torch.load reads its storages; the bytes read."""
    n = 0
    with zipfile.ZipFile(path) as z:
        for name in z.namelist():
            n += len(z.read(name))
    return n


def write_config(demo: Demo, s3: S3Server, prefix: str, writable: bool) -> str:
    path = os.path.join(demo.tmp, "writable.toml" if writable else "reader.toml")
    key = os.path.join(demo.tmp, "ckpt.key")
    if not os.path.exists(key):
        generate_key_file(key)
    o = s3.storage_options
    with open(path, "w") as f:
        f.write(f'volume = "ckpt"\nsource = "{s3.url(prefix)}"\n'
                f'mountpoint = "{demo.mountpoint}"\nkey_file = "{key}"\n'
                f'socket = "{demo.socket}"\nblock_size = "4M"\nmeta_ttl = 60\n'
                + (f'writable = true\nstaging_dir = "{demo.tmp}"\n' if writable else "")
                + f'[storage_options]\nendpoint_url = "{o["endpoint_url"]}"\n'
                  f'key = "{o["key"]}"\nsecret = "{o["secret"]}"\n'
                  f'[storage_options.client_kwargs]\nregion_name = "us-east-1"\n')
    return path


def through_mount(demo: Demo, storages: list[bytes]) -> float:
    """Seconds from the open to the close's return of the zip written through the mount."""
    path = os.path.join(demo.mountpoint, PATH)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    t = time.perf_counter()
    with open(path, "wb") as f:
        write_zip(f, storages)
    return time.perf_counter() - t


def crt_put(s3: S3Server, key: str, data: bytes) -> float:
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    from s3torchconnectorclient._mountpoint_s3_client import MountpointS3Client
    client = MountpointS3Client("us-east-1", endpoint=s3.endpoint_url, force_path_style=True)
    chunks = [data[off:off + 8 * MIB] for off in range(0, len(data), 8 * MIB)]  # (it takes bytes)
    t = time.perf_counter()
    stream = client.put_object(s3.bucket, key)
    for chunk in chunks:
        stream.write(chunk)
    stream.close()
    return time.perf_counter() - t


def s3fs_put(s3: S3Server, key: str, local: str) -> float:
    fs = s3.filesystem()
    t = time.perf_counter()
    fs.put_file(local, f"{s3.bucket}/{key}")
    return time.perf_counter() - t


def wait_cached(demo: Demo, timeout: float = 600.0) -> None:
    """Until the writing mount has put the uploaded file's blocks in the cache."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if demo.stats().get("written_caching", 0) == 0:
            break
        time.sleep(0.1)
    demo.wait_fills(timeout)


def timed_load(demo: Demo, config: str, size: int) -> tuple[float, int]:
    """(seconds, remote bytes) of a whole load through a fresh mount (`size`:
    the bytes of its entries)."""
    read_into_page_cache([os.path.join(demo.tmp, "cache")])
    demo.mount(config)
    try:
        t = time.perf_counter()
        n = load_zip(os.path.join(demo.mountpoint, PATH))
        seconds = time.perf_counter() - t
        remote = demo.stats().get("backend_bytes", 0)
    finally:
        demo.unmount()
    if n != size:
        raise RuntimeError(f"a load read {n} bytes of entries, not {size}")
    return seconds, remote


def run(args: argparse.Namespace) -> dict:
    storages = tensors(args.mib * MIB)
    buf = io.BytesIO()
    write_zip(buf, storages)
    data = buf.getvalue()
    demo = Demo(args)
    rounds: dict[str, list[float]] = {"mount": [], "crt": [], "s3fs": []}
    try:
        with S3Server(log_path=os.path.join(demo.tmp, "moto.log")) as s3:
            demo.start_daemon()
            local = os.path.join(demo.tmp, "model.pt")
            with open(local, "wb") as f:
                f.write(data)
            fs = s3.filesystem()
            fs.pipe(f"{s3.bucket}/run/.keep", b"")
            writable = write_config(demo, s3, "run", writable=True)
            for r in range(args.rounds):
                demo.mount(writable)
                try:
                    rounds["mount"].append(through_mount(demo, storages))
                    wait_cached(demo)
                finally:
                    demo.unmount()
                if fs.cat(f"{s3.bucket}/run/{PATH}") != data:
                    raise RuntimeError("the checkpoint written through the mount differs")
                rounds["crt"].append(crt_put(s3, f"crt/{r}/model.pt", data))
                rounds["s3fs"].append(s3fs_put(s3, f"s3fs/{r}/model.pt", local))
                for other in ("crt", "s3fs"):
                    if fs.cat(f"{s3.bucket}/{other}/{r}/model.pt") != data:
                        raise RuntimeError(f"the {other} upload differs")
            reader = write_config(demo, s3, "run", writable=False)
            entries = sum(i.file_size for i in zipfile.ZipFile(io.BytesIO(data)).infolist())
            first, first_remote = timed_load(demo, reader, entries)
            second, second_remote = timed_load(demo, reader, entries)
    finally:
        demo.cleanup()
    best = {k: min(v) for k, v in rounds.items()}
    mib_s = {k: len(data) / MIB / v for k, v in best.items()}
    return {
        "checkpoint_bytes": len(data), "entries": len(storages) + 3, "rounds": rounds,
        "write_mib_s": {k: round(v, 1) for k, v in mib_s.items()},
        "mount_vs_crt": round(mib_s["mount"] / mib_s["crt"], 3),
        "mount_vs_s3fs": round(mib_s["mount"] / mib_s["s3fs"], 3),
        "load_s": {"first_fresh_mount": round(first, 3), "second_fresh_mount": round(second, 3)},
        "load_remote_bytes": {"first": first_remote, "second": second_remote},
        "load_vs_warm": round(second / first, 3),
        "targets": TARGETS, "cpus": os.cpu_count(),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }


def met(result: dict) -> bool:
    return (result["mount_vs_crt"] >= TARGETS["mount_vs_crt"]
            and result["mount_vs_s3fs"] >= TARGETS["mount_vs_s3fs"]
            and result["load_remote_bytes"]["first"] == 0
            and result["load_vs_warm"] >= TARGETS["load_vs_warm"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.checkpoint",
                                description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=1024, help="checkpoint size (MiB)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=RESULTS, help="where checkpoint.json goes")
    p.add_argument("--keep", action="store_true")
    args = p.parse_args(argv)
    args.delay = 0.0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result = run(args)
    print(json.dumps(result, indent=1))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "checkpoint.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0 if met(result) else 1


if __name__ == "__main__":
    sys.exit(main())
