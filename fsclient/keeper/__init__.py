"""The keeper: the process that holds a mount's FUSE connection, restarts
its server, and hands the connection on (fsclient/DESIGN.md, "The keeper").

- `keeper`: the keeper process itself; `keeping`: `fsclient mount`'s way into it.
- `control`: its control socket (restart, status, surrender), named by a
  digest of the mount point, and the asker's check of the keeper's
  credentials (`Impostor`, `Unvouched`); `desk`: the keeper's side, which answers only
  root and its own uid; `client`: the asking side, as the CLI and the CSI
  plugin ask. `status`, `restart` and `surrender` take `expect_pid=`.
- `handoff`: keeper and server, descriptors by SCM_RIGHTS.
- `saved`: the memfd record of INIT terms and node paths.
- `fdstore`: systemd's fd store, LISTEN_FDS; `successor`: the server that
  starts the next keeper when its keeper dies.
- `privileges`: the server's uid, groups, capabilities and no_new_privs.

This module is the face other packages use (the CSI plugin imports nothing
else of fsclient's keeper or session: an import contract).
"""

from ..mountpoint import MountError
from ..session.mount import set_kernel_readahead, unmount_lazy
from .client import guarantee, recovered, restart, status
from .control import Impostor, Surrendered, Unvouched, surrender
from .fdstore import hand_on
from .privileges import Credentials

__all__ = ["Credentials", "Impostor", "MountError", "Surrendered", "Unvouched", "guarantee",
           "hand_on", "recovered", "restart", "set_kernel_readahead", "status", "surrender",
           "unmount_lazy"]
