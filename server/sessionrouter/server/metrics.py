"""Prometheus metrics from counters the core keeps anyway.

The request path pays nothing for metrics (no label lookups, no locks): the core counts in
plain integers, the event loop copies a snapshot a few times a second (``refresh``), and the
HTTP thread of prometheus_client only reads that immutable snapshot, never live state.
"""

from __future__ import annotations

from collections.abc import Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from sessionrouter.server.core.router import SessionRouter


class RouterCollector(Collector):
    """Exposes worker, session, group, reward and feed figures of one router."""

    def __init__(self, router: SessionRouter) -> None:
        self._router = router
        self._families: list[GaugeMetricFamily | CounterMetricFamily] = []
        self.refresh()

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        return iter(self._families)

    def refresh(self) -> None:
        """Takes a snapshot; call from the event loop that owns the router."""
        self._families = list(self._snapshot())

    def _snapshot(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        snap = self._router.snapshot()
        workers = GaugeMetricFamily(
            "sessionrouter_workers", "Registered workers by state", labels=["state"]
        )
        workers.add_metric(["healthy"], snap.workers_healthy)
        workers.add_metric(["unhealthy"], snap.workers_unhealthy)
        workers.add_metric(["draining"], snap.workers_draining)
        workers.add_metric(["eligible"], snap.workers_eligible)
        yield workers
        yield GaugeMetricFamily(
            "sessionrouter_open_sessions",
            "Sessions holding a worker slot",
            value=snap.open_sessions,
        )
        yield GaugeMetricFamily(
            "sessionrouter_open_groups",
            "Groups waiting for members or rewards",
            value=snap.open_groups,
        )
        sessions = CounterMetricFamily(
            "sessionrouter_sessions_started", "Sessions placed", labels=["placement"]
        )
        sessions.add_metric(["distinct"], snap.sessions_distinct)
        sessions.add_metric(["shared"], snap.sessions_shared)
        yield sessions
        rewards = CounterMetricFamily(
            "sessionrouter_rewards", "Reward entries by result", labels=["status"]
        )
        for status, count in snap.rewards.items():
            rewards.add_metric([status.value], count)
        yield rewards
        groups = CounterMetricFamily(
            "sessionrouter_groups_finished", "Finished groups by outcome", labels=["outcome"]
        )
        for outcome, count in snap.groups_finished.items():
            groups.add_metric([outcome.value], count)
        yield groups
        yield CounterMetricFamily(
            "sessionrouter_reducer_batches", "Micro-batches reduced", value=snap.reducer_batches
        )
        yield GaugeMetricFamily(
            "sessionrouter_feed_cursor",
            "Cursor of the newest group on the feed",
            value=snap.feed_cursor,
        )


def serve_metrics(
    router: SessionRouter, port: int, addr: str = "127.0.0.1"
) -> tuple[RouterCollector, WSGIServer]:
    """Serves /metrics over HTTP on ``addr:port`` (0 picks a free port) from a background
    thread; returns the collector, which the caller refreshes from its event loop, and the
    HTTP server (its ``server_address`` holds the bound port; ``shutdown()`` stops it)."""
    collector = RouterCollector(router)
    registry = CollectorRegistry()
    registry.register(collector)
    httpd, _ = start_http_server(port, addr=addr, registry=registry)
    return collector, httpd
