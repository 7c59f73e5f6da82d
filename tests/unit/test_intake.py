"""The checks of a request that need no state (``core.intake``), through the router's core:
integer rewards from a caller of the core and handles NumPy cannot split get the statuses
the per-entry rules give them, and entries of interleaved groups are applied in request order."""

from __future__ import annotations

from sessionrouter.server.core.clock import ManualClock
from sessionrouter.server.core.commands import StartGroupCommand, StartSessionCommand
from sessionrouter.server.core.groups import retained_bytes
from sessionrouter.server.core.rewards import RewardBatch, RewardStatus
from sessionrouter.server.core.router import RouterSettings, SessionRouter
from sessionrouter.server.core.validation import session_handle

SETTINGS = RouterSettings(deadline_s=10.0, reducer_window_s=0.0, heartbeat_timeout_s=3600.0)


def make_router() -> SessionRouter:
    router = SessionRouter(SETTINGS, ManualClock())
    for i in range(4):
        router.register_worker(f"w{i}", f"10.0.0.{i}:1", 64, {})
    return router


def test_integer_rewards_are_checked_and_kept_as_floats() -> None:
    router = make_router()
    group = router.start_group(StartGroupCommand("t", 2)).group
    a, b = (m.name for m in group.members)
    outcomes = router.submit_rewards([(a, 10**200), (b, 2), (a, 1.0)])
    assert [o.status for o in outcomes] == [
        RewardStatus.NOT_FINITE,
        RewardStatus.ACCEPTED,
        RewardStatus.ACCEPTED,
    ]
    assert "beyond the magnitude bound" in outcomes[0].detail
    assert group.members[1].reward == 2.0 and isinstance(group.members[1].reward, float)


def test_handles_that_are_not_uint64_name_no_session() -> None:
    router = make_router()
    group = router.start_group(StartGroupCommand("t", 2)).group
    first, second = (session_handle(group.seq, m.index) for m in group.members)
    outcome = router.submit_batch(
        RewardBatch(rewards=[1.0, 0.5, 0.0], handles=[-5, first, second], columnar=True)
    )
    assert bytes(outcome.codes) == bytes([4, 1, 1])
    assert outcome.details == ["no session has handle -5"]
    assert router.stats.rewards[RewardStatus.ACCEPTED] == 2
    assert router.stats.rewards[RewardStatus.UNKNOWN_SESSION] == 1


def test_interleaved_groups_finish_in_the_order_their_last_rewards_came() -> None:
    router = make_router()
    g, h = (router.start_group(StartGroupCommand("t", 2)).group for _ in range(2))
    handles = [session_handle(x.seq, m.index) for x in (g, h) for m in x.members]
    # h's first member, g's two, h's second: g completes before h although h came first.
    order = [handles[2], handles[0], handles[1], handles[3]]
    outcome = router.submit_batch(
        RewardBatch(rewards=[1.0, 2.0, 3.0, 4.0], handles=order, columnar=True)
    )
    assert bytes(outcome.codes) == bytes([1, 1, 1, 1])
    batch = router.finalizer.drain()
    assert [r.group_id for r in batch] == [g.group_id, h.group_id]


def test_finished_groups_give_back_exactly_the_bytes_their_members_were_counted_with() -> None:
    router = make_router()
    joined = [
        router.start_session(
            StartSessionCommand("t", group_id="j", group_size=3, metadata={"k": "v" * i})
        ).session
        for i in range(3)
    ]
    whole = router.start_group(StartGroupCommand("task", 2, metadata={"m": "x"})).group
    assert router.groups.open_bytes == retained_bytes(router.groups.get("j")) + retained_bytes(
        whole
    )
    sessions = [*joined, *whole.members]
    router.submit_rewards([(s.name, 1.0) for s in sessions])
    assert router.groups.open_bytes == 0 and router.groups.open_groups == 0
    assert router.groups.finished_bytes == retained_bytes(router.groups.get("j")) + retained_bytes(
        whole
    )
