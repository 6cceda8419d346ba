"""`python -m bench.warm_parts`: what a warm 1 MiB read's CPU goes to, part by part.

    python -m bench.warm_parts [--mib 64] [--rounds 5] [--workdir DIR]

The issue's warm target is 0.8x the machine's parallel AES-GCM decrypt rate
R, measured with every core decrypting: given the same CPU as R had, a MiB
may then cost 1 / 0.8 of the AES's CPU a MiB per thread with every core
decrypting, all parts together (C / (0.8 R) on C idle cores). This prints,
in microseconds of CPU a MiB, each part of a warm 1 MiB read of cached
4 MiB block files (`--mib` of them, in the page cache), measured alone in
one process, and the budget beside them:

- `aes 1 thread` / `aes per thread, C at once`: `cryptography`'s
  decrypt_into of sixteen 64 KiB chunks into a reused buffer (two threads
  on one core's hyperthreads each run slower: the second figure is the one
  a parallel read pays);
- `pread`: the ciphertext copied out of the page cache into a placed
  buffer (`common/aligned.py`);
- `copy`: 1 MiB of plaintext copied from a 4 MiB buffer, what a read pays
  for every MiB another thread decrypted ahead into a buffer of its own;
- `read alone`: `ParallelDecrypt.read_file_into` on the reading thread only
  (the pread, the AES and its unit loop); `mmap, ...`: the same reads'
  chunks decrypted straight from a mapping of each block file, mapped once
  a block with MAP_POPULATE or with MADV_WILLNEED (and the kernel's
  fault-around) and unmapped after, so no pread copy; `each unit mlocked`:
  the same with every 4-chunk unit's pages locked while it decrypts, the
  guard against a disk error striking as SIGBUS; `read split`: the same
  reads shared with the helpers as `Volume` does (all threads' CPU). The
  split's excess over `read alone` and over the AES's own slowdown on C
  threads is what the hand-offs cost.

Then rates against R, each round's measured at once after it: the split
reads (the most `Volume` could reach with its own Python on top), and the
ceiling of any design that preads: C threads, then C processes (no GIL
between them), each reading its own share of the block files with no
hand-off at all.

`Volume`'s own Python (the version, the stream, the block file's open and
header) is the rest of the CPU a MiB that `python -m bench.large_files`
prints for its warm rows. Medians of `--rounds` rounds; on a shared VM every
figure moves with the load (printed): compare runs of one sitting.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import shutil
import statistics
import tempfile
import threading
import time

from blockcache_client.common.aligned import PAGE, aligned
from blockcache_client.contract import blockfile
from blockcache_client.reader.hits.decrypt import ParallelDecrypt, default_threads

from .large_files import decrypt_loops, decrypt_rate

MIB = 1 << 20
BLOCK = 4 << 20
TARGET = 0.8


def _thread_loop(fn, total_mib: int) -> float:
    """This thread's CPU seconds a MiB of `fn` run `total_mib` times."""
    c0 = time.thread_time()
    for i in range(total_mib):
        fn(i)
    return (time.thread_time() - c0) / total_mib


def _reads(decrypt: ParallelDecrypt, files: list[tuple[int, blockfile.BlockCipher]],
           out: memoryview, walls: list[float]) -> float:
    """Process CPU seconds a MiB of 1 MiB reads front to back of every block
    file (and their wall seconds a MiB in `walls`)."""
    c0, t0 = time.process_time(), time.perf_counter()
    n = 0
    for fd, cipher in files:
        for off in range(0, BLOCK, MIB):
            decrypt.read_file_into(cipher, fd, off, out)
            n += 1
    walls.append((time.perf_counter() - t0) / n)
    return (time.process_time() - c0) / n


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = libc.mlock.argtypes = libc.munlock.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _mapped(files: list[tuple[int, blockfile.BlockCipher]], out: memoryview,
            populate: bool, lock: bool = False) -> float:
    """Thread CPU seconds a MiB of 1 MiB reads decrypted straight from a
    mapping of each block file (mapped once a block, with MAP_POPULATE if
    `populate`, else MADV_WILLNEED, and unmapped after: no pread copy),
    unit by unit of 4 chunks. `lock`: each unit's pages locked (`mlock`)
    while it decrypts, the guard that would keep a disk error from striking
    as SIGBUS inside the AES (a locked page is never reclaimed, so never
    read again, and `mlock` reports a failed read as an error)."""
    libc = _libc()
    chunk = 64 << 10
    step = blockfile.TAG_SIZE + chunk
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    c0 = time.thread_time()
    n = 0
    for fd, cipher in files:
        size = os.fstat(fd).st_size
        addr = libc.mmap(None, size, mmap.PROT_READ, flags, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap of a block file failed")
        view = memoryview((ctypes.c_char * size).from_address(addr)).cast("B")
        try:
            if not populate:
                libc.madvise(addr, size, mmap.MADV_WILLNEED)
            for first in range(0, BLOCK // chunk, 4):
                start = blockfile.HEADER_SIZE + first * step
                page = start - start % PAGE
                if lock and libc.mlock(addr + page, start + 4 * step - page):
                    raise OSError(ctypes.get_errno(), "mlock (raise ulimit -l)")
                cipher.open_into(first, first + 4, view[start:start + 4 * step],
                                 out[(first % 16) * chunk:(first % 16 + 4) * chunk])
                if lock:
                    libc.munlock(addr + page, start + 4 * step - page)
            n += BLOCK // MIB
        finally:
            view.release()
            libc.munmap(addr, size)
    return (time.thread_time() - c0) / n


def _streams(files: list[tuple[int, blockfile.BlockCipher]], threads: int,
             processes: bool = False) -> float:
    """Wall seconds a MiB of `threads` threads (forked processes if
    `processes`: no GIL between them) each reading its own share of the
    block files front to back in 1 MiB reads (pread, AES, no hand-off between
    them): the most any design that preads the ciphertext reaches."""
    share = [files[i::threads] for i in range(threads)]
    go_r, go_w = os.pipe()

    def work(mine: list[tuple[int, blockfile.BlockCipher]]) -> None:
        alone, out = ParallelDecrypt(1), aligned(MIB)
        os.read(go_r, 1)  # all start together
        for fd, cipher in mine:
            for off in range(0, BLOCK, MIB):
                alone.read_file_into(cipher, fd, off, out)

    try:
        if processes:
            pids = []
            for mine in share:
                pid = os.fork()
                if pid == 0:
                    code = 1
                    try:
                        work(mine)
                        code = 0
                    finally:
                        os._exit(code)
                pids.append(pid)
            t0 = time.perf_counter()
            os.write(go_w, bytes(threads))
            failed = [pid for pid in pids if os.waitpid(pid, 0)[1]]
            if failed:
                raise RuntimeError(f"{len(failed)} of the reading processes failed "
                                   "(their error is above)")
        else:
            pool = [threading.Thread(target=work, args=(mine,)) for mine in share]
            for t in pool:
                t.start()
            t0 = time.perf_counter()
            os.write(go_w, bytes(threads))
            for t in pool:
                t.join()
        return (time.perf_counter() - t0) / (len(files) * BLOCK // MIB)
    finally:
        os.close(go_r)
        os.close(go_w)


def measure(mib: int, rounds: int, workdir: str) -> dict:
    """The parts' CPU a MiB in microseconds (medians of `rounds`), the rate R
    and the budget a MiB at the target."""
    cores = default_threads()
    vk = os.urandom(32)
    root = tempfile.mkdtemp(prefix="warm-parts-", dir=workdir)
    files: list[tuple[int, blockfile.BlockCipher]] = []
    try:
        for i in range(max(1, mib // 4)):
            path = os.path.join(root, f"b{i}")
            with open(path, "wb") as f:
                f.write(blockfile.seal(f"k{i}", os.urandom(BLOCK), vk))
            fd = os.open(path, os.O_RDONLY)
            head = os.pread(fd, blockfile.HEADER_SIZE, 0)
            files.append((fd, blockfile.BlockCipher.from_head(head, f"k{i}", vk,
                                                             blockfile.key_id(vk))))
            os.pread(fd, os.fstat(fd).st_size, 0)  # into the page cache
        fd0, cipher0 = files[0]
        body = memoryview(bytearray(os.pread(fd0, MIB + 16 * blockfile.TAG_SIZE,
                                             blockfile.HEADER_SIZE)))
        placed = aligned(MIB + 16 * blockfile.TAG_SIZE + PAGE)
        k = blockfile.HEADER_SIZE % PAGE
        src, dst = aligned(BLOCK), aligned(MIB)
        alone, split = ParallelDecrypt(1), ParallelDecrypt(cores)
        out = aligned(MIB)
        n = len(files) * BLOCK // MIB
        step = MIB + 16 * blockfile.TAG_SIZE

        def pread(i: int) -> None:
            fd = files[i % len(files)][0]
            os.preadv(fd, [placed[k:k + step]], blockfile.HEADER_SIZE + (i % 4) * step)

        def copy(i: int) -> None:
            dst[:] = src[(i % 4) * MIB:(i % 4 + 1) * MIB]

        samples: dict[str, list[float]] = {}
        # each round's rates against R measured at once after them: R moves with the load
        ratios: dict[str, list[float]] = {"split": [], "threads": [], "processes": []}
        for _ in range(rounds):
            walls: list[float] = []  # the split reads' wall seconds a MiB
            got = {"aes 1 thread": decrypt_loops(1, 0.2, cipher0, body)[1],
                   f"aes per thread, {cores} at once": decrypt_loops(cores, 0.2, cipher0,
                                                                     body)[1],
                   "pread": _thread_loop(pread, n), "copy": _thread_loop(copy, n),
                   "read alone": _reads(alone, files, out, []),
                   "mmap, MAP_POPULATE, AES from the pages": _mapped(files, out, True),
                   "mmap, MADV_WILLNEED, AES from the pages": _mapped(files, out, False),
                   "mmap, each unit mlocked, AES": _mapped(files, out, True, lock=True),
                   f"read split over {cores} threads": _reads(split, files, out, walls)}
            rate = decrypt_rate(cores)
            ratios["split"].append(MIB / walls[0] / rate)
            ratios["threads"].append(MIB / _streams(files, cores) / decrypt_rate(cores))
            ratios["processes"].append(MIB / _streams(files, cores, True) / decrypt_rate(cores))
            for name, secs in got.items():
                samples.setdefault(name, []).append(secs * 1e6)
        alone.close()
        split.close()
        parts = {name: statistics.median(v) for name, v in samples.items()}
        return {"cores": cores, "parts_us": parts, "rate": decrypt_rate(cores),
                "ratios": ratios, "load": os.getloadavg()[0]}
    finally:
        for fd, _ in files:
            os.close(fd)
        shutil.rmtree(root, ignore_errors=True)


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f}x R ({min(xs):.2f}-{max(xs):.2f})"


def report(res: dict) -> str:
    parts, cores = res["parts_us"], res["cores"]
    lines = ["part                                   us CPU a MiB"]
    lines += [f"{name:<38} {us:8.0f}" for name, us in parts.items()]
    aes_n = parts[f"aes per thread, {cores} at once"]
    base = aes_n + parts["pread"]
    budget = aes_n / TARGET
    hand_off = parts[f"read split over {cores} threads"] - parts["read alone"] - (
        aes_n - parts["aes 1 thread"])
    lines += [f"parallel decrypt rate R on {cores} threads: {res['rate'] / 1e9:.2f} GB/s",
              f"budget at {TARGET}x R, given the CPU R had: {budget:.0f} us a MiB "
              f"(aes per thread / {TARGET})",
              f"aes ({cores} at once) + pread: {base:.0f} us, leaving "
              f"{budget - base:.0f} us for Volume's Python and the hand-offs",
              f"hand-offs of the split read: {hand_off:.0f} us a MiB",
              "rates against R measured at once after them, median (range) of the rounds:",
              f"  split reads without Volume: {_spread(res['ratios']['split'])}",
              f"  {cores} threads each reading its own block files, no hand-off (the "
              f"most threads that pread reach): {_spread(res['ratios']['threads'])}",
              f"  the same in {cores} processes (no GIL between them): "
              f"{_spread(res['ratios']['processes'])}",
              f"load average {res['load']:.2f} (1 min), {os.cpu_count()} CPUs"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.warm_parts",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=64, help="MiB of 4 MiB block files read")
    p.add_argument("--rounds", type=int, default=5, help="rounds (the median counts)")
    p.add_argument("--workdir", default=tempfile.gettempdir(), help="where the block files go")
    args = p.parse_args(argv)
    if args.mib < 4 or args.rounds < 1:
        p.error("--mib must be >= 4 (one 4 MiB block) and --rounds >= 1")
    print(report(measure(args.mib, args.rounds, args.workdir)))


if __name__ == "__main__":
    main()
