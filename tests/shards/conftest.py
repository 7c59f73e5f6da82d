"""Fixtures of the sharded-router tests: a real nats-server and three in-process shards
over it (see ``support``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from sessionrouter.server.shards.identity import DEFAULT_LEASE_CHUNK
from tests.shards.support import NatsServer, start_shard
from tests.support import Harness, stop_harness


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A nats-server with JetStream on 127.0.0.1, its store under the test's tmp_path."""
    server = NatsServer(tmp_path / "nats")
    server.workdir.mkdir()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def shards(
    nats_server: NatsServer, request: pytest.FixtureRequest
) -> AsyncIterator[list[Harness]]:
    """Shards 0/3, 1/3 and 2/3, each given the test module's static ``WORKERS`` (none when
    it defines none) and its ``LEASE_CHUNK`` (the default when it defines none)."""
    workers = getattr(request.module, "WORKERS", ())
    chunk = getattr(request.module, "LEASE_CHUNK", DEFAULT_LEASE_CHUNK)
    started = [
        await start_shard(nats_server.url, i, 3, workers=workers, lease_chunk=chunk)
        for i in range(3)
    ]
    try:
        yield started
    finally:
        for h in started:
            await stop_harness(h)
