"""Shard routing over fake channels: which channel and which ``x-group-id`` each call gets, and
how a ``WRONG_SHARD`` refusal is followed once (to the owner it names) and then raised."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import cast

import grpc
import pytest
from google.rpc import error_details_pb2

from sessionrouter.client import FailedPreconditionError, InvalidArgumentError, SessionRouterClient
from sessionrouter.client._shards import GROUP_HEADER, group_of_session, routing_key
from sessionrouter.client.shardmap import shard_of
from sessionrouter.v1 import resources_pb2 as rpb
from sessionrouter.v1 import session_service_pb2 as spb
from sessionrouter.v1 import worker_service_pb2 as wpb

from ._fake_channel import FakeAioChannel, status_trailer
from .conftest import FAST_RETRIES

N = 3
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


def group_on(shard: int, prefix: str = "g") -> str:
    """A group id that shard ``shard`` of N owns."""
    return next(f"{prefix}{k}" for k in range(1000) if shard_of(f"{prefix}{k}", N) == shard)


WRONG = "group g belongs to another shard"


def wrong_shard(owner: int, address: str = "") -> tuple[tuple[str, str | bytes], ...]:
    """The trailer of a WRONG_SHARD refusal (status message ``WRONG``)."""
    metadata = {"owner_shard": str(owner), "shard_count": str(N)}
    if address:
        metadata["owner_address"] = address
    info = error_details_pb2.ErrorInfo(reason="WRONG_SHARD", metadata=metadata)
    return status_trailer(FAILED_PRECONDITION, WRONG, info)


@pytest.fixture
def fakes() -> Iterator[list[FakeAioChannel]]:
    channels = [FakeAioChannel() for _ in range(N)]
    yield channels
    for channel in channels:
        channel.shutdown()


@pytest.fixture
async def sharded(fakes: list[FakeAioChannel]) -> AsyncIterator[SessionRouterClient]:
    async with SessionRouterClient(
        [cast(grpc.aio.Channel, f) for f in fakes],
        addresses=[f"10.0.0.{i}:50051" for i in range(N)],
        default_timeout=5.0,
        retry_policy=FAST_RETRIES,
    ) as c:
        yield c


def test_group_of_session() -> None:
    assert group_of_session("groups/g-1/sessions/3") == "g-1"
    for bad in ("g", "groups//sessions/0", "groups/g/sessions", "x/g/sessions/0", ""):
        assert group_of_session(bad) is None


def test_routing_keys_map_to_their_shard() -> None:
    for count in (1, 2, 3, 7, 64):
        for shard in range(count):
            assert shard_of(routing_key(shard, count), count) == shard


async def test_calls_naming_a_group_go_to_its_owner_with_the_header(
    fakes: list[FakeAioChannel], sharded: SessionRouterClient
) -> None:
    assert sharded.shard_count == N
    for owner in range(N):
        group = group_on(owner)
        reply = spb.GetGroupResponse(group=rpb.Group(group_id=group))
        got, (md, request) = await asyncio.gather(
            sharded.get_group(group), fakes[owner].reply("GetGroup", reply)
        )
        assert got.group_id == group and request.group_id == group
        assert md[GROUP_HEADER] == group
        session = f"groups/{group}/sessions/0"
        reply_s = spb.GetSessionResponse(session=rpb.Session(name=session, group_id=group))
        _, (md, _) = await asyncio.gather(
            sharded.get_session(session), fakes[owner].reply("GetSession", reply_s)
        )
        assert md[GROUP_HEADER] == group


async def test_calls_naming_no_group_go_round_robin_without_the_header(
    fakes: list[FakeAioChannel], sharded: SessionRouterClient
) -> None:
    reply = wpb.HeartbeatResponse(worker=rpb.Worker(worker_id="w"))
    for turn in range(2 * N):
        _, (md, _) = await asyncio.gather(
            sharded.heartbeat("w"), fakes[turn % N].reply("Heartbeat", reply)
        )
        assert GROUP_HEADER not in md


async def test_wrong_shard_is_followed_once_to_the_owner_shard(
    fakes: list[FakeAioChannel], sharded: SessionRouterClient
) -> None:
    group = group_on(0)
    reply = spb.GetGroupResponse(group=rpb.Group(group_id=group))

    async def routers() -> None:
        await fakes[0].reply(
            "GetGroup", code=FAILED_PRECONDITION, details=WRONG, trailing=wrong_shard(2)
        )
        await fakes[2].reply("GetGroup", reply)

    got, _ = await asyncio.gather(sharded.get_group(group), routers())
    assert got.group_id == group


async def test_wrong_shard_is_followed_by_owner_address(
    fakes: list[FakeAioChannel], sharded: SessionRouterClient
) -> None:
    group = group_on(1)
    reply = spb.GetGroupResponse(group=rpb.Group(group_id=group))

    async def routers() -> None:
        # The address wins over the index (here they disagree on purpose).
        trailer = wrong_shard(0, address="10.0.0.2:50051")
        await fakes[1].reply("GetGroup", code=FAILED_PRECONDITION, details=WRONG, trailing=trailer)
        await fakes[2].reply("GetGroup", reply)

    got, _ = await asyncio.gather(sharded.get_group(group), routers())
    assert got.group_id == group


async def test_a_second_wrong_shard_is_raised(
    fakes: list[FakeAioChannel], sharded: SessionRouterClient
) -> None:
    group = group_on(0)

    async def routers() -> None:
        await fakes[0].reply(
            "GetGroup", code=FAILED_PRECONDITION, details=WRONG, trailing=wrong_shard(1)
        )
        await fakes[1].reply(
            "GetGroup", code=FAILED_PRECONDITION, details=WRONG, trailing=wrong_shard(2)
        )

    with pytest.raises(FailedPreconditionError) as caught:
        await asyncio.gather(sharded.get_group(group), routers())
    assert caught.value.reason == "WRONG_SHARD"
    assert caught.value.metadata["owner_shard"] == "2"


async def test_other_failed_preconditions_are_not_followed(
    fakes: list[FakeAioChannel], sharded: SessionRouterClient
) -> None:
    group = group_on(2)
    info = error_details_pb2.ErrorInfo(reason="GROUP_FULL", metadata={"owner_shard": "0"})
    trailer = status_trailer(FAILED_PRECONDITION, "full", info)
    with pytest.raises(FailedPreconditionError) as caught:
        await asyncio.gather(
            sharded.start_session("t", group_id=group, group_size=2),
            fakes[2].reply(
                "StartSession", code=FAILED_PRECONDITION, details="full", trailing=trailer
            ),
        )
    assert caught.value.reason == "GROUP_FULL"


async def test_list_groups_walks_the_shards_in_order(
    fakes: list[FakeAioChannel], sharded: SessionRouterClient
) -> None:
    async def routers() -> list[str]:
        pages = [(0, ["a0"], "p2"), (0, ["a"], ""), (1, ["b"], ""), (2, ["c"], "")]
        tokens = []
        for shard, groups, token in pages:
            response = spb.ListGroupsResponse(
                groups=[rpb.Group(group_id=g) for g in groups], next_page_token=token
            )
            _, request = await fakes[shard].reply("ListGroups", response)
            tokens.append(request.page_token)
        return tokens

    async def collect() -> list[str]:
        return [g.group_id async for g in sharded.iter_groups(page_size=1)]

    got, tokens = await asyncio.gather(collect(), routers())
    assert got == ["a0", "a", "b", "c"]
    assert tokens == ["", "p2", "", ""]  # each shard sees only its own tokens


async def test_a_malformed_sharded_page_token_is_invalid_argument(
    sharded: SessionRouterClient,
) -> None:
    for bad in ("p2", "9:x", "x:y"):
        with pytest.raises(InvalidArgumentError, match="page token"):
            await sharded.list_groups(page_token=bad)


async def test_through_a_proxy_every_call_naming_a_group_carries_it() -> None:
    proxy = FakeAioChannel()
    try:
        async with SessionRouterClient(
            cast(grpc.aio.Channel, proxy), shard_count=N, retry_policy=FAST_RETRIES
        ) as c:
            assert c.shard_count == N
            group = group_on(1)
            reply = spb.GetGroupResponse(group=rpb.Group(group_id=group))
            _, (md, _) = await asyncio.gather(c.get_group(group), proxy.reply("GetGroup", reply))
            assert md[GROUP_HEADER] == group
            started = spb.StartSessionResponse(session=rpb.Session(name="groups/x/sessions/0"))
            _, (md, _) = await asyncio.gather(
                c.start_session("t"), proxy.reply("StartSession", started)
            )
            assert GROUP_HEADER not in md  # the proxy picks; the shard mints a group it owns
            pages = spb.ListGroupsResponse()
            _, (md, _) = await asyncio.gather(
                c.list_groups(page_token="2:"), proxy.reply("ListGroups", pages)
            )
            assert md[GROUP_HEADER] == routing_key(2, N)  # reaches shard 2 through the proxy
            # A WRONG_SHARD through a proxy names no address this client can reach: raised.
            with pytest.raises(FailedPreconditionError):
                await asyncio.gather(
                    c.get_group(group),
                    proxy.reply(
                        "GetGroup", code=FAILED_PRECONDITION, details=WRONG, trailing=wrong_shard(2)
                    ),
                )
    finally:
        proxy.shutdown()


async def test_an_unsharded_client_sends_no_group_header(fakes: list[FakeAioChannel]) -> None:
    async with SessionRouterClient(cast(grpc.aio.Channel, fakes[0])) as c:
        assert c.shard_count == 1
        reply = spb.GetGroupResponse(group=rpb.Group(group_id="g"))
        _, (md, _) = await asyncio.gather(c.get_group("g"), fakes[0].reply("GetGroup", reply))
        assert GROUP_HEADER not in md


def test_bad_layouts_are_refused() -> None:
    with pytest.raises(ValueError, match="shard_count"):
        SessionRouterClient.connect(["127.0.0.1:1", "127.0.0.1:2"], shard_count=2)
    with pytest.raises(ValueError, match="at least one"):
        SessionRouterClient.connect([])
    with pytest.raises(ValueError, match="shard_count"):
        SessionRouterClient.connect("127.0.0.1:1", shard_count=0)


async def test_trainer_state_goes_to_one_shard(
    fakes: list[FakeAioChannel], sharded: SessionRouterClient
) -> None:
    """The shards share one trainer state (NATS KV): one call, on the next shard in turn
    (sending it to each would repeat a counter reset)."""
    reply = spb.SetTrainerStateResponse(state=rpb.TrainerState(version=7))
    for turn in range(N):
        state, (_, request) = await asyncio.gather(
            sharded.set_trainer_version(7 + turn), fakes[turn].reply("SetTrainerState", reply)
        )
        assert (state.version, request.version) == (7, 7 + turn)
