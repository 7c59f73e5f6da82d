"""Weight updates and the trainer's counters across three shard processes, NATS and nginx.

A BeginWeightUpdate reaching one shard (through nginx, which sends a call without a group id
to any shard, or to one shard's address) takes the workers out of every shard's placement
until CompleteWeightUpdate or a heartbeat at the target version, on any shard, puts them
back; a fleet-wide update holds starts on every shard; two conflicting updates begun at once
on two shards never leave a mixture; a restarted shard takes the update state from NATS
over its journal. Bad input gets exactly the single
router's refusals (compared call by call against one unsharded router), and with NATS down
both calls are UNAVAILABLE NATS_UNAVAILABLE. GetTrainerState on any shard counts the groups
and the worker versions of the whole fleet, and MIXED_VERSIONS is refused by the pool's.

The tests share one cluster and run in file order: the NATS outage is last.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import grpc
import pytest

from sessionrouter.client import SessionRouterClient
from sessionrouter.v1 import resources_pb2 as pb
from sessionrouter.v1 import session_service_pb2 as spb
from sessionrouter.v1 import session_service_pb2_grpc as spb_grpc
from sessionrouter.v1 import worker_service_pb2 as wpb
from sessionrouter.v1 import worker_service_pb2_grpc as wpb_grpc
from tests.shards.support import eventually, owned_group
from tests.support import details_of, start_harness, stop_harness

from ._cluster import Cluster, running

N = 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running(Cluster(tmp_path_factory.mktemp("updates"), N)) as c:
        yield c


class Stubs:
    """Both services over one channel."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.workers = wpb_grpc.WorkerServiceStub(channel)
        self.sessions = spb_grpc.SessionServiceStub(channel)


@pytest.fixture
async def shards(cluster: Cluster) -> AsyncIterator[list[Stubs]]:
    """One channel to each shard's own address."""
    channels = [grpc.aio.insecure_channel(a) for a in cluster.addresses]
    try:
        yield [Stubs(c) for c in channels]
    finally:
        for channel in channels:
            await channel.close()


@pytest.fixture
async def nginx(cluster: Cluster) -> AsyncIterator[Stubs]:
    """One channel to the nginx shard map (no x-group-id: any shard answers)."""
    async with grpc.aio.insecure_channel(cluster.nginx.target) as channel:
        yield Stubs(channel)


def run_id() -> str:
    return uuid.uuid4().hex[:8]


def owned(prefix: str, per_shard: int) -> dict[int, list[str]]:
    """Group ids by the shard that owns them, ``per_shard`` each."""
    return {i: [owned_group(i, N, f"{prefix}-{k}") for k in range(per_shard)] for i in range(N)}


@contextlib.asynccontextmanager
async def pool(
    shards: list[Stubs], workers: dict[str, int], labels: dict[str, str]
) -> AsyncIterator[None]:
    """Registers ``workers`` (id: capacity) once, on shard 0, keeps them heartbeating through
    shard 1 and deregisters them at the end; returns once every shard sees them."""
    for i, (worker, capacity) in enumerate(workers.items()):
        await shards[0].workers.RegisterWorker(
            wpb.RegisterWorkerRequest(
                worker_id=worker, address=f"10.7.0.{i}:1", capacity=capacity, labels=labels
            )
        )

    async def beat() -> None:
        while True:
            for worker in workers:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await shards[1].workers.Heartbeat(wpb.HeartbeatRequest(worker_id=worker))
            await asyncio.sleep(0.5)

    async def seen() -> bool:
        for s in shards:
            for worker in workers:
                try:
                    await s.workers.GetWorker(wpb.GetWorkerRequest(worker_id=worker))
                except grpc.aio.AioRpcError:
                    return False
        return True

    beating = asyncio.create_task(beat())
    try:
        await eventually(seen, 20)
        yield
    finally:
        beating.cancel()
        await asyncio.gather(beating, return_exceptions=True)
        for worker in workers:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await shards[0].workers.DeregisterWorker(
                    wpb.DeregisterWorkerRequest(worker_id=worker)
                )


async def on_every_shard(
    shards: list[Stubs], worker: str, check: Callable[[pb.Worker], bool]
) -> Callable[[], Awaitable[bool]]:
    async def all_agree() -> bool:
        for s in shards:
            got = await s.workers.GetWorker(wpb.GetWorkerRequest(worker_id=worker))
            if not check(got.worker):
                return False
        return True

    return all_agree


async def placed_on(
    shards: list[Stubs], groups: dict[int, list[str]], labels: dict[str, str]
) -> set[str]:
    """Starts each group (1 member) on the shard that owns it; the workers used."""
    used: set[str] = set()
    for index, ids in groups.items():
        for group in ids:
            request = spb.StartGroupRequest(task_id="t", group_id=group, group_size=1)
            request.group_options.selector.update(labels)
            started = await shards[index].sessions.StartGroup(request)
            used.update(m.worker_id for m in started.group.members)
    return used


async def test_an_update_begun_on_one_shard_keeps_every_shard_off_the_worker(
    shards: list[Stubs], nginx: Stubs
) -> None:
    run = run_id()
    updating, other = f"up-{run}", f"other-{run}"
    labels = {"run": run}
    async with pool(shards, {updating: 300, other: 300}, labels):
        begun = await nginx.workers.BeginWeightUpdate(
            wpb.BeginWeightUpdateRequest(version=2, worker_ids=[updating])
        )
        assert [w.worker_id for w in begun.workers] == [updating]
        assert begun.workers[0].updating_to_version == 2
        # Seen by every shard at once (the writer applied it; the others within a watch).
        await eventually(
            await on_every_shard(shards, updating, lambda w: w.updating_to_version == 2)
        )
        used = await placed_on(shards, owned(f"a-{run}", 4), labels)
        assert used == {other}  # no shard placed a session on the updating worker
        for s in shards:  # the fleet's update, whichever shard is asked
            state = (await s.sessions.GetTrainerState(spb.GetTrainerStateRequest())).state
            assert (state.weight_update_version, state.weight_update_fleet_wide) == (2, False)
            assert state.workers_updating == 1
        done = await nginx.workers.CompleteWeightUpdate(
            wpb.CompleteWeightUpdateRequest(worker_id=updating)
        )
        assert done.update_finished and done.worker.policy_version == 2
        await eventually(
            await on_every_shard(
                shards, updating, lambda w: (w.updating_to_version, w.policy_version) == (0, 2)
            )
        )
        assert updating in await placed_on(shards, owned(f"b-{run}", 12), labels)

        # Begun on shard 2, ended by a heartbeat at the target version sent to shard 0.
        await shards[2].workers.BeginWeightUpdate(
            wpb.BeginWeightUpdateRequest(version=3, worker_ids=[updating])
        )
        await eventually(
            await on_every_shard(shards, updating, lambda w: w.updating_to_version == 3)
        )
        assert await placed_on(shards, owned(f"c-{run}", 3), labels) == {other}
        await shards[0].workers.Heartbeat(
            wpb.HeartbeatRequest(worker_id=updating, policy_version=3)
        )
        await eventually(
            await on_every_shard(
                shards, updating, lambda w: (w.updating_to_version, w.policy_version) == (0, 3)
            )
        )

        async def marker_cleared() -> bool:
            for s in shards:
                state = (await s.sessions.GetTrainerState(spb.GetTrainerStateRequest())).state
                if state.weight_update_version or state.workers_updating:
                    return False
            return True

        await eventually(marker_cleared)


async def test_a_fleet_wide_update_holds_starts_on_every_shard(
    shards: list[Stubs], nginx: Stubs
) -> None:
    run = run_id()
    workers = [f"fw-{run}-{i}" for i in range(2)]
    labels = {"run": run}
    async with pool(shards, dict.fromkeys(workers, 30), labels):
        begun = await nginx.workers.BeginWeightUpdate(wpb.BeginWeightUpdateRequest(version=5))
        assert {w.worker_id for w in begun.workers} >= set(workers)

        async def held() -> bool:
            for s in shards:
                state = (await s.sessions.GetTrainerState(spb.GetTrainerStateRequest())).state
                if (state.weight_update_version, state.weight_update_fleet_wide) != (5, True):
                    return False
            return True

        await eventually(held)
        for index, ids in owned(f"fw-{run}", 1).items():
            request = spb.StartGroupRequest(task_id="t", group_id=ids[0], group_size=1)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await shards[index].sessions.StartGroup(request)
            details = details_of(caught.value)
            assert (details.code, details.reason) == (
                grpc.StatusCode.UNAVAILABLE,
                "WEIGHT_UPDATE_IN_PROGRESS",
            ), index
            assert details.metadata["version"] == "5"
        # Each worker completed through another shard: the last one ends the update.
        finished = []
        for i, worker in enumerate(w.worker_id for w in begun.workers):
            done = await shards[i % N].workers.CompleteWeightUpdate(
                wpb.CompleteWeightUpdateRequest(worker_id=worker)
            )
            finished.append(done.update_finished)
        assert finished[-1] and not any(finished[:-1])

        async def released() -> bool:
            for s in shards:
                state = (await s.sessions.GetTrainerState(spb.GetTrainerStateRequest())).state
                if state.weight_update_version:
                    return False
            return True

        await eventually(released)
        assert await placed_on(shards, owned(f"fw2-{run}", 1), labels) <= set(workers)


Call = tuple[str, wpb.BeginWeightUpdateRequest | wpb.CompleteWeightUpdateRequest]
"""A named request for one of the two weight update calls."""


def bad_calls(worker: str, at_5: str, updating_7: str) -> list[Call]:
    """Bad weight update calls; ``worker`` serves no version, ``at_5`` serves version 5 and
    ``updating_7`` is updating to 7."""
    begin, complete = wpb.BeginWeightUpdateRequest, wpb.CompleteWeightUpdateRequest
    return [
        ("version 0", begin(version=0, worker_ids=[worker])),
        ("beyond SQLite", begin(version=2**63, worker_ids=[worker])),
        ("unknown worker", begin(version=2, worker_ids=["nobody-here"])),
        ("bad worker id", begin(version=2, worker_ids=[""])),
        ("backwards", begin(version=3, worker_ids=[at_5])),
        ("same version", begin(version=5, worker_ids=[at_5])),
        ("conflicting update", begin(version=8, worker_ids=[updating_7])),
        ("one good one bad", begin(version=4, worker_ids=[worker, at_5])),
        ("complete unknown", complete(worker_id="nobody-here")),
        ("complete not updating", complete(worker_id=worker)),
        ("complete below target", complete(worker_id=updating_7, version=6)),
        ("complete beyond SQLite", complete(worker_id=updating_7, version=2**63)),
    ]


async def refusals(
    stubs: Stubs, calls: list[Call]
) -> list[tuple[str, grpc.StatusCode, str, dict[str, str]]]:
    """(name, code, reason, metadata) of each call, which must be refused."""
    got = []
    for name, request in calls:
        call: Awaitable[object] = (
            stubs.workers.BeginWeightUpdate(request)
            if isinstance(request, wpb.BeginWeightUpdateRequest)
            else stubs.workers.CompleteWeightUpdate(request)
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call
        details = details_of(caught.value)
        got.append((name, details.code, details.reason, dict(details.metadata)))
    return got


async def prepare(stubs: Stubs, worker: str, at_5: str, updating_7: str) -> None:
    for i, (w, version) in enumerate(((worker, 0), (at_5, 5), (updating_7, 0))):
        await stubs.workers.RegisterWorker(
            wpb.RegisterWorkerRequest(
                worker_id=w, address=f"10.8.0.{i}:1", capacity=9, policy_version=version
            )
        )
    await stubs.workers.BeginWeightUpdate(
        wpb.BeginWeightUpdateRequest(version=7, worker_ids=[updating_7])
    )


async def test_bad_updates_get_the_single_routers_refusals(
    shards: list[Stubs], nginx: Stubs
) -> None:
    run = run_id()
    names = (f"plain-{run}", f"at5-{run}", f"upd7-{run}")
    single = await start_harness()
    try:
        await prepare(Stubs(single.channel), *names)
        expected = await refusals(Stubs(single.channel), bad_calls(*names))
    finally:
        await stop_harness(single)
    await prepare(nginx, *names)
    try:

        async def everywhere() -> bool:
            for s in shards:
                got = await s.workers.GetWorker(wpb.GetWorkerRequest(worker_id=names[2]))
                if got.worker.updating_to_version != 7:
                    return False
            return True

        await eventually(everywhere)
        for stubs in [nginx, *shards]:
            assert await refusals(stubs, bad_calls(*names)) == expected
        # Nothing changed: the update to 7 still holds, on every shard.
        for s in shards:
            for name, updating_to in zip(names, (0, 0, 7), strict=True):
                got = await s.workers.GetWorker(wpb.GetWorkerRequest(worker_id=name))
                assert got.worker.updating_to_version == updating_to
    finally:
        for name in names:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await shards[0].workers.DeregisterWorker(
                    wpb.DeregisterWorkerRequest(worker_id=name)
                )


async def test_get_trainer_state_counts_the_whole_fleet(shards: list[Stubs]) -> None:
    run = run_id()
    labels = {"run": run}
    # The counters count while a policy is set (a roomy one here).
    policy = pb.StalenessPolicy(max_staleness=1000, batch_size=1000)
    await shards[2].sessions.SetTrainerState(spb.SetTrainerStateRequest(version=1, policy=policy))

    async def states() -> list[pb.TrainerState]:
        return [
            (await s.sessions.GetTrainerState(spb.GetTrainerStateRequest())).state for s in shards
        ]

    async def counters() -> list[tuple[int, int]]:
        return [(t.groups_started, t.groups_dropped) for t in await states()]

    async def agreed() -> bool:
        applied = all(t.policy.batch_size == 1000 for t in await states())
        return applied and len(set(await counters())) == 1

    async with pool(shards, {f"count-{run}": 300}, labels):
        await eventually(agreed)
        started0, dropped0 = (await counters())[0]
        groups = owned(f"count-{run}", 2)  # 2 on each shard
        await placed_on(shards, groups, labels)
        # One group of shard 1 dropped: its only member aborted for good.
        dropped_group = groups[1][0]
        await shards[1].sessions.AbortSession(
            spb.AbortSessionRequest(
                session=(
                    await shards[1].sessions.GetGroup(spb.GetGroupRequest(group_id=dropped_group))
                )
                .group.members[0]
                .name,
                reason="test",
                retryable=False,
            )
        )

        async def counted() -> bool:
            return set(await counters()) == {(started0 + 6, dropped0 + 1)}

        await eventually(counted)
    await shards[0].sessions.SetTrainerState(
        spb.SetTrainerStateRequest(version=1, clear_policy=True)
    )


async def test_every_shard_counts_the_versions_of_the_whole_pool(shards: list[Stubs]) -> None:
    """``distinct_worker_versions`` and the MIXED_VERSIONS refusal read the whole pool on
    every shard: workers of capacity 1 have a share on one shard of 3 only, so a shard that
    read its own table would count 0 or 1 of them."""
    run = run_id()
    labels = {"run": run}
    a, b = f"ver-{run}-a", f"ver-{run}-b"

    async def versions() -> list[int]:
        return [
            (
                await s.sessions.GetTrainerState(spb.GetTrainerStateRequest())
            ).state.distinct_worker_versions
            for s in shards
        ]

    async def agreed() -> bool:
        return len(set(await versions())) == 1

    await eventually(agreed)
    before = (await versions())[0]
    async with pool(shards, {a: 1, b: 1}, labels):
        for worker, version in ((a, 101), (b, 102)):
            await shards[2].workers.Heartbeat(
                wpb.HeartbeatRequest(worker_id=worker, policy_version=version)
            )

        async def counted(want: int) -> Callable[[], Awaitable[bool]]:
            async def check() -> bool:
                return await versions() == [want] * N

            return check

        await eventually(await counted(before + 2))
        trainer = (await shards[0].sessions.GetTrainerState(spb.GetTrainerStateRequest())).state
        await shards[0].sessions.SetTrainerState(
            spb.SetTrainerStateRequest(version=trainer.version, refuse_mixed_versions=True)
        )
        try:
            for index, ids in owned(f"ver-{run}", 1).items():
                request = spb.StartGroupRequest(task_id="t", group_id=ids[0], group_size=1)
                request.group_options.selector.update(labels)

                async def refused(
                    index: int = index, request: spb.StartGroupRequest = request
                ) -> bool:
                    try:
                        await shards[index].sessions.StartGroup(request)
                    except grpc.aio.AioRpcError as error:
                        return details_of(error).reason == "MIXED_VERSIONS"
                    return False

                await eventually(refused)
        finally:
            await shards[0].sessions.SetTrainerState(
                spb.SetTrainerStateRequest(version=trainer.version, refuse_mixed_versions=False)
            )
        await shards[2].workers.Heartbeat(wpb.HeartbeatRequest(worker_id=a, policy_version=102))
        await eventually(await counted(before + 1))


def updating_to(version: int) -> Callable[[pb.Worker], bool]:
    return lambda w: w.updating_to_version == version


def serving(version: int) -> Callable[[pb.Worker], bool]:
    """Out of any update, at ``version``."""
    return lambda w: (w.updating_to_version, w.policy_version) == (0, version)


async def test_the_python_client_updates_the_fleet_with_one_call(
    cluster: Cluster, shards: list[Stubs]
) -> None:
    run = run_id()
    worker = f"py-{run}"
    labels = {"run": run}
    async with pool(shards, {worker: 30}, labels):
        for client in (
            SessionRouterClient.connect(cluster.addresses, default_timeout=20.0),
            SessionRouterClient.connect(cluster.nginx.target, shard_count=N, default_timeout=20.0),
        ):
            async with client:
                version = (await client.get_worker(worker)).policy_version + 1
                async with client.weight_update(version, worker_ids=[worker]) as update:
                    assert [w.worker_id for w in update.workers] == [worker]
                    await eventually(await on_every_shard(shards, worker, updating_to(version)))
                await eventually(await on_every_shard(shards, worker, serving(version)))


async def test_conflicting_updates_on_two_shards_never_leave_a_mixture(
    shards: list[Stubs],
) -> None:
    run = run_id()
    a, b = f"race-{run}-a", f"race-{run}-b"
    async with pool(shards, {a: 30, b: 30}, {"run": run}):
        # Opposite orders: each call may find the other's first write on its second worker.
        outcomes = await asyncio.gather(
            shards[0].workers.BeginWeightUpdate(
                wpb.BeginWeightUpdateRequest(version=7, worker_ids=[a, b])
            ),
            shards[1].workers.BeginWeightUpdate(
                wpb.BeginWeightUpdateRequest(version=8, worker_ids=[b, a])
            ),
            return_exceptions=True,
        )
        won = [v for v, o in zip((7, 8), outcomes, strict=True) if not isinstance(o, Exception)]
        for outcome in outcomes:
            if isinstance(outcome, grpc.aio.AioRpcError):
                assert details_of(outcome).reason == "UPDATE_IN_PROGRESS", outcome
            else:
                assert not isinstance(outcome, Exception), outcome
        assert len(won) <= 1, outcomes  # never both
        want = won[0] if won else 0

        async def settled() -> bool:
            for s in shards:
                for worker in (a, b):
                    got = await s.workers.GetWorker(wpb.GetWorkerRequest(worker_id=worker))
                    if got.worker.updating_to_version != want:
                        return False
            return True

        await eventually(settled)  # the winner's version on both workers, or nothing begun
        if won:
            for worker in (a, b):
                await shards[2].workers.CompleteWeightUpdate(
                    wpb.CompleteWeightUpdateRequest(worker_id=worker)
                )


async def test_a_restarted_shard_takes_the_update_state_from_nats(
    cluster: Cluster, shards: list[Stubs]
) -> None:
    run = run_id()
    updating, other = f"rs-{run}-up", f"rs-{run}-other"
    labels = {"run": run}
    async with pool(shards, {updating: 30, other: 30}, labels):
        await shards[0].workers.BeginWeightUpdate(
            wpb.BeginWeightUpdateRequest(version=4, worker_ids=[updating])
        )
        await eventually(await on_every_shard(shards, updating, updating_to(4)))
        victim = cluster.shards[1]
        victim.kill9()
        victim.start()
        # Journaled and in the pool alike: still out of placement after the restart.
        await eventually(await on_every_shard(shards, updating, updating_to(4)), 30)

        async def beating_again() -> bool:  # restored workers wait for a heartbeat
            got = await shards[1].workers.GetWorker(wpb.GetWorkerRequest(worker_id=other))
            return got.worker.health == pb.WORKER_HEALTH_HEALTHY

        await eventually(beating_again, 30)
        assert await placed_on(shards, {1: owned(f"rs-{run}", 3)[1]}, labels) == {other}
        # Completed while the shard is down: its journal still says "updating", NATS wins.
        victim.kill9()
        done = await shards[0].workers.CompleteWeightUpdate(
            wpb.CompleteWeightUpdateRequest(worker_id=updating)
        )
        assert done.update_finished
        victim.start()
        await eventually(await on_every_shard(shards, updating, serving(4)), 30)


async def test_with_nats_down_updates_are_unavailable(
    cluster: Cluster, shards: list[Stubs]
) -> None:
    run = run_id()
    worker = f"down-{run}"
    await shards[0].workers.RegisterWorker(
        wpb.RegisterWorkerRequest(worker_id=worker, address="10.9.9.9:1", capacity=9)
    )
    await eventually(await on_every_shard(shards, worker, lambda w: w.worker_id == worker))
    cluster.nats.kill()
    try:
        for s in shards:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await s.workers.BeginWeightUpdate(
                    wpb.BeginWeightUpdateRequest(version=2, worker_ids=[worker])
                )
            details = details_of(caught.value)
            assert (details.code, details.reason) == (
                grpc.StatusCode.UNAVAILABLE,
                "NATS_UNAVAILABLE",
            )
            # Bad input keeps its own refusal.
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await s.workers.BeginWeightUpdate(
                    wpb.BeginWeightUpdateRequest(version=0, worker_ids=[worker])
                )
            assert details_of(caught.value).reason == "INVALID_VERSION"
            got = await s.workers.GetWorker(wpb.GetWorkerRequest(worker_id=worker))
            assert got.worker.updating_to_version == 0  # nothing half-begun
    finally:
        cluster.nats.restart()
