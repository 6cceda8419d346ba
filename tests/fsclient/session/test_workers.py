"""The session's workers on a real mount: a read that waits on a slow remote
holds one worker, and reads of cached bytes keep being answered meanwhile by
the others, each on the thread that took it."""

from __future__ import annotations

import os
import threading
import time

import pytest

pytestmark = pytest.mark.fuse

DELAY = 1.0  # each remote request of the mount's source


@pytest.mark.parametrize("threads", [1, 4])
def test_a_slow_miss_does_not_hold_up_hits(tmp_path, tree, daemon, mounts, threads):
    # one worker: the miss's wait hands its channel to a new thread, or the
    # hits would wait for it
    config = tmp_path / "slow.toml"
    config.write_text(f"threads = {threads}\n[storage_options]\nlatency = {{delay = {DELAY}}}\n")
    m = mounts(f"latency::file://{tree}", daemon.socket_path,
               args=["--config", str(config)])
    rel = os.path.join("dir0", "sub0", "file3.bin")  # a block and a byte: not read whole
    hit = os.path.join(m.mountpoint, rel)
    with open(os.path.join(tree, rel), "rb") as f:
        want = f.read()
    assert len(want) > 64 << 10
    with open(hit, "rb") as f:  # a miss: cached from now on
        assert f.read() == want
    daemon.wait_idle()
    os.stat(os.path.join(m.mountpoint, "big.bin"))  # looked up before the clock starts

    done = threading.Event()
    remote: list[tuple[float, float]] = []  # each miss read's (start, end)

    def miss() -> None:
        fd = os.open(os.path.join(m.mountpoint, "big.bin"), os.O_RDONLY)
        try:
            for block in (17, 3, 11):  # a remote request each: DELAY each
                began = time.monotonic()
                os.pread(fd, 4096, block * (256 << 10))
                remote.append((began, time.monotonic()))
        finally:
            os.close(fd)
        done.set()

    t = threading.Thread(target=miss, daemon=True)
    t.start()
    time.sleep(DELAY / 2)  # the miss is waiting on the remote now
    fd = os.open(hit, os.O_RDONLY)
    answered: list[float] = []  # when each hit was answered
    try:
        i = 0
        while i < 20 or not done.is_set():  # hits all along the miss's requests
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the read reaches fsclient
            off = i * 7 * 4096 % (len(want) - 4096)  # not sequential: the chunk cache
            assert os.pread(fd, 4096, off) == want[off:off + 4096]
            answered.append(time.monotonic())
            i += 1
            assert i < 100_000, "the miss never ended"
    finally:
        os.close(fd)
        t.join(60)
    # A hit held up behind a miss is answered only once the miss's remote
    # request ends: none would be answered inside one. Compared with the
    # miss's own requests, not a wall bound: on a loaded machine a hit may
    # take a scheduler's half second, but hits keep coming inside each
    # request (DELAY long) all the same. The first DELAY/4 of a request may
    # still answer a hit read just before it.
    assert len(remote) == 3 and all(e - b >= DELAY for b, e in remote), remote
    for b, e in remote:
        inside = [a for a in answered if b + DELAY / 4 < a < e]
        assert inside, f"no hit was answered during the miss's request {b:.2f}-{e:.2f}: " \
                       f"they waited behind it ({[round(a, 2) for a in answered]})"
    stats = m.stats()["fsclient"]["ops"]
    assert stats["read"] >= 20
