"""A shard's admission lease on the core (``StalenessGate.lease``), with a scripted lease
source: a shard admits only within its lease, a used-up lease asks once for more and the
start waits for that answer only, a source that cannot answer gives STALENESS_LIMIT with its
reason, and adopting the fleet's state restarts the counters only on another epoch."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import pytest

from sessionrouter.server.core.clock import ManualClock
from sessionrouter.server.core.commands import StartGroupCommand
from sessionrouter.server.core.errors import ResourceExhausted
from sessionrouter.server.core.router import RouterSettings, SessionRouter
from sessionrouter.server.core.staleness import (
    LeasePendingError,
    StalenessPolicy,
    refused_while_pending,
)

SETTINGS = RouterSettings(deadline_s=10.0, min_members=1, reducer_window_s=0.0)


class ScriptedSource:
    """Grants ``grant`` slots to the first request once the test says so (``answer_now``);
    later requests are answered at once with nothing."""

    def __init__(self, router: SessionRouter, grant: int, reason: str = "") -> None:
        self.router = router
        self.grant = grant
        self.reason = reason
        self.asked = 0
        self.pending: asyncio.Future[bool] | None = None

    def more(self) -> Awaitable[bool] | str:
        if self.reason:
            return self.reason
        self.asked += 1
        if self.pending is not None and self.pending.done():  # answered: nothing more comes
            nothing: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            nothing.set_result(False)
            return nothing
        if self.pending is None:
            self.pending = asyncio.get_running_loop().create_future()
        return self.pending

    def answer_now(self) -> None:
        gate = self.router.trainer
        assert self.pending is not None
        gate.lease = (gate.lease or 0) + self.grant
        self.router.trainer_changed()
        self.pending.set_result(self.grant > 0)


def sharded_router(lease: int, source_grant: int = 2, reason: str = "") -> SessionRouter:
    router = SessionRouter(SETTINGS, ManualClock())
    router.register_worker("w0", "10.0.0.1:1", 1000, {})
    router.set_trainer_state(0, StalenessPolicy(max_staleness=9, batch_size=10))  # limit 100
    router.trainer.lease = lease
    router.trainer.lease_source = ScriptedSource(router, source_grant, reason)
    return router


def start(router: SessionRouter) -> str:
    return router.start_group(StartGroupCommand("t", 1)).group.group_id


async def test_a_shard_admits_within_its_lease_without_asking() -> None:
    router = sharded_router(lease=3)
    source = router.trainer.lease_source
    assert isinstance(source, ScriptedSource)
    for _ in range(3):
        start(router)
    assert source.asked == 0
    with pytest.raises(LeasePendingError) as caught:
        start(router)
    refusal = caught.value.refusal
    assert (refusal.reason, refusal.metadata["shard_lease"]) == ("STALENESS_LIMIT", "3")
    assert router.trainer.in_flight == 3  # the refused start changed nothing


async def test_a_used_up_lease_waits_for_one_answer_shared_by_concurrent_starts() -> None:
    router = sharded_router(lease=0, source_grant=2)
    source = router.trainer.lease_source
    assert isinstance(source, ScriptedSource)
    pending = []
    for _ in range(3):
        with pytest.raises(LeasePendingError) as caught:
            start(router)
        pending.append(asyncio.ensure_future(caught.value.retry(lambda: start(router))))
    await asyncio.sleep(0)
    assert not any(p.done() for p in pending)
    source.answer_now()  # 2 slots for 3 waiting starts
    results = await asyncio.gather(*pending, return_exceptions=True)
    admitted = [r for r in results if isinstance(r, str)]
    refused = [r for r in results if isinstance(r, ResourceExhausted)]
    assert (len(admitted), len(refused)) == (2, 1)
    assert router.trainer.in_flight == 2 == router.trainer.lease


async def test_a_source_that_cannot_answer_refuses_with_its_reason() -> None:
    router = sharded_router(lease=1, reason="NATS is unreachable")
    start(router)
    with pytest.raises(ResourceExhausted) as caught:
        start(router)
    assert caught.value.reason == "STALENESS_LIMIT"
    assert "fill its lease of 1 slots" in caught.value.message
    assert "NATS is unreachable" in caught.value.message


async def test_a_waiting_start_is_admitted_when_the_lease_grows() -> None:
    router = sharded_router(lease=0)
    source = router.trainer.lease_source
    assert isinstance(source, ScriptedSource)
    waiting = asyncio.ensure_future(
        router.start_when_admitted(lambda: refused_while_pending(lambda: start(router)), 5.0)
    )
    await asyncio.sleep(0.01)
    assert not waiting.done()
    source.answer_now()
    assert isinstance(await asyncio.wait_for(waiting, 5.0), str)


async def test_a_dropped_group_reopens_a_slot_of_the_lease() -> None:
    router = sharded_router(lease=1)
    group_id = start(router)
    with pytest.raises(LeasePendingError):
        start(router)
    session = router.groups.get(group_id).members[0].name
    router.abort_session(session, "gone")
    assert router.trainer.in_flight == 0
    start(router)


def test_adopting_the_fleets_state_restarts_the_counters_only_on_another_epoch() -> None:
    router = sharded_router(lease=5)
    gate = router.trainer
    start(router)
    epoch = gate.epoch
    gate.adopt(3, StalenessPolicy(1, 2), True, epoch, 7)
    assert (gate.version, gate.limit, gate.started, gate.lease) == (3, 10, 1, 7)
    assert gate.refuse_mixed_versions
    gate.adopt(3, StalenessPolicy(1, 2), True, epoch + 1, 0)
    assert (gate.started, gate.dropped, gate.epoch, gate.lease) == (0, 0, epoch + 1, 0)
