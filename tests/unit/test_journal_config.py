"""Journal settings from flags and the config file: durable by default, flags win."""

from __future__ import annotations

import pytest

from sessionrouter.server.app import JournalConfig
from sessionrouter.server.config import DEFAULT_STATE_DIR, ConfigError, build_config, file_values
from sessionrouter.server.journal import SyncMode


def test_without_any_setting_the_router_journals_to_the_default_directory() -> None:
    assert build_config({}).journal == JournalConfig(DEFAULT_STATE_DIR, SyncMode.FULL)
    assert DEFAULT_STATE_DIR == "state"


def test_in_memory_turns_the_journal_off() -> None:
    assert build_config({"in_memory": True}).journal is None
    assert build_config({}, file_values({"journal": {"in_memory": True}})).journal is None


def test_flags_win_over_the_file() -> None:
    data = {"journal": {"state_dir": "/from/file", "sync": "full", "check_on_start": False}}
    config = build_config({"state_dir": "/from/flag", "journal_sync": "normal"}, file_values(data))
    assert config.journal == JournalConfig("/from/flag", SyncMode.NORMAL, check_on_start=False)
    assert build_config({"in_memory": True}, file_values(data)).journal is None
    flagged = build_config({"state_dir": "/d"}, file_values({"journal": {"in_memory": True}}))
    assert flagged.journal == JournalConfig("/d")


@pytest.mark.parametrize(
    ("flags", "data", "message"),
    [
        ({"in_memory": True, "state_dir": "/d"}, {}, "exclude each other"),
        ({}, {"journal": {"in_memory": True, "state_dir": "/d"}}, "exclude each other"),
        ({"journal_sync": "off"}, {}, "journal.sync must be 'full' or 'normal'"),
        ({}, {"journal": {"fsync": True}}, "unknown key journal.fsync"),
        ({}, {"journal": "state"}, "journal must be a table"),
        ({}, {"journal": {"state_dir": 3}}, "journal.state_dir must be a str"),
    ],
)
def test_bad_journal_settings_are_one_clear_error(
    flags: dict[str, object], data: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        build_config(flags, file_values(data))
