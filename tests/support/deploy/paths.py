"""Where the deployment files live."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
SYSTEMD = REPO / "systemd"
DAEMONSET = REPO / "daemonset"
EXAMPLE = DAEMONSET / "example"                  # the CSI driver's inline volume
EXAMPLE_STATIC = DAEMONSET / "example-static"    # its static PV and claim
EXAMPLE_SIDECAR = DAEMONSET / "example-sidecar"  # the privileged fsclient sidecar
EXAMPLES = [EXAMPLE, EXAMPLE_STATIC, EXAMPLE_SIDECAR]
