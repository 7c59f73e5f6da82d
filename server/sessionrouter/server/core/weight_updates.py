"""Weight updates: which workers are out of placement while they load new weights.

A weight update names a target policy version and a set of workers (every registered worker
when none is named: a *fleet-wide* update). Each selected worker takes no new sessions until
``CompleteWeightUpdate`` or a heartbeat reporting the target version (or a newer one) puts it
back. While a fleet-wide update lasts, starts wait or are refused Unavailable, as the caller
asks: there is no worker to place them on, and a group started on half-updated workers would
mix policies. The per-worker state (``WorkerRecord.updating_to``) is the truth; this module
holds the checks and the fleet-wide marker. The checks read any worker table with ids,
versions and targets (``UpdatableWorker``): a single router's registry, or the pool a sharded
router's shards share (``shards.pool``), so both refuse the same input the same way.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from sessionrouter.server.core.errors import FailedPrecondition, InvalidArgument, Unavailable
from sessionrouter.server.core.validation import check_id, check_version
from sessionrouter.server.core.workers import WorkerRegistry


class UpdatableWorker(Protocol):
    """What the checks read of a worker."""

    @property
    def worker_id(self) -> str: ...
    @property
    def policy_version(self) -> int: ...
    @property
    def updating_to(self) -> int:
        """The target version of the worker's update (0: not updating)."""
        ...


W = TypeVar("W", bound=UpdatableWorker)
W_co = TypeVar("W_co", bound=UpdatableWorker, covariant=True)


class WorkerTable(Protocol[W_co]):
    """Workers by id (``get`` raises NotFound ``WORKER_NOT_FOUND``), and all of them."""

    def get(self, worker_id: str) -> W_co: ...
    def __iter__(self) -> Iterator[W_co]: ...


@dataclass(frozen=True, slots=True)
class WeightUpdate:
    """The update in progress, as the router remembers it across restarts."""

    version: int
    fleet_wide: bool


def select_for_update(table: WorkerTable[W], version: int, worker_ids: Sequence[str]) -> list[W]:
    """The workers a BeginWeightUpdate selects, every check done before anything changes:
    a version of 0, an unknown worker, or one already at or past ``version``, is refused."""
    check_version("version", version)
    if version < 1:
        raise InvalidArgument(
            "INVALID_VERSION",
            "a weight update needs a target version of at least 1",
            field_violations=[("version", "must be at least 1")],
        )
    if worker_ids:
        for worker_id in worker_ids:
            check_id("worker_ids", worker_id)
        chosen = [table.get(w) for w in dict.fromkeys(worker_ids)]
    else:
        chosen = sorted(table, key=lambda w: w.worker_id)
    for worker in chosen:
        check_can_update(worker, version)
    return chosen


def check_can_update(worker: UpdatableWorker, version: int) -> None:
    """Refuses to move ``worker`` to ``version`` when it serves that version already, or is
    updating to another one."""
    if worker.policy_version >= version:
        raise FailedPrecondition(
            "VERSION_BACKWARDS",
            f"worker {worker.worker_id!r} serves version {worker.policy_version} already;"
            f" an update to {version} would not move it forward",
            metadata={
                "worker_id": worker.worker_id,
                "held": worker.policy_version,
                "got": version,
            },
        )
    if worker.updating_to and worker.updating_to != version:
        raise FailedPrecondition(
            "UPDATE_IN_PROGRESS",
            f"worker {worker.worker_id!r} is updating to version {worker.updating_to}"
            " already; complete that update first",
            metadata={"worker_id": worker.worker_id, "updating_to": worker.updating_to},
        )


def check_completion(worker: UpdatableWorker, version: int) -> int:
    """The version a CompleteWeightUpdate leaves ``worker`` at (0 means the target)."""
    check_version("version", version)
    if not worker.updating_to:
        raise FailedPrecondition(
            "WORKER_NOT_UPDATING",
            f"worker {worker.worker_id!r} is not in a weight update",
            metadata={"worker_id": worker.worker_id, "policy_version": worker.policy_version},
        )
    version = version or worker.updating_to
    if version < worker.updating_to:
        raise InvalidArgument(
            "INVALID_VERSION",
            f"worker {worker.worker_id!r} is updating to version {worker.updating_to}, not"
            f" {version}",
            metadata={"worker_id": worker.worker_id, "updating_to": worker.updating_to},
            field_violations=[("version", f"below the target {worker.updating_to}")],
        )
    return version


def refuse_during_update(update: WeightUpdate, retry_after_s: float) -> Unavailable:
    """The error for a start during a fleet-wide update."""
    return Unavailable(
        "WEIGHT_UPDATE_IN_PROGRESS",
        f"every worker is updating to policy version {update.version}; retry when it completes",
        retry_after_s=retry_after_s,
        metadata={"version": update.version},
    )


def distinct_versions(registry: WorkerRegistry) -> int:
    """How many distinct known policy versions the healthy workers report (O(W))."""
    return len({w.policy_version for w in registry if w.healthy and w.policy_version})
