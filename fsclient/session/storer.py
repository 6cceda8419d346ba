"""Page-cache stores (FUSE notify_store) written by a process of their own.

The kernel locks each page a store fills, and a page a read request waits on
stays locked until that read is answered: a store can wait there,
uninterruptibly, for a read still queued in the kernel. In the server that
wait would pin the whole process: a server killed in that moment cannot
finish dying, its keeper starts the next server (the one that would answer
the read) only once the old one is reaped, and the mount hangs. So the wait
happens in this small child instead. The server's store thread hands it one
store at a time and waits for its answer on a socket, a wait a kill ends.
A killed server exits at once; its child dies (PR_SET_PDEATHSIG) as soon as
its store returns, which the next server's answer to that read allows.

A store the child waits in lands after its server is gone: it must not land
after the next server answers an open of a newer version (which drops the
inode's pages). So every child holds a shared flock on its own open of the
mount's saved-state memfd, and a new server takes an exclusive one
(`await_predecessors`) before any open of its may drop pages: past it, no
older server's store is left.

The exchange, on a SOCK_SEQPACKET pair: the server copies the bytes into a
shared memfd (`SLOT` bytes) and sends (nodeid, offset, length); the child
writes the notification from the memfd and sends back 0 or the errno.
Node id 0 (no inode has it) carries any other notification: `offset` is its
code and the memfd its body, written as it is (`notify`: the node table's
prunes, whose INVAL_ENTRY waits for the parent directory's lock, which a
lookup waiting for this server holds).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import signal
import socket
import struct
import subprocess
import sys
import threading

from . import structs as s

SLOT = 1 << 20  # the largest store: a chunk is 64 KiB
REQUEST = struct.Struct("<QQI")
ANSWER = struct.Struct("<i")
PR_SET_PDEATHSIG = 1


class Storer:
    """The server's side: `store` has `Channel.notify_store`'s signature and
    raises OSError as the kernel answers (EPIPE once the child is gone)."""

    def __init__(self, fuse_fd: int, saved_fd: int):
        lock = reopen(saved_fd)
        fcntl.flock(lock, fcntl.LOCK_SH)  # (held by the child alone once we close it)
        self._memfd = os.memfd_create("fsclient-store", os.MFD_CLOEXEC)
        os.ftruncate(self._memfd, SLOT)
        self._slot = mmap.mmap(self._memfd, SLOT)
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._exchange = threading.Lock()  # one store or notification at a time
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", __name__, str(fuse_fd), str(theirs.fileno()),
                 str(self._memfd), str(os.getpid())],
                stdin=subprocess.DEVNULL,
                pass_fds=(fuse_fd, theirs.fileno(), self._memfd, lock), close_fds=True)
        except BaseException:
            self._close_ours()
            raise
        finally:
            theirs.close()
            os.close(lock)

    def store(self, nodeid: int, offset: int, data: bytes | memoryview) -> None:
        self._exchange_one(nodeid, offset, data)

    def notify(self, code: int, body: bytes) -> None:
        """Write the notification `code` with `body` (after its header) through
        the child; OSError as the kernel answers it."""
        self._exchange_one(0, code, body)

    def _exchange_one(self, nodeid: int, offset: int, data: bytes | memoryview) -> None:
        n = len(data)
        if n > SLOT:
            raise OSError(errno.EINVAL, f"a notification of {n} bytes is over {SLOT}")
        with self._exchange:
            self._slot[:n] = data
            try:
                self._sock.send(REQUEST.pack(nodeid, offset, n))
                answer = self._sock.recv(ANSWER.size)
            except OSError as exc:
                raise OSError(errno.EPIPE, f"the page-store process has gone ({exc})") from exc
        if len(answer) != ANSWER.size:
            raise OSError(errno.EPIPE, "the page-store process has gone")
        code = ANSWER.unpack(answer)[0]
        if code:
            raise OSError(code, os.strerror(code))

    def close(self) -> None:
        """End the child: a store it waits in ends when that page's read is
        answered, and the kill takes effect then."""
        self.proc.kill()
        self._close_ours()
        try:
            self.proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass  # (waiting in a store: reaped by whoever inherits it)

    def _close_ours(self) -> None:
        self._sock.close()
        self._slot.close()
        os.close(self._memfd)


def reopen(fd: int) -> int:
    """A new open of `fd`'s file: flock's locks belong to an open, and every
    server and child gets the saved-state memfd by the same one."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)


def await_predecessors(saved_fd: int) -> None:
    """Return once no child of an earlier server of this mount is left."""
    lock = reopen(saved_fd)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
    finally:
        os.close(lock)  # (which releases it)


def serve(fuse_fd: int, sock_fd: int, memfd: int) -> None:
    """The child's loop: one notification per request, until the server goes."""
    slot = memoryview(mmap.mmap(memfd, SLOT))
    sock = socket.socket(fileno=sock_fd)
    while True:
        request = sock.recv(REQUEST.size)
        if len(request) != REQUEST.size:
            return  # the server closed its end, or died
        nodeid, offset, n = REQUEST.unpack(request)
        if nodeid:
            code, head = s.NOTIFY_STORE, s.NOTIFY_STORE_OUT.pack(nodeid, offset, n, 0)
        else:  # any other notification: `offset` is its code, the slot its body
            code, head = offset, b""
        total = s.OUT_HEADER.size + len(head) + n
        try:
            os.writev(fuse_fd, [s.OUT_HEADER.pack(total, code, 0), head, slot[:n]])
            code = 0
        except OSError as exc:
            code = exc.errno or errno.EIO
        sock.send(ANSWER.pack(code))


def main(argv: list[str]) -> int:
    fuse_fd, sock_fd, memfd, parent = (int(a) for a in argv)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before the prctl took
        return 0
    try:
        serve(fuse_fd, sock_fd, memfd)
    except (OSError, KeyboardInterrupt):
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
