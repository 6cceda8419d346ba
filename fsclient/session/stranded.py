"""Requests a killed server read, on a kernel that cannot resend them (before
FUSE 7.40): nothing would ever answer them, so the next server answers them
EINTR.

Such a request waits on the processing queue of the channel (the open /dev/fuse
file) it was read from; the keeper holds those files, and the next server reads
the same ones, so an answer written to the right channel with the request's
unique ends it (any other channel says ENOENT). Its unique is not known, but the
kernel numbers the requests of a connection in steps of 2 as it queues them, and
hands them out in that order: when the next server reads its first request, every
request with a smaller unique still waiting was read by the server before. So that
server, before serving anything else (its other workers not yet started), answers
EINTR to each unique of the SWEEP below the first, on every channel.

What EINTR does to the reader: a read into the page cache (readahead, the
kernel's usual read) fails only its readahead, and the kernel reads the page again
with a new request, which this server answers: the reader sees nothing. A
synchronous request (lookup, open, stat, listing, an O_DIRECT read) fails its
syscall with EINTR, which Python's open, read and stat retry (PEP 475) and a
listing or C code may report.
"""

from __future__ import annotations

import errno
from collections.abc import Iterable

from .channel import Channel

# Uniques below the first request answered, at most: 2^16 requests, about 0.3 s of
# failed writes per channel. A request read longer ago than that (a remote fetch
# of seconds while tens of thousands of others passed) waits until its reader
# gets a signal (the INTERRUPT is answered EINTR, `Session._interrupt`) or the
# connection is aborted.
SWEEP = 1 << 16


def highest_below(first: int) -> int:
    """The largest unique of an ordinary request queued before the request `first`
    (an INTERRUPT's unique is its request's, plus 1: that request may be one)."""
    return first - 1 if first & 1 else first - 2


def sweep(channels: Iterable[Channel], first: int) -> int:
    """Answer EINTR every request below `first` still waiting on `channels`;
    how many were."""
    chans = list({ch.fd: ch for ch in channels}.values())
    answered = 0
    top = highest_below(first)
    for unique in range(top, max(0, top - 2 * SWEEP), -2):
        for ch in chans:
            if ch.error(unique, errno.EINTR):
                answered += 1
                break
    return answered
