"""The kernel's FUSE protocol, spoken by fsclient itself (no libfuse).

- `structs`: the structs and constants of `include/uapi/linux/fuse.h`, the version spoken.
- `channel`: /dev/fuse descriptors (the mount's and its clones): read a request, answer it.
- `mount`: mount(2) as root, fusermount3 otherwise; the lazy unmount.
- `negotiate`: INIT, and the terms agreed (`Negotiated`, serializable for a successor).
- `requests`: each request decoded, handed to the file system (`Operations`), answered.
- `workers`: the `Session`: threads that each answer the requests they read.
- `keeper`: the process that holds the connection and restarts its server;
  `control` (its control socket: restart, status, surrender), `handoff`
  (keeper and server, descriptors by SCM_RIGHTS), `saved` (the memfd record of
  INIT terms and node paths), `fdstore` (systemd's fd store, LISTEN_FDS).
- `storer`: the child process that writes page-cache stores (notify_store).
"""

from .negotiate import Negotiated
from .requests import DirReply, FuseError, Operations
from .structs import ROOT_ID, Attributes
from .workers import Session

__all__ = ["Attributes", "DirReply", "FuseError", "Negotiated", "Operations", "ROOT_ID",
           "Session"]
