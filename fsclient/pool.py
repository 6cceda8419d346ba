"""The hand-off between the FUSE event loop and the threads that may block.

Volume calls block (remote I/O, cache files), so they run on a thread pool;
the event loop only dispatches and answers from caches. `LoopPool.call` is
the one way across: one hop to a thread and one `call_soon_threadsafe` back.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

log = logging.getLogger("fsclient.fs")


class LoopPool:
    """A thread pool whose results come back as futures of the running loop."""

    __slots__ = ("executor",)

    def __init__(self, threads: int):
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="fsclient-io")

    def call(self, fn: Callable, *args: Any, **kwargs: Any) -> asyncio.Future:
        """Run a blocking call on the pool; its result as an asyncio future.
        No concurrent Future chained to this one: run_in_executor's extra
        locks and callbacks cost the read path a measurable share of its CPU."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def run() -> None:
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:
                loop.call_soon_threadsafe(_settle, fut, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, fut, result, None)
        try:
            self.executor.submit(run)
        except RuntimeError as exc:  # the pool is shut down: the mount is closing
            fut.set_exception(OSError(errno.EIO, f"file system is closing: {exc}"))
        return fut

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def _settle(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.cancelled():  # the handler waiting for it was cancelled (interrupt)
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def retrieve(fut: asyncio.Future) -> None:
    """Done callback of a read nobody may await (a file closed unread): no
    "exception never retrieved"; the read that awaits it reports errors."""
    if not fut.cancelled():
        fut.exception()


def log_prefetch_failure(fut: asyncio.Future) -> None:
    if fut.cancelled():
        return
    exc = fut.exception()
    if exc is not None:
        log.debug("prefetch failed (reads are unaffected): %s", exc)
