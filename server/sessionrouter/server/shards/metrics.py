"""Prometheus figures of a shard's NATS side, copied on the server's tick like the router's
(``metrics.RouterCollector``): the HTTP thread reads an immutable snapshot, never live state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from sessionrouter.server.shards.admission import FleetAdmission
from sessionrouter.server.shards.pool import PoolMirror
from sessionrouter.server.shards.publisher import FeedPublisher
from sessionrouter.server.shards.registry import ShardRegistry

_Family = GaugeMetricFamily | CounterMetricFamily


class ShardCollector(Collector):
    """NATS link, registry, pool and feed-publication figures of one shard."""

    def __init__(
        self,
        pool: PoolMirror,
        publisher: FeedPublisher,
        registry: Callable[[], ShardRegistry | None],
        admission: FleetAdmission | None = None,
    ) -> None:
        """``registry`` gives the shard's registry once it joined (None before)."""
        self._admission = admission
        self._pool = pool
        self._publisher = publisher
        self._registry = registry
        self._families: list[_Family] = []
        self.refresh()

    def collect(self) -> Iterator[_Family]:
        return iter(self._families)

    def refresh(self) -> None:
        """Takes a snapshot; call from the event loop that owns the shard."""
        self._families = list(self._snapshot())

    def _snapshot(self) -> Iterator[_Family]:
        pool, publisher = self._pool, self._publisher
        shard = pool.shard
        info = GaugeMetricFamily(
            "sessionrouter_shard", "This router's shard (always 1)", labels=["index", "count"]
        )
        info.add_metric([str(shard.index), str(shard.count)], 1)
        yield info
        yield GaugeMetricFamily(
            "sessionrouter_shard_nats_connected",
            "1 while the NATS link is up",
            value=1 if pool.link.connected else 0,
        )
        registry = self._registry()
        peers = registry.peers if registry is not None else {}
        mismatched = registry.mismatched if registry is not None else {}
        yield GaugeMetricFamily(
            "sessionrouter_shard_peers", "Live shards of this shard count", value=len(peers)
        )
        yield GaugeMetricFamily(
            "sessionrouter_shard_count_mismatches",
            "Live shards of another shard count (group calls are refused while > 0)",
            value=len(mismatched),
        )
        yield GaugeMetricFamily(
            "sessionrouter_shard_pool_workers",
            "Workers in the shared pool",
            value=len(pool.entries),
        )
        yield GaugeMetricFamily(
            "sessionrouter_shard_pool_open_sessions",
            "Open sessions on the shared pool, summed over shards (as last published)",
            value=sum(pool.cluster_open(w) for w in pool.entries),
        )
        yield GaugeMetricFamily(
            "sessionrouter_shard_pool_capacity",
            "Slots of the shared pool (every worker's whole capacity)",
            value=sum(e.capacity for e in pool.entries.values()),
        )
        yield GaugeMetricFamily(
            "sessionrouter_shard_feed_backlog_groups",
            "Groups finished on this shard and not yet in the merged feed",
            value=publisher.backlog,
        )
        yield CounterMetricFamily(
            "sessionrouter_shard_feed_published",
            "Groups this shard published to the merged feed (since start)",
            value=publisher.published,
        )
        yield CounterMetricFamily(
            "sessionrouter_shard_feed_lost",
            "Groups left out of the merged feed (evicted before their publication)",
            value=publisher.lost,
        )
        admission = self._admission
        if admission is not None:
            lease = admission.router.trainer.lease
            state = admission.state
            yield GaugeMetricFamily(
                "sessionrouter_shard_admission_lease",
                "Staleness admission slots this shard holds of the fleet's limit",
                value=lease or 0,
            )
            yield GaugeMetricFamily(
                "sessionrouter_shard_admission_leased",
                "Admission slots leased by all shards (at most the fleet's limit)",
                value=sum(state.leases.values()) if state is not None else 0,
            )
            yield CounterMetricFamily(
                "sessionrouter_shard_admission_lease_requests",
                "Lease requests this shard sent to NATS (since start)",
                value=admission.requests,
            )
