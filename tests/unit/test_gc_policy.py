"""The serving process's collector settings: frozen startup heap, rarer young passes."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from sessionrouter.server.gc_policy import SERVING_THRESHOLDS, settle_heap


@pytest.fixture
def restored_gc() -> Iterator[None]:
    """Puts the test process's collector back as it was (settle_heap is process-wide)."""
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


@pytest.mark.usefixtures("restored_gc")
def test_settle_heap_freezes_what_is_alive_and_raises_the_young_threshold() -> None:
    alive = [[i] for i in range(100)]
    settle_heap()
    assert gc.get_threshold() == SERVING_THRESHOLDS
    assert gc.get_freeze_count() >= len(alive)


@pytest.mark.usefixtures("restored_gc")
def test_cycles_made_after_settling_are_still_collected() -> None:
    settle_heap()

    class Node:
        peer: object = None

    a, b = Node(), Node()
    a.peer, b.peer = b, a
    del a, b
    assert gc.collect() >= 2
