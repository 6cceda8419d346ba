"""`blockcache-csi`: the CSI node plugin of blockcache, and its keeper host.

    blockcache-csi [node] --endpoint unix:///csi/csi.sock --node-id NODE
                   [--state-dir /var/lib/blockcache-csi] [--server-uid 65534]
                   [--server-gid 65534] [--namespace-uid NAMESPACE=UID[:GID] ...]
                   [--pv-uid VOLUME_HANDLE=UID[:GID] ...]
                   [--allow-source [NAMESPACE=]PREFIX ...] [--s3-endpoint URL]
                   [--s3-region REGION] [--allow-node-credentials NAMESPACE ...]
                   [--socket PATH] [--ready-file PATH] [--keepers-socket PATH]
                   [--registration-dir DIR] [--kubelet-registration-path PATH]
    blockcache-csi keepers [--socket PATH] [--server-memory 1G] [--ready-file PATH]

Errors at start print one line (`blockcache-csi: error: ...`) and exit 1.
"""

from __future__ import annotations

import logging
import os
import sys

import click

from blockcache_client.common.logsetup import FORMATS, LEVELS, setup_logging
from blockcache_client.contract.errors import BlockcacheError

from . import DRIVER_NAME, VERSION

log = logging.getLogger(__name__)

DEFAULT_STATE_DIR = "/var/lib/blockcache-csi"
DEFAULT_REGISTRATION_PATH = f"/var/lib/kubelet/plugins/{DRIVER_NAME}/csi.sock"
DEFAULT_KEEPERS_SOCKET = f"{DEFAULT_STATE_DIR}/keepers/keepers.sock"
NOBODY = 65534
HELP = {"help_option_names": ["-h", "--help"]}


class _Commands(click.Group):
    """`node` is the command when none is named (`blockcache-csi --endpoint ...`)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args or args[0] not in self.commands:
            args = ["node", *args]
        return super().parse_args(ctx, args)


@click.group(cls=_Commands, context_settings=HELP)
@click.version_option(VERSION, prog_name="blockcache-csi")
def main() -> None:
    """The CSI node plugin `csi.blockcache.io` (`node`, the default) and the
    keeper host that holds its mounts (`keepers`)."""


def _refuse_non_root(what: str) -> None:
    if os.geteuid() != 0:
        click.echo(f"blockcache-csi: error: {what} must run as root (a privileged "
                   f"container)", err=True)
        sys.exit(1)


@main.command("node", context_settings=HELP)
@click.option("--endpoint", envvar="CSI_ENDPOINT", required=True, metavar="unix:///PATH",
              help="The CSI socket the kubelet calls [env: CSI_ENDPOINT].")
@click.option("--node-id", envvar="NODE_ID", required=True, metavar="NODE",
              help="This node's name, returned by NodeGetInfo [env: NODE_ID].")
@click.option("--state-dir", default=DEFAULT_STATE_DIR, show_default=True,
              type=click.Path(file_okay=False),
              help="Host dir of the published targets and their volume keys; a restarted "
                   "plugin finds its mounts there. Its parents must be searchable by the "
                   "server uid.")
@click.option("--server-uid", type=click.IntRange(1, 2**32 - 2), default=NOBODY,
              show_default=True, help="The uid the FUSE servers run as (never root).")
@click.option("--server-gid", type=click.IntRange(0, 2**32 - 2), default=NOBODY,
              show_default=True, help="Their gid; they also join the group of "
                                      "blockcached's socket.")
@click.option("--namespace-uid", "namespace_uids", multiple=True,
              metavar="NAMESPACE=UID[:GID]",
              help="Run the servers of the volumes of pods in NAMESPACE (as the kubelet "
                   "names it) as UID (and GID, UID if not given) instead of --server-uid "
                   "(repeat for more namespaces).")
@click.option("--pv-uid", "pv_uids", multiple=True, metavar="VOLUME_HANDLE=UID[:GID]",
              help="Run the servers of the static PersistentVolume whose volumeHandle is "
                   "VOLUME_HANDLE as UID[:GID]; wins over --namespace-uid (repeatable).")
@click.option("--volume-uid", "volume_uids", multiple=True, hidden=True,
              help="Removed: see --namespace-uid and --pv-uid.")
@click.option("--allow-source", "allow_sources", multiple=True,
              metavar="[NAMESPACE=]PREFIX",
              help="Allow sources under PREFIX (s3://bucket/prefix, s3:// for every bucket, "
                   "https://host/path, /local/dir or file:///local/dir) for pods of NAMESPACE, "
                   "or of every namespace without NAMESPACE=. Repeatable; with none, every "
                   "publish is refused. Chained URLs (a::b), data:, memory:, reference: and "
                   "other protocols are always refused.")
@click.option("--s3-endpoint", metavar="URL",
              help="The S3 endpoint of every s3:// source (e.g. a MinIO or on-premises "
                   "store) [default: AWS's]. Never taken from a pod.")
@click.option("--s3-region", metavar="REGION", help="The region of s3:// sources "
                                                    "[default: found by the S3 client].")
@click.option("--allow-node-credentials", "node_credentials", multiple=True,
              metavar="NAMESPACE",
              help="Let s3:// volumes of NAMESPACE whose Secret holds no awsAccessKeyId sign "
                   "with the node's role (instance metadata); elsewhere they send unsigned "
                   "requests. Repeatable. Servers never see the plugin's own credentials.")
@click.option("--socket", help="blockcached socket [default: $BLOCKCACHE_SOCKET or "
                               "/run/blockcache/blockcached.sock].")
@click.option("--ready-file", type=click.Path(dir_okay=False),
              help="Written once every mount found at start is taken over and the socket "
                   "serves, removed at stop: a readiness probe's `test -e` (a surge update "
                   "deletes the old pod only then).")
@click.option("--keepers-socket", default=DEFAULT_KEEPERS_SOCKET, show_default=True,
              metavar="PATH", help="The keeper host's socket (`blockcache-csi keepers`), "
                                   "which starts and stops the mounts' keepers.")
@click.option("--registration-dir", type=click.Path(exists=True, file_okay=False),
              help="Register with the kubelet: the kubelet's plugins_registry dir "
                   "(/var/lib/kubelet/plugins_registry on the host), where the plugin binds "
                   "a registration socket of its own once it serves [default: no "
                   "registration].")
@click.option("--kubelet-registration-path", default=DEFAULT_REGISTRATION_PATH,
              show_default=True, metavar="PATH",
              help="The CSI socket's path as the kubelet sees it on the host, which the "
                   "registration gives the kubelet.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(LEVELS, case_sensitive=False))
@click.option("--log-format", default="text", show_default=True, type=click.Choice(FORMATS))
def node(endpoint: str, node_id: str, state_dir: str, server_uid: int, server_gid: int,
         namespace_uids: tuple[str, ...], pv_uids: tuple[str, ...],
         volume_uids: tuple[str, ...], allow_sources: tuple[str, ...],
         s3_endpoint: str | None, s3_region: str | None, node_credentials: tuple[str, ...],
         socket: str | None, ready_file: str | None, keepers_socket: str,
         registration_dir: str | None, kubelet_registration_path: str, log_level: str,
         log_format: str) -> None:
    """Serve the CSI node plugin `csi.blockcache.io` on ENDPOINT.

    NodePublishVolume mounts a blockcache volume (volume_context: source,
    volume, and optionally blockSize, metaTTL, dirTTL, readaheadBlocks; the
    Secret's "key": the volume key's 64 hex digits, and for s3:// sources
    optionally awsAccessKeyId, awsSecretAccessKey, awsSessionToken) read-only
    at the pod's target path, if an --allow-source rule allows its source for
    the pod's namespace. Each mount's keeper (root: it mounts) is started by
    the keeper host (`blockcache-csi keepers`, at --keepers-socket); the
    volume's FUSE server runs as its --pv-uid, --namespace-uid or
    --server-uid with no capabilities and an environment of its own (none of
    the plugin's credentials), restarted by its keeper if it dies. SIGTERM
    stops the plugin and leaves the mounts; the next start finds them kept.
    """
    from .environment import EnvironmentSettingError, ServerEnvironment
    from .keepers import KeeperHost
    from .mounts import Mounts
    from .registration import Registrar
    from .server import EndpointError, serve
    from .servers import RETIRED_FLAG, ServerUsers, ServerUsersError
    from .sources import SourcePolicy, SourceRuleError
    from .state import StateDir

    setup_logging(log_level, log_format)
    if volume_uids:
        raise click.UsageError(RETIRED_FLAG)
    try:
        servers = ServerUsers.from_entries(server_uid, server_gid, namespace_uids, pv_uids)
        sources = SourcePolicy.from_entries(allow_sources)
        environment = ServerEnvironment(s3_endpoint, s3_region, node_credentials)
    except (ServerUsersError, SourceRuleError, EnvironmentSettingError) as exc:
        raise click.UsageError(str(exc)) from None
    _refuse_non_root("the plugin mounts FUSE file systems and")
    if not kubelet_registration_path.startswith("/"):
        click.echo(f"blockcache-csi: error: --kubelet-registration-path "
                   f"{kubelet_registration_path!r} must be an absolute host path, e.g. "
                   f"{DEFAULT_REGISTRATION_PATH}", err=True)
        sys.exit(1)
    log.info("%s %s starting", DRIVER_NAME, VERSION)
    state = StateDir(state_dir)
    if not sources.rules:
        log.warning("no --allow-source rule: every publish is refused")
    mounts = Mounts(state, servers, socket, KeeperHost(keepers_socket), environment)
    try:
        registrar = (Registrar(registration_dir, kubelet_registration_path)
                     if registration_dir else None)
        code = serve(endpoint, mounts, node_id, ready_file, registrar, sources)
    except (EndpointError, BlockcacheError, OSError) as exc:
        click.echo(f"blockcache-csi: error: {exc}", err=True)
        sys.exit(1)
    sys.exit(code)


@main.command("keepers", context_settings=HELP)
@click.option("--socket", "path", default=DEFAULT_KEEPERS_SOCKET, show_default=True,
              metavar="PATH", help="Where the plugin asks (0600, in a dir made 0700): the "
                                   "plugin's --keepers-socket.")
@click.option("--server-memory", default="1G", show_default=True, metavar="SIZE",
              help="The memory limit of each keeper's cgroup (its FUSE server with it): "
                   "a server past it is OOM-killed alone and restarted. 0: no limit.")
@click.option("--ready-file", type=click.Path(dir_okay=False),
              help="Written once every keeper of the host this one replaces is ours and "
                   "the socket serves, removed at stop (a readiness probe's `test -e`).")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(LEVELS, case_sensitive=False))
@click.option("--log-format", default="text", show_default=True, type=click.Choice(FORMATS))
def keepers(path: str, server_memory: str, ready_file: str | None, log_level: str,
            log_format: str) -> None:
    """Hold this node's fsclient keepers for the plugin: start, stop, list
    and reap them, each in a memory cgroup of its own, so that the mounts
    outlive the plugin's container. A new host takes every keeper of the
    one it replaces over before it is ready.
    """
    from blockcache_client.contract.units import parse_size

    from .keepers.host import Host, HostStartError

    setup_logging(log_level, log_format)
    try:
        limit = parse_size(server_memory, "--server-memory")
    except BlockcacheError as exc:
        raise click.BadParameter(str(exc), param_hint="--server-memory") from None
    _refuse_non_root("the keeper host starts the keepers, which mount; it")
    log.info("%s keeper host %s starting", DRIVER_NAME, VERSION)
    try:
        code = Host(path, limit, ready_file).run()
    except (HostStartError, OSError) as exc:
        click.echo(f"blockcache-csi: error: {exc}", err=True)
        sys.exit(1)
    sys.exit(code)


if __name__ == "__main__":
    main()
