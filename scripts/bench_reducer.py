#!/usr/bin/env python3
"""Benchmark the vectorized advantage reducer against the per-group ways trainers compute GRPO.

Columns, all GRPO (eps 1e-6, ddof 1), medians over ``--repeats`` runs, in milliseconds:

- ``kernel``: the estimator alone on dense arrays (rewards, segment ids, lengths): the
  vectorized core, a fixed number of NumPy passes over N rewards.
- ``reduce``: ``reduce_groups`` end to end, from a list of per-group lists of Python floats
  (what the router holds) to one ``GroupAdvantages`` per group. It adds the O(G) Python at the
  edges (reading the floats, building one result object per group) to the kernel.
- ``loop``: a per-sample Python loop that groups rewards into a dict of lists by group id,
  then computes each group's mean and std with NumPy and writes advantages back one sample at
  a time, as several trainers do. Input: flat lists of rewards and group ids.
- ``per-group``: one NumPy mean/std/normalise per group over per-group arrays.

The baselines do less than the reducer (no degenerate flags, no exact zeros), and the speedups
(``loop/reduce``, ``per-group/reduce``, ``per-group/kernel``) are measured in the same run on
the same data. Run with the project's venv: ``.venv/bin/python scripts/bench_reducer.py``.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shlex
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from sessionrouter.server.core.estimators import ESTIMATORS, EstimatorParams
from sessionrouter.server.core.reducer import reduce_groups

PARAMS = EstimatorParams("grpo", eps=1e-6, ddof=1)
SLOW_BASELINE_LIMIT = 100_000
"""Above this many rewards the two slow baselines run once (seconds each), not ``--repeats``."""


@dataclass(frozen=True, slots=True)
class Workload:
    """One benchmark case in every input form the contenders take (built before timing)."""

    lists: list[list[float]]  # per-group Python floats
    flat_rewards: list[float]  # trainer form: one reward per sample...
    flat_uids: list[int]  # ...and its group id
    arrays: list[NDArray[np.float64]]  # per-group float64 arrays
    rewards: NDArray[np.float64]  # dense (N,)
    segment_ids: NDArray[np.intp]  # dense (N,)
    lengths: NDArray[np.intp]  # (G,)


def make_workload(n_rewards: int, group_size: int, ragged: bool, seed: int) -> Workload:
    """Binary rewards (pass/fail verifiers); ragged sizes are uniform in [1, 2 * size - 1]."""
    rng = np.random.default_rng(seed)
    if ragged:
        sizes = rng.integers(1, 2 * group_size, n_rewards // group_size * 2 + 1)
        ends = np.cumsum(sizes)
        n_groups = int(np.searchsorted(ends, n_rewards)) + 1
        lengths = sizes[:n_groups].astype(np.intp)
        lengths[-1] -= int(ends[n_groups - 1]) - n_rewards
        lengths = lengths[lengths > 0]
    else:
        lengths = np.full(math.ceil(n_rewards / group_size), group_size, dtype=np.intp)
        lengths[-1] -= int(lengths.sum()) - n_rewards
    rewards = rng.integers(0, 2, n_rewards).astype(np.float64)
    segment_ids = np.repeat(np.arange(lengths.shape[0], dtype=np.intp), lengths)
    arrays = np.split(rewards, np.cumsum(lengths)[:-1])
    return Workload(
        lists=[a.tolist() for a in arrays],
        flat_rewards=rewards.tolist(),
        flat_uids=segment_ids.tolist(),
        arrays=arrays,
        rewards=rewards,
        segment_ids=segment_ids,
        lengths=lengths,
    )


def loop_baseline(rewards: Sequence[float], uids: Sequence[int], eps: float) -> list[float]:
    """Dict of lists by group id, NumPy stats per group, per-sample write-back (ddof 1)."""
    by_uid: defaultdict[int, list[float]] = defaultdict(list)
    for reward, uid in zip(rewards, uids, strict=True):
        by_uid[uid].append(reward)
    mean: dict[int, float] = {}
    std: dict[int, float] = {}
    for uid, members in by_uid.items():
        values = np.asarray(members)
        mean[uid] = float(values.mean())
        std[uid] = float(values.std(ddof=1)) if len(members) > 1 else 0.0
    return [(r - mean[u]) / (std[u] + eps) for r, u in zip(rewards, uids, strict=True)]


def per_group_baseline(
    groups: Sequence[NDArray[np.float64]], eps: float
) -> list[NDArray[np.float64]]:
    """One NumPy mean, std and normalisation per group (ddof 1)."""
    out = []
    for g in groups:
        std = float(g.std(ddof=1)) if g.shape[0] > 1 else 0.0
        out.append((g - g.mean()) / (std + eps))
    return out


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: first-touch page faults and lazy imports are not what we measure
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(w: Workload, repeats: int, slow_repeats: int) -> tuple[float, float, float, float]:
    """Median ms of kernel, reduce, loop and per-group on one workload."""
    estimator = ESTIMATORS[PARAMS.name]
    return (
        median_ms(lambda: estimator(w.rewards, w.segment_ids, w.lengths, PARAMS), repeats),
        median_ms(lambda: reduce_groups(w.lists, PARAMS), repeats),
        median_ms(lambda: loop_baseline(w.flat_rewards, w.flat_uids, PARAMS.eps), slow_repeats),
        median_ms(lambda: per_group_baseline(w.arrays, PARAMS.eps), slow_repeats),
    )


def check_agreement(w: Workload) -> None:
    """The contenders must compute the same numbers, or the timings mean nothing."""
    kernel = ESTIMATORS[PARAMS.name](w.rewards, w.segment_ids, w.lengths, PARAMS).advantages
    reduced = np.concatenate([g.advantages for g in reduce_groups(w.lists, PARAMS)])
    # The degenerate groups are where the baselines' 0 / (0 + eps) and our exact 0.0 agree.
    head = slice(0, min(20_000, w.rewards.shape[0]))
    n_head_groups = int(np.searchsorted(np.cumsum(w.lengths), head.stop))
    loop = loop_baseline(w.flat_rewards[head], w.flat_uids[head], PARAMS.eps)
    per_group = np.concatenate(per_group_baseline(w.arrays[:n_head_groups], PARAMS.eps))
    assert np.array_equal(kernel, reduced)
    assert np.allclose(loop[: per_group.shape[0]], kernel[: per_group.shape[0]], atol=1e-12)
    assert np.allclose(per_group, kernel[: per_group.shape[0]], atol=1e-12)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per cell (median)")
    parser.add_argument("--quick", action="store_true", help="10k rewards only, 3 repeats")
    args = parser.parse_args(argv)
    repeats = 3 if args.quick else args.repeats
    sizes = [10_000] if args.quick else [10_000, 100_000, 1_000_000]

    print(f"# command: {shlex.join([sys.executable, *sys.argv])}")
    print(
        f"# numpy {np.__version__}, python {platform.python_version()}, {platform.machine()}, "
        f"{os.cpu_count()} cpus, load average {os.getloadavg()[0]:.2f}; single-threaded ops"
    )
    print(
        f"# grpo eps={PARAMS.eps} ddof={PARAMS.ddof}; binary rewards; median of {repeats} "
        f"runs after a warm-up; ragged group sizes uniform in [1, 2*size-1]"
    )
    if any(n > SLOW_BASELINE_LIMIT for n in sizes):
        print(
            f"# above {SLOW_BASELINE_LIMIT:,} rewards the loop and per-group baselines run once "
            f"(marked *), not {repeats} times: each takes seconds"
        )
    header = (
        f"{'rewards':>9} {'size':>4} {'layout':>6} {'groups':>7} | {'kernel':>8} "
        f"{'reduce':>8} {'loop':>9} {'per-group':>9} | {'loop/reduce':>11} "
        f"{'per-group/reduce':>16} {'per-group/kernel':>16}"
    )
    print(header)
    print("-" * len(header))
    for n_rewards in sizes:
        for group_size in (8, 16):
            for ragged in (False, True):
                w = make_workload(n_rewards, group_size, ragged, seed=n_rewards + group_size)
                check_agreement(w)
                slow_repeats = 1 if n_rewards > SLOW_BASELINE_LIMIT else repeats
                mark = "*" if slow_repeats == 1 else " "
                kernel_ms, reduce_ms, loop_ms, per_group_ms = measure(w, repeats, slow_repeats)
                print(
                    f"{n_rewards:>9,} {group_size:>4} {'ragged' if ragged else 'equal':>6} "
                    f"{w.lengths.shape[0]:>7,} | {kernel_ms:>8.2f} {reduce_ms:>8.2f} "
                    f"{loop_ms:>8.1f}{mark} {per_group_ms:>8.1f}{mark} | "
                    f"{loop_ms / reduce_ms:>10.0f}x {per_group_ms / reduce_ms:>15.0f}x "
                    f"{per_group_ms / kernel_ms:>15.0f}x",
                    flush=True,
                )
    print("# times in ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
