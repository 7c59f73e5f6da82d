"""Drives a router through the public client, with whatever protobuf and grpcio are installed.

Run by tests/compat in venvs at the ends of the supported range (``python client_probe.py``,
``SESSIONROUTER_ADDRESS`` set, warnings as errors): every kind of message the client
exchanges (unary calls, a reward stream, the feed, well-known types, rich error details
decoded by grpcio-status) goes through the stubs and the protobuf runtime of that venv.
Prints one JSON line with the versions it ran on; any failed check exits non-zero.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import uuid
from collections.abc import Awaitable
from datetime import timedelta
from importlib.metadata import version
from typing import TypeVar

from sessionrouter.client import (
    FailedPreconditionError,
    GroupOptions,
    GroupOutcome,
    InvalidArgumentError,
    NotFoundError,
    RewardStatus,
    SessionRouterClient,
    SessionRouterError,
)

ADDRESS = os.environ["SESSIONROUTER_ADDRESS"]
E = TypeVar("E", bound=SessionRouterError)


async def refusal(call: Awaitable[object], expected: type[E]) -> E:
    """The error ``call`` fails with, which must be an ``expected``."""
    try:
        await call
    except expected as error:
        return error
    raise AssertionError(f"the call succeeded; expected {expected.__name__}")


async def probe() -> dict[str, object]:
    run = uuid.uuid4().hex[:8]
    async with SessionRouterClient.connect(ADDRESS) as client:
        workers = [w async for w in client.iter_workers(page_size=3)]
        assert len(workers) >= 4, workers

        options = GroupOptions(deadline=timedelta(minutes=5), min_members=2)
        started = await client.start_group("probe", 4, group_id=f"{run}-g", options=options)
        group = await client.get_group(started.group_id)
        assert group.options.deadline == timedelta(minutes=5), group.options  # Duration
        assert group.create_time is not None and group.create_time.tzinfo is not None  # Timestamp
        assert len({s.worker_id for s in started.sessions}) == 4

        # Rich error details (ErrorInfo, BadRequest) through grpcio-status and this protobuf.
        size = await refusal(
            client.start_session("probe", group_id=f"{run}-g", group_size=5), InvalidArgumentError
        )
        assert size.reason == "GROUP_SIZE_MISMATCH", size
        assert size.metadata["expected"] == "4" and size.metadata["got"] == "5", size
        assert [f for f, _ in size.field_violations] == ["group_size"], size
        full = await refusal(
            client.start_session("probe", group_id=f"{run}-g"), FailedPreconditionError
        )
        assert full.reason == "GROUP_FULL", full
        missing = await refusal(client.get_group(f"{run}-missing"), NotFoundError)
        assert missing.code is not None and missing.code.name == "NOT_FOUND", missing

        # One reward stream: good and bad entries side by side, the group's result back.
        rewards = dict(zip((s.name for s in started.sessions), (1.0, 0.0, 0.5, 0.25), strict=True))
        async with client.reward_stream() as stream:
            bad = await stream.submit(f"groups/{run}-g/sessions/9", 1.0)
            nan = await stream.submit(started.sessions[0].name, math.nan)
            acks = await stream.submit_many(rewards.items())
        assert bad.status is RewardStatus.UNKNOWN_SESSION, bad
        assert nan.status is RewardStatus.NOT_FINITE, nan
        assert all(a.status is RewardStatus.ACCEPTED for a in acks), acks
        (result,) = [r async for r in stream.results()]
        assert result.outcome is GroupOutcome.COMPLETE and result.rewards == tuple(rewards.values())
        assert abs(float(result.advantages_array.sum())) < 1e-9

        # The feed, resumed from the cursor before this group: the same result again.
        feed = client.subscribe_groups(after_cursor=result.cursor - 1)
        again = await anext(feed)
        await feed.aclose()
        assert again == result, (again, result)
    return {
        "protobuf": version("protobuf"),
        "grpcio": version("grpcio"),
        "grpcio-status": version("grpcio-status"),
        "numpy": version("numpy"),
        "cursor": result.cursor,
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(probe())))
