"""Membership is configured once, in the daemon: `[cluster]`, `--memcached`,
DNS names and TLS, handed to readers in `hello`."""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import time

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from blockcache_client.cluster import pool as pool_module
from blockcache_client.cluster.pool import Pool
from blockcache_client.common.counters import Counters
from blockcache_client.contract.cluster import ClusterConfig
from blockcache_client.contract.errors import ConfigError
from blockcached.cli import config_from_args
from devtools.daemon import DaemonProcess
from devtools.memcached import MemcachedProcess

CLUSTER_TOML = """
[[cache_dirs]]
path = "/tmp/bc-test/a"
[cluster]
memcached = ["10.0.0.5:11211", "memcached.blockcache.svc:11211", "[fd00::5]:11211"]
connect_timeout = "20ms"
timeout = "50ms"
retry_after = "5s"
dns_refresh = "30s"
fill_queue_bytes = "64M"
tls_ca_file = "/etc/blockcache/memcached-ca.pem"
tls_cert_file = "/etc/blockcache/client.pem"
tls_key_file = "/etc/blockcache/client.key"
"""


def _config(tmp_path, toml: str, *flags: str):
    path = tmp_path / "blockcached.toml"
    path.write_text(toml)
    return config_from_args(["--config", str(path), *flags])


def test_every_cluster_key_from_toml_and_the_flag_over_it(tmp_path):
    c = _config(tmp_path, CLUSTER_TOML).cluster
    assert c.memcached == ("10.0.0.5:11211", "memcached.blockcache.svc:11211",
                           "[fd00::5]:11211")
    assert (c.connect_timeout, c.timeout, c.retry_after, c.dns_refresh) == (0.02, 0.05, 5, 30)
    assert c.fill_queue_bytes == 64 << 20 and c.tls
    assert ClusterConfig.from_wire(c.to_wire()) == c
    flagged = _config(tmp_path, CLUSTER_TOML, "--memcached", "10.1.1.1:1,10.1.1.2:2").cluster
    assert flagged.memcached == ("10.1.1.1:1", "10.1.1.2:2")
    assert flagged.timeout == 0.05 and flagged.tls_ca_file == c.tls_ca_file  # the file's rest
    assert _config(tmp_path, CLUSTER_TOML, "--memcached", "").cluster is None
    assert config_from_args(["--cache-dir", "/tmp/bc-test/a"]).cluster is None


@pytest.mark.parametrize("table, named", [
    ('memcached = ["10.0.0.5"]', "is not HOST:PORT"),
    ('memcached = ["10.0.0.5:0"]', "is not HOST:PORT"),
    ('memcached = ["fd00::5:11211"]', "IPv6 address in brackets"),
    ('memcached = "10.0.0.5:11211"\ntimeout = "soon"', "timeout: 'soon' is not a duration"),
    ('memcached = ["10.0.0.5:11211"]\ntimeout = "0ms"', "timeout: must be more than zero"),
    ('memcached = ["10.0.0.5:11211"]\nservers = []', "unknown key(s) servers"),
    ('memcached = ["10.0.0.5:11211"]\ntls_cert_file = "/c.pem"', "go together"),
    ('memcached = 5', 'a list of "HOST:PORT" strings'),
])
def test_bad_cluster_settings_are_named(tmp_path, table, named):
    with pytest.raises(ConfigError) as err:
        _config(tmp_path, f"[[cache_dirs]]\npath = \"/tmp/bc-test/a\"\n[cluster]\n{table}\n")
    assert named in str(err.value)


def test_hello_hands_the_pool_to_readers(tmp_path):
    d = DaemonProcess(tmp_path, extra_args=["--memcached", "127.0.0.1:11311,localhost:11312"])
    try:
        d.start()
        got = ClusterConfig.from_wire(d.client().hello("test")["cluster"])
        assert got.memcached == ("127.0.0.1:11311", "localhost:11312")
        assert got.timeout == 0.05 and got.retry_after == 5.0  # the documented defaults
    finally:
        d.stop()
    (tmp_path / "plain").mkdir()
    plain = DaemonProcess(tmp_path / "plain")
    try:
        plain.start()
        assert "cluster" not in plain.client().hello("test")
    finally:
        plain.stop()


def _two_hosts_share(cluster, root, files, key_file, **host_keys):
    """Host 1 fills the tier, host 2 reads everything from it."""
    v1 = cluster.volume(cluster.host(**host_keys), root, key_file)
    for rel, data in files.items():
        assert v1.read(rel, 0, len(data)) == data
    assert v1.wait_fills(10)
    v2 = cluster.volume(cluster.host(**host_keys), root, key_file)
    for rel, data in files.items():
        assert v2.read(rel, 0, len(data)) == data
    return v1.stats(), v2.stats()


def test_a_dns_name_is_resolved_to_its_addresses(cluster, key_file, dataset):
    root, files = dataset
    (m,) = cluster.memcached(1)
    _, s2 = _two_hosts_share(cluster, root, files, key_file, servers=[f"localhost:{m.port}"])
    assert s2["cluster_hits"] == 5 and s2["backend_bytes"] == 0


def test_a_dns_name_is_resolved_again_every_dns_refresh(monkeypatch):
    answers = [socket.gaierror(socket.EAI_NONAME, "not yet")]  # a Service with no pod yet
    real = socket.getaddrinfo

    def resolve(host, port, *args, **kw):
        if host == "memcached.test.svc" and answers:
            raise answers.pop()
        return real("127.0.0.1" if host == "memcached.test.svc" else host, port, *args, **kw)

    monkeypatch.setattr(pool_module.socket, "getaddrinfo", resolve)
    with MemcachedProcess() as m:
        # generous timeouts: this is about DNS, and a loaded machine must not
        # make the live server look dead
        pool = Pool(ClusterConfig(memcached=(f"memcached.test.svc:{m.port}",),
                                  dns_refresh=0.2, connect_timeout=2.0, timeout=2.0))
        try:
            assert pool.owner("k") is None  # no address yet: misses, not errors
            deadline = time.monotonic() + 10
            while pool.owner("k") is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert [s.name for s in pool.live] == [f"127.0.0.1:{m.port}"]
            counters = Counters()
            assert pool.offer_fill("k", [("bc1:k:0", b"v")], counters) and pool.wait_fills(5)
            got = bytearray(1)
            assert pool.get_into({"k": {"bc1:k:0": 1}}, lambda name, size: [memoryview(got)],
                                 counters) == {"bc1:k:0"}
            assert got == b"v"
        finally:
            pool.close()


def _certs(tmp_path):
    """A CA, a server certificate for 127.0.0.1 and localhost, and a client's."""
    def key():
        return ec.generate_private_key(ec.SECP256R1())

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    now = datetime.datetime.now(datetime.UTC)
    ca_key = key()
    ca = (x509.CertificateBuilder().subject_name(name("test ca")).issuer_name(name("test ca"))
          .public_key(ca_key.public_key()).serial_number(1)
          .not_valid_before(now - datetime.timedelta(hours=1))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    out = {"ca": tmp_path / "ca.pem"}
    out["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    for who, serial in (("server", 2), ("client", 3)):
        k = key()
        cert = (x509.CertificateBuilder().subject_name(name(who)).issuer_name(ca.subject)
                .public_key(k.public_key()).serial_number(serial)
                .not_valid_before(now - datetime.timedelta(hours=1))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"),
                     x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
                .sign(ca_key, hashes.SHA256()))
        out[who] = tmp_path / f"{who}.pem"
        out[who].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        out[f"{who}_key"] = tmp_path / f"{who}.key"
        out[f"{who}_key"].write_bytes(k.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
        os.chmod(out[f"{who}_key"], 0o600)
    return out


def test_tls_with_client_certificates(cluster, key_file, dataset, tmp_path):
    root, files = dataset
    c = _certs(tmp_path)
    # -Z: TLS only; ssl_verify_mode=2: a client certificate is required
    (m,) = cluster.memcached(1, extra=(
        "-Z", "-o", f"ssl_chain_cert={c['server']},ssl_key={c['server_key']},"
                    f"ssl_ca_cert={c['ca']},ssl_verify_mode=2"))
    tls = {"tls_ca_file": str(c["ca"]), "tls_cert_file": str(c["client"]),
           "tls_key_file": str(c["client_key"])}
    s1, s2 = _two_hosts_share(cluster, root, files, key_file,
                              servers=[f"localhost:{m.port}"], **tls)
    assert s1["cluster_fills_sent"] == 5 and s1["cluster_errors"] == 0
    assert s2["cluster_hits"] == 5 and s2["backend_bytes"] == 0

    # without a client certificate the server refuses: counted, reads go on
    no_cert = {"tls_ca_file": str(c["ca"])}
    v3 = cluster.volume(cluster.host(servers=[f"localhost:{m.port}"], **no_cert), root,
                        key_file)
    for rel, data in files.items():
        assert v3.read(rel, 0, len(data)) == data
    s3 = v3.stats()
    assert s3["cluster_hits"] == 0 and s3["cluster_errors"] >= 1
