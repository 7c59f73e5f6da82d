"""The batch reducer: many completed groups in, per-group advantages out, one estimator call.

Why batch: groups complete a few at a time, and the router reduces those that complete within a
short window together. ``reduce_groups`` packs them into the dense layout of
``estimators`` (rewards (N,), segment_ids (N,), lengths (G,)) and calls the estimator once, so
the NumPy work is a fixed number of passes over N rewards. What remains proportional to G is
the unavoidable Python at the edges: reading the input sequences and building one
``GroupAdvantages`` per group.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
from numpy.typing import NDArray

from sessionrouter.server.core.estimators import ESTIMATORS, EstimatorParams, validate_params

__all__ = ["AdvantageReducer", "GroupAdvantages", "reduce_groups"]

GroupRewards = Sequence[float] | NDArray[np.float64]


@dataclass(frozen=True, slots=True, eq=False)
class GroupAdvantages:
    """The reduction of one group.

    - ``advantages``: float64 (n,), one per member in input order; a read-only view into the
      batch's array (so results share one allocation; copy it to keep it past the batch
      cheaply). Units depend on the estimator (see ``estimators``).
    - ``mean``, ``std``: the group's reward mean and std (with ``ddof``), reward units.
    - ``degenerate``: one member, or all rewards equal; the advantages are then exactly 0.0.

    Equality is identity (``eq=False``): field-wise ``==`` on an array field would be ambiguous;
    compare ``advantages`` with ``np.array_equal``.
    """

    advantages: NDArray[np.float64]
    mean: float
    std: float
    degenerate: bool


def _pack(groups: Sequence[GroupRewards]) -> tuple[NDArray[np.float64], NDArray[np.intp]]:
    """Concatenate the groups into rewards (N,) float64 and return them with lengths (G,)."""
    lengths = np.fromiter(map(len, groups), dtype=np.intp, count=len(groups))
    n_rewards = int(lengths.sum())
    # Checking the first group first keeps the common all-lists case free of an O(G) scan.
    if isinstance(groups[0], np.ndarray) and all(isinstance(g, np.ndarray) for g in groups):
        rewards = np.concatenate(cast(Sequence[NDArray[np.float64]], groups)).astype(
            np.float64, copy=False
        )
    else:
        # One pass over Python floats; np.asarray per group would be one NumPy call per group.
        rewards = np.fromiter(
            itertools.chain.from_iterable(groups), dtype=np.float64, count=n_rewards
        )
    if rewards.shape != (n_rewards,):
        raise ValueError("each group must be a flat (1-D) sequence of rewards")
    return rewards, lengths


def reduce_groups(
    rewards_per_group: Sequence[GroupRewards], params: EstimatorParams
) -> list[GroupAdvantages]:
    """Reduce G groups with one estimator call; result i belongs to ``rewards_per_group[i]``.

    ``rewards_per_group[g]`` is the (n_g,) rewards of group g, reward units, as a sequence of
    floats or a 1-D array. Every group needs at least one reward, and every reward must be
    finite (the caller, which records rewards, rejects non-finite ones; this is checked here
    again in O(N) because a NaN would silently poison a whole group). Raises ``ValueError`` on
    bad params, an empty group, a non-flat group or a non-finite reward. No groups, no result.
    """
    validate_params(params)
    if not rewards_per_group:
        return []
    rewards, lengths = _pack(rewards_per_group)
    if int(lengths.min()) == 0:
        empty = np.flatnonzero(lengths == 0)
        raise ValueError(f"groups without rewards at positions {empty[:10].tolist()}")
    if not np.isfinite(rewards).all():
        bad_rewards = np.flatnonzero(~np.isfinite(rewards))
        bad_groups = np.unique(np.searchsorted(np.cumsum(lengths), bad_rewards, side="right"))
        raise ValueError(f"non-finite rewards in groups at positions {bad_groups[:10].tolist()}")

    segment_ids = np.repeat(np.arange(lengths.shape[0], dtype=np.intp), lengths)
    out = ESTIMATORS[params.name](rewards, segment_ids, lengths, params)
    advantages = out.advantages
    advantages.flags.writeable = False  # results are frozen; so are the views they hold

    ends = np.cumsum(lengths).tolist()
    return [
        GroupAdvantages(advantages[end - n : end], mean, std, degenerate)
        for end, n, mean, std, degenerate in zip(
            ends,
            lengths.tolist(),
            out.mean.tolist(),
            out.std.tolist(),
            out.degenerate.tolist(),
            strict=True,
        )
    ]


class AdvantageReducer:
    """Reduces a micro-batch of groups that may carry different ``EstimatorParams``.

    Groups that share params (typically all of them) go through one ``reduce_groups`` call;
    results come back in input order. ``calls`` counts those vectorized calls since creation,
    so tests and metrics can see that a batch was not reduced group by group.

    With ``batch_std`` the "batch" is the set of groups in one ``reduce`` call that share the
    params, so it depends on which groups completed in the same window.
    """

    __slots__ = ("calls",)

    def __init__(self) -> None:
        self.calls: int = 0

    def reduce(
        self, batch: Sequence[tuple[GroupRewards, EstimatorParams]]
    ) -> list[GroupAdvantages]:
        """Reduce every ``(rewards, params)`` pair; result i belongs to ``batch[i]``.

        All distinct params are validated before any work, so a bad entry fails the whole
        batch with ``ValueError`` and nothing is half-done.
        """
        positions: dict[EstimatorParams, list[int]] = {}
        for i, (_, params) in enumerate(batch):
            positions.setdefault(params, []).append(i)
        for params in positions:
            validate_params(params)

        if len(positions) == 1:
            (params,) = positions
            self.calls += 1
            return reduce_groups([rewards for rewards, _ in batch], params)

        results: list[GroupAdvantages | None] = [None] * len(batch)
        for params, indices in positions.items():
            reduced = reduce_groups([batch[i][0] for i in indices], params)
            self.calls += 1
            for i, group in zip(indices, reduced, strict=True):
                results[i] = group
        return cast(list[GroupAdvantages], results)
