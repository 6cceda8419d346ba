"""Tenants sharing one daemon, with children that really drop to uid
`nobody`: per-volume access tied to SO_PEERCRED, the admin rule, and two
tenants using one volume name with different keys."""

from __future__ import annotations

import os
import pwd

from blockcache_client.contract import blockfile, layout
from blockcache_client.contract.blockkey import BlockKey
from blockcache_client.contract.errors import DaemonError
from blockcache_client.daemonclient.client import Client
from devtools.daemon import DaemonProcess
from tests.support.figures import record
from tests.support.skips import needs_root
from tests.support.uids import as_nobody, socket_group

pytestmark = needs_root

VICTIM_KEY = bytes(range(32))


def _start(tmp_path, shared_dir, *extra: str) -> DaemonProcess:
    d = DaemonProcess(tmp_path, cache_dirs=[(os.path.join(shared_dir, "cache"), "64M")],
                      extra_args=["--socket-group", str(socket_group()), *extra])
    d.socket_path = os.path.join(shared_dir, "bc.sock")
    return d.start()


def _fill(d: DaemonProcess, vol: str, n: int = 4) -> list[str]:
    keys = [str(BlockKey(vol, 7, 0xabc, i << 16)) for i in range(n)]
    c = d.client()
    for k in keys:
        assert c.put(k, blockfile.seal(k, b"x" * 1000, VICTIM_KEY))[0]
    d.wait_idle()
    return keys


def _attack(path: str, victim: str) -> dict[str, str]:
    """What a co-tenant tries on another's volume: the outcome of each step."""
    out = {}
    with Client(path, timeout=5) as c:
        def attempt(name, fn):
            try:
                out[name] = f"ok {fn()}"
            except DaemonError as exc:
                out[name] = exc.code
        attempt("list", lambda: len(c.list(victim, 1000)["keys"]))
        attempt("list all", lambda: len(c.list(None, 1000)["keys"]))
        key = str(BlockKey(victim, 7, 0xabc, 0))
        attempt("evict key", lambda: c.evict(key))
        attempt("evict inode", lambda: c.evict(inode=(victim, 7)))
        attempt("evict volume", lambda: c.evict(volume=victim))
        attempt("put", lambda: c.put(str(BlockKey(victim, 9, 1, 0)),
                                     blockfile.seal(str(BlockKey(victim, 9, 1, 0)), b"y",
                                                    bytes(32)))[1])
        own = str(BlockKey("mine", 1, 1, 0))
        attempt("put own", lambda: c.put(own, blockfile.seal(own, b"y", bytes(32)))[1])
        attempt("list own", lambda: len(c.list("mine", 10)["keys"]))
    return out


def test_default_open_host_lets_any_peer_evict_by_inode(tmp_path, shared_dir):
    """Without access tables the host is single-tenant, as documented: any
    peer the socket admits may list and evict a volume's blocks by inode."""
    d = _start(tmp_path, shared_dir)
    try:
        _fill(d, "victim")
        got = as_nobody(_attack, d.socket_path, "victim", gid=socket_group())
        assert got["list"] == "ok 4" and got["evict inode"] == "ok 3"  # key 0 went first
        assert got["evict volume"] == "permission_denied"
    finally:
        d.stop()


def test_cross_tenant_list_and_evict_refused(tmp_path, shared_dir):
    nobody = pwd.getpwnam("nobody").pw_uid
    d = _start(tmp_path, shared_dir, "--volume-access", "victim=uid:0",
               "--volume-access", f"mine=uid:{nobody}")
    try:
        keys = _fill(d, "victim")
        got = as_nobody(_attack, d.socket_path, "victim", gid=socket_group())
        denied = "permission_denied"
        assert got == {"list": denied, "list all": denied, "evict key": denied,
                       "evict inode": denied, "evict volume": denied, "put": denied,
                       "put own": "ok queued", "list own": got["list own"]}, got
        d.wait_idle()
        c = d.client()
        assert c.list("victim", 100)["keys"] == keys  # nothing of the victim's was touched
        assert as_nobody(lambda p: Client(p, timeout=5).list("mine", 10)["keys"],
                         d.socket_path, gid=socket_group()) == [str(BlockKey("mine", 1, 1, 0))]
        s = c.stats()
        assert s["errors"]["permission_denied"] >= 6
        record("cross_tenant_bypass", attempts=6, refused=6, victim_blocks_left=len(keys))
    finally:
        d.stop()


def _look_around(path: str, cache: str, victim_key: str, own_key: str) -> dict:
    """What a tenant can learn of another's blocks without its key."""
    out: dict = {}
    victim = os.path.join(cache, layout.block_relpath(victim_key))
    leaf = os.path.dirname(victim)
    for name, where in (("list blocks", os.path.dirname(os.path.dirname(leaf))),
                        ("list fan-out", os.path.dirname(leaf)), ("list leaf", leaf)):
        try:
            out[name] = len(os.listdir(where))
        except PermissionError:
            out[name] = "denied"
    out["stat by name"] = os.stat(victim).st_size > 0  # a reader computes paths
    with Client(path, timeout=5) as c:
        s = c.stats()
        out["stats volumes"] = sorted(s["volumes"])
        out["stats cluster volumes"] = sorted(s["cluster"]["volumes"])
        out["lookup"] = [p is not None for p in c.lookup([victim_key, own_key])]
        out["touch"] = c.touch([victim_key])["touched"]
    return out


def test_a_tenant_cannot_list_the_tree_or_see_another_volume(tmp_path, shared_dir):
    nobody = pwd.getpwnam("nobody").pw_uid
    d = _start(tmp_path, shared_dir, "--volume-access", "victim=uid:0",
               "--volume-access", f"mine=uid:{nobody}")
    try:
        victim_key = _fill(d, "victim")[0]
        # a tree an older daemon left listable (0755) is mended at start
        d.stop()
        for top, _dirs, _ in os.walk(os.path.join(d.cache_dirs[0], "blocks")):
            os.chmod(top, 0o755)
        d.start()
        own_key = str(BlockKey("mine", 1, 1, 0))
        assert d.client().put(own_key, blockfile.seal(own_key, b"y", bytes(32)))[0]
        d.wait_idle()
        d.client().ping(cluster={"volume": "victim", "counters": {"cluster_hits": 1}})
        before = d.client().stats()["volumes"]["victim"]["touches"]
        got = as_nobody(_look_around, d.socket_path, d.cache_dirs[0], victim_key, own_key,
                        gid=socket_group())
        assert got == {"list blocks": "denied", "list fan-out": "denied",
                       "list leaf": "denied", "stat by name": True,
                       "stats volumes": ["mine"], "stats cluster volumes": [],
                       "lookup": [False, True], "touch": 0}, got
        s = d.client().stats()  # root, an admin, sees every volume
        assert sorted(s["volumes"]) == ["mine", "victim"]
        assert sorted(s["cluster"]["volumes"]) == ["victim"]
        assert s["volumes"]["victim"]["touches"] == before
    finally:
        d.stop()


def _root_tries(path: str) -> dict[str, str]:
    out = {}
    with Client(path, timeout=5) as c:
        for name, kw in (("evict all", {"all_": True}), ("evict volume", {"volume": "victim"})):
            try:
                out[name] = f"ok {c.evict(**kw)}"
            except DaemonError as exc:
                out[name] = exc.code
    return out


def test_admin_rule_is_configurable(tmp_path, shared_dir):
    """With admin_uids empty, root (the fsclient sidecar) is no admin: it may
    use the volumes it is listed for, not evict others' or everything; the
    admin group still may."""
    admin = socket_group()
    d = _start(tmp_path, shared_dir, "--admin-uid", "", "--admin-gid", str(admin),
               "--volume-access", "victim=uid:0")
    try:
        keys = _fill(d, "victim")  # root may put its listed volume
        assert _root_tries(d.socket_path) == {"evict all": "permission_denied",
                                              "evict volume": "permission_denied"}
        assert d.client().list("victim", 10)["keys"] == keys
        # nobody in the admin group: admin
        assert as_nobody(_root_tries, d.socket_path, gid=admin) == {
            "evict all": "ok 4", "evict volume": "ok 0"}
    finally:
        d.stop()


def test_two_tenants_one_volume_name_different_keys(tmp_path, key_file):
    """Two tenants both call their volume "data", each with its own key:
    their block names differ (derived from the key), so neither sees the
    other's blocks as its own: each other's blocks are misses, never
    integrity failures, and nobody evicts anybody. Before key format 2 they
    evicted each other's blocks on every read."""
    from blockcache_client.volumekey import generate_key_file
    from tests.support.remote_files import write_dataset
    from tests.support.volumes import connected_volume
    other_key = str(tmp_path / "other.key")
    generate_key_file(other_key)
    files = write_dataset(str(tmp_path / "src"), [3 * 65536 + 5, 65536], seed=11)
    d = DaemonProcess(tmp_path).start()
    try:
        a = connected_volume("data", str(tmp_path / "src"), key_file, d)
        b = connected_volume("data", str(tmp_path / "src"), other_key, d)
        try:
            for _ in range(3):  # each reads everything, in turns
                for v in (a, b):
                    for rel, data in files.items():
                        assert v.read(rel, 0, len(data)) == data
                    assert v.wait_fills(10)
                d.wait_idle()
            sa, sb = a.stats(), b.stats()
            blocks = 5
            for s in (sa, sb):
                assert s["integrity_failures"] == 0, s
                assert s["misses"] == blocks and s["hits"] == 2 * blocks, s
            s = d.client().stats()
            assert s["entries"] == 2 * blocks and s["requests"].get("evict", 0) == 0
            record("two_tenants_one_name", blocks_each=blocks, rounds=3,
                   integrity_failures=0, evictions=0, hits_each=sa["hits"])
        finally:
            a.close()
            b.close()
    finally:
        d.stop()
