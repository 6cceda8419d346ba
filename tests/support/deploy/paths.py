"""Where the deployment files live."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
SYSTEMD = REPO / "systemd"
DAEMONSET = REPO / "daemonset"
EXAMPLE = DAEMONSET / "example"
