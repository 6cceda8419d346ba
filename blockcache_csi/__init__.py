"""blockcache-csi: a CSI node plugin that mounts blockcache volumes into pods.

The kubelet asks it (gRPC on a unix socket, `csi.v1`) to publish a volume at a
pod's target path; it mounts the volume there with fsclient's keeper, whose
FUSE server runs as an unprivileged uid. See DESIGN.md and docs/csi.md.
"""

from importlib.metadata import PackageNotFoundError, version

DRIVER_NAME = "csi.blockcache.io"

try:
    VERSION = version("blockcache")
except PackageNotFoundError:  # run from a checkout that was never installed
    VERSION = "0.0.0+unknown"
