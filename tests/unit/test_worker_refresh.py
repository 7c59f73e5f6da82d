"""A freed slot refreshes its worker's heap entry once, before the next lookup."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from sessionrouter.server.core.workers import SessionKey, WorkerRecord, WorkerRegistry


@dataclass(frozen=True, eq=False)
class Placed:
    """A stand-in session record: the registry hashes it by identity, as it does records."""

    key: SessionKey


@cache
def placed(group_id: str, index: int) -> Placed:
    """The one stand-in of session (group_id, index)."""
    return Placed((group_id, index))


def two_workers(
    capacity_a: int, open_a: int, open_b: int
) -> tuple[WorkerRegistry, WorkerRecord, WorkerRecord]:
    """Workers "a" (sessions ("g", i)) and "b" (capacity 100, sessions ("h", i))."""
    registry = WorkerRegistry(heartbeat_timeout_s=60.0)
    a, _ = registry.register("a", "10.0.0.1:1", capacity_a, {}, 0.0, 0.0)
    b, _ = registry.register("b", "10.0.0.2:1", 100, {}, 0.0, 0.0)
    for i in range(open_a):
        registry.add_session(a, placed("g", i))
    for i in range(open_b):
        registry.add_session(b, placed("h", i))
    return registry, a, b


def test_released_slots_are_seen_by_the_next_lookup_with_one_push_per_worker() -> None:
    registry, a, b = two_workers(100, 10, 5)
    assert registry.least_loaded(exclude=()) is b
    heap = registry.pool(()).heap
    before = len(heap)
    for i in range(8):  # a falls to 2 open sessions, below b's 5
        registry.release_session("a", placed("g", i))
    assert len(heap) == before  # nothing pushed per release...
    assert registry.least_loaded(exclude=()) is a  # ...but the lookup sees the new load
    assert len(registry.pool(()).heap) <= before + 1  # one push for a, however many releases


def test_a_full_worker_that_frees_a_slot_is_eligible_at_once() -> None:
    registry = WorkerRegistry(heartbeat_timeout_s=60.0)
    a, _ = registry.register("a", "10.0.0.1:1", 2, {}, 0.0, 0.0)
    registry.add_session(a, placed("g", 0))
    registry.add_session(a, placed("g", 1))
    assert registry.eligible_count == 0 and registry.least_loaded(exclude=()) is None
    registry.release_session("a", placed("g", 0))
    assert registry.eligible_count == 1  # counts are never deferred
    assert registry.pool(()).eligible_capacity == 2
    assert registry.least_loaded(exclude=()) is a
    registry.release_session("gone", placed("g", 1))  # an unknown worker: nothing to free
    registry.release_session("a", placed("g", 7))  # a session it does not hold: nothing either
    assert len(a.open_sessions) == 1


def test_slots_released_together_count_once_and_make_a_full_worker_eligible() -> None:
    registry, a, b = two_workers(3, 3, 2)
    assert registry.eligible_count == 1 and registry.least_loaded(exclude=()) is b
    # Two of a's sessions, one it never held: a falls to 1 open session and is eligible.
    registry.release_sessions("a", [placed("g", 0), placed("g", 2), placed("g", 9)])
    assert len(a.open_sessions) == 1 and registry.eligible_count == 2
    assert registry.pool(()).eligible_capacity == 103
    assert registry.least_loaded(exclude={"b"}) is a
    registry.release_sessions("a", [placed("g", 1)])  # a (not full) to 0/3: refreshed before lookup
    assert registry.least_loaded(exclude=()) is a
    registry.release_sessions("gone", [placed("g", 1)])  # an unknown worker: nothing to free
    registry.release_sessions("b", [])
    assert len(b.open_sessions) == 2 and registry.eligible_count == 2
