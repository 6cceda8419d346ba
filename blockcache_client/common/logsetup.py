"""Logging set-up shared by blockcached, fsclient and the CLIs.

Two formats on stderr: `text` for people (`time level logger: message`) and
`json` for log collectors, one object per line:

    {"time": "2026-11-22T14:11:59.123Z", "level": "info", "logger": "blockcached",
     "message": "serving on /run/blockcache/blockcached.sock"}

plus "exception" (the formatted traceback) when one is attached. Times are
UTC with milliseconds, levels lower case, so both programs' lines can be
parsed by one collector rule.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import TextIO

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        entry = {"time": f"{stamp}.{int(record.msecs):03d}Z", "level": record.levelname.lower(),
                 "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(level: str = "info", fmt: str = "text", stream: TextIO | None = None) -> None:
    """Route every logger to `stream` (stderr) in `fmt` at `level` (values checked
    by the caller's config: one of LEVELS and FORMATS)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
