"""The kernel's FUSE protocol: the structs and constants of `include/uapi/linux/fuse.h`
that fsclient uses (a read-only mount's, and a writable mount's writes), as
`struct.Struct` layouts (little-endian, the kernel's own padding), and the
encoders of the replies built from several parts.

Protocol version 7.45 (`KERNEL_MINOR`): the newest whose layouts are written here.
The session speaks min(kernel's minor, KERNEL_MINOR) and refuses a kernel older
than 7.31 (`MIN_MINOR`: max_pages and cached symlinks, both 7.28, and the 64-byte
INIT reply every kernel since 7.23 takes).

Byte layouts (offsets in bytes):

    fuse_in_header  (40)  len u32 | opcode u32 | unique u64 | nodeid u64 | uid u32 |
                          gid u32 | pid u32 | total_extlen u16 | padding u16
    fuse_out_header (16)  len u32 | error s32 (-errno) | unique u64
    fuse_attr       (88)  ino size blocks atime mtime ctime (u64 each) | atimensec
                          mtimensec ctimensec mode nlink uid gid rdev blksize flags (u32)
    fuse_entry_out (128)  nodeid generation entry_valid attr_valid (u64) |
                          entry_valid_nsec attr_valid_nsec (u32) | fuse_attr
    fuse_attr_out  (104)  attr_valid u64 | attr_valid_nsec u32 | dummy u32 | fuse_attr
    fuse_dirent (24+name) ino off (u64) | namelen type (u32) | name, padded to 8
    fuse_direntplus       fuse_entry_out | fuse_dirent
"""

from __future__ import annotations

import struct

KERNEL_MAJOR = 7
KERNEL_MINOR = 45
MIN_MINOR = 31
ROOT_ID = 1

# enum fuse_opcode
LOOKUP, FORGET, GETATTR, SETATTR, READLINK, SYMLINK = 1, 2, 3, 4, 5, 6
MKNOD, MKDIR, UNLINK, RMDIR, RENAME, LINK, OPEN, READ, WRITE = 8, 9, 10, 11, 12, 13, 14, 15, 16
STATFS, RELEASE, FSYNC, SETXATTR, GETXATTR, LISTXATTR = 17, 18, 20, 21, 22, 23
REMOVEXATTR, FLUSH, INIT, OPENDIR, READDIR, RELEASEDIR = 24, 25, 26, 27, 28, 29
FSYNCDIR, GETLK, SETLK, SETLKW, ACCESS, CREATE, INTERRUPT = 30, 31, 32, 33, 34, 35, 36
BMAP, DESTROY, IOCTL, POLL, NOTIFY_REPLY, BATCH_FORGET = 37, 38, 39, 40, 41, 42
FALLOCATE, READDIRPLUS, RENAME2, LSEEK, COPY_FILE_RANGE = 43, 44, 45, 46, 47
SETUPMAPPING, REMOVEMAPPING, SYNCFS, TMPFILE, STATX = 48, 49, 50, 51, 52

# The requests that change the file system: a read-only mount answers EROFS.
WRITE_OPS = frozenset({SETATTR, SYMLINK, MKNOD, MKDIR, UNLINK, RMDIR, RENAME, LINK, WRITE,
                       SETXATTR, REMOVEXATTR, CREATE, FALLOCATE, RENAME2, COPY_FILE_RANGE,
                       TMPFILE})
# Lower-case names, for logs and the per-operation metrics.
OP_NAMES = {
    LOOKUP: "lookup", FORGET: "forget", GETATTR: "getattr", SETATTR: "setattr",
    READLINK: "readlink", SYMLINK: "symlink", MKNOD: "mknod", MKDIR: "mkdir", UNLINK: "unlink",
    RMDIR: "rmdir", RENAME: "rename", LINK: "link", OPEN: "open", READ: "read", WRITE: "write",
    STATFS: "statfs", RELEASE: "release", FSYNC: "fsync", SETXATTR: "setxattr",
    GETXATTR: "getxattr", LISTXATTR: "listxattr", REMOVEXATTR: "removexattr", FLUSH: "flush",
    INIT: "init", OPENDIR: "opendir", READDIR: "readdir", RELEASEDIR: "releasedir",
    FSYNCDIR: "fsyncdir", GETLK: "getlk", SETLK: "setlk", SETLKW: "setlkw", ACCESS: "access",
    CREATE: "create", INTERRUPT: "interrupt", BMAP: "bmap", DESTROY: "destroy", IOCTL: "ioctl",
    POLL: "poll", NOTIFY_REPLY: "notify_reply", BATCH_FORGET: "batch_forget",
    FALLOCATE: "fallocate", READDIRPLUS: "readdirplus", RENAME2: "rename2", LSEEK: "lseek",
    COPY_FILE_RANGE: "copy_file_range", SETUPMAPPING: "setupmapping",
    REMOVEMAPPING: "removemapping", SYNCFS: "syncfs", TMPFILE: "tmpfile", STATX: "statx",
}

# INIT flags (fuse_init_in/out.flags; flags2 holds bits 32 and up)
ASYNC_READ = 1 << 0
ATOMIC_O_TRUNC = 1 << 3  # OPEN carries O_TRUNC (no SETATTR size 0 after it)
EXPORT_SUPPORT = 1 << 4
BIG_WRITES = 1 << 5
AUTO_INVAL_DATA = 1 << 12
DO_READDIRPLUS = 1 << 13
READDIRPLUS_AUTO = 1 << 14
ASYNC_DIO = 1 << 15
PARALLEL_DIROPS = 1 << 18
MAX_PAGES = 1 << 22
CACHE_SYMLINKS = 1 << 23
INIT_EXT = 1 << 30  # flags2 is valid

# fuse_open_out.open_flags
FOPEN_DIRECT_IO = 1 << 0
FOPEN_KEEP_CACHE = 1 << 1
FOPEN_NOFLUSH = 1 << 5  # 7.35: no FLUSH at close (older kernels ignore it and send one)

# enum fuse_notify_code
NOTIFY_INVAL_INODE = 2  # drop a node's attributes (and, from an offset, its pages)
NOTIFY_INVAL_ENTRY = 3  # drop a dentry (parent, name): its inode, once unused, is forgotten
NOTIFY_STORE = 4
NOTIFY_RESEND = 7  # 7.40: requests read but not answered are queued again
RESEND_MINOR = 40
NOTIFY_PRUNE = 9  # 7.45 (Linux 6.18): drop the unused dentries of node ids, no parent lock
PRUNE_MINOR = 45
# INIT flags (flags | flags2 << 32) that first came with 7.40 and later: bit 37 on
# (PASSTHROUGH, NO_EXPORT_SUPPORT, HAS_RESEND 7.40; ALLOW_IDMAP 7.41;
# OVER_IO_URING 7.42; REQUEST_TIMEOUT 7.43). Older kernels offer none of them.
_FLAGS_SINCE_7_40 = ~((1 << 37) - 1)


def flags_of_minor(minor: int) -> int:
    """The mask of INIT flags a kernel of protocol 7.`minor` may offer (exact
    for the 7.40 boundary, the one fsclient's behaviour turns on)."""
    return ~0 if minor >= RESEND_MINOR else ~_FLAGS_SINCE_7_40

# FUSE_DEV_IOC_CLONE = _IOR(229, 0, uint32_t)
DEV_IOC_CLONE = 0x8004E500
# The kernel's smallest accepted read buffer.
MIN_READ_BUFFER = 8192

IN_HEADER = struct.Struct("<IIQQIIIHH")        # fuse_in_header, 40
OUT_HEADER = struct.Struct("<IiQ")             # fuse_out_header, 16
ATTR = struct.Struct("<6Q10I")                 # fuse_attr, 88
ENTRY_HEAD = struct.Struct("<4Q2I")            # fuse_entry_out before its attr, 40
ATTR_OUT_HEAD = struct.Struct("<QII")          # fuse_attr_out before its attr, 16
DIRENT = struct.Struct("<QQII")                # fuse_dirent before its name, 24
INIT_IN = struct.Struct("<IIIII44x")           # fuse_init_in, 64 (7.36+)
INIT_IN_OLD = struct.Struct("<IIII")           # fuse_init_in before 7.36, 16
# fuse_init_out, 64: major minor max_readahead flags | max_background
# congestion_threshold (u16) | max_write time_gran | max_pages map_alignment (u16) |
# flags2 max_stack_depth | request_timeout u16 | unused[11] u16
INIT_OUT = struct.Struct("<IIIIHHIIHHIIH22x")
FORGET_IN = struct.Struct("<Q")                # fuse_forget_in, 8
BATCH_FORGET_IN = struct.Struct("<II")         # fuse_batch_forget_in, 8
FORGET_ONE = struct.Struct("<QQ")              # fuse_forget_one, 16
GETATTR_IN = struct.Struct("<IIQ")             # fuse_getattr_in, 16
OPEN_IN = struct.Struct("<II")                 # fuse_open_in, 8
OPEN_OUT = struct.Struct("<QIi")               # fuse_open_out, 16
OPEN_REPLY = struct.Struct("<IiQQIi")          # fuse_out_header + fuse_open_out, 32
READ_IN = struct.Struct("<QQIIQII")            # fuse_read_in, 40
RELEASE_IN = struct.Struct("<QIIQ")            # fuse_release_in, 24
FLUSH_IN = struct.Struct("<QIIQ")              # fuse_flush_in, 24
# writes (a writable mount): fuse_create_in (flags mode umask open_flags) and
# fuse_mkdir_in (mode umask) before their names; fuse_write_in (fh offset size
# write_flags lock_owner flags) before its data; fuse_write_out; fuse_fsync_in;
# fuse_rename_in (newdir) and fuse_rename2_in (newdir flags) before the two
# names; fuse_setattr_in (valid fh size lock_owner atime mtime ctime, their
# nsecs, mode uid gid)
CREATE_IN = struct.Struct("<IIII")             # 16
MKDIR_IN = struct.Struct("<II")                # 8
WRITE_IN = struct.Struct("<QQIIQII")           # 40
WRITE_OUT = struct.Struct("<II")               # 8
FSYNC_IN = struct.Struct("<QII")               # 16
RENAME_IN = struct.Struct("<Q")                # 8
RENAME2_IN = struct.Struct("<QII")             # 16
SETATTR_IN = struct.Struct("<IIQQQQQQIIIIIIII")  # 88
FATTR_MODE, FATTR_UID, FATTR_GID, FATTR_SIZE = 1, 2, 4, 8
FATTR_ATIME, FATTR_MTIME, FATTR_FH, FATTR_ATIME_NOW, FATTR_MTIME_NOW = 16, 32, 64, 128, 256
FATTR_CTIME = 1 << 10
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2
GETXATTR_IN = struct.Struct("<II")             # fuse_getxattr_in, 8
GETXATTR_OUT = struct.Struct("<II")            # fuse_getxattr_out, 8
ACCESS_IN = struct.Struct("<II")               # fuse_access_in, 8
INTERRUPT_IN = struct.Struct("<Q")             # fuse_interrupt_in, 8
STATFS_OUT = struct.Struct("<5Q4I24x")         # fuse_statfs_out (fuse_kstatfs), 80
NOTIFY_STORE_OUT = struct.Struct("<QQII")      # fuse_notify_store_out, 24
NOTIFY_INVAL_ENTRY_OUT = struct.Struct("<QII")  # fuse_notify_inval_entry_out, 16
NOTIFY_INVAL_INODE_OUT = struct.Struct("<Qqq")  # fuse_notify_inval_inode_out, 24
NOTIFY_PRUNE_OUT = struct.Struct("<IIQ")       # fuse_notify_prune_out, 16 (then u64 ids)

ENTRY_SIZE = ENTRY_HEAD.size + ATTR.size       # fuse_entry_out, 128
ATTR_OUT_SIZE = ATTR_OUT_HEAD.size + ATTR.size  # fuse_attr_out, 104
MAX_NAME = 255


class Attributes:
    """What a lookup, getattr or readdirplus answers about one inode (`st_ino` 0: a
    negative entry, cached by the kernel for `entry_timeout`). Times in ns."""

    __slots__ = ("st_ino", "st_size", "st_blocks", "st_mode", "st_nlink", "st_uid", "st_gid",
                 "st_rdev", "st_blksize", "st_atime_ns", "st_mtime_ns", "st_ctime_ns",
                 "generation", "entry_timeout", "attr_timeout")

    def __init__(self) -> None:
        self.st_ino = self.st_size = self.st_blocks = self.st_mode = 0
        self.st_uid = self.st_gid = self.st_rdev = self.generation = 0
        self.st_nlink = 1
        self.st_blksize = 4096
        self.st_atime_ns = self.st_mtime_ns = self.st_ctime_ns = 0
        self.entry_timeout = self.attr_timeout = 0.0


def _split(seconds: float) -> tuple[int, int]:
    """A timeout as (seconds, nanoseconds), as the kernel takes it."""
    if seconds <= 0:
        return 0, 0
    whole = int(seconds)
    return whole, int((seconds - whole) * 1e9)


def pack_attr(a: Attributes) -> bytes:
    at, mt, ct = a.st_atime_ns, a.st_mtime_ns, a.st_ctime_ns
    return ATTR.pack(a.st_ino, a.st_size, a.st_blocks, at // 10**9, mt // 10**9, ct // 10**9,
                     at % 10**9, mt % 10**9, ct % 10**9, a.st_mode, a.st_nlink, a.st_uid,
                     a.st_gid, a.st_rdev, a.st_blksize, 0)


def pack_entry(a: Attributes) -> bytes:
    """fuse_entry_out of a lookup (or a readdirplus entry)."""
    ev, ens = _split(a.entry_timeout)
    av, ans = _split(a.attr_timeout)
    head = ENTRY_HEAD.pack(a.st_ino, a.generation, ev, av, ens, ans)
    if a.st_ino == 0:  # negative: the attributes are not looked at
        return head + bytes(ATTR.size)
    return head + pack_attr(a)


def pack_attr_out(a: Attributes) -> bytes:
    av, ans = _split(a.attr_timeout)
    return ATTR_OUT_HEAD.pack(av, ans, 0) + pack_attr(a)


def dirent_size(name: bytes, plus: bool) -> int:
    """Bytes a (plus) directory entry of `name` takes in a reply, padded to 8."""
    n = DIRENT.size + len(name)
    return (ENTRY_SIZE if plus else 0) + ((n + 7) & ~7)


def pack_dirent(name: bytes, ino: int, next_off: int, mode: int) -> bytes:
    """fuse_dirent: the type is the mode's file-type bits shifted to DT_* (S_IFMT >> 12)."""
    n = DIRENT.size + len(name)
    return DIRENT.pack(ino, next_off, len(name), (mode >> 12) & 0o17) + name + \
        bytes(((n + 7) & ~7) - n)


def pack_statfs(blocks: int, bfree: int, bavail: int, files: int, ffree: int, bsize: int,
                namelen: int, frsize: int) -> bytes:
    return STATFS_OUT.pack(blocks, bfree, bavail, files, ffree, bsize, namelen, frsize, 0)
