"""Crash test: a real router process, ``kill -9`` at random moments, restarted on its state dir.

Concurrent producers start groups, abort a few members and stream rewards; a trainer-side
subscriber follows the feed and resumes by cursor after every restart. The router is killed
with SIGKILL a few times (fixed seed, so a failure replays), restarted on the same directory,
and after each restart and at the end the test checks what the contract promises:

- every reward whose ack said ACCEPTED (or DUPLICATE) is there, with its value;
- every group whose StartGroup reply arrived exists, with the members the reply named;
- no group is finalized twice, and cursors run 1..N without gaps;
- the subscriber, resuming with its last cursor, receives every finalized group exactly once,
  and a cursor a reward stream reported is never given to another group.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from sessionrouter.v1 import resources_pb2 as pb
from sessionrouter.v1 import session_service_pb2 as spb
from sessionrouter.v1 import session_service_pb2_grpc as spb_grpc
from tests.router_process import RouterProcess, static_workers

SEED = 20261130
KILLS = 3
RUN_S = (1.5, 3.5)
"""How long each run lasts before its SIGKILL, seconds (drawn from the seeded generator)."""
PRODUCERS = 6
GROUP_SIZE = 4

ACCEPTED = {spb.REWARD_STATUS_ACCEPTED, spb.REWARD_STATUS_DUPLICATE}
DEAD_ROUTER_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.INTERNAL,
}


def reward_of(session: str) -> float:
    """The one reward a session ever gets, so a resubmission after a crash is a duplicate."""
    return (zlib.crc32(session.encode()) % 1000) / 1000.0


@dataclass
class Observed:
    """What the clients were told, across every run."""

    attempted: set[str] = field(default_factory=set)
    groups: dict[str, list[str]] = field(default_factory=dict)
    """Groups whose StartGroup reply arrived: id -> member names."""
    rewarded: dict[str, float] = field(default_factory=dict)
    aborted: set[str] = field(default_factory=set)
    stream_cursors: dict[int, str] = field(default_factory=dict)
    """Cursors seen in group results on reward streams -> group id."""
    feed: list[pb.GroupResult] = field(default_factory=list)
    caught_up: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the feed holds as many groups as were started."""

    def to_abort(self, names: list[str]) -> list[str]:
        """The members this test aborts instead of rewarding: the last one of about a quarter
        of the groups."""
        return [n for n in names if n.endswith("/sessions/3") and zlib.crc32(n.encode()) % 4 == 0]

    def owed(self, group_id: str) -> list[str]:
        """Members with neither an acknowledged reward nor an acknowledged abort."""
        return [
            n for n in self.groups[group_id] if n not in self.rewarded and n not in self.aborted
        ]


async def submit(stub: spb_grpc.SessionServiceAsyncStub, seen: Observed, names: list[str]) -> None:
    """Sends the rewards of ``names`` in requests of two entries on one stream, reading acks
    and group results until the server ends the stream."""
    chunks = [names[i : i + 2] for i in range(0, len(names), 2)]
    call = stub.SubmitRewards()
    for seq, chunk in enumerate(chunks, 1):
        entries = [spb.RewardEntry(session=n, reward=reward_of(n)) for n in chunk]
        await call.write(spb.SubmitRewardsRequest(entries=entries, sequence=seq))
    await call.done_writing()
    while (response := await call.read()) is not grpc.aio.EOF:
        assert isinstance(response, spb.SubmitRewardsResponse)
        if response.HasField("ack"):
            chunk = chunks[response.ack.sequence - 1]
            for name, result in zip(chunk, response.ack.results, strict=True):
                assert result.status in ACCEPTED, (name, result)
                seen.rewarded[name] = reward_of(name)
        for group in response.group_results:
            assert seen.stream_cursors.setdefault(group.cursor, group.group_id) == group.group_id


async def complete(stub: spb_grpc.SessionServiceAsyncStub, seen: Observed, group_id: str) -> None:
    names = seen.groups[group_id]
    for name in seen.to_abort(names):
        if name not in seen.aborted and name not in seen.rewarded:
            await stub.AbortSession(spb.AbortSessionRequest(session=name, reason="crash test"))
            seen.aborted.add(name)
    owed = [n for n in names if n not in seen.aborted and n not in seen.rewarded]
    if owed:
        await submit(stub, seen, owed)


async def start_group(
    stub: spb_grpc.SessionServiceAsyncStub, seen: Observed, group_id: str
) -> None:
    seen.attempted.add(group_id)
    reply = await stub.StartGroup(
        spb.StartGroupRequest(
            task_id="t", group_id=group_id, group_size=GROUP_SIZE, request_id=f"r-{group_id}"
        )
    )
    names = [m.name for m in reply.group.members]
    assert seen.groups.setdefault(group_id, names) == names
    assert len(names) == GROUP_SIZE


async def produce(stub: spb_grpc.SessionServiceAsyncStub, seen: Observed, tag: str) -> None:
    n = 0
    while True:
        group_id = f"{tag}-{n}"
        n += 1
        await start_group(stub, seen, group_id)
        await complete(stub, seen, group_id)


async def follow_feed(stub: spb_grpc.SessionServiceAsyncStub, seen: Observed) -> None:
    after = seen.feed[-1].cursor if seen.feed else 0
    call = stub.SubscribeGroups(spb.SubscribeGroupsRequest(after_cursor=after))
    async for response in call:
        for group in response.groups:
            expected = seen.feed[-1].cursor + 1 if seen.feed else 1
            assert group.cursor == expected, f"cursor {group.cursor} after {expected - 1}"
            seen.feed.append(group)
        if len(seen.feed) >= len(seen.groups):
            seen.caught_up.set()


async def verify_durable(stub: spb_grpc.SessionServiceAsyncStub, seen: Observed) -> None:
    """After a restart: every acknowledged change is there."""
    for group_id, names in seen.groups.items():
        group = (await stub.GetGroup(spb.GetGroupRequest(group_id=group_id))).group
        assert [m.name for m in group.members] == names
        for member in group.members:
            if member.name in seen.rewarded:
                assert member.state == pb.SESSION_STATE_REWARDED, member.name
                assert member.reward == seen.rewarded[member.name]
            if member.name in seen.aborted:
                assert member.state == pb.SESSION_STATE_ABORTED, member.name


async def drive(
    channel: grpc.aio.Channel, seen: Observed, tag: str, seconds: float
) -> list[asyncio.Task[None]]:
    """Checks what earlier runs were told, then starts the clients and returns their tasks
    after ``seconds`` (the caller then kills the router under them)."""
    stub = spb_grpc.SessionServiceStub(channel)
    await verify_durable(stub, seen)
    tasks = [asyncio.create_task(follow_feed(stub, seen))]
    # Starts whose reply never came are retried with their request id: replayed or created.
    for group_id in sorted(seen.attempted - set(seen.groups)):
        await start_group(stub, seen, group_id)
    tasks += [asyncio.create_task(complete(stub, seen, g)) for g in seen.groups if seen.owed(g)]
    tasks += [asyncio.create_task(produce(stub, seen, f"{tag}p{i}")) for i in range(PRODUCERS)]
    await asyncio.sleep(seconds)
    return tasks


async def finish(channel: grpc.aio.Channel, seen: Observed) -> None:
    """Last run, no kill: completes every group and waits until the feed has them all."""
    stub = spb_grpc.SessionServiceStub(channel)
    await verify_durable(stub, seen)
    feed = asyncio.create_task(follow_feed(stub, seen))
    for group_id in sorted(seen.attempted - set(seen.groups)):
        await start_group(stub, seen, group_id)
    await asyncio.gather(*(complete(stub, seen, g) for g in seen.groups if seen.owed(g)))
    if len(seen.feed) < len(seen.groups):
        seen.caught_up.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(seen.caught_up.wait(), 30)
    await asyncio.sleep(0.2)  # anything more (a group finalized twice) would show up now
    feed.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await feed
    await verify_durable(stub, seen)


async def reap(tasks: list[asyncio.Task[None]]) -> None:
    """The router was killed: every client call fails with UNAVAILABLE (or was cancelled)."""
    done, pending = await asyncio.wait(tasks, timeout=30)
    assert not pending, "client tasks hung after the router died"
    errors = [task.exception() for task in done]  # all retrieved before any assert
    for error in errors:
        if error is None:
            continue
        if isinstance(error, asyncio.InvalidStateError):
            # grpc.aio's client reports a stream write after the call already failed this
            # way (the router died between the failure and the next write).
            assert str(error) == "RPC already finished.", repr(error)
            continue
        assert isinstance(error, grpc.aio.AioRpcError), repr(error)
        # A write on a connection that just died is reported as INTERNAL by grpc's client.
        assert error.code() in DEAD_ROUTER_CODES, error


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_kill_9_loses_no_acknowledged_reward_and_finalizes_each_group_once(
    tmp_path: Path,
) -> None:
    rng = random.Random(SEED)
    seen = Observed()
    router = RouterProcess(
        tmp_path,
        *("--state-dir", str(tmp_path / "state"), "--log-level", "warning"),
        *static_workers(4, 1_000_000),
    )
    try:
        for kill in range(KILLS):
            async with grpc.aio.insecure_channel(router.start()) as channel:
                tasks = await drive(channel, seen, f"k{kill}", rng.uniform(*RUN_S))
                router.kill9()
                await reap(tasks)
        async with grpc.aio.insecure_channel(router.start()) as channel:
            await finish(channel, seen)
    finally:
        code = router.stop()
    assert code == 0, router.tail()

    assert len(seen.groups) > 100, "the runs were too short to test anything"
    cursors = [g.cursor for g in seen.feed]
    assert cursors == list(range(1, len(cursors) + 1))
    finalized = [g.group_id for g in seen.feed]
    assert len(set(finalized)) == len(finalized), "a group was finalized twice"
    assert set(finalized) == set(seen.groups), "a complete group never reached the feed"
    by_cursor = {g.cursor: g.group_id for g in seen.feed}
    for cursor, group_id in seen.stream_cursors.items():
        assert by_cursor[cursor] == group_id, f"cursor {cursor} was reassigned"
    for result in seen.feed:
        assert [reward_of(s) for s in result.sessions] == list(result.rewards)
        assert all(seen.rewarded[s] == reward_of(s) for s in result.sessions)
        assert set(result.excluded_sessions) <= seen.aborted
        assert result.outcome in (pb.GROUP_OUTCOME_COMPLETE, pb.GROUP_OUTCOME_PARTIAL)
    assert seen.aborted, "no abort was exercised"
