"""Log formats: the text form keeps every structured field the JSON form has."""

from __future__ import annotations

import json
import logging

from sessionrouter.server.logs import JsonFormatter, TextFormatter


def _record(**extra: object) -> logging.LogRecord:
    record = logging.LogRecord(
        "sessionrouter.router", logging.INFO, "f.py", 1, "group %s", ("complete",), None
    )
    for key, value in extra.items():
        setattr(record, key, value)
    return record


def test_text_lines_show_the_fields_after_the_message() -> None:
    record = _record(event="group_finished", group_id="g-7", rewarded=8, group_size=8)
    line = TextFormatter().format(record)
    assert line.endswith(
        "INFO sessionrouter.router: group complete"
        " event=group_finished group_id=g-7 rewarded=8 group_size=8"
    )


def test_text_values_with_spaces_or_quotes_are_quoted_so_fields_still_split() -> None:
    line = TextFormatter().format(_record(reason='worker "w1" lost', empty="", ratio=0.5))
    assert line.endswith('reason="worker \\"w1\\" lost" empty="" ratio=0.5')


def test_a_line_without_fields_is_the_bare_message() -> None:
    assert TextFormatter().format(_record()).endswith("sessionrouter.router: group complete")


def test_json_and_text_carry_the_same_fields() -> None:
    record = _record(event="refused", reason="GROUP_FULL", group_id="g1")
    fields = json.loads(JsonFormatter().format(record))
    text = TextFormatter().format(record)
    for key in ("event", "reason", "group_id"):
        assert f"{key}={fields[key]}" in text
