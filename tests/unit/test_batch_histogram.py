"""``metrics.BatchHistogram`` exposes what a ``prometheus_client.Histogram`` with the same
buckets exposes for the same observations, whether they come one at a time or in batches."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sessionrouter.server.metrics import GROUP_COMPLETION_BUCKETS_S, BatchHistogram

Exposed = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _exposed(registry: CollectorRegistry) -> Exposed:
    text = generate_latest(registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.name.endswith("_created")
    }


def test_batches_and_single_values_expose_what_a_histogram_does() -> None:
    rng = np.random.default_rng(7)
    edges = np.asarray(GROUP_COMPLETION_BUCKETS_S, dtype=np.float64)
    # Values on every bucket edge (an edge counts in its own bucket), between edges, 0,
    # and past the last edge (+Inf only).
    values = np.concatenate([edges, rng.uniform(0, 4000, 500), [0.0, 3600.5, 1e6]])
    theirs_registry, ours_registry = CollectorRegistry(), CollectorRegistry()
    theirs = Histogram(
        "h_seconds",
        "doc",
        ["outcome"],
        buckets=GROUP_COMPLETION_BUCKETS_S,
        registry=theirs_registry,
    )
    ours = BatchHistogram(
        "h_seconds",
        "doc",
        "outcome",
        ["complete", "dropped"],
        GROUP_COMPLETION_BUCKETS_S,
        ours_registry,
    )
    theirs.labels("dropped")  # a series for every label value, as ours has
    for v in values:
        theirs.labels("complete").observe(float(v))
    ours.observe_many("complete", values[:300])
    for v in values[300:310]:
        ours.observe("complete", float(v))
    ours.observe_many("complete", values[310:])
    ours.observe_many("complete", values[:0])  # an empty batch changes nothing
    expected, got = _exposed(theirs_registry), _exposed(ours_registry)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        if key[0].endswith("_sum"):  # added in another order: equal up to rounding
            assert got[key] == pytest.approx(value, rel=1e-12), key
        else:
            assert got[key] == value, key
    assert got[("h_seconds_count", frozenset({("outcome", "complete")}))] == len(values)
    assert got[("h_seconds_count", frozenset({("outcome", "dropped")}))] == 0
