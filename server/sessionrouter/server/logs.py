"""Structured log lines: one JSON object (or one text line) per state change worth seeing.

Core code logs with ``extra={"event": ..., ...}``; the JSON formatter puts those fields next
to the time, level and message, so that log pipelines can filter on ``event`` without parsing
text; the text formatter (``--log-format text``, for people at a terminal) appends the same
fields as ``key=value`` after the message, so no id or count is lost either way.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from typing import Any

_STANDARD_ATTRS = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


def extra_fields(record: logging.LogRecord) -> Iterator[tuple[str, Any]]:
    """The ``extra`` fields a record carries, in the order they were given."""
    for key, value in vars(record).items():
        if key not in _STANDARD_ATTRS and not key.startswith("_"):
            yield key, value


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON line with its ``extra`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        line.update(extra_fields(record))
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class TextFormatter(logging.Formatter):
    """``time LEVEL logger: message key=value ...``; values with spaces or quotes are quoted
    (JSON string syntax), so a line still splits into its fields."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = " ".join(f"{key}={_text_value(value)}" for key, value in extra_fields(record))
        if not fields:
            return text
        head, sep, tail = text.partition("\n")  # a traceback stays below the fields
        return f"{head} {fields}{sep}{tail}"


def _text_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    if text == "" or any(c.isspace() or c in "\"='" for c in text):
        return json.dumps(text)
    return text


def configure(level: str, fmt: str) -> None:
    """Sends sessionrouter logs to stderr, as JSON lines or as text lines with the fields."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger("sessionrouter")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
