"""Correctness of what placement and finishing feed into: a dropped group stays out of the
batch std of the groups reduced with it; a journal without placement policies is refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sessionrouter.server.core.clock import ManualClock
from sessionrouter.server.core.estimators import EstimatorParams
from sessionrouter.server.core.feed import GroupOutcome
from sessionrouter.server.core.router import (
    OptionsSpec,
    RouterSettings,
    SessionRouter,
    StartGroupCommand,
)
from sessionrouter.server.journal import JOURNAL_FILE, JournalError, SqliteJournal
from tests.unit.test_journal import set_meta


def test_a_dropped_group_never_enters_the_batch_std() -> None:
    router = SessionRouter(
        RouterSettings(estimator=EstimatorParams(batch_std=True), reducer_window_s=0.0),
        ManualClock(),
    )
    router.register_worker("w0", "10.0.0.1:1", 16, {})
    kept = router.start_group(StartGroupCommand(task_id="t", group_size=2, group_id="kept"))
    dropped = router.start_group(
        StartGroupCommand(
            task_id="t", group_size=3, group_id="dropped", options=OptionsSpec(min_members=2)
        )
    )
    names = [s.name for s in dropped.group.members]
    router.submit_rewards([(names[0], 100.0)])
    router.abort_session(names[1], "")
    router.abort_session(names[2], "")  # the group is settled and dropped here
    router.submit_rewards(
        [(s.name, r) for s, r in zip(kept.group.members, [1.0, 0.0], strict=True)]
    )
    results = {r.group_id: r for r in router.finalizer.drain()}
    assert router.finalizer.batches == 1  # reduced together
    assert results["dropped"].outcome is GroupOutcome.DROPPED
    assert results["dropped"].advantages.size == 0
    np.testing.assert_allclose(results["kept"].advantages, [2**-0.5, -(2**-0.5)], rtol=1e-5)


def test_a_version_1_journal_is_refused_naming_its_file(tmp_path: Path) -> None:
    """Schema 2 added the placement policy, filter metrics and replacements; a journal of the
    previous version is refused, not guessed at."""
    SqliteJournal(tmp_path).close_now()
    set_meta(tmp_path / JOURNAL_FILE, "schema_version", 1)
    with pytest.raises(JournalError, match="schema version 1 is not supported") as info:
        SqliteJournal(tmp_path)
    assert str(tmp_path / JOURNAL_FILE) in str(info.value)
