"""The worker pool every shard shares, through the KV bucket ``sessionrouter_workers``.

A worker registers and heartbeats once, on any shard: that shard writes the worker's record
(``WorkerEntry``: address, capacity, labels, drain state, last heartbeat) to the bucket, whose
TTL is the heartbeat timeout. Every shard watches the bucket and mirrors each record into its
own worker table, so each shard places on the whole pool, and health and drain travel with
the records: a put is a heartbeat on every shard, a drain or a deregistration is seen by all
of them within milliseconds, and a worker that stops heartbeating expires on each shard by
its own heartbeat timeout.

**Capacity split.** Shard ``i`` of ``N`` may fill ``share(worker, c, i, N)`` slots of a worker
of capacity ``c``: ``c // N`` each, and one more for ``c % N`` shards chosen by a rotation
that starts at ``crc32(worker_id) % N``. The shares add up to ``c`` exactly, so the worker's
capacity is never exceeded across shards, with no coordination on the placement path. The
cost: a shard whose share of a worker is full cannot borrow another shard's idle slots, so a
pool can refuse (or share a worker) on one shard while another has room; with W workers the
imbalance between shards is at most W slots (one per worker), and a worker with fewer slots
than shards is placed by only ``c`` of them. A dynamic lease (slots borrowed through KV
compare-and-set) would use the pool fully, but would put a NATS round trip on every
StartSession and make placement stop when NATS does; the static split keeps placement local.

Each shard publishes its open sessions per worker to ``sessionrouter_load`` every
``LOAD_PUBLISH_S``, so any shard reports the global load (``Worker.cluster_open_sessions``).

While NATS is unreachable the pool stays as it was last known: mirrored workers are kept
healthy on every shard (their heartbeats cannot arrive), heartbeats received keep working
locally, and registering, draining and deregistering are UNAVAILABLE (``NATS_UNAVAILABLE``)
since they must reach every shard. A worker that dies during the outage is only noticed once
NATS is back and its heartbeats stay away.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from sessionrouter.server.config import WorkerSpec
from sessionrouter.server.core.errors import (
    AlreadyExists,
    FailedPrecondition,
    NotFound,
    ResourceExhausted,
    RouterError,
    Unavailable,
)
from sessionrouter.server.core.router import SessionRouter
from sessionrouter.server.core.validation import (
    ADDRESS_MAX_LEN,
    LABEL_VALUE_MAX_LEN,
    MAX_CAPACITY,
    check_id,
    check_range,
    check_string_map,
    check_text,
    check_version,
)
from sessionrouter.server.core.workers import WorkerRecord
from sessionrouter.server.shards.identity import ShardIdentity
from sessionrouter.server.shards.link import LOAD_BUCKET, WORKERS_BUCKET, NatsLink, stop_watch

log = logging.getLogger("sessionrouter.shards")

LOAD_PUBLISH_S = 1.0
"""How often a shard publishes its per-worker open sessions."""


def share(worker_id: str, capacity: int, shard: ShardIdentity) -> int:
    """The slots of ``capacity`` that ``shard`` may fill (see the module docstring); the
    shares of all N shards add up to ``capacity``."""
    n = shard.count
    base, extra = divmod(capacity, n)
    start = zlib.crc32(worker_id.encode("utf-8")) % n
    return base + (1 if (shard.index - start) % n < extra else 0)


def check_policy_version(policy_version: int, known: WorkerEntry | None) -> None:
    """The checks of a single router: at most 2^63 - 1, never backwards."""
    check_version("policy_version", policy_version)
    if known is not None and policy_version and policy_version < known.policy_version:
        raise FailedPrecondition(
            "VERSION_BACKWARDS",
            f"worker {known.worker_id!r} serves policy version {known.policy_version};"
            f" it cannot go back to {policy_version}",
            metadata={
                "worker_id": known.worker_id,
                "held": known.policy_version,
                "got": policy_version,
            },
        )


def _newer(reported: int, known: WorkerEntry | None) -> int:
    """The version a record keeps: the one reported, else the one it had (0 means
    "unchanged", and versions never go backwards)."""
    before = known.policy_version if known is not None else 0
    return max(reported, before)


def worker_key(worker_id: str) -> str:
    """KV key of a worker: its id in unpadded base64url (ids may hold ``~ : @ +``, which
    NATS keys may not)."""
    return "w." + base64.urlsafe_b64encode(worker_id.encode("utf-8")).decode().rstrip("=")


@dataclass(frozen=True, slots=True)
class WorkerEntry:
    """A worker as the pool bucket holds it."""

    worker_id: str
    address: str
    capacity: int
    labels: dict[str, str] = field(default_factory=dict)
    draining: bool = False
    heartbeat: float = 0.0
    """Unix seconds of the last registration or heartbeat."""
    policy_version: int = 0
    """The policy version the worker last reported (0: unknown)."""

    def encode(self) -> bytes:
        return json.dumps(
            {
                "worker_id": self.worker_id,
                "address": self.address,
                "capacity": self.capacity,
                "labels": self.labels,
                "draining": self.draining,
                "heartbeat": self.heartbeat,
                "policy_version": self.policy_version,
            },
            sort_keys=True,
        ).encode()

    @classmethod
    def decode(cls, data: bytes) -> WorkerEntry | None:
        try:
            raw = json.loads(data)
            return cls(
                str(raw["worker_id"]),
                str(raw["address"]),
                int(raw["capacity"]),
                {str(k): str(v) for k, v in dict(raw.get("labels", {})).items()},
                bool(raw.get("draining", False)),
                float(raw.get("heartbeat", 0.0)),
                int(raw.get("policy_version", 0)),
            )
        except (ValueError, KeyError, TypeError, AttributeError):
            return None


def nats_unavailable(what: str) -> Unavailable:
    return Unavailable(
        "NATS_UNAVAILABLE",
        f"NATS is unreachable, so {what} cannot reach the other shards; retry",
        retry_after_s=1.0,
    )


class PoolMirror:
    """This shard's view of the shared pool, kept in step with its router's worker table."""

    def __init__(self, router: SessionRouter, link: NatsLink, shard: ShardIdentity) -> None:
        self.router = router
        self.link = link
        self.shard = shard
        self.entries: dict[str, WorkerEntry] = {}
        """Every worker of the pool, by id."""
        self.loads: dict[int, dict[str, int]] = {}
        """Open sessions per worker as each shard last published them, by shard index."""
        self._workers_kv: Any = None
        self._static: tuple[WorkerSpec, ...] = ()
        self._published_load: dict[str, int] | None = None

    # -- what the RPCs do --------------------------------------------------------------

    def check_registration(
        self, worker_id: str, address: str, capacity: int, labels: Mapping[str, str]
    ) -> dict[str, str]:
        """The checks of a single router's RegisterWorker, against the whole pool."""
        check_id("worker_id", worker_id)
        check_text("address", address, ADDRESS_MAX_LEN, required=True)
        check_range("capacity", capacity, 1, MAX_CAPACITY)
        checked = check_string_map("labels", labels, LABEL_VALUE_MAX_LEN)
        known = self.entries.get(worker_id)
        if known is not None and known.address != address:
            raise AlreadyExists(
                "WORKER_ADDRESS_CONFLICT",
                f"worker {worker_id!r} is registered at {known.address!r}, not {address!r};"
                " deregister it first",
                metadata={"worker_id": worker_id, "address": known.address},
            )
        limit = self.router.settings.max_workers
        if known is None and len(self.entries) >= limit:
            raise ResourceExhausted(
                "WORKERS_LIMIT",
                f"{len(self.entries)} workers are registered, at most {limit} allowed",
                metadata={"workers": len(self.entries), "limit": limit},
            )
        return checked

    def get(self, worker_id: str) -> WorkerEntry:
        entry = self.entries.get(worker_id)
        if entry is None:
            raise NotFound(
                "WORKER_NOT_FOUND",
                f"worker {worker_id!r} is not registered",
                metadata={"worker_id": worker_id},
            )
        return entry

    async def register(
        self,
        worker_id: str,
        address: str,
        capacity: int,
        labels: Mapping[str, str],
        policy_version: int = 0,
    ) -> WorkerEntry:
        checked = self.check_registration(worker_id, address, capacity, labels)
        known = self.entries.get(worker_id)
        check_policy_version(policy_version, known)
        entry = WorkerEntry(
            worker_id,
            address,
            capacity,
            checked,
            known.draining if known is not None else False,
            time.time(),
            _newer(policy_version, known),
        )
        await self._put(entry, "a registration")
        return entry

    async def heartbeat(self, worker_id: str, policy_version: int = 0) -> WorkerEntry:
        known = self.get(worker_id)
        check_policy_version(policy_version, known)
        entry = replace(known, heartbeat=time.time(), policy_version=_newer(policy_version, known))
        if self.link.connected:
            try:
                await self._put(entry, "a heartbeat")
                return entry
            except Unavailable:
                pass
        # NATS is down: the worker stays alive here; the other shards keep their last view.
        self.entries[entry.worker_id] = entry
        if self.router.find_worker(worker_id) is not None:
            self.router.heartbeat(worker_id, entry.policy_version)
        return entry

    async def drain(self, worker_id: str, resume: bool) -> WorkerEntry:
        entry = replace(self.get(worker_id), draining=not resume, heartbeat=time.time())
        await self._put(entry, "a drain")
        return entry

    async def deregister(self, worker_id: str) -> tuple[WorkerEntry, int, WorkerRecord | None]:
        """Removes the worker from the pool; returns it, the open sessions this shard lost
        and its local record (None when this shard had no share)."""
        local = self.router.find_worker(worker_id)
        known = self.entries.get(worker_id)
        if known is None and local is not None:
            # Restored from this shard's journal but gone from the pool (its record expired):
            # still removable here.
            known = WorkerEntry(worker_id, local.address, local.capacity, dict(local.labels))
        entry = known if known is not None else self.get(worker_id)
        if not self.link.connected:
            raise nats_unavailable("a deregistration")
        try:
            await self._kv().delete(worker_key(worker_id))
        except RouterError:
            raise
        except Exception:
            raise nats_unavailable("a deregistration") from None
        # Our own watch may have removed it meanwhile: then it lost what it held before.
        lost = len(local.open_sessions) if local is not None else 0
        if self.router.find_worker(worker_id) is not None:
            local, lost = self.router.deregister_worker(worker_id)
        self.entries.pop(worker_id, None)
        return entry, lost, local

    async def _put(self, entry: WorkerEntry, what: str) -> None:
        if not self.link.connected:
            raise nats_unavailable(what)
        try:
            await self._kv().put(worker_key(entry.worker_id), entry.encode())
        except Exception:
            raise nats_unavailable(what) from None
        self.apply(entry)

    def _kv(self) -> Any:
        if self._workers_kv is None:
            raise nats_unavailable("the pool")
        return self._workers_kv

    # -- mirroring -----------------------------------------------------------------------

    def apply(self, entry: WorkerEntry) -> None:
        """Brings this shard's worker table in step with one record (idempotent)."""
        self.entries[entry.worker_id] = entry
        router = self.router
        slots = share(entry.worker_id, entry.capacity, self.shard)
        local = router.find_worker(entry.worker_id)
        if local is not None and (slots == 0 or local.address != entry.address):
            router.deregister_worker(entry.worker_id)
            local = None
        if slots == 0:
            return
        if local is None or local.capacity != slots or local.labels != entry.labels:
            local = router.register_worker(
                entry.worker_id, entry.address, slots, entry.labels, entry.policy_version
            )
        elif time.time() - entry.heartbeat < router.settings.heartbeat_timeout_s:
            router.heartbeat(entry.worker_id, entry.policy_version)
        if local.draining != entry.draining:
            router.drain_worker(entry.worker_id, resume=not entry.draining)

    def remove(self, worker_id: str) -> None:
        self.entries.pop(worker_id, None)
        if self.router.find_worker(worker_id) is not None:
            self.router.deregister_worker(worker_id)

    async def open(self) -> None:
        """Opens the buckets (the link's ``ensure_jetstream`` made them)."""
        self._workers_kv = await self.link.js.key_value(WORKERS_BUCKET)

    async def watch_workers(self) -> None:
        """Mirrors the pool bucket until cancelled (run under ``retry_forever``)."""
        kv = self._workers_kv = await self.link.js.key_value(WORKERS_BUCKET)
        watcher = await kv.watchall()
        try:
            async for update in watcher:
                if update is None:  # the end of the current values
                    continue
                if update.operation in ("DEL", "PURGE"):
                    known = [w for w in self.entries if worker_key(w) == update.key]
                    for worker_id in known:
                        self.remove(worker_id)
                    continue
                entry = WorkerEntry.decode(update.value or b"")
                if entry is not None:
                    self.apply(entry)
        finally:
            await stop_watch(watcher)

    async def watch_loads(self) -> None:
        """Follows what every shard publishes of its load, until cancelled."""
        kv = await self.link.js.key_value(LOAD_BUCKET)
        watcher = await kv.watchall()
        try:
            async for update in watcher:
                if update is None or not update.key.startswith("shard-"):
                    continue
                index = int(update.key.removeprefix("shard-"))
                if update.operation in ("DEL", "PURGE"):
                    self.loads.pop(index, None)
                    continue
                try:
                    self.loads[index] = {
                        str(k): int(v) for k, v in json.loads(update.value).items()
                    }
                except (ValueError, TypeError, AttributeError):
                    continue
        finally:
            await stop_watch(watcher)

    async def publish_loads(self) -> None:
        """Publishes this shard's open sessions per worker every LOAD_PUBLISH_S (when they
        changed, and at least every few seconds so the bucket's TTL keeps them), and keeps
        the static workers (``--worker``) alive in the pool, until cancelled."""
        kv = await self.link.js.key_value(LOAD_BUCKET)
        key = f"shard-{self.shard.index}"
        rounds = 0
        while True:
            for spec in self._static:
                known = self.entries.get(spec.worker_id)
                entry = WorkerEntry(
                    spec.worker_id,
                    spec.address,
                    spec.capacity,
                    dict(spec.labels),
                    known.draining if known is not None else False,
                    time.time(),
                )
                await self._put(entry, "a static worker")
            load = {w.worker_id: len(w.open_sessions) for w in self.router.workers}
            if load != self._published_load or rounds % 5 == 0:
                await kv.put(key, json.dumps(load).encode())
                self._published_load = load
                self.loads[self.shard.index] = load
            rounds += 1
            await asyncio.sleep(LOAD_PUBLISH_S)

    def keep_static(self, specs: tuple[WorkerSpec, ...]) -> None:
        """Workers given at start-up: registered in the pool and heartbeated by this shard
        (every shard given them does the same; the puts are idempotent)."""
        self._static = specs

    def hold_while_down(self) -> None:
        """Keeps every mirrored worker healthy while NATS is down (called each tick)."""
        if self.link.connected:
            return
        for worker in list(self.router.workers):
            if worker.healthy and worker.worker_id in self.entries:
                self.router.heartbeat(worker.worker_id)

    def cluster_open(self, worker_id: str) -> int:
        """Open sessions on the worker summed over shards (this one's counted live)."""
        local = self.router.find_worker(worker_id)
        total = len(local.open_sessions) if local is not None else 0
        for index, load in self.loads.items():
            if index != self.shard.index:
                total += load.get(worker_id, 0)
        return total
