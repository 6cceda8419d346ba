"""The CSI driver's manifests: the CSIDriver object, the node plugin's
DaemonSet (the plugin registers itself with the kubelet), the keeper host's
DaemonSet (it holds the mounts), and the examples that mount volumes
through it.

What the kubelet needs to find and call the plugin (the registration path is
the host path of the plugin's socket), what the plugin needs to mount FUSE
into pods (privilege, /dev/fuse, Bidirectional propagation on the kubelet's
pods dir, and on no other container), and what the interface agreed with the
plugin says (the command, its env, the volume attributes and the Secret's
field). Pod Security levels: test_pod_security.
"""

from __future__ import annotations

import posixpath
import re

import pytest

from tests.support.deploy.render import (
    container,
    containers,
    daemon_config,
    mount,
    named,
    one,
    pod_spec,
    volume,
)

DRIVER = "csi.blockcache.io"
KUBELET_DIR = "/var/lib/kubelet"
ATTRIBUTES = {"source", "volume", "blockSize", "metaTTL", "dirTTL", "readaheadBlocks"}
REQUIRED_ATTRIBUTES = {"source", "volume"}


def args(c: dict) -> dict[str, str]:
    """--flag=value and --flag value pairs of a container's command and args."""
    words = c.get("command", []) + c.get("args", [])
    out = {}
    for i, w in enumerate(words):
        if w.startswith("--"):
            name, eq, value = w.partition("=")
            nxt = words[i + 1] if i + 1 < len(words) else ""
            out[name] = value if eq else ("" if nxt.startswith("--") else nxt)
    return out


def expand(c: dict, text: str) -> str:
    """The kubelet's $(VAR) expansion from the container's own env values."""
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    for name in re.findall(r"\$\((\w+)\)", text):
        assert name in env, f"{c['name']}: $({name}) has no env entry"
        if env[name] is not None:
            text = text.replace(f"$({name})", env[name])
    return text


def host_path_of(obj: dict, c: dict, path: str) -> str:
    """The host path behind a container path, through its hostPath mounts."""
    for m in sorted(c["volumeMounts"], key=lambda m: -len(m["mountPath"])):
        if path == m["mountPath"] or path.startswith(m["mountPath"] + "/"):
            host = volume(obj, m["name"])["hostPath"]["path"]
            return posixpath.normpath(posixpath.join(host, posixpath.relpath(path, m["mountPath"])))
    raise AssertionError(f"{c['name']}: {path} is on no hostPath mount")


def socket_path(endpoint: str) -> str:
    assert endpoint.startswith("unix:///"), endpoint
    return endpoint[len("unix://"):]


@pytest.fixture(scope="module")
def driver(daemon_objs):
    return one(daemon_objs, "CSIDriver")


@pytest.fixture(scope="module")
def plugin(csi_node):
    return container(csi_node, "blockcache-csi")


@pytest.fixture(scope="module")
def keeper_host(csi_keepers):
    return container(csi_keepers, "blockcache-keepers")


def test_csidriver_object(driver):
    assert driver["metadata"]["name"] == DRIVER
    spec = driver["spec"]
    assert spec["attachRequired"] is False          # no controller: nothing to attach
    assert spec["podInfoOnMount"] is True
    assert sorted(spec["volumeLifecycleModes"]) == ["Ephemeral", "Persistent"]
    assert spec["fsGroupPolicy"] == "None"          # never a recursive chown of a dataset


def test_plugin_runs_the_agreed_command(csi_node, plugin, csi_keepers):
    assert plugin["command"][0] == "blockcache-csi"
    flags = args(plugin)
    assert expand(plugin, flags["--endpoint"]) == "unix:///csi/csi.sock"
    node_id = next(e for e in plugin["env"] if e["name"] == "NODE_ID")
    assert node_id["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert flags["--node-id"] == "$(NODE_ID)"
    assert int(flags["--server-uid"]) != 0 and int(flags["--server-gid"]) != 0
    # the memcached TLS files (0440) are readable by the servers' group,
    # in the keeper host's pod, where the servers run
    assert pod_spec(csi_keepers)["securityContext"]["fsGroup"] == int(flags["--server-gid"])
    # the plugin's state is on the host, so a restarted plugin finds its mounts
    state = flags["--state-dir"]
    assert host_path_of(csi_node, plugin, state) == "/var/lib/blockcache-csi"


def test_fuse_servers_may_connect_to_the_daemon_but_are_no_admins(daemon_objs, ds, plugin):
    """By the socket's mode and group in blockcached.toml: a server that
    cannot connect would read everything from remote storage, uncached."""
    cfg = daemon_config(daemon_objs, ds)
    daemon = container(ds, "blockcached")["securityContext"]
    mode = int(cfg["socket_mode"], 8)
    group = int(cfg.get("socket_group") or daemon["runAsGroup"])   # "": the daemon's gid
    flags = args(plugin)
    uid, gid = int(flags["--server-uid"]), int(flags["--server-gid"])
    assert (uid == daemon["runAsUser"] and mode & 0o600 == 0o600
            or gid == group and mode & 0o060 == 0o060
            or mode & 0o006 == 0o006), f"uid {uid} gid {gid} cannot use a {mode:o} socket"
    assert uid not in cfg.get("admin_uids", [0]) and gid not in cfg.get("admin_gids", [])


def test_plugin_registers_its_own_socket(csi_node, plugin):
    """The kubelet calls the plugin at the host path the plugin's registration
    gives it, which must be where the plugin's socket is on the host; the
    registration socket is in the kubelet's plugin registry."""
    flags = args(plugin)
    plugin_sock = socket_path(expand(plugin, flags["--endpoint"]))
    host_sock = host_path_of(csi_node, plugin, plugin_sock)
    assert host_sock == f"{KUBELET_DIR}/plugins/{DRIVER}/csi.sock"
    assert flags["--kubelet-registration-path"] == host_sock
    assert host_path_of(csi_node, plugin, flags["--registration-dir"]) == \
        f"{KUBELET_DIR}/plugins_registry"
    assert mount(plugin, "registration-dir")["mountPath"] == "/registration"
    # no registrar sidecar: its fixed socket name is what an upgrade's old pod
    # removed under the new pod (blockcache_csi/DESIGN.md)
    assert [c["name"] for c in containers(csi_node)] == ["blockcache-csi"]


def test_propagation_bidirectional_on_the_plugin_and_keeper_host_only(
        daemon_objs, csi_node, plugin, csi_keepers, keeper_host):
    """The keepers mount at the pods' targets; the plugin unmounts there."""
    for obj, c in ((csi_node, plugin), (csi_keepers, keeper_host)):
        pods = mount(c, "kubelet-pods")
        assert pods["mountPropagation"] == "Bidirectional"
        assert pods["mountPath"] == volume(obj, "kubelet-pods")["hostPath"]["path"] == \
            f"{KUBELET_DIR}/pods"
        # the API server accepts Bidirectional only in privileged containers
        assert c["securityContext"]["privileged"] is True
    bidirectional = [(o["metadata"]["name"], c["name"]) for o in daemon_objs
                     for c in containers(o) for m in c.get("volumeMounts", [])
                     if m.get("mountPropagation") == "Bidirectional"]
    assert sorted(bidirectional) == [("blockcache-csi-keepers", "blockcache-keepers"),
                                     ("blockcache-csi-node", "blockcache-csi")]


def test_the_keeper_host_mounts_fuse_as_root_and_the_plugin_asks_it(
        csi_node, plugin, csi_keepers, keeper_host):
    assert volume(csi_keepers, "dev-fuse")["hostPath"] == \
        {"path": "/dev/fuse", "type": "CharDevice"}
    assert mount(keeper_host, "dev-fuse")["mountPath"] == "/dev/fuse"
    assert "dev-fuse" not in {m["name"] for m in plugin["volumeMounts"]}  # it mounts nothing
    # the image runs as the daemon's uid; mounting (and unmounting) takes root
    assert plugin["securityContext"]["runAsUser"] == keeper_host["securityContext"][
        "runAsUser"] == 0
    assert keeper_host["command"][:2] == ["blockcache-csi", "keepers"]
    # one socket on the host, which the plugin asks and the keeper host serves
    asked, served = args(plugin)["--keepers-socket"], args(keeper_host)["--socket"]
    assert host_path_of(csi_node, plugin, asked) == \
        host_path_of(csi_keepers, keeper_host, served)
    # the keys the servers read are where the plugin writes them
    state = args(plugin)["--state-dir"]
    assert host_path_of(csi_keepers, keeper_host, state) == host_path_of(csi_node, plugin, state)
    # restarting the keeper host's container would end every mount on the node
    assert "livenessProbe" not in keeper_host
    # the plugin holds no mount: a limit costs none
    assert plugin["resources"]["limits"]["memory"]


def test_the_keeper_host_is_guaranteed_and_upgrades_beside_the_old_one(csi_keepers,
                                                                       keeper_host):
    """Guaranteed QoS (requests = limits): evicted and OOM-killed last. An
    upgrade starts the new host beside the old one, ready only once it has
    taken every keeper over, on the host's network (the keepers' abstract
    control sockets)."""
    res = keeper_host["resources"]
    assert {"cpu", "memory"} <= set(res["requests"])
    assert res["requests"] == res["limits"]
    strategy = csi_keepers["spec"]["updateStrategy"]
    assert strategy["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    spec = pod_spec(csi_keepers)
    assert spec["hostNetwork"] is True
    ready_file = args(keeper_host)["--ready-file"]
    assert keeper_host["readinessProbe"]["exec"]["command"] == ["test", "-e", ready_file]
    assert int(args(keeper_host)["--server-memory"].rstrip("G")) >= 1


def test_an_upgrade_starts_the_new_plugin_before_the_old_one_goes(csi_node):
    """A new plugin pod finds the mounts kept (taking over any kept by a
    keeper not the keeper host's), so it runs beside the old one (surge,
    never 0 available) and reaches their abstract control sockets (the
    host's network namespace)."""
    strategy = csi_node["spec"]["updateStrategy"]
    assert strategy["type"] == "RollingUpdate"
    assert strategy["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    spec = csi_node["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True
    assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    # the old pod goes once the new one is ready: ready only after the takeover
    plugin = next(c for c in spec["containers"] if c["name"] == "blockcache-csi")
    ready_file = plugin["command"][plugin["command"].index("--ready-file") + 1]
    assert plugin["readinessProbe"]["exec"]["command"] == ["test", "-e", ready_file]
    # on the host's network a port would keep the surge pod from starting
    ports = [p for c in spec["containers"] for p in c.get("ports", [])]
    assert ports == [] and not any("--http-endpoint" in " ".join(c.get("args", []))
                                   for c in spec["containers"])


def test_no_api_access_and_no_rbac(daemon_objs, csi_node):
    """The plugin never calls the API server: no roles."""
    assert not [o for o in daemon_objs if o["kind"] in
                ("Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding")]
    spec = pod_spec(csi_node)
    account = named(daemon_objs, "ServiceAccount", spec["serviceAccountName"])
    assert account["automountServiceAccountToken"] is False
    assert spec["automountServiceAccountToken"] is False
    assert spec["priorityClassName"] == one(daemon_objs, "PriorityClass")["metadata"]["name"]


def csi_sources(objs: list[dict]) -> list[dict]:
    """Every CSI volume source: inline in pod specs, and in PersistentVolumes."""
    found = [v["csi"] for o in objs for v in (pod_spec(o) or {}).get("volumes", []) if "csi" in v]
    return found + [o["spec"]["csi"] for o in objs if o["kind"] == "PersistentVolume"]


@pytest.mark.parametrize("which", ["example_objs", "static_objs"])
def test_examples_volumes_name_the_driver_and_agreed_attributes(which, request):
    objs = request.getfixturevalue(which)
    (source,) = csi_sources(objs)
    assert source["driver"] == DRIVER
    assert source["readOnly"] is True
    attrs = source["volumeAttributes"]
    assert REQUIRED_ATTRIBUTES <= set(attrs) <= ATTRIBUTES
    assert all(isinstance(v, str) for v in attrs.values()), "volume context values are strings"
    assert source["nodePublishSecretRef"]["name"]


@pytest.mark.parametrize("which", ["example_objs", "static_objs"])
def test_example_attributes_are_valid_mount_settings(which, request, tmp_path):
    """The attribute values, as fsclient's own loader takes its settings."""
    config = pytest.importorskip("fsclient.config", reason="fsclient is not installed")
    (source,) = csi_sources(request.getfixturevalue(which))
    attrs = source["volumeAttributes"]
    cfg = config.build_config(
        volume=attrs["volume"], source=attrs["source"], mountpoint=str(tmp_path),
        key_file=str(tmp_path / "key"), block_size=attrs.get("blockSize"),
        meta_ttl=attrs.get("metaTTL"), readahead_blocks=attrs.get("readaheadBlocks"),
        dir_ttl=[config.parse_dir_ttl_flag(p) for p in attrs.get("dirTTL", "").split(",") if p])
    assert cfg.volume == attrs["volume"]
    assert cfg.block_size == 4 << 20 and cfg.readahead_blocks == 2
    assert cfg.ttl.ttl_for("code/train.py") == 0 and cfg.ttl.ttl_for("train/0.jpg") == 60


def test_inline_volume_is_what_the_trainer_mounts(job, driver):
    spec = pod_spec(job)
    (vol,) = [v for v in spec["volumes"] if "csi" in v]
    assert "Ephemeral" in driver["spec"]["volumeLifecycleModes"]
    m = mount(container(job, "trainer"), vol["name"])
    assert m["readOnly"] is True and "mountPropagation" not in m
    # the pod runs nothing of blockcache's: only the trainer
    assert [c["name"] for c in containers(job)] == ["trainer"]


def test_static_volume_is_bound_to_its_claim(static_objs, static_job, driver):
    pv = one(static_objs, "PersistentVolume")
    pvc = one(static_objs, "PersistentVolumeClaim")
    assert "Persistent" in driver["spec"]["volumeLifecycleModes"]
    assert pvc["spec"]["volumeName"] == pv["metadata"]["name"]
    assert pv["spec"]["claimRef"] == {"namespace": pvc["metadata"]["namespace"],
                                      "name": pvc["metadata"]["name"]}
    # no storage class on either side: no provisioner, bound by name only
    assert pv["spec"]["storageClassName"] == pvc["spec"]["storageClassName"] == ""
    assert pv["spec"]["accessModes"] == pvc["spec"]["accessModes"] == ["ReadOnlyMany"]
    assert pv["spec"]["persistentVolumeReclaimPolicy"] == "Retain"
    # the key Secret is in the claim's namespace, where the pods are
    assert pv["spec"]["csi"]["nodePublishSecretRef"]["namespace"] == pvc["metadata"]["namespace"]
    (claim,) = [v for v in pod_spec(static_job)["volumes"] if "persistentVolumeClaim" in v]
    assert claim["persistentVolumeClaim"] == {"claimName": pvc["metadata"]["name"],
                                              "readOnly": True}
    assert static_job["metadata"]["namespace"] == pvc["metadata"]["namespace"]


def test_examples_share_the_key_secret_and_namespace(example_objs, static_objs, job):
    ns = one(example_objs, "Namespace")["metadata"]["name"]
    assert job["metadata"]["namespace"] == ns
    (inline,), (static,) = csi_sources(example_objs), csi_sources(static_objs)
    assert inline["nodePublishSecretRef"]["name"] == static["nodePublishSecretRef"]["name"]
    assert static["nodePublishSecretRef"]["namespace"] == ns


MOUNTS_PER_NODE = 8  # what csi-keepers.yaml's memory is sized for (its comment)
HOST_BYTES = 128 << 20  # the keeper host itself


def test_keeper_memory_holds_the_bound_of_its_mounts(keeper_host):
    """Each keeper's cgroup limit (--server-memory) holds a mount at fsclient's
    memory bound with the settings the plugin gives its servers, and the
    host's request and limit hold 8 such mounts and the host (a limit below
    them risks OOM kills of servers)."""
    from blockcache_client.contract.units import parse_size
    from fsclient.config import build_config
    from fsclient.memory import mount_bound

    cfg = build_config({}, volume="v", source="/data", mountpoint="/mnt", key_file="k")
    per_keeper = parse_size(args(keeper_host)["--server-memory"], "--server-memory")
    assert mount_bound(cfg) <= per_keeper  # (the server, its keeper and page store)
    need = MOUNTS_PER_NODE * per_keeper + HOST_BYTES
    res = keeper_host["resources"]
    assert res["requests"]["memory"] == res["limits"]["memory"]
    number, unit = re.fullmatch(r"(\d+)(Mi|Gi)", res["limits"]["memory"]).groups()
    limit = int(number) << (20 if unit == "Mi" else 30)
    assert need <= limit < need + (16 << 20), (need, limit)
