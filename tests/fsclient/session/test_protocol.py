"""fsclient.session over a SOCK_SEQPACKET socketpair standing in for /dev/fuse:
requests go in as the kernel writes them, answers come out as it reads them.
A short, garbled, unknown or failing request gets an error answer and the
session goes on serving."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import threading
import time

import pytest

from fsclient.session import Attributes, FuseError, Session
from fsclient.session import structs as s

TIMEOUT = 10.0


class Files:
    """Operations of a tiny file system: one file "f" (inode 2) holding DATA."""

    DATA = bytes(range(256)) * 16
    STALE_FH = 8  # a handle whose version a later open replaced: its reads get ESTALE

    def __init__(self) -> None:
        self.release_calls: list[int] = []
        self.gate = threading.Event()  # a read of offset 1 waits for it
        self.forgotten: list[tuple[int, int]] = []

    def lookup(self, parent: int, name: bytes) -> Attributes:
        if name == b"boom":
            raise RuntimeError("a handler bug")
        if name != b"f":
            raise FuseError(errno.ENOENT)
        return self.getattr(2)

    def getattr(self, inode: int) -> Attributes:
        a = Attributes()
        a.st_ino, a.entry_timeout, a.attr_timeout = inode, 1.0, 1.0
        if inode == 1:
            a.st_mode = stat.S_IFDIR | 0o755
        else:
            a.st_size, a.st_mode = len(self.DATA), stat.S_IFREG | 0o444
        return a

    def forget(self, items) -> None:
        self.forgotten.extend(items)

    def open(self, inode: int, flags: int) -> tuple[int, bool]:
        return 7, False

    def read(self, fh: int, off: int, size: int, inode: int = 0) -> bytes:
        if off == 1:
            self.gate.wait(TIMEOUT)
        return self.DATA[off:off + size]

    def answering(self, fh: int, inode: int):
        if fh == self.STALE_FH:
            raise FuseError(errno.ESTALE)
        return contextlib.nullcontext()

    def release(self, fh: int) -> None:
        self.release_calls.append(fh)


@pytest.fixture
def kernel():
    """(our end of the socketpair, the session's Files); the session serves the other."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.settimeout(TIMEOUT)
    ops = Files()
    session = Session(ops, workers=3, clone=False)
    session.start(theirs.fileno())
    try:
        yield ours, ops, session
    finally:
        ops.gate.set()
        ours.close()  # the workers read EOF and end
        assert session.join(TIMEOUT)
        theirs.close()


_unique = iter(range(100, 10**9))


def send(sock, op: int, body: bytes = b"", nodeid: int = 1, length: int | None = None) -> int:
    unique = next(_unique)
    n = s.IN_HEADER.size + len(body)
    sock.send(s.IN_HEADER.pack(n if length is None else length, op, unique, nodeid, 0, 0, 1,
                               0, 0) + body)
    return unique


def answer(sock) -> tuple[int, int, bytes]:
    """(unique, -errno or 0, payload) of the next answer."""
    msg = sock.recv(1 << 20)
    size, err, unique = s.OUT_HEADER.unpack_from(msg)
    assert size == len(msg)
    return unique, err, msg[s.OUT_HEADER.size:]


def wait_until(cond, timeout: float = TIMEOUT) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def init(sock) -> bytes:
    u = send(sock, s.INIT, s.INIT_IN.pack(7, 45, 131072, 0xFFFFFFFF, 0))
    got, err, payload = answer(sock)
    assert (got, err) == (u, 0)
    return payload


def lookup_f(sock) -> None:
    u = send(sock, s.LOOKUP, b"f\0")
    got, err, payload = answer(sock)
    assert (got, err) == (u, 0) and s.ENTRY_HEAD.unpack_from(payload)[0] == 2


def test_nothing_but_init_is_served_before_init(kernel):
    sock, _, session = kernel
    u = send(sock, s.LOOKUP, b"f\0")
    assert answer(sock)[:2] == (u, -errno.EIO)
    assert s.INIT_OUT.unpack(init(sock))[:2] == (7, 45)
    assert session.terms is not None and session.terms.minor == 45
    lookup_f(sock)


def test_short_garbled_and_unknown_requests_get_errors_and_the_session_goes_on(kernel):
    sock, ops, session = kernel
    init(sock)
    # shorter than a header, but its unique readable: EIO
    sock.send(s.IN_HEADER.pack(40, s.LOOKUP, 4242, 1, 0, 0, 0, 0, 0)[:24])
    assert answer(sock)[:2] == (4242, -errno.EIO)
    sock.send(b"\x01\x02\x03")  # too short for even that: dropped
    # a length that is not what was read: EIO
    u = send(sock, s.LOOKUP, b"f\0", length=400)
    assert answer(sock)[:2] == (u, -errno.EIO)
    # a body too short for its opcode's struct: EINVAL
    u = send(sock, s.READ, b"\0" * 8)
    assert answer(sock)[:2] == (u, -errno.EINVAL)
    # a name without its NUL: EINVAL
    u = send(sock, s.LOOKUP, b"f")
    assert answer(sock)[:2] == (u, -errno.EINVAL)
    # unknown opcodes: ENOSYS; anything that writes: EROFS
    for op, want in ((999, errno.ENOSYS), (s.MKDIR, errno.EROFS), (s.WRITE, errno.EROFS),
                     (s.SETXATTR, errno.EROFS), (s.FSYNC, errno.ENOSYS)):
        u = send(sock, op, b"\0" * 64)
        assert answer(sock)[:2] == (u, -want)
    # a handler's bug: EIO, logged, and the worker serves on
    u = send(sock, s.LOOKUP, b"boom\0")
    assert answer(sock)[:2] == (u, -errno.EIO)
    u = send(sock, s.LOOKUP, b"nope\0")
    assert answer(sock)[:2] == (u, -errno.ENOENT)
    lookup_f(sock)
    counts = session.op_counts()
    assert counts["lookup"] == 5 and counts["mkdir"] == 1 and counts["init"] == 1
    assert wait_until(lambda: session.busy() == 0)  # (a worker is busy until it answered)


def test_reads_forgets_and_interrupts(kernel):
    sock, ops, session = kernel
    init(sock)
    u = send(sock, s.OPEN, s.OPEN_IN.pack(os.O_RDONLY, 0), nodeid=2)
    got, err, payload = answer(sock)
    # (no FLUSH at close: nothing is written)
    assert (got, err) == (u, 0) and s.OPEN_OUT.unpack(payload) == (7, s.FOPEN_NOFLUSH, 0)
    u = send(sock, s.READ, s.READ_IN.pack(7, 100, 50, 0, 0, 0, 0), nodeid=2)
    assert answer(sock) == (u, 0, Files.DATA[100:150])
    # forgets are not answered
    send(sock, s.FORGET, s.FORGET_IN.pack(3), nodeid=2)
    send(sock, s.BATCH_FORGET, s.BATCH_FORGET_IN.pack(2, 0) + s.FORGET_ONE.pack(5, 1)
         + s.FORGET_ONE.pack(6, 2))
    # a read that hangs is answered EINTR once the kernel interrupts it
    stuck = send(sock, s.READ, s.READ_IN.pack(7, 1, 10, 0, 0, 0, 0), nodeid=2)
    assert wait_until(lambda: session.busy() == 1)
    # (a worker may still be between reading it and registering it: EAGAIN,
    # and the kernel sends the INTERRUPT again, as here)
    for _ in range(1000):
        interrupt = send(sock, s.INTERRUPT, s.INTERRUPT_IN.pack(stuck))
        got = answer(sock)[:2]
        if got != (interrupt, -errno.EAGAIN):
            break
    assert got == (stuck, -errno.EINTR)
    ops.gate.set()  # its late answer goes nowhere the kernel waits (dropped here too)
    assert answer(sock)[:2] == (stuck, 0)
    u = send(sock, s.RELEASE, s.RELEASE_IN.pack(7, 0, 0, 0), nodeid=2)
    assert answer(sock)[:2] == (u, 0) and ops.release_calls == [7]
    # an INTERRUPT of a request already answered is answered EAGAIN (the
    # kernel, finding no such request waiting, drops it); once its worker is
    # done with it (it unregisters the request just after writing the answer)
    assert wait_until(lambda: session.busy() == 0)
    interrupt = send(sock, s.INTERRUPT, s.INTERRUPT_IN.pack(u))
    assert answer(sock)[:2] == (interrupt, -errno.EAGAIN)
    assert sorted(ops.forgotten) == [(2, 3), (5, 1), (6, 2)]  # (workers race)
    u = send(sock, s.DESTROY)
    assert answer(sock)[:2] == (u, 0)
    assert session.ended.wait(TIMEOUT)


def init_7_39(sock) -> None:
    """INIT from a kernel before resend (Linux < 6.9)."""
    u = send(sock, s.INIT, s.INIT_IN.pack(7, 39, 131072, 0xFFFFFFFF, 0))
    assert answer(sock)[:2] == (u, 0)


def test_before_7_40_a_drain_stops_every_reader_and_answers_what_it_read(kernel):
    sock, ops, session = kernel
    init_7_39(sock)
    stuck = send(sock, s.READ, s.READ_IN.pack(7, 1, 10, 0, 0, 0, 0), nodeid=2)
    assert wait_until(lambda: session.busy() == 1)
    done: list = []
    drain = threading.Thread(target=lambda: done.append(session.drain(TIMEOUT)))
    drain.start()
    time.sleep(0.2)
    assert not done  # the read it holds is answered before it goes
    ops.gate.set()
    assert answer(sock)[:2] == (stuck, 0)
    drain.join(TIMEOUT)
    assert done == [True]
    # every worker has stopped reading, though the channel is still open: a
    # request sent now is read by no one (its successor's)
    assert session.join(0.5)
    send(sock, s.LOOKUP, b"f\0")
    sock.settimeout(0.3)
    with pytest.raises(TimeoutError):
        answer(sock)


def test_before_7_40_a_request_still_held_when_the_drain_ends_is_answered_eintr(kernel):
    # nothing would ever answer it after this server: EINTR, which Python retries
    sock, ops, session = kernel
    init_7_39(sock)
    stuck = send(sock, s.READ, s.READ_IN.pack(7, 1, 10, 0, 0, 0, 0), nodeid=2)
    assert wait_until(lambda: session.busy() == 1)
    assert session.drain(0.3) is False
    assert answer(sock)[:2] == (stuck, -errno.EINTR)


def test_before_7_40_an_interrupt_of_a_request_no_worker_holds_ends_it(kernel):
    # a request a killed server read waits on the channel it came from: the
    # INTERRUPT its reader's signal sends is answered EINTR on every channel
    sock, _, _ = kernel
    init_7_39(sock)
    send(sock, s.INTERRUPT, s.INTERRUPT_IN.pack(4242))
    assert answer(sock)[:2] == (4242, -errno.EINTR)


def test_a_read_whose_answer_is_refused_gets_its_error(kernel):
    """A read the file system will not answer with bytes (`answering` raises:
    a later open replaced its version) gets that error, and reads of other
    handles their bytes."""
    sock, ops, session = kernel
    init(sock)
    u = send(sock, s.READ, s.READ_IN.pack(Files.STALE_FH, 100, 50, 0, 0, 0, 0), nodeid=2)
    assert answer(sock) == (u, -errno.ESTALE, b"")
    u = send(sock, s.READ, s.READ_IN.pack(7, 100, 50, 0, 0, 0, 0), nodeid=2)
    assert answer(sock) == (u, 0, Files.DATA[100:150])


def test_a_flush_is_answered_enosys_so_an_old_kernel_sends_no_more(kernel):
    # kernels before 7.35 ignore FOPEN_NOFLUSH and send a FLUSH at every close;
    # ENOSYS is the answer that makes them stop (no_flush; the close succeeds)
    sock, _, session = kernel
    init(sock)
    u = send(sock, s.FLUSH, s.FLUSH_IN.pack(7, 0, 0, 0), nodeid=2)
    assert answer(sock)[:2] == (u, -errno.ENOSYS)
    u = send(sock, s.FLUSH, b"\0" * 8, nodeid=2)  # too short for fuse_flush_in
    assert answer(sock)[:2] == (u, -errno.EINVAL)
    lookup_f(sock)
    assert session.op_counts()["flush"] == 2


@pytest.mark.fuse
@pytest.mark.parametrize("use_fusermount", [False, True])
def test_a_real_mount_by_mount2_or_fusermount3(tmp_path, use_fusermount):
    # the same session over the kernel: mount(2) as root, or fusermount3
    # handing the /dev/fuse descriptor back over _FUSE_COMMFD
    from fsclient.session import mount as fusemount

    mnt = str(tmp_path / "mnt")
    os.mkdir(mnt)
    ops = Files()
    ops.gate.set()
    fd = fusemount.mount(mnt, ["ro", "fsname=probe", "subtype=probe", "default_permissions"],
                         use_fusermount=use_fusermount)
    session = Session(ops, workers=2)
    try:
        session.start(fd)
        with open(os.path.join(mnt, "f"), "rb") as f:
            assert f.read() == Files.DATA
        with open("/proc/self/mountinfo") as f:
            line = next(x for x in f if x.split(" ")[4] == mnt)
        assert " - fuse.probe probe " in line and "ro" in line.split(" ")[5].split(",")
        assert session.terms is not None and session.op_counts()["read"] >= 1
    finally:
        fusemount.unmount_lazy(mnt)
        assert session.join(TIMEOUT)  # the connection ends with the mount
        session.close()
        os.close(fd)


def test_unknown_mount_options_are_named():
    from fsclient.session import mount as fusemount

    flags, kernel, fsname, subtype = fusemount.split(
        ["ro", "noatime", "allow_other", "fsname=blockcache:v", "subtype=blockcache", "dev"])
    assert flags == fusemount.MS_RDONLY | fusemount.MS_NOATIME | fusemount.MS_NOSUID
    assert (kernel, fsname, subtype) == (["allow_other"], "blockcache:v", "blockcache")
    with pytest.raises(ValueError, match="'auto_unmount' is not known"):
        fusemount.split(["ro", "auto_unmount"])
