"""Figures a test measured, kept for the docs that quote them."""

from __future__ import annotations

import json
import os
from typing import Any


def record(scenario: str, **figures: Any) -> None:
    """Append one scenario's figures to $RELIABILITY_FIGURES (JSON lines), if
    set; docs/reliability.md quotes them."""
    path = os.environ.get("RELIABILITY_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"scenario": scenario, **figures}) + "\n")
