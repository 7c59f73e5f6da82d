"""Fixtures for the client's unit tests: a fake channel and a client over it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import cast

import grpc
import pytest

from sessionrouter.client import RetryPolicy, SessionRouterClient

from ._fake_channel import FakeAioChannel

FAST_RETRIES = RetryPolicy(max_attempts=3, initial_backoff=0.001, max_backoff=0.002)
"""Backoffs short enough that retry tests take milliseconds."""


@pytest.fixture
def fake() -> Iterator[FakeAioChannel]:
    channel = FakeAioChannel()
    yield channel
    channel.shutdown()


@pytest.fixture
async def client(fake: FakeAioChannel) -> AsyncIterator[SessionRouterClient]:
    async with SessionRouterClient(
        cast(grpc.aio.Channel, fake),
        token="s3cret",
        metadata=[("x-trainer", "unit")],
        default_timeout=5.0,
        retry_policy=FAST_RETRIES,
    ) as c:
        yield c
