"""fsclient.fuseloop: a FUSE request already queued is taken without a loop
round trip, the loop still runs every FAST_STREAK waits, and a wait with
nothing queued waits as before (a pipe stands in for /dev/fuse)."""

from __future__ import annotations

import asyncio
import os

import pyfuse3.asyncio

import fsclient.fs  # noqa: F401  (installs the wrapper, as a mount does)
from fsclient import fuseloop


async def _wait_for_data(wait, r: int, w: int) -> None:
    """A wait on an empty fd: goes through the loop, returns once data comes."""
    asyncio.get_running_loop().call_later(0.01, os.write, w, b"x")
    await asyncio.wait_for(wait(r), 10)


def test_queued_request_skips_the_loop_but_the_loop_still_runs():
    wait = pyfuse3.asyncio.wait_readable
    assert wait is fuseloop._installed
    r, w = os.pipe()

    async def main() -> list[bool]:
        await _wait_for_data(wait, r, w)  # nothing queued: the stock wait (streak reset)
        loop = asyncio.get_running_loop()
        yielded = []
        for _ in range(fuseloop.FAST_STREAK + 1):
            ran = []
            loop.call_soon(ran.append, True)
            await wait(r)  # data is queued: readable now
            yielded.append(bool(ran))
        return yielded

    try:
        yielded = asyncio.run(main())
    finally:
        os.close(r)
        os.close(w)
    # FAST_STREAK waits answered without running the loop, then one through it
    assert yielded == [False] * fuseloop.FAST_STREAK + [True]


def test_install_is_idempotent():
    first = pyfuse3.asyncio.wait_readable
    fuseloop.install()
    assert pyfuse3.asyncio.wait_readable is first


def test_read_lock_is_barging_and_never_strands_a_waiter():
    assert pyfuse3.asyncio.Lock is fuseloop.BargingLock

    async def main() -> list[str]:
        lock = fuseloop.BargingLock()
        order: list[str] = []

        async def waiter(name: str) -> None:
            async with lock:
                order.append(name)

        await lock.acquire()
        b = asyncio.ensure_future(waiter("b"))
        await asyncio.sleep(0)  # b now waits for the lock
        lock.release()
        await lock.acquire()  # free: taken at once, ahead of b (no yield)
        order.append("a again")
        lock.release()
        await asyncio.wait_for(b, 10)  # b was woken, and gets it now

        # a woken waiter that is cancelled passes its wake-up on
        await lock.acquire()
        c = asyncio.ensure_future(waiter("c"))
        d = asyncio.ensure_future(waiter("d"))
        await asyncio.sleep(0)
        lock.release()  # wakes c ...
        c.cancel()  # ... which is cancelled before it runs
        await asyncio.wait_for(d, 10)
        assert c.cancelled() and not lock.locked()
        return order

    assert asyncio.run(main()) == ["a again", "b", "d"]
