"""One adapter per system under test: start it, say how a worker reads through it, stop it.

Kinds (they decide which of this project's systems a figure is compared to):

- `inproc`: a Python library read inside the worker (s3fs, fsspec caches,
  `Volume`); compared to `volume`.
- `mount`: a FUSE mount read with plain file calls (fsclient, rclone,
  s3fs-fuse, the passthrough floor); compared to `fuse`.
- `local`: the local copy read directly: the physical limit; compared to `fuse`.

`start(ctx)` gives a fresh, empty cache; `stop()` removes every process and
mount it made, even after a failure. `add_client()` makes one more client of
the same cache (workload 5): another mount, or for in-process systems simply
another reader process over the same cache directory or daemon;
`restart_client()` starts one anew over the cache it has (a remount).
`server_pids()` are the processes whose CPU time counts toward the system
besides the readers (FUSE servers, the blockcached daemon).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

from blockcache_client.sources import s3direct

from . import PROJECT_ROOT
from .datasets import MIB, Size
from .remote import ACCESS_KEY, REGION, SECRET_KEY, Remote

log = logging.getLogger(__name__)

MOUNT_TIMEOUT = 30.0
BUCKET_ROOT_VOLUME = "bench"
# Metadata TTL for our two systems: a read-only dataset, cached as long as
# rclone's --dir-cache-time 1h below (s3fs-fuse's stat cache: 900 s default).
META_TTL = 3600.0
XATTR_STATS = "user.blockcache.stats"


@dataclass
class Ctx:
    """What every system needs: the remote, the local copy, a scratch dir."""
    remote: Remote
    local_root: str
    workdir: str
    size: Size


def read_into_page_cache(dirs: list[str], chunk: int = 1 << 20) -> int:
    """Read every file under `dirs` once (so the host page cache holds them);
    returns the bytes read. Files that vanish meanwhile are skipped."""
    total = 0
    for top in dirs:
        for dirpath, _, files in os.walk(top):
            for name in files:
                try:
                    with open(os.path.join(dirpath, name), "rb", buffering=0) as f:
                        while data := f.read(chunk):
                            total += len(data)
                except OSError:  # evicted meanwhile, or not a regular file
                    continue
    return total


def drop_page_cache() -> bool:
    """Drop the host page cache (so local and cached files come from disk);
    False, with a warning, where this process may not."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError as exc:
        log.warning("cannot drop the page cache (%s); cold epochs of local files may "
                    "be served from memory", exc)
        return False


def disk_bytes(paths: list[str]) -> int:
    """Bytes allocated on disk under `paths` (st_blocks, so sparse files count true)."""
    total = 0
    for top in paths:
        for dirpath, _dirs, files in os.walk(top):
            for name in files:
                try:
                    total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
                except FileNotFoundError:
                    pass
    return total


def stat_cpu(path: str, children: bool = False) -> float | None:
    """CPU seconds in a /proc `stat` file (a process's or a thread's): user
    and system, and its waited-for children's with `children`; None if gone."""
    try:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()  # (after the command's name)
    except (FileNotFoundError, ProcessLookupError):
        return None
    ticks = sum(int(x) for x in fields[11:15 if children else 13])  # utime stime cutime cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def host_cpu() -> float:
    """The machine's busy CPU seconds since boot, every CPU's, from /proc/stat:
    user, nice, system, irq, softirq and steal (a hypervisor's, not ours to
    use). It counts what no process is charged: the kernel's writeback
    threads, softirqs of loopback TCP."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    busy = sum(ticks) - ticks[3] - ticks[4]  # (less idle and iowait)
    return busy / os.sysconf("SC_CLK_TCK")


def proc_cpu(pid: int) -> float:
    """CPU seconds of a process and its waited-for children, from /proc (0 if gone)."""
    return stat_cpu(f"/proc/{pid}/stat", children=True) or 0.0


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of each live thread of a process, by thread id, from /proc
    (a thread that ended is in `proc_cpu` only)."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return out
    for tid in tids:
        cpu = stat_cpu(f"/proc/{pid}/task/{tid}/stat")
        if cpu is not None:
            out[int(tid)] = cpu
    return out


def is_mounted(path: str) -> bool:
    path = os.path.realpath(path)
    with open("/proc/mounts") as f:
        return any(line.split()[1] == path for line in f)


def _tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


class MountProcess:
    """A FUSE server run in the foreground as a child: ready when the mount shows up."""

    def __init__(self, argv: list[str], mountpoint: str, log_path: str, env: dict | None = None):
        self.argv = argv
        self.mountpoint = mountpoint
        self.log_path = log_path
        self.env = env
        self.proc: subprocess.Popen | None = None

    def start(self) -> MountProcess:
        os.makedirs(self.mountpoint, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env,
                                         start_new_session=True)
        deadline = time.monotonic() + MOUNT_TIMEOUT
        while not is_mounted(self.mountpoint):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{os.path.basename(self.argv[0])} exited with "
                                   f"{self.proc.returncode} before mounting {self.mountpoint}:\n"
                                   f"{_tail(self.log_path)}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.mountpoint} not mounted within {MOUNT_TIMEOUT:.0f} s:\n"
                                   f"{_tail(self.log_path)}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if is_mounted(self.mountpoint):
            r = subprocess.run(["fusermount3", "-u", self.mountpoint], capture_output=True)
            if r.returncode:
                subprocess.run(["fusermount3", "-uz", self.mountpoint], capture_output=True)
        if self.proc and self.proc.poll() is None:
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None


class System:
    """Base adapter. Subclasses set `name`, `label`, `kind` and fill the hooks."""
    name = ""
    label = ""
    kind = "inproc"
    ours = False
    shares_cache = True      # do extra clients (workload 5) share the first one's cache?

    def __init__(self):
        self.ctx: Ctx | None = None
        self.dir = ""
        self.clients = 1

    def unavailable(self) -> str | None:
        """Why this system cannot run here, or None."""
        return None

    def start(self, ctx: Ctx, tag: str) -> None:
        """Fresh, empty caches under a new directory for run `tag`."""
        self.ctx = ctx
        self.clients = 1
        self.dir = os.path.join(ctx.workdir, f"{self.name}-{tag}")
        shutil.rmtree(self.dir, ignore_errors=True)
        os.makedirs(self.dir)
        self._start()

    def _start(self) -> None:
        pass

    def stop(self, remove: bool = True) -> None:
        """Stop every process and mount; remove the caches (unless not
        `remove`: the caller removes `dir` later)."""
        try:
            self._stop()
        finally:
            if self.dir and remove:
                shutil.rmtree(self.dir, ignore_errors=True)

    def _stop(self) -> None:
        pass

    def reader_spec(self, client: int = 0) -> dict:
        raise NotImplementedError

    def add_client(self) -> int:
        """Another client of the same cache; returns its index for `reader_spec`."""
        self.clients += 1
        return self.clients - 1

    def restart_client(self, client: int) -> None:
        """Start `client` anew over the cache it has: nothing to do for an
        in-process system, whose next workers are new processes anyway."""

    def server_pids(self) -> list[int]:
        return []

    def cache_dirs(self) -> list[str]:
        return []

    def backing_dirs(self) -> list[str]:
        """Where this system's warm reads come from on the host: its cache
        dirs (the local copy for local disk and the passthrough)."""
        return self.cache_dirs()

    def settle(self) -> None:
        """Wait for background work that a pause between epochs would let finish."""

    def settings(self) -> dict:
        return {}

    def version(self) -> str:
        return ""


# --- in-process systems ---

class S3fsDirect(System):
    name, label = "s3fs", "s3fs (no cache)"
    shares_cache = False

    def reader_spec(self, client: int = 0) -> dict:
        return {"type": "fsspec", "protocol": "s3", "prefix": self.ctx.remote.bucket,
                "options": self.ctx.remote.storage_options()}

    def version(self) -> str:
        import s3fs
        return f"s3fs {s3fs.__version__}"


class CrtSystem(System):
    name, label = "crt", "AWS CRT client (s3torchconnectorclient)"
    shares_cache = False

    def unavailable(self) -> str | None:
        try:
            import s3torchconnectorclient  # noqa: F401
        except ImportError as exc:
            return f"s3torchconnectorclient is not installed (the bench extra): {exc}"
        return None

    def reader_spec(self, client: int = 0) -> dict:
        r = self.ctx.remote
        return {"type": "crt", "args": {"bucket": r.bucket, "endpoint": r.endpoint,
                                        "region": REGION, "key": ACCESS_KEY,
                                        "secret": SECRET_KEY}}

    def settings(self) -> dict:
        return {"client": "MountpointS3Client defaults: 8 MiB parts, 10 Gb/s target"}

    def version(self) -> str:
        from importlib.metadata import version
        return f"s3torchconnectorclient {version('s3torchconnectorclient')}"


class FsspecCache(System):
    """fsspec's `simplecache`, `blockcache` or `filecache` chained over s3fs."""

    def __init__(self, protocol: str):
        super().__init__()
        self.protocol = protocol
        self.name = f"fsspec-{protocol}"
        self.label = f"fsspec {protocol}"

    def _target_options(self) -> dict:
        opts = dict(self.ctx.remote.storage_options())
        if self.protocol == "blockcache":
            # blockcache caches in units of the target file's block size; use
            # ours (4 MiB), not s3fs's 50 MiB default.
            opts["default_block_size"] = 4 * MIB
        return opts

    def reader_spec(self, client: int = 0) -> dict:
        return {"type": "fsspec", "protocol": self.protocol, "prefix": self.ctx.remote.bucket,
                "options": {"target_protocol": "s3", "target_options": self._target_options(),
                            "cache_storage": os.path.join(self.dir, "cache")}}

    def cache_dirs(self) -> list[str]:
        return [os.path.join(self.dir, "cache")]

    def settings(self) -> dict:
        return {"block_size": "4 MiB (target default_block_size)"} \
            if self.protocol == "blockcache" else {}

    def version(self) -> str:
        import fsspec
        return f"fsspec {fsspec.__version__}"


class _Daemon:
    """This project's blockcached for one run (our two systems share the code)."""

    def __init__(self, workdir: str):
        from devtools.daemon import DaemonProcess
        self.cache = os.path.join(workdir, "cache")
        self.proc = DaemonProcess(workdir, cache_dirs=[(self.cache, "64G")]).start()
        self.key_file = os.path.join(workdir, "volume.key")
        from blockcache_client.volumekey import generate_key_file
        generate_key_file(self.key_file)

    @property
    def socket(self) -> str:
        return self.proc.socket_path

    def settle(self, timeout: float = 60.0) -> None:
        """Until the daemon's put queue is empty and its block count holds still
        (for 0.15 s: the readers have settled first, so every fill they make
        has already been handed over; this runs after every epoch)."""
        from blockcache_client.daemonclient.client import Client
        c = Client(self.socket)
        try:
            deadline = time.monotonic() + timeout
            last, still = None, 0
            while time.monotonic() < deadline and still < 3:
                s = c.stats()
                blocks = (s.get("entries"), s.get("used_bytes"))
                idle = s.get("queue", {}).get("entries", 0) == 0
                still = still + 1 if idle and blocks == last else 0
                last = blocks
                time.sleep(0.05)
        finally:
            c.close()

    def stats(self) -> dict:
        from blockcache_client.daemonclient.client import Client
        c = Client(self.socket)
        try:
            return c.stats()
        finally:
            c.close()

    def stop(self) -> None:
        self.proc.stop()


class VolumeSystem(System):
    name, label, ours = "volume", "blockcache Volume", True

    def __init__(self):
        super().__init__()
        self.daemon: _Daemon | None = None

    def _start(self) -> None:
        self.daemon = _Daemon(self.dir)

    def _stop(self) -> None:
        if self.daemon:
            self.daemon.stop()
            self.daemon = None

    def reader_spec(self, client: int = 0) -> dict:
        return {"type": "volume", "args": {
            "name": BUCKET_ROOT_VOLUME, "source": f"s3://{self.ctx.remote.bucket}",
            "key_file": self.daemon.key_file, "socket_path": self.daemon.socket,
            "meta_ttl": META_TTL, **self.ctx.remote.storage_options()}}

    def server_pids(self) -> list[int]:
        return [self.daemon.proc.proc.pid]

    def cache_dirs(self) -> list[str]:
        return [self.daemon.cache]

    def settle(self) -> None:
        self.daemon.settle()

    def settings(self) -> dict:
        return {"block_size": "4 MiB", "memory_cache": "64 MiB per process (default)",
                "meta_ttl": f"{META_TTL:.0f} s", "s3_gets": _S3_GETS}

    def version(self) -> str:
        return f"blockcache {_project_version()}"


# how our readers send S3 GETs (blockcache_client/s3direct.py), as the
# environment the suite runs in says
_S3_GETS = ("direct (signed, plain sockets; default)" if s3direct.switched_on()
            else "through s3fs (BLOCKCACHE_S3_DIRECT=0)")


def _project_version() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
        return rev.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


# --- mounts ---

class _MountSystem(System):
    kind = "mount"

    def __init__(self):
        super().__init__()
        self.mounts: list[MountProcess] = []

    def _mountpoint(self, client: int) -> str:
        return os.path.join(self.dir, f"mnt{client}")

    def _mount(self, client: int) -> MountProcess:
        raise NotImplementedError

    def _start(self) -> None:
        self.mounts = [self._mount(0).start()]

    def add_client(self) -> int:
        self.mounts.append(self._mount(len(self.mounts)).start())
        return len(self.mounts) - 1

    def restart_client(self, client: int) -> None:
        """Unmount `client` and mount it again over the same cache dir: its
        kernel page cache and its server's memory are gone, the cache stays."""
        self.mounts[client].stop()
        self.mounts[client] = self._mount(client).start()

    def _stop(self) -> None:
        for m in self.mounts:
            m.stop()
        self.mounts = []

    def reader_spec(self, client: int = 0) -> dict:
        return {"type": "posix", "root": self.mounts[client].mountpoint}

    def server_pids(self) -> list[int]:
        return [m.proc.pid for m in self.mounts if m.proc]


class FuseSystem(_MountSystem):
    name, label, ours = "fuse", "blockcache FUSE (fsclient)", True

    def __init__(self):
        super().__init__()
        self.daemon: _Daemon | None = None

    def unavailable(self) -> str | None:
        return _fuse_unavailable()

    def _start(self) -> None:
        self.daemon = _Daemon(self.dir)
        self.config = os.path.join(self.dir, "volume.toml")
        opts = self.ctx.remote.storage_options()
        with open(self.config, "w") as f:
            f.write("[storage_options]\n")
            f.write(f'key = "{opts["key"]}"\nsecret = "{opts["secret"]}"\n'
                    f'endpoint_url = "{opts["endpoint_url"]}"\n')
            f.write(f'[storage_options.client_kwargs]\nregion_name = "{REGION}"\n')
        super()._start()

    def _mount(self, client: int) -> MountProcess:
        exe = os.path.join(os.path.dirname(sys.executable), "fsclient")
        return MountProcess(
            [exe, "mount", f"s3://{self.ctx.remote.bucket}", self._mountpoint(client),
             "--volume", BUCKET_ROOT_VOLUME, "--key-file", self.daemon.key_file,
             "--socket", self.daemon.socket, "--config", self.config,
             "--meta-ttl", str(META_TTL), "--foreground"],
            self._mountpoint(client), os.path.join(self.dir, f"fsclient{client}.log"))

    def _stop(self) -> None:
        try:
            super()._stop()
        finally:
            if self.daemon:
                self.daemon.stop()
                self.daemon = None

    def reader_spec(self, client: int = 0) -> dict:
        return {**super().reader_spec(client), "xattr_stats": XATTR_STATS}

    def server_pids(self) -> list[int]:
        return super().server_pids() + [self.daemon.proc.proc.pid]

    def cache_dirs(self) -> list[str]:
        return [self.daemon.cache]

    def settle(self) -> None:
        self.daemon.settle()

    def settings(self) -> dict:
        return {"block_size": "4 MiB", "meta_ttl": f"{META_TTL:.0f} s",
                "readahead_blocks": "2 (default)", "s3_gets": _S3_GETS}

    def version(self) -> str:
        return f"blockcache {_project_version()}"


def _fuse_unavailable() -> str | None:
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is not installed (apt-get install fuse3)"
    return None


def _apt_install(package: str, binary: str) -> str | None:
    """Install a Debian package when its binary is missing; None, or why it cannot be had."""
    if shutil.which(binary):
        return None
    if os.geteuid() != 0:
        return f"{binary} is not installed and installing {package} needs root"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    log.info("installing %s (apt-get)", package)
    for argv in (["apt-get", "install", "-y", "-q", "--no-install-recommends", package],
                 ["apt-get", "update", "-q"],
                 ["apt-get", "install", "-y", "-q", "--no-install-recommends", package]):
        r = subprocess.run(argv, capture_output=True, text=True, env=env,
                           stdin=subprocess.DEVNULL)
        if r.returncode == 0 and shutil.which(binary):
            return None
    return f"`apt-get install {package}` failed: {(r.stderr or r.stdout).strip()[-300:]}"


class RcloneSystem(_MountSystem):
    name, label = "rclone", "rclone mount --vfs-cache-mode full"
    # rclone's VFS cache belongs to one process: each mount gets its own.
    shares_cache = False

    def unavailable(self) -> str | None:
        return _fuse_unavailable() or _apt_install("rclone", "rclone")

    def _mount(self, client: int) -> MountProcess:
        r = self.ctx.remote
        return MountProcess(
            ["rclone", "mount", f":s3:{r.bucket}", self._mountpoint(client),
             "--config", os.devnull, "--s3-provider", "Other", "--s3-endpoint", r.endpoint,
             "--s3-access-key-id", ACCESS_KEY, "--s3-secret-access-key", SECRET_KEY,
             "--s3-region", REGION, "--s3-force-path-style=true", "--read-only",
             "--vfs-cache-mode", "full", "--cache-dir",
             os.path.join(self.dir, f"cache{client}"), "--dir-cache-time", "1h"],
            self._mountpoint(client), os.path.join(self.dir, f"rclone{client}.log"),
            # rclone's AWS SDK refuses a custom CA bundle on its transport, even
            # for a plain-http endpoint.
            env={k: v for k, v in os.environ.items() if k != "AWS_CA_BUNDLE"})

    def cache_dirs(self) -> list[str]:
        return [os.path.join(self.dir, f"cache{i}") for i in range(len(self.mounts))]

    def settings(self) -> dict:
        return {"flags": "--vfs-cache-mode full --read-only --dir-cache-time 1h",
                "cache": "one --cache-dir per mount (rclone's VFS cache is per process)"}

    def version(self) -> str:
        r = subprocess.run(["rclone", "version"], capture_output=True, text=True)
        return r.stdout.splitlines()[0] if r.stdout else ""


class S3fsFuseSystem(_MountSystem):
    name, label = "s3fs-fuse", "s3fs-fuse -o use_cache"

    def unavailable(self) -> str | None:
        return _fuse_unavailable() or _apt_install("s3fs", "s3fs")

    def _start(self) -> None:
        self.passwd = os.path.join(self.dir, "passwd")
        fd = os.open(self.passwd, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"{ACCESS_KEY}:{SECRET_KEY}\n")
        super()._start()

    def _mount(self, client: int) -> MountProcess:
        r = self.ctx.remote
        opts = ",".join([f"url={r.endpoint}", "use_path_request_style", f"endpoint={REGION}",
                         f"use_cache={os.path.join(self.dir, 'cache')}",
                         f"passwd_file={self.passwd}", "ro"])
        return MountProcess(["s3fs", r.bucket, self._mountpoint(client), "-f", "-o", opts],
                            self._mountpoint(client), os.path.join(self.dir, f"s3fs{client}.log"))

    def cache_dirs(self) -> list[str]:
        return [os.path.join(self.dir, "cache")]

    def settings(self) -> dict:
        return {"options": "use_cache=DIR,use_path_request_style,ro",
                "cache": "one use_cache dir shared by every mount"}

    def version(self) -> str:
        r = subprocess.run(["s3fs", "--version"], capture_output=True, text=True)
        return r.stdout.splitlines()[0] if r.stdout else ""


class PassthroughSystem(_MountSystem):
    name, label = "passthrough", "passthrough pyfuse3 over local copy"
    shares_cache = False

    def unavailable(self) -> str | None:
        return _fuse_unavailable()

    def _mount(self, client: int) -> MountProcess:
        return MountProcess([sys.executable, "-m", "bench.passthrough", self.ctx.local_root,
                             self._mountpoint(client)],
                            self._mountpoint(client),
                            os.path.join(self.dir, f"passthrough{client}.log"),
                            env=dict(os.environ, PYTHONPATH=PROJECT_ROOT))

    def backing_dirs(self) -> list[str]:
        return [self.ctx.local_root]

    def settings(self) -> dict:
        return {"ttl": "300 s kernel entry/attr timeout (bench.passthrough default)"}

    def version(self) -> str:
        import pyfuse3
        return f"pyfuse3 {pyfuse3.__version__}"


class LocalSystem(System):
    name, label, kind = "local", "local disk (copy)", "local"
    shares_cache = False

    def reader_spec(self, client: int = 0) -> dict:
        return {"type": "posix", "root": self.ctx.local_root}

    def backing_dirs(self) -> list[str]:
        return [self.ctx.local_root]

    def version(self) -> str:
        return f"Python {sys.version.split()[0]}"


def settle(system: System, workers) -> None:
    """Until the fills of `workers` (a `worker.Workers` reading through
    `system`) have left them and `system`'s background work is done."""
    workers.run_all("settle", None)
    system.settle()


def retire(system: System, spent: list[str]) -> None:
    """Stop `system`, leaving its caches in `spent` for the caller to remove
    once every system has run: on ext4 without a journal (the bench
    machine's) a file created within about a minute of many deletions in
    the same block group has the kernel scan past the freed inodes, which
    doubled the daemon's CPU per cache file in the epoch after another
    system's caches were removed (`python -m bench.large_files`)."""
    system.stop(remove=False)
    spent.append(system.dir)


def all_systems() -> list[System]:
    """Every system, in the order they run and appear in tables."""
    return [LocalSystem(), PassthroughSystem(), FuseSystem(), RcloneSystem(), S3fsFuseSystem(),
            VolumeSystem(), FsspecCache("simplecache"), FsspecCache("blockcache"),
            FsspecCache("filecache"), S3fsDirect(), CrtSystem()]


REFERENCE = {"inproc": "volume", "mount": "fuse", "local": "fuse"}
