"""A verifying reader of a mount, for crash and upgrade tests and the bench:
every byte and listing it gets is compared with the source tree.

    python -m devtools.mountreader MOUNT SOURCE STOPFILE [--threads 8] [--cwd DIR]

Runs with its working directory in the mount (MOUNT/DIR) until STOPFILE exists,
then prints one JSON line: ok, failed (by error), wrong, the longest operation
(`worst`, seconds) and the operations that took over a second (`stalled`).
`serving` waits for a mount's (new) server. Each thread keeps to one kind of access:
- a file held open from the start, read at random offsets (its pages dropped
  first with POSIX_FADV_DONTNEED, so every read reaches the server);
- fresh opens by a path relative to the working directory;
- fresh opens by absolute path;
- directory listings (relative and absolute) and the root's stats xattr.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time


def serving(mountpoint: str, other_than: int = 0, timeout: float = 60.0) -> int:
    """The pid of the mount's server once one other than `other_than` serves
    (asked of its keeper); RuntimeError after `timeout`."""
    from fsclient import keeper as keeping

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = keeping.status(mountpoint)
        if st["serving"] and st["server"] != other_than:
            return st["server"]
        time.sleep(0.01)
    raise RuntimeError(f"no server took {mountpoint} over within {timeout:g}s")


class Tally:
    def __init__(self) -> None:
        self.ok = 0
        self.wrong = 0
        self.failed: dict[str, int] = {}
        self.worst = 0.0
        self.stalled = 0
        self.samples: list[str] = []  # the first few failures, with their paths
        self.lock = threading.Lock()

    def run(self, fn, *args) -> None:
        t = time.monotonic()
        try:
            right = fn(*args)
        except OSError as exc:
            with self.lock:
                key = f"{getattr(fn, '__name__', 'op')}: {exc.strerror or exc.errno}"
                if len(self.samples) < 5:
                    self.samples.append(f"{key} {exc.filename or ''}")
                self.failed[key] = self.failed.get(key, 0) + 1
            return
        finally:
            took = time.monotonic() - t
            with self.lock:
                self.worst = max(self.worst, took)
                self.stalled += took > 1.0
        with self.lock:
            if right:
                self.ok += 1
            else:
                self.wrong += 1


def files_of(root: str) -> list[str]:
    out = []
    for d, _, names in os.walk(root):
        out += [os.path.relpath(os.path.join(d, n), root) for n in names
                if os.path.isfile(os.path.join(d, n)) and not os.path.islink(os.path.join(d, n))]
    return sorted(out)


def read_whole(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mount")
    ap.add_argument("source")
    ap.add_argument("stopfile")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--cwd", default="")
    a = ap.parse_args()
    files = files_of(a.source)
    truth = {f: read_whole(os.path.join(a.source, f)) for f in files}
    big = max(files, key=lambda f: len(truth[f]))
    os.chdir(os.path.join(a.mount, a.cwd))
    local = [os.path.relpath(f, a.cwd) for f in files if f.startswith(a.cwd)] or files
    tally = Tally()
    held = os.open(os.path.join(a.mount, big), os.O_RDONLY)
    stop = threading.Event()

    def held_read(rng: random.Random) -> bool:
        off = rng.randrange(len(truth[big]))
        os.posix_fadvise(held, 0, 0, os.POSIX_FADV_DONTNEED)
        return os.pread(held, 65536, off) == truth[big][off:off + 65536]

    def relative_open(rng: random.Random) -> bool:
        name = rng.choice(local)
        return read_whole(name) == truth[os.path.normpath(os.path.join(a.cwd, name))]

    def absolute_open(rng: random.Random) -> bool:
        name = rng.choice(files)
        return read_whole(os.path.join(a.mount, name)) == truth[name]

    def listing(rng: random.Random) -> bool:
        d = os.path.dirname(rng.choice(files))
        if rng.random() < 0.5 and d.startswith(a.cwd):
            got = os.listdir(os.path.relpath(d, a.cwd) if d != a.cwd else ".")
        else:
            got = os.listdir(os.path.join(a.mount, d))
        json.loads(os.getxattr(a.mount, "user.blockcache.stats"))
        return sorted(got) == sorted(os.listdir(os.path.join(a.source, d)))

    kinds = [held_read, relative_open, absolute_open, listing]

    def worker(i: int) -> None:
        rng = random.Random(i)
        fn = kinds[i % len(kinds)]
        while not stop.is_set():
            tally.run(fn, rng)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True)
               for i in range(a.threads)]
    for t in threads:
        t.start()
    while not os.path.exists(a.stopfile):
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(60)
    # the working directory still works after everything
    tally.run(lambda: sorted(os.listdir(".")) == sorted(os.listdir(os.path.join(a.source,
                                                                                  a.cwd))))
    os.close(held)
    print(json.dumps({"ok": tally.ok, "wrong": tally.wrong, "failed": tally.failed,
                      "worst": round(tally.worst, 3), "stalled": tally.stalled,
                      "samples": tally.samples}), flush=True)


if __name__ == "__main__":
    main()
