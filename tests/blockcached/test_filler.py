"""The dir workers (`filler.DirWorker`): lazy and eager jobs in order, a
failing job's bookkeeping, a request accounting for finished writes."""

from __future__ import annotations

import os
import threading
import time

from tests.support.cache_engine import block, key


def test_lazy_jobs_finish_in_order_with_eager_ones(tmp_path):
    """A lazy job's `done` waits for a drain, a timer or an eager job, but
    every `done` still runs in submission order."""
    import asyncio

    from blockcached.filler import DirWorker

    loop = asyncio.new_event_loop()
    worker = DirWorker("t", loop)
    ran: list[str] = []
    gate = threading.Event()
    try:
        def record(name):
            return lambda result, exc: ran.append(name)
        worker.submit(gate.wait, 10, done=record("lazy1"), lazy=True)
        worker.submit(lambda: None, done=record("lazy2"), lazy=True)
        worker.submit(lambda: None, done=record("eager"))
        worker.submit(lambda: None, done=record("lazy3"), lazy=True)
        gate.set()

        async def until_idle():
            while worker.backlog:
                await asyncio.sleep(0.001)
        loop.run_until_complete(asyncio.wait_for(until_idle(), 10))
        assert ran == ["lazy1", "lazy2", "eager", "lazy3"]
    finally:
        worker.stop()
        worker.join(5)
        loop.close()


def test_a_failing_jobs_bookkeeping_costs_only_that_job(tmp_path):
    """A `done` that raises is logged; the jobs behind it still finish and the
    lazy timer keeps going (a drain runs inside some unrelated request)."""
    import asyncio

    from blockcached.filler import DirWorker

    loop = asyncio.new_event_loop()
    worker = DirWorker("t", loop)
    ran: list[str] = []

    def broken(result, exc):
        raise RuntimeError("bookkeeping bug")
    try:
        worker.submit(lambda: None, done=broken, lazy=True)
        worker.submit(lambda: None, done=lambda r, e: ran.append("lazy"), lazy=True)

        async def until_idle():
            while worker.backlog:
                await asyncio.sleep(0.001)
        loop.run_until_complete(asyncio.wait_for(until_idle(), 10))
        assert ran == ["lazy"]
        assert worker._lazy_timer is None  # nothing lazy left: the timer stopped
    finally:
        worker.stop()
        worker.join(5)
        loop.close()


def test_a_request_first_accounts_for_finished_writes(engines, monkeypatch):
    """A put's write does not wake the loop; the next request runs its
    bookkeeping before answering, so a lookup right after the write hits."""
    from blockcached import filler
    from blockcached.service import Peer, Service

    monkeypatch.setattr(filler, "LAZY_DELAY", 60.0)  # no timer within the test
    e = engines([1 << 20])
    svc = Service(e.cfg, e.cache)
    worker = e.cache.workers[0]
    wakeups = []
    real_wake = worker._loop.call_soon_threadsafe
    monkeypatch.setattr(worker._loop, "call_soon_threadsafe",
                        lambda *a: wakeups.append(a) or real_wake(*a))
    k = key(inode=7)
    assert e.cache.put(k, block(k, 4000)) == (True, "queued")
    deadline = time.monotonic() + 10
    while not worker._finished:        # written by the dir's thread, loop not run
        assert time.monotonic() < deadline
        time.sleep(0.002)
    assert k in e.files() and wakeups == []  # the write's end did not wake the loop
    reply = svc.handle({"op": "lookup", "id": 1, "keys": [k]}, Peer(os.getpid(), 0, 0))
    assert reply["paths"][0], reply
    assert e.cache.workers[0].backlog == 0
