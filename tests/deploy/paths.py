"""Where the deployment files live, and where the console scripts are."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SYSTEMD = REPO / "systemd"
DAEMONSET = REPO / "daemonset"
EXAMPLE = DAEMONSET / "example"
# The venv that runs the tests also holds blockcached, fsclient, blockcache-cli.
BIN = Path(sys.executable).parent
