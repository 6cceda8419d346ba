"""The cluster tier's manifests (daemonset/memcached*.yaml) agree with the
daemon's: memcached beside every blockcached, a headless Service the daemon
config names, a NetworkPolicy that admits only blockcache pods, and TLS
that is optional and mounted at one path everywhere.

That the manifest's memcached command really runs (flags, extstore, TLS):
test_tier_memcached_runs.py.
"""

from __future__ import annotations

import posixpath
import re
import shlex
import tomllib

import pytest

from tests.support.deploy.netpol import Peer, admits, selects
from tests.support.deploy.render import (
    configmap_for,
    container,
    daemon_config,
    mount,
    one,
    pod_spec,
    volume,
)

PORT = 11211


@pytest.fixture(scope="module")
def service(daemon_objs):
    return one(daemon_objs, "Service")


@pytest.fixture(scope="module")
def policy(daemon_objs):
    return one(daemon_objs, "NetworkPolicy")


def pod_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"]["labels"]


def env_of(c: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", [])}


def script(c: dict) -> str:
    assert c["command"][:2] == ["sh", "-c"], c["command"]
    return c["command"][2]


def gib(quantity: str) -> float:
    number, unit = re.fullmatch(r"(\d+)(Mi|Gi)", quantity).groups()
    return int(number) / (1024 if unit == "Mi" else 1)


def test_memcached_runs_beside_every_daemon(ds, memcached):
    spec, mspec = pod_spec(ds), pod_spec(memcached)
    assert mspec["nodeSelector"] == spec["nodeSelector"]
    assert mspec["tolerations"] == spec["tolerations"]
    assert mspec["priorityClassName"] == spec["priorityClassName"]
    # two DaemonSets, each selecting only its own pods (a shared label would
    # make each roll the other's pods)
    assert selects(memcached["spec"]["selector"], pod_labels(memcached))
    assert not selects(memcached["spec"]["selector"], pod_labels(ds))
    assert not selects(ds["spec"]["selector"], pod_labels(memcached))
    mc = container(memcached, "memcached")
    assert mc["securityContext"]["runAsNonRoot"] is True
    assert mc["securityContext"]["capabilities"]["drop"] == ["ALL"]


def test_service_is_headless_and_selects_only_memcached(service, memcached, ds, csi_node,
                                                        sidecar_job):
    spec = service["spec"]
    assert spec["clusterIP"] == "None"             # DNS answers every pod IP
    assert spec.get("publishNotReadyAddresses", False) is False
    assert selects({"matchLabels": spec["selector"]}, pod_labels(memcached))
    for other in (ds, csi_node, sidecar_job):
        assert not selects({"matchLabels": spec["selector"]}, pod_labels(other))
    (port,) = spec["ports"]
    ports = {p["name"]: p["containerPort"] for p in container(memcached, "memcached")["ports"]}
    assert port["protocol"] == "TCP" and port["port"] == PORT
    assert ports[port["targetPort"]] == PORT


def test_daemon_config_names_the_service(daemon_objs, ds, service):
    cluster = daemon_config(daemon_objs, ds)["cluster"]
    name, ns = service["metadata"]["name"], service["metadata"]["namespace"]
    # <service>.<namespace>.svc: resolves from any namespace, on any cluster domain
    assert cluster["memcached"] == [f"{name}.{ns}.svc:{service['spec']['ports'][0]['port']}"]
    assert re.fullmatch(r"\d+s", cluster["dns_refresh"])


def test_networkpolicy_admits_only_blockcache_pods(policy, memcached, ds, csi_node, csi_keepers,
                                                  job, sidecar_job, daemon_objs):
    target = pod_labels(memcached)
    ns = one(daemon_objs, "Namespace")["metadata"]["name"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert admits(policy, pod_labels(ds), Peer(namespace=ns), PORT) is None  # daemons untouched
    tier_ns = {"blockcache.io/tier-access": "true"}
    daemon = Peer(pod_labels(ds), ns)
    # the CSI volumes' FUSE servers (the keeper host's) read for the pods
    plugin = Peer(pod_labels(csi_keepers), ns)
    # the sidecar recipe's training pod reads itself
    reader = Peer(pod_labels(sidecar_job), "ml-team", tier_ns)
    assert admits(policy, target, daemon, PORT)
    assert admits(policy, target, plugin, PORT)
    assert admits(policy, target, reader, PORT)
    refused = {
        "a reader in a namespace without tier access": Peer(pod_labels(sidecar_job), "ml-team"),
        # a pod on the driver's volume reads nothing itself
        "a training pod on a CSI volume": Peer(pod_labels(job), "ml-training", tier_ns),
        "a keeper-host-labelled pod of another namespace": Peer(pod_labels(csi_keepers),
                                                                 "ml-team"),
        # the plugin runs no server: it reads nothing
        "the CSI plugin": Peer(pod_labels(csi_node), ns),
        "an unlabelled pod in a tier namespace": Peer({"app": "web"}, "ml-team", tier_ns),
        "an unlabelled pod in the daemon's namespace": Peer({"app": "web"}, ns),
        "a daemon-labelled pod of another namespace": Peer(pod_labels(ds), "ml-team"),
        "memcached itself": Peer(target, ns),
    }
    for what, peer in refused.items():
        assert not admits(policy, target, peer, PORT), what
    assert not admits(policy, target, daemon, 22)
    assert not admits(policy, target, reader, PORT, "UDP")


def test_memcached_ram_items_and_port(memcached):
    c = container(memcached, "memcached")
    words = shlex.split(script(c).replace("\\\n", " "))
    env = env_of(c)
    assert words[words.index("-m") + 1] == "$MEMORY_MB"
    assert words[words.index("-p") + 1] == str(PORT) == str(c["ports"][0]["containerPort"])
    # memcached's default 1 MiB item size: readers slice blocks to fit it
    assert "-I" not in words and "--max-item-size" not in script(c)
    ram_gib = int(env["MEMORY_MB"]) / 1024
    res = c["resources"]
    assert res["requests"] == res["limits"]          # Guaranteed: -m bounds its memory
    assert ram_gib * 1.03 <= gib(res["limits"]["memory"]) <= ram_gib * 1.15
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["tcpSocket"]["port"] == "memcache"


def test_extstore_is_beside_the_daemons_cache_on_its_disk(memcached, ds):
    c = container(memcached, "memcached")
    m = re.search(r"ext_path=(\S+?):\$EXTSTORE_SIZE", script(c))
    assert m and env_of(c)["EXTSTORE_SIZE"] == ""    # off unless sized
    ext_dir = posixpath.dirname(m.group(1))
    ext_mount = next(x for x in c["volumeMounts"] if x["mountPath"] == ext_dir)
    ext_host = volume(memcached, ext_mount["name"])["hostPath"]["path"]
    cache_host = volume(ds, mount(container(ds, "blockcached"), "cache")["name"])["hostPath"]
    assert posixpath.dirname(ext_host) == posixpath.dirname(cache_host["path"])  # same disk
    assert not ext_host.startswith(cache_host["path"] + "/") and ext_host != cache_host["path"]
    chown = next(i for i in pod_spec(memcached)["initContainers"] if i["command"][0] == "chown")
    uid = c["securityContext"]["runAsUser"]
    assert chown["command"][1:] == [f"{uid}:{c['securityContext']['runAsGroup']}", ext_dir]


def tls_files(text: str, mount_path: str) -> set[str]:
    return {posixpath.basename(p) for p in re.findall(rf"{re.escape(mount_path)}/([\w.]+)", text)}


def test_tls_is_optional_and_mounted_at_one_path(memcached, ds, csi_keepers, sidecar_job,
                                                 daemon_objs):
    c = container(memcached, "memcached")
    vol = volume(memcached, "tls")["secret"]
    assert vol["optional"] is True                    # no Secret: plain TCP
    path = mount(c, "tls")["mountPath"]
    assert re.search(rf"if \[ -f {path}/tls.crt \]; then\n\s+set -- \"\$@\" -Z ", script(c))
    assert "ssl_verify_mode=2" in script(c)           # clients need a certificate
    assert tls_files(script(c), path) == {"tls.crt", "tls.key", "ca.crt"}
    # the daemon and the readers: the same Secret, optional, read-only, at one path
    paths = set()
    for workload, name in ((ds, "blockcached"), (csi_keepers, "blockcache-keepers"),
                           (sidecar_job, "fsclient")):
        secret = volume(workload, "memcached-tls")["secret"]
        assert secret["secretName"] == vol["secretName"] and secret["optional"] is True
        m = mount(container(workload, name), "memcached-tls")
        assert m["readOnly"] is True
        paths.add(m["mountPath"])
    (client_path,) = paths
    # blockcached.toml's commented-out tls_* keys name the files of that mount
    text = configmap_for(daemon_objs, ds, "config")["data"]["blockcached.toml"]
    keys = tomllib.loads("\n".join(line.lstrip("# ") for line in text.splitlines()
                                   if re.match(r"#\s*tls_\w+_file\s*=", line)))
    assert set(keys) == {"tls_ca_file", "tls_cert_file", "tls_key_file"}
    assert {posixpath.dirname(p) for p in keys.values()} == {client_path}
    assert {posixpath.basename(p) for p in keys.values()} == {"tls.crt", "tls.key", "ca.crt"}
