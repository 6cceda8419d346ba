"""Volume slots shared between uids, with a real daemon and children that
really drop to other uids in the socket's group: one uid making up volume
names fills its own share of `max_volumes`, not every slot, and a volume
whose blocks are all gone frees its slot, also across a restart."""

from __future__ import annotations

import os
import shutil
import time

from blockcache_client import Volume
from blockcache_client.contract import blockfile, layout
from blockcache_client.contract.blockkey import BlockKey
from blockcache_client.daemonclient.client import Client
from blockcache_client.volumekey import generate_key_file
from devtools.daemon import DaemonProcess
from tests.support.cli_runs import run_cli
from tests.support.figures import record
from tests.support.metrics import logged_port, scrape, value
from tests.support.remote_files import write_dataset
from tests.support.skips import needs_root
from tests.support.uids import as_uid, socket_group
from tests.support.volumes import BS
from tests.support.waiting import wait_for

pytestmark = needs_root

ATTACKER, TENANT, OTHER = 60001, 60002, 60003
VOLUME_KEY = bytes(range(32))


def _start(tmp_path, shared_dir, *extra: str, size: str = "64M") -> DaemonProcess:
    d = DaemonProcess(tmp_path, cache_dirs=[(os.path.join(shared_dir, "cache"), size)],
                      extra_args=["--socket-group", str(socket_group()), *extra])
    d.socket_path = os.path.join(shared_dir, "bc.sock")
    return d.start()


def _key(vol: str, offset: int = 0) -> str:
    return str(BlockKey(vol, 1, 1, offset))


def _puts(path: str, volumes: list[str], payload: int = 1) -> list[str]:
    """One block of `payload` bytes under each volume name: the put reasons
    (the finding's attack with one-byte blocks under made-up names)."""
    with Client(path, timeout=10) as c:
        return [c.put(_key(v), blockfile.seal(_key(v), b"j" * payload, VOLUME_KEY))[1]
                for v in volumes]


def _evict_keys(path: str, keys: list[str]) -> int:
    """Evict blocks by key, as a reader does with one failing authentication."""
    with Client(path, timeout=10) as c:
        return sum(c.evict(k) for k in keys)


def _reads(name: str, src: str, key: str, sock: str, files: dict[str, bytes]) -> dict:
    """A tenant's reader reads every file once and waits for its fills to
    reach the daemon; its hits and misses."""
    with Volume(name, src, key, socket_path=sock, block_size=BS, memory_cache_bytes=0) as vol:
        wait_for(lambda: vol.stats()["daemon_connected"], what="the volume to connect")
        for rel, data in files.items():
            assert vol.read(rel, 0, len(data)) == data, rel
        assert vol.wait_fills(10)
        s = vol.stats()
        return {"hits": s["hits"], "misses": s["misses"]}


def _tenant_data(shared_dir: str, uid: int) -> tuple[str, str, dict[str, bytes]]:
    """A source tree and a 0400 key file of `uid`'s own."""
    src = os.path.join(shared_dir, "src")
    files = write_dataset(src, [BS // 2, BS + 7], seed=41)
    key = os.path.join(shared_dir, "tenant.key")
    generate_key_file(key)
    os.chown(key, uid, socket_group())
    return src, key, files


def test_one_uid_filling_its_share_leaves_other_uids_and_root_caching(tmp_path, shared_dir):
    """The finding: a uid's one-byte puts under made-up names took every one
    of max_volumes, and every later volume was refused. Now it gets its share
    (3 of 8), is refused alone (counted, logged once), and a tenant published
    later caches its reads; root, an admin, is held to no share."""
    d = _start(tmp_path, shared_dir, "--max-volumes", "8", "--max-volumes-per-uid", "3",
               "--metrics-addr", "127.0.0.1:0")
    group = socket_group()
    try:
        t = time.monotonic()
        junk = [f"junk{i}" for i in range(40)]
        got = as_uid(ATTACKER, group, _puts, d.socket_path, junk)
        attack_s = time.monotonic() - t
        assert got == ["queued"] * 3 + ["volume_share"] * 37, got
        # a tenant (another uid) published later: its reads are cached
        src, key, files = _tenant_data(shared_dir, TENANT)
        blocks = sum(-(-len(data) // BS) for data in files.values())
        first = as_uid(TENANT, group, _reads, "tenant", src, key, d.socket_path, files)
        assert first == {"hits": 0, "misses": blocks}, first
        d.wait_idle()
        second = as_uid(TENANT, group, _reads, "tenant", src, key, d.socket_path, files)
        assert second == {"hits": blocks, "misses": 0}, second
        # root is an admin: its new volumes count to no uid's share
        assert _puts(d.socket_path, ["root0", "root1", "root2", "root3"]) == ["queued"] * 4
        # max_volumes still bounds them all: 3 + 1 + 4 are held
        assert as_uid(OTHER, group, _puts, d.socket_path, ["other0"]) == ["too_many_volumes"]
        s = d.wait_idle()
        assert s["volume_slots"] == {"held": 8, "limit": 8, "per_uid": 3, "owners": 2,
                                     "unowned": 4}, s["volume_slots"]
        assert s["refused"]["volume_share"] == 37 == s["put_results"]["volume_share"]
        assert s["volumes"]["tenant"]["entries"] == blocks
        assert not {f"junk{i}" for i in range(3, 40)} & set(s["volumes"])  # no state for them
        # counted in the metrics and in `blockcache-cli stats`
        port = logged_port(d.stderr)
        assert value(scrape(port), "blockcache_refused_total", kind="volume_share") == 37
        assert value(scrape(port), "blockcache_volume_slots") == 8
        out = run_cli("blockcache_client.cli", "--socket", d.socket_path, "stats")
        assert out.returncode == 0, out.stderr
        assert "volumes      8 of 8 slots (per uid 3; 4 owned by no uid)" in out.stdout
        assert "volume_share 37" in out.stdout and "too_many_volumes 1" in out.stdout
        # one log line for the 37 refusals, naming the uid and the setting
        lines = [line for line in d.stderr().splitlines()
                 if f"refused uid {ATTACKER}" in line and "max_volumes_per_uid" in line]
        assert len(lines) == 1, lines
        record("volume_slots_per_uid", max_volumes=8, per_uid=3, attacker_puts=len(junk),
               attacker_queued=3, attacker_refused=37, attack_s=round(attack_s, 3),
               tenant_hits=second["hits"], tenant_misses=second["misses"], root_queued=4)
    finally:
        d.stop()


def test_volumes_with_no_blocks_left_are_forgotten_also_across_a_restart(tmp_path, shared_dir):
    """Each way a volume's last block leaves frees its slot for its owner:
    `blockcache-cli evict --volume`, evictions by key (what a reader sends
    for a block failing authentication), capacity eviction; a restart holds
    a slot for each volume it finds on disk (owned by nobody) and none for
    one whose blocks it does not find."""
    d = _start(tmp_path, shared_dir, "--max-volumes", "4", "--max-volumes-per-uid", "2",
               "--admission-policy", "lru", size="1M")
    group = socket_group()
    sock = d.socket_path

    def held() -> int:
        return d.wait_idle()["volume_slots"]["held"]

    try:
        assert as_uid(ATTACKER, group, _puts, sock, ["a0", "a1", "a2"]) == [
            "queued", "queued", "volume_share"]
        # evicted as a volume by an admin
        out = run_cli("blockcache_client.cli", "--socket", sock, "evict", "--volume", "a0")
        assert out.returncode == 0 and "evicted 1 block" in out.stdout, out
        assert held() == 1
        assert as_uid(ATTACKER, group, _puts, sock, ["a3", "a4"]) == ["queued", "volume_share"]
        # evicted by key, as a reader evicts a block failing authentication
        assert as_uid(ATTACKER, group, _evict_keys, sock, [_key("a1")]) == 1
        assert held() == 1
        assert as_uid(ATTACKER, group, _puts, sock, ["a5", "a6"]) == ["queued", "volume_share"]
        # evicted for room: root's 100 KiB blocks push the attacker's out of a 1M dir
        with Client(sock, timeout=10) as c:
            for i in range(12):
                k = _key("big", i << 20)
                assert c.put(k, blockfile.seal(k, b"b" * (100 << 10), VOLUME_KEY))[0]
                d.wait_idle()
        s = d.wait_idle()
        assert s["evictions_by_reason"].get("admission", 0) >= 2, s["evictions_by_reason"]
        assert s["volume_slots"]["held"] == 1 and set(s["volumes"]) >= {"big"}
        assert s["volumes"].get("a3", {}).get("entries", 0) == 0
        assert as_uid(ATTACKER, group, _puts, sock, ["a7", "a8", "a9"]) == [
            "queued", "queued", "volume_share"]
        assert held() == 3
        # a restart: a7's block is gone from disk meanwhile (a lost write)
        d.stop()
        os.unlink(os.path.join(d.cache_dirs[0], layout.block_relpath(_key("a7"))))
        d.start()
        s = d.wait_idle()
        assert s["volume_slots"] == {"held": 2, "limit": 4, "per_uid": 2, "owners": 0,
                                     "unowned": 2}, s["volume_slots"]
        assert s["volumes"]["big"]["entries"] > 0 and s["volumes"]["a8"]["entries"] == 1
        assert "a7" not in s["volumes"]
        # the two free slots are taken by the next new volumes, then max_volumes binds
        assert as_uid(OTHER, group, _puts, sock, ["o0", "o1"]) == ["queued", "queued"]
        assert _puts(sock, ["root0"]) == ["too_many_volumes"]
        record("volume_slots_forgotten", max_volumes=4, per_uid=2,
               forgotten_by=["evict --volume", "evict key", "admission", "restart"],
               held_after_restart=2)
    finally:
        d.stop()
        shutil.rmtree(os.path.join(shared_dir, "cache"), ignore_errors=True)
