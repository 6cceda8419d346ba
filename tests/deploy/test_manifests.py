"""The Kubernetes manifests render, parse into client models, and agree.

The daemon's DaemonSet, its ConfigMap, the CSI plugin's DaemonSet and the
sidecar recipe's training pod are views of one node: the same socket, the
same cache dir at the same path (readers open block files at the paths the
daemon reports), the key from a Secret. The CSI driver's own manifests and
the examples on it: test_csi_manifests.
"""

from __future__ import annotations

import posixpath
import tomllib

import pytest

from tests.support.deploy.daemon_config import load_daemon_config
from tests.support.deploy.k8s_models import round_trip
from tests.support.deploy.paths import DAEMONSET, EXAMPLES
from tests.support.deploy.render import (
    config_path_arg,
    configmap_for,
    container,
    containers,
    daemon_config,
    kubectl,
    mount,
    named,
    one,
    pod_spec,
    render,
    render_without_kubectl,
    volume,
)

GPU_TAINT = "nvidia.com/gpu"
ALL = [DAEMONSET, *EXAMPLES]


def mounts_of_hostpath(obj: dict, host_path: str) -> list[tuple[dict, dict]]:
    """(container, volumeMount) for every mount of the hostPath `host_path`."""
    names = {v["name"] for v in pod_spec(obj)["volumes"]
             if v.get("hostPath", {}).get("path") == host_path}
    return [(c, m) for c in containers(obj) for m in c.get("volumeMounts", [])
            if m["name"] in names]


def env(c: dict, name: str) -> str:
    return next(e["value"] for e in c.get("env", []) if e["name"] == name)


def volume_config(sidecar_objs, sidecar_job) -> dict:
    cm = configmap_for(sidecar_objs, sidecar_job, "volume-config")
    sidecar = container(sidecar_job, "fsclient")
    path = config_path_arg(sidecar)
    assert posixpath.dirname(path) == mount(sidecar, "volume-config")["mountPath"]
    return tomllib.loads(cm["data"][posixpath.basename(path)])


@pytest.mark.parametrize("directory", ALL, ids=lambda d: d.name)
def test_every_object_parses_into_client_models_unchanged(directory):
    objs = render(directory)
    assert objs
    for obj in objs:
        assert round_trip(obj) == obj, (
            f"{obj['kind']} {obj['metadata']['name']}: a field is unknown to the "
            f"Kubernetes API or has the wrong type (the client dropped or changed it)")


def test_daemonset_kinds(daemon_objs):
    kinds = sorted(o["kind"] for o in daemon_objs)
    assert kinds == ["CSIDriver", "ConfigMap", "DaemonSet", "DaemonSet", "DaemonSet", "DaemonSet",
                     "Namespace",
                     "NetworkPolicy", "PriorityClass", "Service", "ServiceAccount",
                     "ServiceAccount"]
    ns = one(daemon_objs, "Namespace")["metadata"]["name"]
    for o in daemon_objs:
        if o["kind"] not in ("Namespace", "PriorityClass", "CSIDriver"):
            assert o["metadata"]["namespace"] == ns


def test_socket_path_agrees_everywhere(daemon_objs, sidecar_objs, ds, csi_node, csi_keepers,
                                       sidecar_job):
    sock = daemon_config(daemon_objs, ds)["socket"]
    daemon, sidecar = container(ds, "blockcached"), container(sidecar_job, "fsclient")
    plugin = container(csi_node, "blockcache-csi")
    keepers = container(csi_keepers, "blockcache-keepers")
    assert env(daemon, "BLOCKCACHE_SOCKET") == sock      # what the probes use
    assert env(sidecar, "BLOCKCACHE_SOCKET") == sock
    assert env(plugin, "BLOCKCACHE_SOCKET") == sock      # its FUSE servers connect there
    assert env(keepers, "BLOCKCACHE_SOCKET") == sock     # where they run
    assert volume_config(sidecar_objs, sidecar_job)["socket"] == sock
    sock_dir = posixpath.dirname(sock)
    host_dirs = set()
    for obj, c in ((ds, daemon), (sidecar_job, sidecar), (csi_node, plugin),
                   (csi_keepers, keepers)):
        m = next(m for m in c["volumeMounts"] if m["mountPath"] == sock_dir)
        host_dirs.add(volume(obj, m["name"])["hostPath"]["path"])
    assert host_dirs == {sock_dir}, "daemon and pods must share the host's socket dir"


def test_cache_dirs_agree_and_pods_mount_them_read_only(daemon_objs, ds, csi_keepers,
                                                        sidecar_job):
    daemon = container(ds, "blockcached")
    cache_dirs = [d["path"] for d in daemon_config(daemon_objs, ds)["cache_dirs"]]
    assert cache_dirs
    for path in cache_dirs:
        m = next(m for m in daemon["volumeMounts"] if m["mountPath"] == path)
        assert not m.get("readOnly"), "the daemon writes its cache dir"
        host = volume(ds, m["name"])["hostPath"]["path"]
        for reader, name in ((sidecar_job, "fsclient"), (csi_keepers, "blockcache-keepers")):
            pod_mounts = mounts_of_hostpath(reader, host)
            assert pod_mounts, f"{name}'s pod does not mount the cache dir {host}"
            for c, pm in pod_mounts:
                # Same container path as the daemon's: readers open block
                # files at the paths the daemon reports in `hello`.
                assert pm["mountPath"] == path, c["name"]
                assert pm.get("readOnly") is True, f"{c['name']} mounts the cache dir writable"
            assert name in {c["name"] for c, _ in pod_mounts}


def test_volume_key_comes_from_a_secret_by_reference(sidecar_objs, sidecar_job):
    for directory in ALL:
        assert not [o for o in render(directory) if o["kind"] == "Secret"], \
            f"a Secret with key material is in {directory.name}"
    key_vol = volume(sidecar_job, "volume-key")
    assert key_vol["secret"]["secretName"]
    assert key_vol["secret"]["defaultMode"] == 0o400
    m = mount(container(sidecar_job, "fsclient"), "volume-key")
    assert m.get("readOnly") is True
    paths = {posixpath.join(m["mountPath"], i["path"]) for i in key_vol["secret"]["items"]}
    assert volume_config(sidecar_objs, sidecar_job)["key_file"] in paths


def test_daemon_has_requests_and_no_memory_limit(ds):
    res = container(ds, "blockcached")["resources"]
    assert {"cpu", "memory"} <= set(res["requests"])
    assert "memory" not in res.get("limits", {})


def test_pods_land_on_gpu_nodes(ds, csi_node, csi_keepers, job, static_job, sidecar_job):
    for obj in (ds, csi_node, csi_keepers, job, static_job, sidecar_job):
        tolerations = pod_spec(obj)["tolerations"]
        assert any(t["key"] == GPU_TAINT and t["operator"] == "Exists" for t in tolerations)
        # where the daemon runs, and (for CSI volumes) the plugin
        assert pod_spec(obj)["nodeSelector"] == pod_spec(ds)["nodeSelector"]


def test_daemonset_rollout_probes_priority(daemon_objs, ds):
    strategy = ds["spec"]["updateStrategy"]
    assert strategy["type"] == "RollingUpdate"
    assert strategy["rollingUpdate"]["maxUnavailable"] == 1
    spec = pod_spec(ds)
    assert spec["priorityClassName"] == one(daemon_objs, "PriorityClass")["metadata"]["name"]
    assert named(daemon_objs, "ServiceAccount", spec["serviceAccountName"])
    assert spec["terminationGracePeriodSeconds"] >= 10
    daemon = container(ds, "blockcached")
    for probe in ("readinessProbe", "livenessProbe"):
        assert daemon[probe]["exec"]["command"] == ["blockcache-cli", "ping"]
    sc = daemon["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["capabilities"]["drop"] == ["ALL"]


def test_sidecar_recipe_fuse_sidecar_and_propagation(sidecar_objs, sidecar_job):
    job = sidecar_job
    spec = pod_spec(job)
    sidecar, trainer = container(job, "fsclient"), container(job, "trainer")
    assert sidecar in spec["initContainers"] and sidecar["restartPolicy"] == "Always"
    assert sidecar["securityContext"]["privileged"] is True   # the API's rule for Bidirectional
    shared = mount(sidecar, "datasets")
    assert shared["mountPropagation"] == "Bidirectional"
    t = mount(trainer, "datasets")
    assert t["mountPropagation"] == "HostToContainer" and t["mountPath"] == shared["mountPath"]
    mountpoint = volume_config(sidecar_objs, job)["mountpoint"]
    assert mountpoint.startswith(shared["mountPath"] + "/")
    for probe in ("startupProbe", "livenessProbe"):
        check = " ".join(sidecar[probe]["exec"]["command"])
        # statfs reaches fsclient even where a stat is answered from cache,
        # and only a FUSE mount answers "fuseblk" (not the bare directory)
        assert f"mountpoint -q {mountpoint}" in check
        assert f'test "$(stat -f -c %T {mountpoint})" = fuseblk' in check
    assert volume(job, "dev-fuse")["hostPath"]["path"] == "/dev/fuse"
    assert mount(sidecar, "dev-fuse")["mountPath"] == "/dev/fuse"
    assert not trainer.get("securityContext", {}).get("privileged")
    assert trainer["securityContext"]["runAsNonRoot"] is True
    # The trainer runs as another uid than the root-run fsclient.
    assert volume_config(sidecar_objs, job)["allow_other"] is True


@pytest.mark.parametrize("directory", ALL, ids=lambda d: d.name)
def test_fallback_renderer_matches_kubectl(directory):
    """Where kubectl is missing the tests render with PyYAML; it must agree."""
    if not kubectl():
        pytest.skip("kubectl not installed: nothing to compare the PyYAML renderer with")
    hashed = render(directory)
    plain = render_without_kubectl(directory)
    renames = {}
    for o in hashed:
        if o["kind"] == "ConfigMap":
            name = o["metadata"]["name"]
            renames[name] = name.rsplit("-", 1)[0]
            o["metadata"]["name"] = renames[name]
    for o in hashed:
        for v in (pod_spec(o) or {}).get("volumes", []):
            if "configMap" in v:
                v["configMap"]["name"] = renames[v["configMap"]["name"]]
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    assert sorted(hashed, key=key) == sorted(plain, key=key)


def test_rendered_configs_load_in_the_real_loaders(daemon_objs, sidecar_objs, ds, sidecar_job,
                                                   tmp_path):
    """The ConfigMaps as applied: only keys the daemon and fsclient know."""
    vconfig = pytest.importorskip("fsclient.config", reason="fsclient is not installed")
    daemon_toml = configmap_for(daemon_objs, ds, "config")["data"]["blockcached.toml"]
    (tmp_path / "d.toml").write_text(daemon_toml)
    cfg = load_daemon_config(str(tmp_path / "d.toml"))
    assert [d.path for d in cfg.cache_dirs] == [
        d["path"] for d in tomllib.loads(daemon_toml)["cache_dirs"]]
    volume_toml = configmap_for(sidecar_objs, sidecar_job,
                                "volume-config")["data"]["volume.toml"]
    (tmp_path / "v.toml").write_text(volume_toml)
    vcfg = vconfig.build_config(vconfig.load_toml(str(tmp_path / "v.toml")))
    assert vcfg.socket == cfg.socket


@pytest.mark.parametrize("directory", ALL, ids=lambda d: d.name)
def test_every_image_has_a_pinned_tag(directory):
    """An untagged image means :latest, which changes under a running fleet."""
    for obj in render(directory):
        for c in containers(obj):
            name, _, tag = c["image"].rpartition(":")
            assert name and tag and tag != "latest" and "/" not in tag, c["image"]


# Enumerated fields (Kubernetes API reference); the client models take any
# string there, so a misspelt value would only fail at `kubectl apply`.
ENUMS = {
    ("hostPath", "type"): {"", "DirectoryOrCreate", "Directory", "FileOrCreate", "File",
                           "Socket", "CharDevice", "BlockDevice"},
    ("volumeMounts", "mountPropagation"): {"None", "HostToContainer", "Bidirectional"},
    ("tolerations", "operator"): {"Exists", "Equal"},
    ("tolerations", "effect"): {"NoSchedule", "PreferNoSchedule", "NoExecute"},
    ("seccompProfile", "type"): {"RuntimeDefault", "Localhost", "Unconfined"},
    ("emptyDir", "medium"): {"", "Memory"},
    ("updateStrategy", "type"): {"RollingUpdate", "OnDelete"},
    ("initContainers", "restartPolicy"): {"Always"},
    ("spec", "restartPolicy"): {"Always", "OnFailure", "Never"},
    ("", "preemptionPolicy"): {"PreemptLowerPriority", "Never"},
    ("containers", "imagePullPolicy"): {"Always", "IfNotPresent", "Never"},
    ("initContainers", "imagePullPolicy"): {"Always", "IfNotPresent", "Never"},
}


def enum_fields(node, parent: str = ""):
    """(parent key, key, value) for every scalar in a manifest object."""
    if isinstance(node, dict):
        for k, v in node.items():
            if isinstance(v, (dict, list)):
                yield from enum_fields(v, k)
            else:
                yield parent, k, v
    elif isinstance(node, list):
        for item in node:
            yield from enum_fields(item, parent)


@pytest.mark.parametrize("directory", ALL, ids=lambda d: d.name)
def test_enumerated_fields_hold_valid_values(directory):
    checked = 0
    for obj in render(directory):
        for parent, key, value in enum_fields(obj):
            allowed = ENUMS.get((parent, key))
            if allowed is not None:
                assert value in allowed, f"{obj['kind']}: {parent}.{key} = {value!r}"
                checked += 1
    assert checked


def test_metrics_ports_agree(daemon_objs, sidecar_objs, ds, sidecar_job):
    """With metrics_addr set, its port is the container's `metrics` port and the
    scrape annotation's; without it, nothing claims a metrics port."""
    for obj, c, cfg in ((ds, container(ds, "blockcached"), daemon_config(daemon_objs, ds)),
                        (sidecar_job, container(sidecar_job, "fsclient"),
                         volume_config(sidecar_objs, sidecar_job))):
        ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
        annotations = obj["spec"]["template"]["metadata"].get("annotations", {})
        if "metrics_addr" not in cfg:
            assert "metrics" not in ports and "prometheus.io/port" not in annotations
            continue
        port = int(cfg["metrics_addr"].rpartition(":")[2])
        assert ports["metrics"] == port
        assert annotations["prometheus.io/port"] == str(port)
