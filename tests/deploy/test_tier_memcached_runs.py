"""The memcached container of daemonset/memcached.yaml, run for real: its
script with its env, as its uid, with Debian's memcached. Only the address
changes (127.0.0.1 and a free port: no pod network here) and the volume
paths map to scratch dirs, as podsim does for the daemon's pod.

Checks what the manifest promises: -m is the RAM, items up to the default
1 MiB fit and larger ones do not, extstore comes on with EXTSTORE_SIZE, and
with the TLS Secret's files present memcached serves TLS only, and only to
clients with a certificate from its CA.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import ssl
import subprocess
import time
from pathlib import Path

import pytest

from devtools.procs import free_port
from tests.support.deploy.paths import DAEMONSET
from tests.support.deploy.render import named, render
from tests.support.deploy.unit_runner import scratch_root, setpriv

pytestmark = [
    pytest.mark.skipif(shutil.which("memcached") is None,
                       reason="memcached is not installed (make sysdeps installs it)"),
    pytest.mark.skipif(os.geteuid() != 0, reason="runs memcached as the manifest's uid"),
]
WAIT = 15.0


def memcached_container() -> dict:
    pod = named(render(DAEMONSET), "DaemonSet", "blockcache-memcached")["spec"]["template"]
    return next(c for c in pod["spec"]["containers"] if c["name"] == "memcached")


@contextlib.contextmanager
def run_memcached(root: Path, env_overrides: dict[str, str], tls: bool = False):
    """The manifest's memcached on 127.0.0.1:<port>; yields the port."""
    c = memcached_container()
    dirs = {}
    for m in c["volumeMounts"]:
        d = root / m["name"]
        d.mkdir()
        os.chown(d, c["securityContext"]["runAsUser"], c["securityContext"]["runAsGroup"])
        dirs[m["mountPath"]] = d
    if tls:
        make_certs(dirs["/etc/memcached/tls"], c["securityContext"]["runAsUser"])
    port = free_port()
    script = c["command"][2].replace("-p 11211", f"-l 127.0.0.1 -p {port}")
    assert str(port) in script, "the manifest's port flag changed: update this test"
    for path, d in dirs.items():
        script = script.replace(path, str(d))
    env = {"PATH": "/usr/bin:/bin", **{e["name"]: e["value"] for e in c["env"]}, **env_overrides}
    sc = c["securityContext"]
    argv = setpriv(sc["runAsUser"], sc["runAsGroup"], [], ["sh", "-c", script])
    log = root / "memcached.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + WAIT
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            assert proc.poll() is None, f"memcached exited: {log.read_text()}"
            assert time.monotonic() < deadline, f"memcached did not listen: {log.read_text()}"
            time.sleep(0.05)
        yield port
    finally:
        proc.kill()
        proc.wait()


def make_certs(d: Path, uid: int) -> None:
    """A CA, and one certificate from it for server and clients (as a
    cert-manager Certificate with both usages), named as the Secret's keys."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
            "-keyout", "ca.key", "-out", "ca.crt")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=blockcache-memcached",
            "-keyout", "tls.key", "-out", "tls.csr")
    (d / "ext.cnf").write_text("extendedKeyUsage = serverAuth, clientAuth\n"
                               "subjectAltName = DNS:blockcache-memcached.blockcache.svc\n")
    openssl("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-extfile", "ext.cnf", "-out", "tls.crt")
    for name in ("ca.crt", "tls.crt", "tls.key"):
        os.chown(d / name, uid, -1)
        os.chmod(d / name, 0o400)


def talk(sock, request: bytes, end: bytes = b"\r\n") -> bytes:
    sock.sendall(request)
    data = b""
    while not data.endswith(end):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def stats(sock, kind: str = "") -> dict[str, str]:
    text = talk(sock, f"stats {kind}".strip().encode() + b"\r\n", b"END\r\n").decode()
    return {p[1]: p[2] for p in (line.split(" ", 2) for line in text.splitlines())
            if p[0] == "STAT"}


def store(sock, key: str, size: int) -> bytes:
    return talk(sock, f"set {key} 0 0 {size}\r\n".encode() + b"x" * size + b"\r\n")


def test_memory_item_size_and_extstore():
    with scratch_root() as root, \
            run_memcached(root, {"MEMORY_MB": "64", "MAX_CONNECTIONS": "64", "THREADS": "2",
                                 "EXTSTORE_SIZE": "256M"}) as port, \
            socket.create_connection(("127.0.0.1", port), WAIT) as s:
        s.settimeout(WAIT)
        settings = stats(s, "settings")
        assert int(settings["maxbytes"]) == 64 << 20
        assert int(settings["item_size_max"]) == 1 << 20
        assert int(settings["maxconns"]) == 64
        # a 1 MiB slice (key and header included) fits; more does not
        assert store(s, "blk:0", (1 << 20) - 4096) == b"STORED\r\n"
        assert store(s, "blk:1", (1 << 20) + 1).startswith(b"SERVER_ERROR")
        assert any(k.startswith("extstore_") for k in stats(s)), "extstore is off"
        assert (root / "extstore" / "extstore").exists()


def test_without_extstore_size_there_is_no_extstore():
    with scratch_root() as root, \
            run_memcached(root, {"MEMORY_MB": "64", "THREADS": "2"}) as port, \
            socket.create_connection(("127.0.0.1", port), WAIT) as s:
        s.settimeout(WAIT)
        assert not any(k.startswith("extstore_") for k in stats(s))
        assert not list((root / "extstore").iterdir())


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls_when_the_secret_is_there():
    with scratch_root() as root, \
            run_memcached(root, {"MEMORY_MB": "64", "THREADS": "2"}, tls=True) as port:
        certs = root / "tls"
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(certs / "ca.crt"))
        ctx.load_cert_chain(str(certs / "tls.crt"), str(certs / "tls.key"))
        with ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), WAIT),
                             server_hostname="blockcache-memcached.blockcache.svc") as s:
            s.settimeout(WAIT)
            assert talk(s, b"version\r\n").startswith(b"VERSION 1.6")
            assert stats(s, "settings")["ssl_enabled"] == "yes"

        # no client certificate: refused (during the handshake or at the first read)
        anon = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(certs / "ca.crt"))
        with pytest.raises((ssl.SSLError, ConnectionError)):
            with anon.wrap_socket(socket.create_connection(("127.0.0.1", port), WAIT),
                                  server_hostname="blockcache-memcached.blockcache.svc") as s:
                s.settimeout(WAIT)
                if not talk(s, b"version\r\n"):
                    raise ConnectionError("closed without an answer")

        # plain TCP gets no memcached answer
        with socket.create_connection(("127.0.0.1", port), WAIT) as s:
            s.settimeout(WAIT)
            with contextlib.suppress(OSError):
                assert not talk(s, b"version\r\n").startswith(b"VERSION")
