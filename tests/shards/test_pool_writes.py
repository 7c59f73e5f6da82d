"""Pool record writes are compare-and-set, on in-process shards over a real NATS: a shard
whose view of a worker lags behind (its watch has not delivered the latest record yet) does
not overwrite what another shard wrote; its write is recomputed from the current record. And
a weight update that interrupts sessions marks them on every shard, and one refused after it
wrote some records leaves nothing behind."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest

from sessionrouter.server.shards.pool import PoolMirror, WorkerEntry, worker_key
from sessionrouter.v1 import session_service_pb2 as spb
from sessionrouter.v1 import worker_service_pb2 as wpb
from tests.shards.support import eventually, owned_group
from tests.support import Harness, details_of


def mirror(h: Harness) -> PoolMirror:
    pool: PoolMirror = h.server.shards.pool
    return pool


async def stored(h: Harness, worker_id: str) -> WorkerEntry:
    """The worker's record as the bucket holds it now."""
    got = await mirror(h)._kv().get(worker_key(worker_id))
    entry = WorkerEntry.decode(got.value)
    assert entry is not None
    return entry


async def begin_behind(
    lagging: Harness, writer: Harness, worker_id: str, version: int
) -> Callable[[], None]:
    """Begins an update of the worker to ``version`` on ``writer`` and, once ``lagging``'s
    watch applied it, puts ``lagging``'s view of the worker back as it was before, as if its
    watch lagged behind; returns what puts that stale view back again."""
    pool = mirror(lagging)
    stale, stale_revision = pool.entries[worker_id], pool.revisions[worker_id]

    def lag() -> None:
        pool.entries[worker_id], pool.revisions[worker_id] = stale, stale_revision

    await writer.workers.BeginWeightUpdate(
        wpb.BeginWeightUpdateRequest(version=version, worker_ids=[worker_id])
    )

    async def applied() -> bool:
        return pool.entries[worker_id].updating_to == version

    await eventually(applied)
    lag()
    return lag


async def test_a_heartbeat_from_a_lagging_shard_keeps_an_update_begun_elsewhere(
    shards: list[Harness],
) -> None:
    s0, s1 = shards[0], shards[1]
    await s0.workers.RegisterWorker(
        wpb.RegisterWorkerRequest(worker_id="lag", address="10.0.0.9:1", capacity=30)
    )

    async def seen() -> bool:
        return "lag" in mirror(s1).entries

    await eventually(seen)
    # Shard 1's view as it was before the update: as if its watch lagged behind.
    lag = await begin_behind(s1, s0, "lag", 2)
    reply = await s1.workers.Heartbeat(wpb.HeartbeatRequest(worker_id="lag"))
    assert reply.worker.updating_to_version == 2
    assert (await stored(s1, "lag")).updating_to == 2  # a blind put would have cleared it
    assert mirror(s1).entries["lag"].updating_to == 2
    # A heartbeat at the target ends it, from the lagging view too.
    lag()
    await s1.workers.Heartbeat(wpb.HeartbeatRequest(worker_id="lag", policy_version=2))
    ended = await stored(s1, "lag")
    assert (ended.updating_to, ended.policy_version) == (0, 2)


async def test_interrupting_sessions_reaches_every_shard(shards: list[Harness]) -> None:
    await shards[0].workers.RegisterWorker(
        wpb.RegisterWorkerRequest(worker_id="busy", address="10.0.0.8:1", capacity=30)
    )

    async def seen() -> bool:
        return all("busy" in mirror(h).entries for h in shards)

    await eventually(seen)
    names = []
    for i, h in enumerate(shards):  # one open session on the worker on each shard
        request = spb.StartGroupRequest(task_id="t", group_id=owned_group(i, 3, "busy"))
        request.group_size = 1
        started = await h.sessions.StartGroup(request)
        names.append((h, started.group.members[0].name))

    async def published() -> bool:  # each shard's load, as the others see it
        return all(mirror(h).cluster_open("busy") == 3 for h in shards)

    await eventually(published)
    begun = await shards[0].workers.BeginWeightUpdate(
        wpb.BeginWeightUpdateRequest(version=2, worker_ids=["busy"], interrupt_sessions=True)
    )
    assert begun.interrupted_sessions == 3  # its own, and the others' open ones

    async def marked() -> bool:
        for h, name in names:
            got = await h.sessions.GetSession(spb.GetSessionRequest(session=name))
            if not got.session.interrupted:
                return False
        return True

    await eventually(marked)


async def test_a_begin_that_loses_a_race_leaves_no_session_interrupted(
    shards: list[Harness],
) -> None:
    """Shard 0 begins an interrupting update of [ra, rb] from a view that lags behind
    (rb's update to 8, begun on shard 1, not seen yet): it writes ra, finds rb taken when it
    writes it, puts ra back and is refused. Nothing of it stays: ra is not updating, and no
    session on ra is marked interrupted, on any shard."""
    s0, s1 = shards[0], shards[1]
    for worker in ("ra", "rb"):
        await s0.workers.RegisterWorker(
            wpb.RegisterWorkerRequest(
                worker_id=worker, address="10.0.0.7:1", capacity=30, labels={"w": worker}
            )
        )

    async def seen() -> bool:
        return all(w in mirror(h).entries for h in shards for w in ("ra", "rb"))

    await eventually(seen)
    names = []
    for i, h in enumerate(shards):  # one open session on ra on each shard
        request = spb.StartGroupRequest(task_id="t", group_id=owned_group(i, 3, "race"))
        request.group_size = 1
        request.group_options.selector["w"] = "ra"
        started = await h.sessions.StartGroup(request)
        names.append((h, started.group.members[0].name))
    await begin_behind(s0, s1, "rb", 8)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await s0.workers.BeginWeightUpdate(
            wpb.BeginWeightUpdateRequest(
                version=7, worker_ids=["ra", "rb"], interrupt_sessions=True
            )
        )
    assert details_of(caught.value).reason == "UPDATE_IN_PROGRESS"
    put_back = await stored(s0, "ra")
    assert (put_back.updating_to, put_back.interrupt) == (0, False)
    latest = mirror(s0).revisions["ra"]

    async def caught_up() -> bool:  # every shard applied the put-back record
        return all(mirror(h).revisions.get("ra", 0) >= latest for h in shards)

    await eventually(caught_up)
    for h, name in names:
        got = await h.sessions.GetSession(spb.GetSessionRequest(session=name))
        assert not got.session.interrupted, name
    assert (await stored(s0, "rb")).updating_to == 8  # the winner's update holds
