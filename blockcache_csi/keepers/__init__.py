"""The keeper host: a process of its own (`blockcache-csi keepers`, its own
DaemonSet) that holds the node's fsclient keepers, so that no mount depends
on the plugin's container (blockcache_csi/DESIGN.md, "Who holds the mounts").

- `host`: the process; `children`: the keepers it started, their start,
  stop and reaping; `cgroups`: a memory cgroup per keeper; `succession`: a
  new host taking the keepers of the one it replaces.
- `client`: how the plugin (and a new host) ask it; `wire`: the messages.
- `takeover`: surrender a live keeper's mount to a new keeper.
"""

from .client import HostError, HostUnavailable, KeeperHost
from .takeover import Backoff, NoKeeper, Refused, Squatted, Unanswered, take_over

__all__ = ["Backoff", "HostError", "HostUnavailable", "KeeperHost", "NoKeeper", "Refused",
           "Squatted", "Unanswered", "take_over"]
