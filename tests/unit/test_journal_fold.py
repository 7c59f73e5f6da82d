"""The journal's fold on its own, without SQLite: events in, row changes out, and the schema
the rows follow."""

from __future__ import annotations

import json

import numpy as np

from sessionrouter.server.core.estimators import EstimatorParams
from sessionrouter.server.core.events import (
    GroupCreated,
    GroupFinalized,
    RequestSaved,
    RewardSaved,
    SessionAborted,
    SessionLost,
    SessionStarted,
    WorkerRemoved,
    WorkerSaved,
)
from sessionrouter.server.core.feed import GroupOutcome, GroupResult
from sessionrouter.server.journal import schema
from sessionrouter.server.journal.fold import fold
from sessionrouter.server.journal.logrows import Batch, Finalized, decode_batch


def created(seq: int, size: int = 2) -> GroupCreated:
    return GroupCreated(seq, f"g{seq}", "t", size, "grpo", 1e-6, 1, False, 600.0, 1, 1.0, 601.0)


def started(seq: int, idx: int) -> SessionStarted:
    return SessionStarted(seq, idx, "w", "h:1", "", {"k": "v"}, 1.0, False)


def finalized(seq: int, cursor: int, rewards: list[float]) -> GroupFinalized:
    result = GroupResult(
        cursor=cursor,
        group_id=f"g{seq}",
        task_id="t",
        outcome=GroupOutcome.COMPLETE,
        group_size=len(rewards),
        sessions=tuple(f"groups/g{seq}/sessions/{i}" for i in range(len(rewards))),
        rewards=np.array(rewards),
        advantages=np.zeros(len(rewards)),
        mean=float(np.mean(rewards)),
        std=0.0,
        estimator=EstimatorParams(),
        degenerate=True,
        excluded_sessions=(),
        finalize_time=2.0,
    )
    return GroupFinalized(seq, result, tuple(range(len(rewards))), ())


def test_the_groups_table_starts_with_the_fields_of_group_created() -> None:
    assert GroupCreated._fields == schema.GROUP_CREATED_COLUMNS
    assert schema.GROUPS.names == schema.GROUP_CREATED_COLUMNS + schema.GROUP_RESULT_COLUMNS
    assert schema.SESSIONS.names[schema.SESSION_STATE] == "state"
    assert all(len(set(t.names)) == t.width for t in schema.TABLES)


def test_the_ddl_has_every_column_of_every_table() -> None:
    ddl = "\n".join(schema.ddl())
    for table in schema.TABLES:
        assert f"CREATE TABLE {table.name} (" in ddl
        for column in table.names:
            assert f" {column}" in ddl or f"({column}" in ddl


def test_a_session_started_and_rewarded_in_one_fold_is_one_insert() -> None:
    changes = fold(
        [created(1), started(1, 0), started(1, 1), RewardSaved(1, 0, 0.5)],
        ([1], [1], [0.25]),
        last_cursor=0,
        next_seq=1,
    )
    assert list(changes.new_groups) == [1] and changes.next_seq == 2
    rows = changes.new_sessions
    assert rows[(1, 0)][schema.SESSION_STATE] == "rewarded"
    assert rows[(1, 0)][schema.SESSION_REWARD] == 0.5
    assert rows[(1, 1)][schema.SESSION_REWARD] == 0.25
    assert changes.rewards == []  # nothing left to update row by row
    assert len(rows[(1, 0)]) == schema.SESSIONS.width
    assert len(changes.new_groups[1]) == schema.GROUPS.width


def test_rewards_of_a_group_finalized_in_the_same_fold_are_not_written_to_rows() -> None:
    changes = fold(
        [finalized(7, 3, [0.1, 0.2])],
        ([7, 7, 8], [0, 1, 0], [0.1, 0.2, 0.9]),
        last_cursor=2,
        next_seq=9,
    )
    assert changes.rewards == [(8, 0, 0.9)]  # only the group still open
    assert changes.finals[7][:2] == ("finalized", 3)
    assert changes.last_cursor == 3


def test_marks_on_rows_of_an_earlier_fold_become_updates() -> None:
    changes = fold(
        [SessionAborted(4, 1), SessionLost(4, 2), WorkerSaved("w", "h:1", 2, {}, False, 0.0)],
        ([], [], []),
        last_cursor=0,
        next_seq=5,
    )
    assert changes.aborts == [(4, 1)] and changes.lost == [(4, 2)]
    assert list(changes.workers) == ["w"]
    removed = fold([WorkerRemoved("w")], ([], [], []), last_cursor=0, next_seq=1)
    assert removed.workers == {"w": None}


def test_under_load_rewards_of_open_groups_are_carried_once() -> None:
    first = fold([], ([5, 6], [0, 0], [1.0, 2.0]), last_cursor=0, next_seq=7, carry=True)
    assert first.rewards == []
    assert (first.carried.seqs, first.carried.values) == ([5, 6], [1.0, 2.0])
    # The next fold writes what was carried once, and carries the fresh ones.
    again = Batch()
    again.extend(first.carried)
    again.carried = first.carried.carried
    again.seqs.append(6)
    again.idxs.append(1)
    again.values.append(3.0)
    second = fold(
        [], again.rewards(), last_cursor=0, next_seq=7, carried_before=again.carried, carry=True
    )
    assert second.rewards == [(5, 0, 1.0), (6, 0, 2.0)]
    assert second.carried.seqs == [6] and second.events == 1


def test_a_batch_survives_its_log_row_format_exactly() -> None:
    batch = Batch()
    batch.events = [created(1), RequestSaved("r", 1, None, ("group", "t", None, 2))]
    batch.events.append(Finalized.of(finalized(1, 1, [0.1, 1 / 3])))
    batch.seqs, batch.idxs, batch.values = [1], [0], [1 / 3]
    back = decode_batch(batch.encode())
    assert back.events == batch.events
    assert back.values == [1 / 3]  # the exact float


def test_each_request_row_gets_its_own_fingerprint_when_some_are_shared() -> None:
    """Fingerprints are encoded once per fold and reused for the requests that share one:
    every row still carries the JSON of its own request's fingerprint, in event order."""
    member = ("session", "t", "g1", 2)
    made = ("session", "t", None, 8)
    prints = [member, made, member, ("group", "t", "g2", 4), made, ("session", 'ü"', None, 1)]
    events = [RequestSaved(f"r{k}", k + 1, 0, p) for k, p in enumerate(prints)]
    changes = fold(events, ([], [], []), last_cursor=0, next_seq=1)
    assert [row[0] for row in changes.requests] == [f"r{k}" for k in range(len(prints))]
    assert [json.loads(row[3]) for row in changes.requests] == [list(p) for p in prints]
    assert changes.requests[0][3] == '["session","t","g1",2]'
    assert changes.requests[5][3] == '["session","\\u00fc\\"",null,1]'
