"""Structured log lines: one JSON object per state change worth seeing.

Core code logs with ``extra={"event": ..., ...}``; this formatter puts those fields next to the
time, level and message, so that log pipelines can filter on ``event`` without parsing text.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

_STANDARD_ATTRS = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON line with its ``extra`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS and not key.startswith("_"):
                line[key] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure(level: str, fmt: str) -> None:
    """Sends sessionrouter logs to stderr, as JSON lines or as plain text."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("sessionrouter")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
