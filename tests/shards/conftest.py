"""Fixtures of the sharded-router tests: a real nats-server (see ``support``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.shards.support import NatsServer


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
