"""Access control, with children that really drop to uid `nobody`: who may
connect, who may evict, what a pod without a volume's key can learn from the
cache dir, forged blocks, and who may write the cache.

Covered elsewhere and not repeated here: a non-admin `nobody` in the socket
group is refused volume/all evictions through the CLI and an admin gid is not
(tests/integration/test_daemon.py::test_admin_evictions_need_admin_peer); key
files readable by group/others are refused by the loader, `Volume` and
`fsclient mount` (tests/blockcache_client/test_volumekey.py,
test_volume_faults.py::test_bad_input, tests/fsclient/test_lifecycle.py).
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import stat

import pytest

from blockcache_client import Volume
from blockcache_client.contract import blockfile
from blockcache_client.contract.errors import DaemonError, IntegrityError
from blockcache_client.contract.layout import Layout
from blockcache_client.contract.protocol import ErrorCode
from blockcache_client.daemonclient.client import Client
from blockcache_client.volumekey import generate_key_file, load_key_file
from devtools.daemon import DaemonProcess
from tests.support.cache_audit import cache_files
from tests.support.figures import record
from tests.support.remote_files import write_dataset
from tests.support.skips import needs_root
from tests.support.uids import ChildError, as_nobody
from tests.support.volumes import BS, block_key
from tests.support.waiting import wait_for

pytestmark = needs_root

MARKER = b"KNOWN-PLAINTEXT!"  # 16 bytes that must never be seen in the cache


def _ping(path: str) -> bool:
    with Client(path, timeout=5) as c:
        return c.ping()["ok"]


def _admin_evictions(path: str) -> list[str]:
    """Try to evict a volume and everything; the outcome of each."""
    out = []
    with Client(path, timeout=5) as c:
        for kw in ({"volume": "vol"}, {"all_": True}):
            try:
                c.evict(**kw)
                out.append("evicted")
            except DaemonError as exc:
                out.append(exc.code)
    return out


def _start(tmp_path, shared_dir, *extra: str) -> DaemonProcess:
    d = DaemonProcess(tmp_path, cache_dirs=[(os.path.join(shared_dir, "cache"), "64M")],
                      extra_args=list(extra))
    d.socket_path = os.path.join(shared_dir, "bc.sock")
    return d.start()


def test_socket_mode_and_group_decide_who_connects(tmp_path, shared_dir):
    nogroup = pwd.getpwnam("nobody").pw_gid
    other = next(g.gr_gid for g in grp.getgrall() if g.gr_gid not in (0, nogroup))
    d = _start(tmp_path, shared_dir, "--socket-group", str(other))
    try:
        st = os.stat(d.socket_path)
        assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == other and st.st_uid == 0
        # uid nobody, gid nobody: neither owner nor group -> refused by the kernel
        with pytest.raises(ChildError) as exc:
            as_nobody(_ping, d.socket_path)
        assert exc.value.kind == "DaemonUnavailable" and "Permission denied" in exc.value.message
        # uid nobody in the socket's group: may connect, but is no admin
        assert as_nobody(_ping, d.socket_path, gid=other)
        assert as_nobody(_admin_evictions, d.socket_path, gid=other) == \
            [ErrorCode.PERMISSION_DENIED] * 2
        record("socket_access", refused_uid="nobody/nogroup", allowed="nobody in socket group",
               non_admin_evict_volume_and_all="permission_denied")
    finally:
        d.stop()


def _read_all_cache_files(paths: list[str]) -> list[bytes]:
    out = []
    for p in paths:
        with open(p, "rb") as f:
            out.append(f.read())
    return out


def _try_to_write(cache: str, block: str) -> dict[str, int]:
    """Every way a pod could change the cache; the errno each one got (0 = it worked)."""
    tries = {
        "open block for writing": lambda: os.close(os.open(block, os.O_WRONLY)),
        "create next to a block": lambda: os.close(os.open(
            os.path.join(os.path.dirname(block), "x"), os.O_CREAT | os.O_WRONLY, 0o644)),
        "unlink a block": lambda: os.unlink(block),
        "rename a block": lambda: os.rename(block, block + ".x"),
        "create in tmp/": lambda: os.close(os.open(os.path.join(cache, "tmp", "x"),
                                                   os.O_CREAT | os.O_WRONLY, 0o644)),
        "mkdir in blocks/": lambda: os.mkdir(os.path.join(cache, "blocks", "zz")),
        "chmod a block": lambda: os.chmod(block, 0o666),
        "utime a block": lambda: os.utime(block, (0, 0)),
    }
    out = {}
    for name, fn in tries.items():
        try:
            fn()
            out[name] = 0
        except OSError as exc:
            out[name] = exc.errno
    return out


def test_pod_without_the_key_sees_only_ciphertext_and_cannot_write(tmp_path, shared_dir):
    key_a = str(tmp_path / "a.key")
    generate_key_file(key_a)
    src = tmp_path / "src"
    files = write_dataset(str(src), [3 * BS + 100], seed=5)
    (src / "known.bin").write_bytes(MARKER * (2 * BS // len(MARKER)))
    d = _start(tmp_path, shared_dir)
    try:
        with Volume("vol", str(src), key_a, socket_path=d.socket_path, block_size=BS,
                    memory_cache_bytes=0) as vol:
            wait_for(lambda: vol.stats()["daemon_connected"], what="the volume to connect")
            assert vol.read("known.bin", 0, 2 * BS) == MARKER * (2 * BS // len(MARKER))
            for rel, data in files.items():
                assert vol.read(rel, 0, len(data)) == data
            assert vol.wait_fills(10)
        d.wait_idle()
        cache = d.cache_dirs[0]
        blocks = sorted(cache_files([cache]))
        assert len(blocks) == 2 + 4
        # a pod with the cache dir mounted reads every file and learns nothing
        contents = as_nobody(_read_all_cache_files, blocks)
        plaintexts = [MARKER] + [data[i:i + 32] for data in files.values()
                                 for i in range(0, len(data) - 32, 4096)]
        assert not any(p in blob for blob in contents for p in plaintexts)
        # ... and cannot change anything: modes, and a real attempt by nobody
        for dirpath, _dirnames, filenames in os.walk(cache):
            st = os.stat(dirpath)
            assert st.st_uid == 0 and not st.st_mode & 0o022, dirpath
            for n in filenames:
                st = os.stat(os.path.join(dirpath, n))
                assert st.st_uid == 0 and not st.st_mode & 0o022, n
        tried = as_nobody(_try_to_write, cache, blocks[0])
        assert all(e in (errno.EACCES, errno.EPERM) for e in tried.values()), tried
        assert sorted(cache_files([cache])) == blocks
        record("pod_without_key", cache_files=len(blocks), plaintext_probes=len(plaintexts),
               found=0, write_attempts=len(tried), write_attempts_refused=len(tried))
    finally:
        d.stop()


def test_foreign_and_forged_blocks(tmp_path, daemon):
    """Volume A's block never opens under volume B's key; a block forged under
    A's key name by a pod holding only B's key is caught by A's reader,
    evicted and refilled, and A never sees its bytes."""
    key_a, key_b = str(tmp_path / "a.key"), str(tmp_path / "b.key")
    generate_key_file(key_a)
    generate_key_file(key_b)
    vk_a, vk_b = load_key_file(key_a), load_key_file(key_b)
    src = tmp_path / "src"
    files = write_dataset(str(src), [BS, BS], seed=6)
    (good_rel, good), (forged_rel, want) = sorted(files.items())
    layout = Layout.from_wire(daemon.client().hello()["layout"])
    with Volume("vola", str(src), key_a, socket_path=daemon.socket_path, block_size=BS,
                memory_cache_bytes=0) as a, \
            Volume("volb", str(src), key_b, socket_path=daemon.socket_path, block_size=BS,
                   memory_cache_bytes=0) as b:
        for v in (a, b):
            wait_for(lambda v=v: v.stats()["daemon_connected"], what="the volumes to connect")

        # A's block, opened as B's in every way: B's key with A's name, with B's name
        assert a.read(good_rel, 0, BS) == good
        assert a.wait_fills(10)
        daemon.wait_idle()
        ka = block_key(a, good_rel)
        with open(layout.path(ka), "rb") as f:
            blob_a = f.read()
        kb = block_key(b, good_rel)
        for key, vk in ((ka, vk_b), (kb, vk_b), (kb, vk_a)):
            with pytest.raises(IntegrityError):
                blockfile.unseal(key, blob_a, vk)
        # the same block copied under B's key name: B's reader rejects it
        daemon.client().put(kb, blob_a)
        daemon.wait_idle()
        assert b.read(good_rel, 0, BS) == good
        assert b.stats()["integrity_failures"] == 1

        # a forgery under A's name, sealed by someone holding only B's key
        kf = block_key(a, forged_rel)
        evil = b"\x00EVIL" * (BS // 5) + b"\x00" * (BS % 5)
        accepted, _ = daemon.client().put(kf, blockfile.seal(kf, evil, vk_b))
        assert accepted  # the daemon cannot tell: it never holds keys
        daemon.wait_idle()
        before = a.stats()
        got = a.read(forged_rel, 0, BS)
        assert got == want and b"EVIL" not in got
        assert a.stats()["integrity_failures"] == before["integrity_failures"] + 1
        assert a.wait_fills(10)
        daemon.wait_idle()
        wait_for(lambda: _opens(kf, layout.path(kf), vk_a), what="the forged block refilled")
        assert a.read(forged_rel, 0, BS) == want
        assert a.stats()["hits"] == before["hits"] + 1
        record("forged_blocks", cross_volume_opens=0, forged_detected=2, wrong_bytes=0)


def _opens(key: str, path: str, vk: bytes) -> bool:
    try:
        with open(path, "rb") as f:
            blockfile.unseal(key, f.read(), vk)
        return True
    except (OSError, IntegrityError):
        return False
