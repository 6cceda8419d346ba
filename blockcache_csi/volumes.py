"""What a NodePublishVolume asks for, checked: the volume_context, the pod's
namespace (the kubelet's), the source against the operator's policy, the
volume key and S3 credentials from the Secret, the capability; and the
`fsclient mount` they make, with the environment it runs in.

Every refusal is INVALID_ARGUMENT naming the field and the fix (a source the
policy forbids: PERMISSION_DENIED, `sources.py`); no message ever holds a
secret's value.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from blockcache_client.common import convert
from blockcache_client.contract.blockfile import KEY_SIZE
from blockcache_client.contract.blockkey import check_volume_name
from blockcache_client.contract.errors import BlockcacheError
from fsclient.config import MountConfig, build_config, parse_dir_ttl_flag
from fsclient.keeper import Credentials

from .environment import SECRET_KEYS, ServerEnvironment, SourceCredentials, parse_credentials
from .errors import invalid, required
from .proto import csi_pb2
from .sources import SourcePolicy, canonical

log = logging.getLogger(__name__)

# volume_context keys (the CSI spelling) -> how each is checked
REQUIRED_KEYS = ("source", "volume")
OPTIONAL_KEYS = ("blockSize", "metaTTL", "dirTTL", "readaheadBlocks", "writable")
# the access modes a writable volume is served read-write for: one node writes
WRITER_MODES = frozenset({"SINGLE_NODE_WRITER", "SINGLE_NODE_SINGLE_WRITER",
                          "SINGLE_NODE_MULTI_WRITER"})
# keys the kubelet adds (podInfoOnMount, ephemeral): accepted, not used
KUBELET_PREFIX = "csi.storage.k8s.io/"
# set by the kubelet (podInfoOnMount), over any value the pod wrote: uids and
# sources are chosen by them
NAMESPACE_KEY = KUBELET_PREFIX + "pod.namespace"
EPHEMERAL_KEY = KUBELET_PREFIX + "ephemeral"
# mount flags a PV's mountOptions may carry: mount(2) flags fsclient passes on
MOUNT_FLAGS = frozenset({"ro", "noexec", "noatime", "nodiratime", "relatime", "nosuid",
                         "nodev"})
# SELinux labels a mount may carry: the kubelet adds `context="LABEL"` on an
# SELinux node (pkg/volume/util AddSELinuxMountOption, quoted for the commas
# of an MCS level); passed to the mount where the node has SELinux
SELINUX_OPTIONS = ("context", "fscontext", "defcontext", "rootcontext")
# user:role:type[:level], level sN[-sN][:cN[.cN][,cN...]]
_SELINUX_LABEL = re.compile(r"[A-Za-z0-9_.]+:[A-Za-z0-9_.]+:[A-Za-z0-9_.]+"
                            r"(:s[0-9]+(-s[0-9]+)?(:c[0-9]+([.,]c[0-9]+)*)?)?")
FILESYSTEMS = "/proc/filesystems"  # lists selinuxfs only when SELinux is enabled
FS_TYPES = frozenset({"", "fuse", "fuse.blockcache", "blockcache"})
KEY_FIELD = 'secrets["key"]'
KEY_FIX = ("the Secret named by nodePublishSecretRef must hold, under \"key\", the 64 hex "
           "digits of a volume key file: make one with `fsclient keygen FILE`, then "
           "`kubectl create secret generic NAME --from-file=key=FILE`")
_HEX_KEY = re.compile(f"[0-9a-fA-F]{{{2 * KEY_SIZE}}}")
# a random key has ~30 distinct byte values; fewer than this is a pattern
_MIN_DISTINCT = 16
Mode = csi_pb2.VolumeCapability.AccessMode.Mode


@dataclass(frozen=True)
class Publication:
    """One volume at one target path, as asked and checked."""

    volume_id: str
    target: str
    context: tuple[tuple[str, str], ...]  # the keys used, sorted
    mount_flags: tuple[str, ...]
    readonly: bool  # as asked
    namespace: str = ""  # the pod's, as the kubelet says
    ephemeral: bool = True  # an inline volume (False: a PersistentVolume, the kubelet says)
    # served read-write: the context says writable "true", the access mode is
    # a single-node writer's, and neither readonly nor an `ro` flag is asked
    writable: bool = False

    def get(self, key: str) -> str | None:
        return dict(self.context).get(key)

    def same_volume(self, other: Publication) -> bool:
        """Whether `other` asks for what this one serves (a repeated publish)."""
        return (self.volume_id, self.context, self.mount_flags, self.namespace,
                self.writable) == (other.volume_id, other.context, other.mount_flags,
                                   other.namespace, other.writable)

    def to_record(self) -> dict[str, Any]:
        return {"volume_id": self.volume_id, "target": self.target,
                "context": dict(self.context), "mount_flags": list(self.mount_flags),
                "readonly": self.readonly, "namespace": self.namespace,
                "ephemeral": self.ephemeral, "writable": self.writable}

    @classmethod
    def from_record(cls, data: dict[str, Any]) -> Publication:
        return cls(str(data["volume_id"]), str(data["target"]),
                   tuple(sorted((str(k), str(v)) for k, v in data["context"].items())),
                   tuple(str(f) for f in data["mount_flags"]), bool(data["readonly"]),
                   str(data.get("namespace", "")), bool(data.get("ephemeral", True)),
                   bool(data.get("writable", False)))


def parse_publish(request: Any, sources: SourcePolicy
                  ) -> tuple[Publication, bytes, SourceCredentials]:
    """The request checked: (its Publication, with the source as the policy
    reads it; the volume key's 32 bytes; the volume's S3 credentials)."""
    required(request, "volume_id", "target_path")
    volume_id, target = request.volume_id, request.target_path
    if not target.startswith("/"):
        raise invalid(f"target_path {target!r} must be an absolute path")
    if request.staging_target_path:
        raise invalid("staging_target_path is set, but this plugin does not stage volumes "
                      "(it has no STAGE_UNSTAGE_VOLUME capability)")
    if not request.HasField("volume_capability"):
        raise invalid("volume_capability is missing: it is a required field of the request")
    flags = check_capability(request.volume_capability)
    given = dict(request.volume_context)
    namespace, ephemeral = pod_of(given)
    context = dict(check_context(given))
    context["source"] = sources.check(context["source"], namespace)
    secrets = dict(request.secrets)
    for name in secrets:
        if name != "key" and name not in SECRET_KEYS:
            raise invalid(f"secrets[{name!r}] is not known; the Secret of nodePublishSecretRef "
                          f"holds key and, for s3:// sources, {', '.join(SECRET_KEYS)}")
    key = parse_key(secrets)
    credentials = parse_credentials(secrets, canonical(context["source"]).protocol)
    writable = served_writable(context, request.volume_capability.access_mode.mode,
                               request.readonly, flags)
    return Publication(volume_id, target, tuple(sorted(context.items())), flags,
                       request.readonly, namespace, ephemeral, writable), key, credentials


def served_writable(context: dict[str, str], mode: int, readonly: bool,
                    flags: tuple[str, ...]) -> bool:
    """Whether a publication is served read-write: only a volume whose
    context says `writable: "true"`, asked for by a single-node writer
    (SINGLE_NODE_WRITER, ..._SINGLE_WRITER, ..._MULTI_WRITER: one node's
    staging and uploads), not `readOnly` and without the `ro` flag. Every
    other publication is read-only (a writable volume asked for by readers
    is served to them read-only)."""
    asked = context.get("writable", "false") == "true"
    writer = Mode.Name(mode) in WRITER_MODES
    if asked and not writer:
        log.info("volume_context writable is true, but access mode %s is not a single-node "
                 "writer's: served read-only", Mode.Name(mode))
    return asked and writer and not readonly and "ro" not in flags


def pod_of(context: dict[str, str]) -> tuple[str, bool]:
    """(the pod's namespace, whether the volume is inline) as the kubelet says."""
    namespace = context.get(NAMESPACE_KEY, "")
    if not namespace:
        raise invalid(f"volume_context[{NAMESPACE_KEY!r}] is missing: the kubelet sets it "
                      f"when the CSIDriver csi.blockcache.io has podInfoOnMount: true "
                      f"(daemonset/csi-driver.yaml), and the plugin chooses each volume's "
                      f"uid and allowed sources by it")
    return namespace, context.get(EPHEMERAL_KEY, "true") != "false"


def check_capability(cap: Any) -> tuple[str, ...]:
    """The mount flags of a mount capability; block access and unknown modes
    refused. Writer modes are served read-write only for a writable volume
    (`served_writable`, docs/csi.md)."""
    if cap.HasField("block"):
        raise invalid("volume_capability asks for block access; blockcache volumes are "
                      "file systems: use a mount (volumeMode: Filesystem)")
    if cap.access_mode.mode == Mode.UNKNOWN:
        raise invalid("volume_capability.access_mode is missing or UNKNOWN; give a mode, "
                      "e.g. MULTI_NODE_READER_ONLY (ReadOnlyMany)")
    if not cap.HasField("mount"):
        raise invalid("volume_capability has no access type; give mount")
    if cap.mount.fs_type not in FS_TYPES:
        raise invalid(f"volume_capability.mount.fs_type {cap.mount.fs_type!r} is not "
                      f"blockcache's; leave fsType empty")
    if cap.mount.volume_mount_group:
        raise invalid("volume_capability.mount.volume_mount_group is set, but this plugin has "
                      "no VOLUME_MOUNT_GROUP capability: every file is readable by every uid")
    return tuple(dict.fromkeys(check_flag(f) for f in cap.mount.mount_flags))


def check_flag(flag: str) -> str:
    """One mount flag, checked; an SELinux label as `NAME="LABEL"`."""
    name, eq, value = flag.partition("=")
    if name in SELINUX_OPTIONS and eq:
        label = value[1:-1] if len(value) > 1 and value[0] == value[-1] == '"' else value
        if not _SELINUX_LABEL.fullmatch(label):
            raise invalid(f"mount flag {flag!r} is not an SELinux label: give "
                          f'{name}="user:role:type:level", e.g. '
                          f'{name}="system_u:object_r:container_file_t:s0:c1,c2"')
        return f'{name}="{label}"'
    if flag not in MOUNT_FLAGS:
        raise invalid(f"mount flag {flag!r} (mountOptions) is not supported; use only "
                      f"{', '.join(sorted(MOUNT_FLAGS))} or an SELinux "
                      f"{'=, '.join(SELINUX_OPTIONS)}=")
    return flag


def selinux_enabled() -> bool:
    """Whether this node's kernel runs SELinux (only then does it register
    selinuxfs; without it, a FUSE mount refuses context= with EINVAL)."""
    try:
        with open(FILESYSTEMS) as f:
            return any(line.split()[-1:] == ["selinuxfs"] for line in f)
    except OSError:
        return False


def mount_options(flags: tuple[str, ...], selinux: bool) -> list[str]:
    """The FUSE mount options of a publication's mount flags: its SELinux
    labels only where the node has SELinux (elsewhere they label nothing, and
    the kernel would refuse the mount)."""
    out = []
    for flag in flags:
        if flag.partition("=")[0] in SELINUX_OPTIONS and not selinux:
            log.info("mount flag %s not passed: SELinux is not enabled on this node", flag)
            continue
        out.append(flag)
    return ["allow_other", *out]


def check_context(context: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The volume_context's keys that matter, each checked; an unknown key refused."""
    used: dict[str, str] = {}
    for name, value in context.items():
        if name.startswith(KUBELET_PREFIX):
            continue
        if name not in REQUIRED_KEYS and name not in OPTIONAL_KEYS:
            raise invalid(f"volume_context key {name!r} is not known; the keys are "
                          f"{', '.join(REQUIRED_KEYS + OPTIONAL_KEYS)}")
        used[name] = value
    for name in REQUIRED_KEYS:
        if not used.get(name):
            raise invalid(f"volume_context[{name!r}] is missing: set it in the volume's "
                          f"volumeAttributes")
    try:
        check_volume_name(used["volume"])
        if "blockSize" in used:
            convert.size(used["blockSize"], 'volume_context["blockSize"]')
        if "metaTTL" in used:
            convert.duration(used["metaTTL"], 'volume_context["metaTTL"]', allow_zero=True)
        if "readaheadBlocks" in used:
            convert.count(used["readaheadBlocks"], 'volume_context["readaheadBlocks"]', 0, 64)
        if used.get("writable", "false") not in ("true", "false"):
            raise BlockcacheError(f'volume_context["writable"] {used["writable"]!r} must be '
                                  f'"true" or "false"')
        dir_ttls(used)
    except BlockcacheError as exc:
        raise invalid(f"volume_context: {exc}") from None
    return tuple(sorted(used.items()))


def dir_ttls(context: dict[str, str]) -> list[str]:
    """`dirTTL` (PREFIX=SECONDS,...) as `--dir-ttl` values, each checked."""
    items = [i.strip() for i in context.get("dirTTL", "").split(",") if i.strip()]
    for item in items:
        try:
            parse_dir_ttl_flag(item)
        except BlockcacheError as exc:
            raise invalid(f'volume_context["dirTTL"]: {exc}; write PREFIX=SECONDS pairs '
                          f'separated by commas, e.g. code/=0,data/=600') from None
    return items


def parse_key(secrets: dict[str, str]) -> bytes:
    """The volume key in `secrets`; its value never appears in an error."""
    text = secrets.get("key")
    if text is None:
        raise invalid(f"{KEY_FIELD} is missing: {KEY_FIX}")
    text = text.strip()
    if not _HEX_KEY.fullmatch(text):
        raise invalid(f"{KEY_FIELD} is not a volume key ({len(text)} characters, not "
                      f"{2 * KEY_SIZE} hex digits): {KEY_FIX}")
    key = bytes.fromhex(text)
    if len(set(key)) < _MIN_DISTINCT:
        raise invalid(f"{KEY_FIELD} is a pattern, not a random key (only {len(set(key))} "
                      f"distinct bytes): {KEY_FIX}")
    return key


def mount_command(pub: Publication, key_file: str, socket: str | None, server: Credentials,
                  credentials: SourceCredentials, environment: ServerEnvironment,
                  selinux: bool | None = None
                  ) -> tuple[list[str], MountConfig, dict[str, str]]:
    """The `fsclient mount` arguments that serve `pub`, their config (checked
    by fsclient itself, so the keeper will not refuse them), and the whole
    environment the keeper and its server run with (`environment.py`).
    `selinux`: whether the node has SELinux (None: find out)."""
    ctx = dict(pub.context)
    options = mount_options(pub.mount_flags,
                            selinux_enabled() if selinux is None else selinux)
    argv = ["mount", ctx["source"], pub.target, "--volume", ctx["volume"],
            "--key-file", key_file, "-o", ",".join(options),
            "--server-user", f"{server.uid}:{server.gid}"]
    for g in server.groups:
        argv += ["--server-group", str(g)]
    if socket:
        argv += ["--socket", socket]
    for key, flag in (("blockSize", "--block-size"), ("metaTTL", "--meta-ttl"),
                      ("readaheadBlocks", "--readahead-blocks")):
        if key in ctx:
            argv += [flag, ctx[key]]
    ttls = dir_ttls(ctx)
    for item in ttls:
        argv += ["--dir-ttl", item]
    if pub.writable:  # the pod's own mount: any uid in it may write (docs/csi.md)
        argv += ["--writable", "--write-access", "all"]
    try:
        cfg = build_config(
            {}, volume=ctx["volume"], source=ctx["source"], mountpoint=pub.target,
            key_file=key_file, socket=socket, block_size=ctx.get("blockSize"),
            meta_ttl=ctx.get("metaTTL"), readahead_blocks=ctx.get("readaheadBlocks"),
            dir_ttl=[parse_dir_ttl_flag(i) for i in ttls],
            options=options,
            server_user=f"{server.uid}:{server.gid}", server_groups=list(server.groups),
            writable=pub.writable or None, write_access="all" if pub.writable else None)
    except BlockcacheError as exc:
        raise invalid(f"volume_context: {exc}") from None
    return argv, cfg, environment.build(pub.namespace, credentials)
