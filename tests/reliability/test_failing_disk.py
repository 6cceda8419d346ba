"""A failing cache disk: one of two cache dirs sits on faultyfs (a
fault-injecting passthrough FUSE file system, tests/support/faultyfs.py)
whose every operation first fails with EIO, then hangs.

What must hold: the daemon marks the dir unhealthy within seconds (I/O
errors in a row, or an operation outliving --io-timeout); readers follow
the layout epoch and read that dir's blocks from the remote while the other
dir keeps serving hits; every read is correct and none fails; when the disk
answers again a probe returns the dir and its blocks are hits again.
"""

from __future__ import annotations

import time

from blockcache_client import Volume
from devtools.daemon import DaemonProcess
from tests.support.faultyfs import FaultyMount
from tests.support.figures import record
from tests.support.remote_files import write_dataset
from tests.support.skips import needs_fuse
from tests.support.volumes import BS, block_key, connected_volume, fill_files
from tests.support.waiting import wait_for

pytestmark = needs_fuse

IO_TIMEOUT = 1.0
DETECT_WITHIN = 15.0   # seconds: "within seconds", generous on a loaded machine


def _dir_healthy(daemon: DaemonProcess, path: str) -> bool:
    s = daemon.client().stats()
    return next(d for d in s["dirs"] if d["path"] == path)["healthy"]


def _reader_sees(vol: Volume, path: str, healthy: bool) -> bool:
    layout = vol._link.layout
    return layout is not None and any(d.path == path and d.healthy == healthy
                                      for d in layout.dirs)


def test_failing_cache_dir_is_taken_out_and_returns(tmp_path, key_file):
    files = write_dataset(str(tmp_path / "src"), [BS] * 16, seed=8)
    names = sorted(files)
    fm = FaultyMount(str(tmp_path / "real"), str(tmp_path / "faulty"))
    daemon = DaemonProcess(tmp_path, cache_dirs=[(tmp_path / "faulty", "64M"),
                                                 (tmp_path / "good", "64M")],
                           extra_args=["--io-timeout", str(IO_TIMEOUT)])
    vol = None
    figures: dict = {}
    try:
        fm.start()
        daemon.start()
        daemon.wait_rebuilt()
        faulty = daemon.cache_dirs[0]
        vol = connected_volume("vol", str(tmp_path / "src"), key_file, daemon)
        layout = fill_files(vol, daemon, files)
        on_faulty = {n for n in names if layout.dir_index(block_key(vol, n)) == 0}
        assert 0 < len(on_faulty) < len(names), "both dirs hold some blocks"

        reads = wrong = 0
        for mode in ("eio", "hang"):
            fm.set_mode(mode)
            t0 = time.monotonic()
            if mode == "eio":
                # readers that still use the dir get EIO on open: a miss, not an error
                for n in names:
                    wrong += vol.read(n, 0, BS) != files[n]
                    reads += 1
            wait_for(lambda: not _dir_healthy(daemon, faulty), DETECT_WITHIN,
                     f"the daemon to take out the {mode} dir")
            figures[f"{mode}_unhealthy_after_s"] = round(time.monotonic() - t0, 2)
            wait_for(lambda: _reader_sees(vol, faulty, False), DETECT_WITHIN,
                     "the reader to follow the layout epoch")
            figures[f"{mode}_reader_follows_after_s"] = round(time.monotonic() - t0, 2)
            before = vol.stats()
            for n in names:  # the good dir serves hits, the faulty dir's keys go remote
                wrong += vol.read(n, 0, BS) != files[n]
                reads += 1
            after = vol.stats()
            assert after["hits"] - before["hits"] == len(names) - len(on_faulty)
            assert after["misses"] - before["misses"] == len(on_faulty)
            assert daemon.proc.poll() is None
            fm.set_mode("ok")
            t1 = time.monotonic()
            wait_for(lambda: _dir_healthy(daemon, faulty), DETECT_WITHIN,
                     "a probe to bring the dir back")
            figures[f"{mode}_healthy_again_after_s"] = round(time.monotonic() - t1, 2)
            wait_for(lambda: _reader_sees(vol, faulty, True), DETECT_WITHIN,
                     "the reader to use the dir again")
            before = vol.stats()
            for n in names:  # its blocks survived: hits again
                wrong += vol.read(n, 0, BS) != files[n]
                reads += 1
            assert vol.stats()["hits"] - before["hits"] == len(names)
        assert wrong == 0
        s = daemon.client().stats()
        record("failing_disk", reads=reads, wrong_reads=wrong, failed_reads=0,
               blocks_on_faulty_dir=len(on_faulty), io_timeout_s=IO_TIMEOUT,
               io_errors=s["dirs"][0]["io_errors"], **figures)
    finally:
        if fm.proc is not None:
            try:
                fm.set_mode("ok")  # release hung operations before the daemon stops
            except RuntimeError:
                pass  # faultyfs died; stop() below cleans up the mount
        if vol is not None:
            vol.close()
        daemon.stop()
        fm.stop()
