"""The kernel's FUSE protocol, spoken by fsclient itself (no libfuse).

- `structs`: the structs and constants of `include/uapi/linux/fuse.h`, the version spoken.
- `channel`: /dev/fuse descriptors (the mount's and its clones): read a request, answer it.
- `mount`: mount(2) as root, fusermount3 otherwise; the lazy unmount.
- `negotiate`: INIT, and the terms agreed (`Negotiated`, serializable for a successor).
- `requests`: each request decoded, handed to the file system (`Operations`), answered.
- `workers`: the `Session`: threads that each answer the requests they read.
- `storer`: the child process that writes page-cache stores (notify_store).

The process that holds the connection across servers is `fsclient.keeper`.
"""

from .negotiate import Negotiated
from .requests import DirReply, FuseError, Operations
from .structs import ROOT_ID, Attributes
from .workers import Session

__all__ = ["Attributes", "DirReply", "FuseError", "Negotiated", "Operations", "ROOT_ID",
           "Session"]
