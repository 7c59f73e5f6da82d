"""The cyclic garbage collector's settings for a serving process.

A router keeps every open session and group as live Python objects, and grpc.aio allocates a
few dozen short-lived containers per call. At CPython's default thresholds (700, 10, 10) the
collector ran about 20 young passes per 1,000 StartSession calls, each walking the calls still
in flight, and its full passes walked the whole import-time heap again each time: about
25 µs of CPU per StartSession under load, against 4 µs in a server that keeps no state.

``settle_heap`` is called once the server is serving: it moves what is alive then (modules,
the recovered state) out of the collector's sight with ``gc.freeze`` and raises the young
threshold, so a young pass comes every 10,000 container allocations instead of every 700.
Cycles still get collected, only in larger, rarer passes; an object frozen here that later
becomes cyclic garbage is not reclaimed (the process keeps it, as it kept it alive so far).
"""

from __future__ import annotations

import gc

SERVING_THRESHOLDS = (10_000, 10, 10)
"""``gc.set_threshold`` of a serving router: young passes every 10,000 net container
allocations; the older generations keep CPython's ratios."""


def settle_heap() -> None:
    """Freezes the objects alive now and sets ``SERVING_THRESHOLDS``; for the process that
    runs a server (the CLI), not for code that embeds one (its heap is its own)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*SERVING_THRESHOLDS)
