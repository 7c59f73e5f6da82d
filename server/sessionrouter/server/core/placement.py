"""Where the next member of a group runs.

Rule, in order:
1. the least-loaded eligible worker that no member of the group uses yet;
2. only when every eligible worker already holds a member of this group (the pool has fewer
   eligible workers than members): the eligible worker holding the fewest members of this
   group, then the least loaded, so members spread evenly (never a third member on one worker
   while another eligible worker holds one) and the reply says the placement is shared;
   in strict mode this case is ResourceExhausted instead;
3. no eligible worker at all: Unavailable, with a retry hint.

Rule 2 scans only the group's own workers (at most the group size), never the whole pool.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from sessionrouter.server.core.errors import ResourceExhausted, Unavailable
from sessionrouter.server.core.workers import WorkerRecord, WorkerRegistry


class PlacementMode(enum.Enum):
    """What to do when a group has more members than there are eligible workers."""

    SPREAD = "spread"
    """Share workers, evenly, and say so in the reply."""
    STRICT = "strict"
    """Refuse with ResourceExhausted."""


@dataclass(frozen=True, slots=True)
class PlacementChoice:
    worker: WorkerRecord
    shared: bool
    """True when the worker already holds another member of the same group."""


def choose_worker(
    registry: WorkerRegistry,
    group_id: str,
    members_per_worker: Mapping[str, int],
    mode: PlacementMode,
    retry_after_s: float,
) -> PlacementChoice:
    """Picks the worker for one more member of ``group_id``.

    ``members_per_worker`` maps worker_id to how many members of the group it holds already.
    """
    worker = registry.least_loaded(exclude=members_per_worker)
    if worker is not None:
        return PlacementChoice(worker, shared=False)
    candidates = [
        w
        for w in (registry.find(worker_id) for worker_id in members_per_worker)
        if w is not None and w.eligible
    ]
    if not candidates:
        raise Unavailable(
            "NO_ELIGIBLE_WORKER",
            "no worker can take a session now (none registered, healthy, undrained and"
            " below capacity)",
            retry_after_s=retry_after_s,
            metadata={"group_id": group_id, "workers": len(registry)},
        )
    if mode is PlacementMode.STRICT:
        raise ResourceExhausted(
            "NOT_ENOUGH_DISTINCT_WORKERS",
            f"group {group_id!r} already uses every eligible worker"
            f" ({len(candidates)}); strict placement refuses to share one",
            metadata={
                "group_id": group_id,
                "eligible_workers": registry.eligible_count,
                "members_placed": sum(members_per_worker.values()),
            },
        )
    best = min(
        candidates,
        key=lambda w: (members_per_worker[w.worker_id], w.load, w.worker_id),
    )
    return PlacementChoice(best, shared=True)
