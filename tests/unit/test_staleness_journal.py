"""The journal keeps versions, the trainer state and an update in progress (schema 4)."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest

from sessionrouter.server.core.clock import ManualClock
from sessionrouter.server.core.commands import StartGroupCommand
from sessionrouter.server.core.router import RouterSettings, SessionRouter
from sessionrouter.server.core.staleness import StalenessPolicy
from sessionrouter.server.journal import JOURNAL_FILE, JournalError, SqliteJournal

SETTINGS = RouterSettings(heartbeat_timeout_s=3600.0, min_members=1)


def scripted(router: SessionRouter, between: Callable[[], None]) -> tuple[str, str]:
    """Sessions placed in one write and changed (versions, interruption) in the next, so
    the fold updates rows it inserted earlier; returns (finished group, open group)."""
    router.register_worker("w0", "10.0.0.0:1", 8, {}, policy_version=5)
    router.register_worker("w1", "10.0.0.1:1", 8, {}, policy_version=5)
    router.set_trainer_state(6, StalenessPolicy(2, 3))
    done = router.start_group(StartGroupCommand("t", 2)).group
    still_open = router.start_group(StartGroupCommand("t", 2)).group
    between()
    a, b = done.members
    router.submit_rewards([(a.name, 1.0, None, 4, 5), (b.name, 0.5)])
    router.finalizer.drain()
    router.begin_weight_update(7, [], interrupt_sessions=True)
    router.complete_weight_update("w0", 7)
    return done.group_id, still_open.group_id


def check_restored(router: SessionRouter, done: str, still_open: str) -> None:
    assert router.trainer.version == 6 and router.trainer.policy == StalenessPolicy(2, 3)
    assert (router.trainer.started, router.trainer.dropped) == (2, 0)
    assert router.weight_update is not None and router.weight_update.version == 7
    assert router.weight_update.fleet_wide
    w0, w1 = router.get_worker("w0"), router.get_worker("w1")
    assert (w0.policy_version, w0.updating_to, w1.policy_version, w1.updating_to) == (7, 0, 5, 7)
    a, b = router.groups.get(done).members
    assert (a.min_version, a.max_version, b.min_version, b.max_version) == (4, 5, 5, 5)
    assert [m.interrupted for m in router.groups.get(still_open).members] == [True, True]
    (result,) = router.feed.read_after(0, 10)
    assert (result.min_version, result.max_version, result.trainer_version) == (4, 5, 6)
    assert result.admitted_version == 6


@pytest.mark.parametrize("how", ["folded", "left_in_the_log"])
def test_versions_and_the_trainer_state_survive_a_restart(tmp_path: Path, how: str) -> None:
    journal = SqliteJournal(tmp_path)
    router = SessionRouter(SETTINGS, ManualClock(), journal)
    done, still_open = scripted(router, journal.write_pending)
    if how == "folded":
        journal.write_pending()
    else:
        journal.log_pending()  # a crash before the fold: the next open folds the log
    journal.close_now()
    again = SqliteJournal(tmp_path)
    restored = SessionRouter(SETTINGS, ManualClock(), again)
    restored.restore(again.load())
    check_restored(restored, done, still_open)
    again.close_now()


def test_a_version_1_journal_is_refused_with_a_message_naming_the_file(tmp_path: Path) -> None:
    SqliteJournal(tmp_path).close_now()
    path = tmp_path / JOURNAL_FILE
    con = sqlite3.connect(path)
    con.execute("UPDATE meta SET value=1 WHERE key='schema_version'")
    con.commit()
    con.close()
    with pytest.raises(JournalError, match="schema version 1 is not supported") as info:
        SqliteJournal(tmp_path)
    message = str(info.value)
    assert str(path) in message and "schema version 1" in message
    assert "was not converted" in message
    con = sqlite3.connect(path)  # left as it was
    assert con.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() == (1,)
    con.close()
