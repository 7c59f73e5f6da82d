"""Shared fixtures: real routers on 127.0.0.1:0 (see tests/support.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from sessionrouter.server.app import WorkerSpec
from tests.support import Harness, start_harness, stop_harness


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    """A router with no workers and default settings."""
    h = await start_harness()
    try:
        yield h
    finally:
        await stop_harness(h)


@pytest.fixture
async def router_address() -> AsyncIterator[str]:
    """Address of a real router with workers w1..w3 of capacity 4 registered."""
    h = await start_harness(
        workers=tuple(WorkerSpec(f"w{i}", f"10.0.0.{i}:30000", 4) for i in (1, 2, 3))
    )
    try:
        yield h.address
    finally:
        await stop_harness(h)
