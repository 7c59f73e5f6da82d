"""``subscribe_groups`` over the fake channel: resuming from the last cursor, giving up, errors.

The test plays the router's side of SubscribeGroups with grpcio-testing's unary-stream fixture
through ``FakeAioChannel``; see ``test_client_unary`` for how the sync fake drives the client.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from google.rpc import error_details_pb2

from sessionrouter.client import (
    GroupResult,
    OutOfRangeError,
    RetryPolicy,
    SessionRouterClient,
    UnavailableError,
)
from sessionrouter.v1 import resources_pb2 as rpb
from sessionrouter.v1 import session_service_pb2 as spb

from ._fake_channel import FakeAioChannel, status_trailer

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


def groups(*cursors: int) -> spb.SubscribeGroupsResponse:
    return spb.SubscribeGroupsResponse(
        groups=[rpb.GroupResult(cursor=c, group_id=f"g{c}") for c in cursors]
    )


async def take(fake: FakeAioChannel) -> tuple[spb.SubscribeGroupsRequest, object]:
    _, request, rpc = await fake.take_unary_stream("SubscribeGroups")
    return request, rpc


class Trainer:
    """Consumes a subscription; lets the router side wait until messages were read.

    grpcio-testing's fake drops responses not yet read when the RPC is terminated (a real
    channel delivers them before the status), so the router side waits for the reads before
    ending a stream.
    """

    def __init__(self, client: SessionRouterClient) -> None:
        self.client = client
        self.results: list[GroupResult] = []
        self._read = asyncio.Condition()

    async def first(self, n: int, **kwargs: object) -> list[GroupResult]:
        """The first ``n`` results of a subscription, which is then closed."""
        feed = self.client.subscribe_groups(**kwargs)  # type: ignore[arg-type]
        async with contextlib.aclosing(feed):
            async for result in feed:
                async with self._read:
                    self.results.append(result)
                    self._read.notify_all()
                if len(self.results) == n:
                    break
        return self.results

    async def has_read(self, n: int) -> None:
        async with self._read:
            await self._read.wait_for(lambda: len(self.results) >= n)


async def test_resumes_after_the_last_delivered_cursor(
    fake: FakeAioChannel, client: SessionRouterClient
) -> None:
    trainer = Trainer(client)

    async def router() -> list[spb.SubscribeGroupsRequest]:
        one, rpc = await take(fake)
        rpc.send_response(groups(6, 7))  # type: ignore[attr-defined]
        await trainer.has_read(2)
        rpc.terminate((), UNAVAILABLE, "router restarting")  # type: ignore[attr-defined]
        two, rpc = await take(fake)
        rpc.send_response(groups(7, 8))  # type: ignore[attr-defined]  # 7 again: not twice
        await fake.in_thread(rpc.cancelled)  # type: ignore[attr-defined]
        return [one, two]

    results, requests = await asyncio.gather(trainer.first(3, after_cursor=5), router())
    assert [r.cursor for r in results] == [6, 7, 8]
    assert [(r.after_cursor, r.from_latest) for r in requests] == [(5, False), (7, False)]
    assert requests[0] == spb.SubscribeGroupsRequest(after_cursor=5)


async def test_a_stream_the_router_ends_is_resumed_too(
    fake: FakeAioChannel, client: SessionRouterClient
) -> None:
    trainer = Trainer(client)

    async def router() -> int:
        _, rpc = await take(fake)
        rpc.send_response(groups(1))  # type: ignore[attr-defined]
        await trainer.has_read(1)
        rpc.terminate((), grpc.StatusCode.OK, "")  # type: ignore[attr-defined]
        request, rpc = await take(fake)
        rpc.send_response(groups(2))  # type: ignore[attr-defined]
        await fake.in_thread(rpc.cancelled)  # type: ignore[attr-defined]
        return request.after_cursor

    results, resumed_from = await asyncio.gather(trainer.first(2), router())
    assert [r.group_id for r in results] == ["g1", "g2"]
    assert resumed_from == 1


async def test_from_latest_holds_until_the_first_group(
    fake: FakeAioChannel, client: SessionRouterClient
) -> None:
    trainer = Trainer(client)

    async def router() -> list[spb.SubscribeGroupsRequest]:
        one, rpc = await take(fake)
        rpc.terminate((), UNAVAILABLE, "blip")  # type: ignore[attr-defined]
        two, rpc = await take(fake)
        rpc.send_response(groups(40))  # type: ignore[attr-defined]
        await trainer.has_read(1)
        rpc.terminate((), UNAVAILABLE, "blip")  # type: ignore[attr-defined]
        three, rpc = await take(fake)
        rpc.send_response(groups(41))  # type: ignore[attr-defined]
        await fake.in_thread(rpc.cancelled)  # type: ignore[attr-defined]
        return [one, two, three]

    _, requests = await asyncio.gather(trainer.first(2, from_latest=True), router())
    assert [(r.after_cursor, r.from_latest) for r in requests] == [
        (0, True),
        (0, True),
        (40, False),
    ]


async def test_out_of_range_is_raised_with_the_oldest_cursor(
    fake: FakeAioChannel, client: SessionRouterClient
) -> None:
    code = grpc.StatusCode.OUT_OF_RANGE
    info = error_details_pb2.ErrorInfo(reason="CURSOR_EXPIRED", metadata={"oldest_cursor": "100"})

    async def router() -> None:
        _, rpc = await take(fake)
        rpc.terminate(status_trailer(code, "cursor 3 expired", info), code, "cursor 3 expired")  # type: ignore[attr-defined]

    with pytest.raises(OutOfRangeError) as caught:
        await asyncio.gather(Trainer(client).first(1, after_cursor=3), router())
    assert caught.value.metadata == {"oldest_cursor": "100"}


async def test_gives_up_after_consecutive_failed_connections(fake: FakeAioChannel) -> None:
    client = SessionRouterClient(
        fake,  # type: ignore[arg-type]
        retry_policy=RetryPolicy(max_attempts=2, initial_backoff=0.001, max_backoff=0.002),
    )

    async def router() -> None:
        for _ in range(2):
            _, rpc = await take(fake)
            rpc.terminate((), UNAVAILABLE, "down")  # type: ignore[attr-defined]

    with pytest.raises(UnavailableError, match="down"):
        await asyncio.gather(Trainer(client).first(1), router())
