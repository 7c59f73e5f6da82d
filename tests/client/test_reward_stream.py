"""The reward stream helper over the fake channel: batching, ack matching, failure handling.

The test plays the router's side of SubmitRewards with grpcio-testing's stream-stream fixture
(``take_request`` / ``send_response`` / ``terminate``) through ``FakeAioChannel``; see
``test_client_unary`` for why and how the sync fake drives the asyncio client.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.rpc import error_details_pb2

from sessionrouter.client import (
    GroupOutcome,
    InternalError,
    InvalidArgumentError,
    Replacement,
    RewardResult,
    RewardStatus,
    SessionRouterClient,
    StreamClosedError,
    UnavailableError,
)
from sessionrouter.v1 import resources_pb2 as rpb
from sessionrouter.v1 import session_service_pb2 as spb

from ._fake_channel import FakeAioChannel, Metadata, status_trailer


def name(i: int, group: str = "g1") -> str:
    return f"groups/{group}/sessions/{i}"


class RouterSide:
    """The router's end of one SubmitRewards stream."""

    def __init__(self, fake: FakeAioChannel) -> None:
        self.fake = fake
        self.rpc: object = None
        self.metadata: Metadata = {}

    async def accept(self) -> None:
        self.metadata, self.rpc = await self.fake.take_stream_stream("SubmitRewards")

    async def request(self) -> spb.SubmitRewardsRequest:
        request: spb.SubmitRewardsRequest = await self.fake.in_thread(self.rpc.take_request)  # type: ignore[attr-defined]
        return request

    def send(self, response: spb.SubmitRewardsResponse) -> None:
        self.rpc.send_response(response)  # type: ignore[attr-defined]

    def ack(self, request: spb.SubmitRewardsRequest, *statuses: spb.RewardStatus.ValueType) -> None:
        statuses = statuses or (spb.REWARD_STATUS_ACCEPTED,) * len(request.entries)
        results = [spb.RewardResult(status=s) for s in statuses]
        self.send(
            spb.SubmitRewardsResponse(ack=spb.RewardAck(sequence=request.sequence, results=results))
        )

    def group_result(self, group_id: str, cursor: int) -> None:
        result = rpb.GroupResult(
            cursor=cursor,
            group_id=group_id,
            outcome=rpb.GROUP_OUTCOME_COMPLETE,
            sessions=[name(0, group_id), name(1, group_id)],
            rewards=[1.0, 0.0],
            advantages=[0.7071, -0.7071],
        )
        self.send(spb.SubmitRewardsResponse(group_results=[result]))

    async def finish(self) -> None:
        """Ends the stream normally once the client has half-closed it."""
        await self.fake.in_thread(self.rpc.requests_closed)  # type: ignore[attr-defined]
        self.end()

    def end(
        self,
        code: grpc.StatusCode = grpc.StatusCode.OK,
        details: str = "",
        trailing: tuple[tuple[str, str | bytes], ...] = (),
    ) -> None:
        self.rpc.terminate(trailing, code, details)  # type: ignore[attr-defined]


@pytest.fixture
def router(fake: FakeAioChannel) -> RouterSide:
    return RouterSide(fake)


async def test_concurrent_submitters_share_one_request(
    client: SessionRouterClient, router: RouterSide
) -> None:
    statuses = [spb.REWARD_STATUS_ACCEPTED, spb.REWARD_STATUS_DUPLICATE, spb.REWARD_STATUS_CONFLICT]

    async def trainer() -> list[RewardStatus]:
        async with client.reward_stream(max_delay=0.05) as rs:
            results = await asyncio.gather(*(rs.submit(name(i), float(i)) for i in range(3)))
        return [r.status for r in results]

    async def server() -> spb.SubmitRewardsRequest:
        await router.accept()
        request = await router.request()
        router.ack(request, *statuses)
        await router.finish()
        return request

    got, request = await asyncio.gather(trainer(), server())
    assert [e.session for e in request.entries] == [name(0), name(1), name(2)]
    assert [e.reward for e in request.entries] == [0.0, 1.0, 2.0]
    assert request.sequence == 1
    assert got == [RewardStatus.ACCEPTED, RewardStatus.DUPLICATE, RewardStatus.CONFLICT]
    assert router.metadata["authorization"] == "Bearer s3cret"


async def test_max_batch_splits_requests_with_increasing_sequences(
    client: SessionRouterClient, router: RouterSide
) -> None:
    async def trainer() -> None:
        async with client.reward_stream(max_batch=4, max_delay=0.05) as rs:
            results = await rs.submit_many([(name(i), 1.0) for i in range(10)])
        assert all(r.ok for r in results)

    async def server() -> list[spb.SubmitRewardsRequest]:
        await router.accept()
        requests = []
        for _ in range(3):
            request = await router.request()
            router.ack(request)
            requests.append(request)
        await router.finish()
        return requests

    _, requests = await asyncio.gather(trainer(), server())
    assert [len(r.entries) for r in requests] == [4, 4, 2]
    assert [r.sequence for r in requests] == [1, 2, 3]
    sent = [e.session for r in requests for e in r.entries]
    assert sent == [name(i) for i in range(10)]


async def test_acks_are_matched_by_sequence_not_by_order(
    client: SessionRouterClient, router: RouterSide
) -> None:
    async def trainer() -> tuple[RewardStatus, RewardStatus]:
        async with client.reward_stream(max_batch=1, max_delay=0.0) as rs:
            first = asyncio.create_task(rs.submit(name(0), 1.0))
            second = asyncio.create_task(rs.submit(name(1), float("nan")))
            a, b = await asyncio.gather(first, second)
        return a.status, b.status

    async def server() -> None:
        await router.accept()
        one = await router.request()
        two = await router.request()
        router.ack(two, spb.REWARD_STATUS_NOT_FINITE)
        router.ack(one, spb.REWARD_STATUS_ACCEPTED)
        await router.finish()

    statuses, _ = await asyncio.gather(trainer(), server())
    assert statuses == (RewardStatus.ACCEPTED, RewardStatus.NOT_FINITE)


async def test_group_results_reach_results_and_watchers_even_after_the_last_ack(
    client: SessionRouterClient, router: RouterSide
) -> None:
    async def trainer() -> tuple[list[str], str]:
        async with client.reward_stream() as rs:
            watched = rs.watch_group("g1")
            await rs.submit_many([(name(0), 1.0), (name(1), 0.0)])
            result = await watched
        # After the block: the stream is over, results() yields what came and ends.
        return [g.group_id async for g in rs.results()], result.group_id

    async def server() -> None:
        await router.accept()
        request = await router.request()
        router.ack(request)
        router.group_result("g1", cursor=1)
        await router.fake.in_thread(router.rpc.requests_closed)  # type: ignore[attr-defined]
        router.group_result("g2", cursor=2)  # finalized late, still on this stream
        router.end()

    (results, watched), _ = await asyncio.gather(trainer(), server())
    assert watched == "g1"
    assert results == ["g1", "g2"]


async def test_a_dying_stream_fails_every_pending_entry_with_the_mapped_error(
    client: SessionRouterClient, router: RouterSide
) -> None:
    """Without reconnect (as ``submit_rewards`` uses it, retrying as a whole)."""
    info = error_details_pb2.ErrorInfo(reason="SHUTTING_DOWN")
    trailer = status_trailer(grpc.StatusCode.UNAVAILABLE, "router stopping", info)

    async def trainer() -> None:
        async with client.reward_stream(max_delay=0.05, reconnect=False) as rs:
            outcomes = await asyncio.gather(
                rs.submit(name(0), 1.0), rs.submit(name(1), 0.5), return_exceptions=True
            )
            assert all(isinstance(o, UnavailableError) for o in outcomes)
            assert all(o.reason == "SHUTTING_DOWN" for o in outcomes)  # type: ignore[union-attr]
            with pytest.raises(UnavailableError):
                await rs.submit(name(2), 1.0)  # the stream is gone: no silent drop either
        with pytest.raises(UnavailableError):
            [g async for g in rs.results()]

    async def server() -> None:
        await router.accept()
        await router.request()  # received, never acknowledged
        router.end(grpc.StatusCode.UNAVAILABLE, "router stopping", trailer)

    await asyncio.gather(trainer(), server())


async def test_a_stream_ended_before_its_ack_raises_stream_closed(
    client: SessionRouterClient, router: RouterSide
) -> None:
    async def trainer() -> None:
        async with client.reward_stream() as rs:
            with pytest.raises(StreamClosedError):
                await rs.submit(name(0), 1.0)

    async def server() -> None:
        await router.accept()
        await router.request()
        router.end()

    await asyncio.gather(trainer(), server())


async def test_an_ack_with_the_wrong_number_of_results_is_an_internal_error(
    client: SessionRouterClient, router: RouterSide
) -> None:
    async def trainer() -> None:
        async with client.reward_stream(max_delay=0.05) as rs:
            outcomes = await asyncio.gather(
                rs.submit(name(0), 1.0), rs.submit(name(1), 1.0), return_exceptions=True
            )
        assert all(isinstance(o, InternalError) for o in outcomes)

    async def server() -> None:
        await router.accept()
        request = await router.request()
        router.ack(request, spb.REWARD_STATUS_ACCEPTED)  # one result for two entries
        await router.fake.in_thread(router.rpc.cancelled)  # type: ignore[attr-defined]

    await asyncio.gather(trainer(), server())


async def test_leaving_with_an_exception_cancels_and_fails_what_is_pending(
    client: SessionRouterClient, router: RouterSide
) -> None:
    pending: list[asyncio.Task[object]] = []
    # The crash comes once the router holds the request, not after a guessed delay: a
    # request still unsent would be failed without reaching the router, whose
    # ``take_request`` (grpc_testing) then waits for it forever.
    sent = asyncio.Event()

    async def crash() -> None:
        async with client.reward_stream() as rs:
            pending.append(asyncio.create_task(rs.submit(name(0), 1.0)))
            await sent.wait()
            raise RuntimeError("trainer crashed")

    async def trainer() -> None:
        with pytest.raises(RuntimeError, match="trainer crashed"):
            await crash()
        with pytest.raises(StreamClosedError):
            await pending[0]

    async def server() -> None:
        await router.accept()
        await router.request()
        sent.set()
        await router.fake.in_thread(router.rpc.cancelled)  # type: ignore[attr-defined]

    await asyncio.gather(trainer(), server())


async def test_submit_rewards_one_shot_returns_results_and_group_results(
    client: SessionRouterClient, router: RouterSide
) -> None:
    async def server() -> spb.SubmitRewardsRequest:
        await router.accept()
        request = await router.request()
        router.ack(request, spb.REWARD_STATUS_ACCEPTED, spb.REWARD_STATUS_UNKNOWN_SESSION)
        router.group_result("g1", cursor=4)
        await router.finish()
        return request

    result, request = await asyncio.gather(
        client.submit_rewards({name(0): 1.0, "groups/nope/sessions/0": 0.0}), server()
    )
    assert len(request.entries) == 2
    assert [r.status for r in result.results] == [
        RewardStatus.ACCEPTED,
        RewardStatus.UNKNOWN_SESSION,
    ]
    assert [r.ok for r in result.results] == [True, False]
    assert [(g.group_id, g.cursor, g.outcome) for g in result.group_results] == [
        ("g1", 4, GroupOutcome.COMPLETE)
    ]


@pytest.mark.parametrize("kwargs", [{"max_batch": 0}, {"max_batch": 4097}, {"max_delay": -1.0}])
def test_reward_stream_refuses_bad_settings(
    client: SessionRouterClient, kwargs: dict[str, float]
) -> None:
    with pytest.raises(ValueError, match="must be"):
        client.reward_stream(**kwargs)  # type: ignore[arg-type]


async def test_submit_outside_the_block_is_a_usage_error(client: SessionRouterClient) -> None:
    with pytest.raises(RuntimeError, match="async with"):
        await client.reward_stream().submit(name(0), 1.0)


async def test_an_ack_and_several_group_results_in_one_message(
    client: SessionRouterClient, router: RouterSide
) -> None:
    async def trainer() -> tuple[bool, list[int]]:
        async with client.reward_stream() as rs:
            first, second = rs.watch_group("g1"), rs.watch_group("g2")
            result = await rs.submit(name(0), 1.0)
            await asyncio.gather(first, second)
        return result.ok, [g.cursor async for g in rs.results()]

    async def server() -> None:
        await router.accept()
        request = await router.request()
        results = [rpb.GroupResult(cursor=c, group_id=g) for c, g in ((11, "g1"), (12, "g2"))]
        ack = spb.RewardAck(
            sequence=request.sequence, results=[spb.RewardResult(status=spb.REWARD_STATUS_ACCEPTED)]
        )
        router.send(spb.SubmitRewardsResponse(ack=ack, group_results=results))
        await router.finish()

    (ok, cursors), _ = await asyncio.gather(trainer(), server())
    assert ok
    assert cursors == [11, 12]


async def test_submit_after_a_normal_close_says_closed(
    client: SessionRouterClient, router: RouterSide
) -> None:
    async def trainer() -> None:
        async with client.reward_stream() as rs:
            pass
        with pytest.raises(StreamClosedError, match="closed"):
            await rs.submit(name(0), 1.0)

    async def server() -> None:
        await router.accept()
        await router.finish()

    await asyncio.gather(trainer(), server())


async def test_a_lost_stream_is_reopened_and_what_was_not_acknowledged_resent(
    client: SessionRouterClient, router: RouterSide
) -> None:
    """The router drains after recording the second reward but before acking it: the client
    resends it on a new stream, where it comes back DUPLICATE, which is ok."""
    info = error_details_pb2.ErrorInfo(reason="SHUTTING_DOWN", domain="sessionrouter.dev")
    trailer = status_trailer(grpc.StatusCode.UNAVAILABLE, "shutting down", info)

    async def trainer() -> tuple[RewardResult, RewardResult, BaseException]:
        async with client.reward_stream(max_delay=0.0) as rs:
            watched = rs.watch_group("g1")
            first = await rs.submit(name(0), 1.0)
            second = await rs.submit(name(1), 0.0)
        lost = watched.exception()
        assert lost is not None
        return first, second, lost

    async def server() -> list[spb.SubmitRewardsRequest]:
        await router.accept()
        one = await router.request()
        router.ack(one)
        two = await router.request()
        router.end(grpc.StatusCode.UNAVAILABLE, "shutting down", trailer)
        await router.accept()
        resent = await router.request()
        router.ack(resent, spb.REWARD_STATUS_DUPLICATE)
        await router.finish()
        return [one, two, resent]

    (first, second, lost), (one, two, resent) = await asyncio.gather(trainer(), server())
    assert first.status is RewardStatus.ACCEPTED
    assert second.status is RewardStatus.DUPLICATE and second.ok
    assert list(resent.entries) == list(two.entries)
    assert resent.sequence > two.sequence > one.sequence
    # A watched group's result may have been on the lost stream: its watcher is told.
    assert isinstance(lost, StreamClosedError) and "feed" in str(lost)


async def test_reconnects_stop_after_max_attempts_lost_streams_in_a_row(
    client: SessionRouterClient, router: RouterSide
) -> None:
    """The client's policy allows 3 attempts: the third lost stream fails the entry."""

    async def trainer() -> None:
        async with client.reward_stream(max_delay=0.0) as rs:
            with pytest.raises(UnavailableError, match="down") as caught:
                await rs.submit(name(0), 1.0)
        assert any("3 tries" in note for note in caught.value.__notes__)

    async def server() -> None:
        for _ in range(3):
            await router.accept()
            await router.request()
            router.end(grpc.StatusCode.UNAVAILABLE, "down")

    await asyncio.gather(trainer(), server())


async def test_an_answer_from_the_router_is_not_a_reason_to_reconnect(
    client: SessionRouterClient, router: RouterSide
) -> None:
    code = grpc.StatusCode.INVALID_ARGUMENT
    info = error_details_pb2.ErrorInfo(reason="TOO_MANY_ENTRIES", domain="sessionrouter.dev")

    async def trainer() -> None:
        async with client.reward_stream(max_delay=0.0) as rs:
            with pytest.raises(InvalidArgumentError):
                await rs.submit(name(0), 1.0)

    async def server() -> None:
        await router.accept()
        await router.request()
        router.end(code, "too many", status_trailer(code, "too many", info))

    await asyncio.gather(trainer(), server())


async def test_filter_metrics_are_sent_only_where_given(
    client: SessionRouterClient, router: RouterSide
) -> None:
    async def trainer() -> None:
        async with client.reward_stream(max_delay=0.05) as rs:
            await asyncio.gather(
                rs.submit(name(0), 1.0, filter_metric=0.5),
                rs.submit(name(1), 0.0),
                rs.submit_many([(name(2), 1.0, 0.25), (name(3), 1.0), (name(4), 0.0, None)]),
            )

    async def server() -> spb.SubmitRewardsRequest:
        await router.accept()
        request = await router.request()
        router.ack(request)
        await router.finish()
        return request

    _, request = await asyncio.gather(trainer(), server())
    sent = {
        e.session: e.filter_metric if e.HasField("filter_metric") else None for e in request.entries
    }
    assert sent == {name(0): 0.5, name(1): None, name(2): 0.25, name(3): None, name(4): None}


async def test_submit_rewards_sends_the_filter_metrics_it_is_given(
    client: SessionRouterClient, router: RouterSide
) -> None:
    async def server() -> spb.SubmitRewardsRequest:
        await router.accept()
        request = await router.request()
        router.ack(request)
        await router.finish()
        return request

    result, request = await asyncio.gather(
        client.submit_rewards({name(0): 1.0, name(1): 0.0}, filter_metrics={name(1): 3.0}),
        server(),
    )
    assert [r.ok for r in result.results] == [True, True]
    assert [e.HasField("filter_metric") for e in request.entries] == [False, True]
    assert request.entries[1].filter_metric == 3.0


async def test_a_bad_entry_shape_is_a_value_error(
    client: SessionRouterClient, router: RouterSide
) -> None:
    """Refused before anything is sent: the stream stays usable and closes normally."""

    async def trainer() -> None:
        async with client.reward_stream() as rs:
            with pytest.raises(ValueError, match="session, reward"):
                await rs.submit_many([(name(0),)])  # type: ignore[list-item]

    async def server() -> None:
        await router.accept()
        await router.finish()

    await asyncio.gather(trainer(), server())


async def test_replacement_notices_reach_the_hook_and_a_failing_hook_ends_nothing(
    client: SessionRouterClient, router: RouterSide
) -> None:
    seen: list[Replacement] = []

    def hook(notice: Replacement) -> None:
        seen.append(notice)
        if len(seen) == 1:
            raise RuntimeError("the trainer's hook is broken")

    async def trainer() -> bool:
        async with client.reward_stream(on_replacement=hook) as rs:
            result = await rs.submit(name(0), 1.0)
        return result.ok

    async def server() -> None:
        await router.accept()
        notices = [
            spb.MemberReplaced(
                group_id="g1",
                replaced_session=name(i),
                replacement=rpb.Session(name=name(i + 2), group_id="g1", index=i + 2),
                reason="worker_lost",
            )
            for i in (0, 1)
        ]
        router.send(spb.SubmitRewardsResponse(replacements=notices[:1]))
        request = await router.request()
        router.send(spb.SubmitRewardsResponse(replacements=notices[1:]))
        router.ack(request)
        await router.finish()

    ok, _ = await asyncio.gather(trainer(), server())
    assert ok  # the hook's failure is logged, the stream goes on
    assert [(n.group_id, n.replaced_session, n.session.name, n.reason) for n in seen] == [
        ("g1", name(0), name(2), "worker_lost"),
        ("g1", name(1), name(3), "worker_lost"),
    ]
