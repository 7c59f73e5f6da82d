"""Group-relative advantage estimators over dense, segmented reward arrays.

Why dense arrays: the router reduces every group that completes within a short window in one
call. Concatenating the groups and working on segments costs a fixed handful of NumPy passes
over the N rewards, whatever the number of groups G, where one NumPy call per group would pay
Python and dispatch overhead G times.

Layout shared by every estimator (N rewards, G groups):

- ``rewards``: float64, shape (N,), reward units. Groups are laid out one after the other:
  group g occupies the contiguous run ``rewards[starts[g] : starts[g] + lengths[g]]``.
- ``segment_ids``: intp, shape (N,); ``segment_ids[i]`` is the group slot g of reward i, so it
  is ``0, 0, ..., 1, 1, ..., G-1`` (non-decreasing, consistent with ``lengths``).
- ``lengths``: intp, shape (G,); every group has at least one member and the lengths sum to N.

Preconditions: rewards are float64, finite and of moderate magnitude: |r| well below 1e154 and
distinct rewards of a group more than ~1e-150 apart, so that squared deviations neither
overflow nor underflow (RL rewards are nowhere near either); ``segment_ids`` agrees with
``lengths``. The reducer
checks finiteness at its boundary; the estimators check only the cheap O(G) shape facts.

Conventions every estimator follows, so trainers see one meaning whatever the name:

- ``mean`` (G,) is the group mean and ``std`` (G,) the group standard deviation with
  ``params.ddof``, both in reward units. The variance is two-pass (deviations from the mean are
  squared, never ``E[x^2] - E[x]^2``, which cancels catastrophically for large, close rewards).
  A group with ``n <= ddof`` members (a group of one under ddof 1) reports std 0.0.
- A group is *degenerate* when it has one member or when all its rewards are exactly equal
  (max == min). It carries no learning signal: its advantages are exactly 0.0 (not 1e-17
  noise divided by a tiny std), its mean is exactly the common reward and its std exactly 0.0,
  and it is flagged so that trainers can filter such groups, as DAPO does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "ESTIMATORS",
    "EstimatorFn",
    "EstimatorParams",
    "Segmented",
    "UnknownEstimatorError",
    "dr_grpo",
    "grpo",
    "rloo",
    "validate_params",
]

FloatArray = NDArray[np.float64]
IndexArray = NDArray[np.intp]
BoolArray = NDArray[np.bool_]


@dataclass(frozen=True, slots=True)
class EstimatorParams:
    """How a group's advantages are computed; hashable, so batches can be split by it.

    - ``name``: a key of ``ESTIMATORS``: ``"grpo"``, ``"dr_grpo"`` or ``"rloo"``.
    - ``eps``: grpo only, added to the std (reward units) so that tiny spreads do not blow up.
    - ``ddof``: delta degrees of freedom of every reported std; 1 is the unbiased sample std
      that most trainers use (``torch.std``), 0 the population std (``np.std``).
    - ``batch_std``: grpo only; divide by the std of all rewards passed in the same call instead
      of the group's std. In the router that "batch" is the micro-batch of groups that complete
      in one window and share these params, not a trainer's whole step.
    """

    name: str = "grpo"
    eps: float = 1e-6
    ddof: int = 1
    batch_std: bool = False


@dataclass(frozen=True, slots=True)
class Segmented:
    """One estimator's output for a whole batch.

    - ``advantages``: float64 (N,), aligned with the input rewards.
    - ``mean``, ``std``: float64 (G,), per group, reward units (std with ``params.ddof``).
    - ``degenerate``: bool (G,), per group (one member, or all rewards equal).
    """

    advantages: FloatArray
    mean: FloatArray
    std: FloatArray
    degenerate: BoolArray


EstimatorFn = Callable[[FloatArray, IndexArray, IndexArray, EstimatorParams], Segmented]
"""``fn(rewards (N,), segment_ids (N,), lengths (G,), params) -> Segmented``."""


class UnknownEstimatorError(KeyError, ValueError):
    """An estimator name that is not registered.

    A ``KeyError`` so that ``ESTIMATORS`` keeps the ``Mapping`` contract (``get``, ``in``), and
    a ``ValueError`` because to a caller it is a bad argument value.
    """

    def __init__(self, name: str, known: Iterable[str]) -> None:
        self.name = name
        self.known = tuple(sorted(known))
        super().__init__(f"unknown estimator {name!r}; known estimators: {', '.join(self.known)}")

    def __str__(self) -> str:
        # KeyError's str() would repr-quote the whole message.
        return str(self.args[0])


class _Registry(Mapping[str, EstimatorFn]):
    """Read-only view of the registered estimators; a missing name says which ones exist."""

    __slots__ = ("_by_name",)

    def __init__(self, by_name: dict[str, EstimatorFn]) -> None:
        self._by_name = by_name

    def __getitem__(self, name: str) -> EstimatorFn:
        try:
            return self._by_name[name]
        except KeyError:
            raise UnknownEstimatorError(name, self._by_name) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    def __repr__(self) -> str:
        return f"ESTIMATORS({sorted(self._by_name)})"


_BY_NAME: dict[str, EstimatorFn] = {}
ESTIMATORS: Mapping[str, EstimatorFn] = _Registry(_BY_NAME)


def _register(name: str) -> Callable[[EstimatorFn], EstimatorFn]:
    def add(fn: EstimatorFn) -> EstimatorFn:
        _BY_NAME[name] = fn
        return fn

    return add


def validate_params(p: EstimatorParams) -> None:
    """Raise ``ValueError`` (``UnknownEstimatorError`` for the name) when ``p`` is unusable.

    Checked once per distinct params by the reducer, so the estimators themselves stay lean.
    """
    if p.name not in _BY_NAME:
        raise UnknownEstimatorError(p.name, _BY_NAME)
    if not math.isfinite(p.eps) or p.eps < 0:
        raise ValueError(f"eps must be finite and >= 0, got {p.eps!r}")
    if isinstance(p.ddof, bool) or p.ddof not in (0, 1):
        raise ValueError(f"ddof must be 0 or 1, got {p.ddof!r}")
    if p.batch_std and p.name != "grpo":
        # Silently ignoring it would hand the trainer advantages it did not ask for.
        raise ValueError(f"batch_std applies to 'grpo' only, not to {p.name!r}")


@dataclass(frozen=True, slots=True)
class _Moments:
    """Per-group statistics shared by the estimators (shapes as in ``Segmented``)."""

    mean: FloatArray  # (G,)
    std: FloatArray  # (G,)
    centred: FloatArray  # (N,), r - mean of its group; exactly 0.0 in degenerate groups
    degenerate: BoolArray  # (G,)


def _moments(
    rewards: FloatArray, segment_ids: IndexArray, lengths: IndexArray, ddof: int
) -> _Moments:
    """Segmented mean, two-pass std and degenerate flags, in O(1) NumPy calls."""
    if rewards.ndim != 1 or segment_ids.shape != rewards.shape or lengths.ndim != 1:
        raise ValueError(
            f"rewards and segment_ids must be 1-D of one shape, lengths 1-D; got "
            f"{rewards.shape}, {segment_ids.shape}, {lengths.shape}"
        )
    n_rewards, n_groups = rewards.shape[0], lengths.shape[0]
    if n_groups == 0:
        if n_rewards:
            raise ValueError(f"{n_rewards} rewards but no groups")
        empty = np.zeros(0, dtype=np.float64)
        return _Moments(empty, empty.copy(), empty.copy(), np.zeros(0, dtype=np.bool_))
    if int(lengths.min()) < 1 or int(lengths.sum()) != n_rewards:
        raise ValueError("every group needs at least one reward and lengths must sum to N")

    starts = np.cumsum(lengths) - lengths
    first = rewards[starts]
    # A group is degenerate when no member differs from its first member (max == min, exactly).
    differs = rewards != first[segment_ids]
    degenerate = ~np.logical_or.reduceat(differs, starts)

    sums = np.bincount(segment_ids, weights=rewards, minlength=n_groups)
    # Exact mean for degenerate groups: sum/n can be off by an ulp (3 * 0.1 / 3 != 0.1), and
    # the exact value makes their deviations, hence advantages, exactly 0.0.
    mean = np.where(degenerate, first, sums / lengths)
    centred = rewards - mean[segment_ids]
    squares = np.bincount(segment_ids, weights=centred * centred, minlength=n_groups)
    dof = lengths - ddof
    var = np.divide(squares, dof, out=np.zeros(n_groups, dtype=np.float64), where=dof > 0)
    return _Moments(mean, np.sqrt(var), centred, degenerate)


def _batch_std(rewards: FloatArray, ddof: int) -> float:
    """Two-pass std of all rewards of the call, reward units; 0.0 when N <= ddof."""
    n = rewards.shape[0]
    if n <= ddof:
        return 0.0
    deviations = rewards - rewards.mean()
    return math.sqrt(float(np.sum(deviations * deviations)) / (n - ddof))


@_register("grpo")
def grpo(
    rewards: FloatArray, segment_ids: IndexArray, lengths: IndexArray, params: EstimatorParams
) -> Segmented:
    """GRPO: ``A_i = (r_i - mean_g) / (std_g + eps)``, dimensionless, shape (N,).

    With ``params.batch_std`` the denominator is ``std_batch + eps``, where ``std_batch`` is the
    std (same ddof) of all N rewards of this call: it keeps the relative scale between groups,
    which per-group normalisation erases. Degenerate groups get exactly 0.0. Where the
    denominator is 0.0 (only possible with ``eps == 0``), the deviations are 0.0 too and the
    advantages stay 0.0 instead of 0/0.
    """
    m = _moments(rewards, segment_ids, lengths, params.ddof)
    if params.batch_std:
        scale = _batch_std(rewards, params.ddof) + params.eps
        advantages = m.centred / scale if scale > 0 else m.centred.copy()
    else:
        denom = m.std + params.eps
        denom[denom == 0.0] = 1.0
        advantages = m.centred / denom[segment_ids]
    return Segmented(advantages, m.mean, m.std, m.degenerate)


@_register("dr_grpo")
def dr_grpo(
    rewards: FloatArray, segment_ids: IndexArray, lengths: IndexArray, params: EstimatorParams
) -> Segmented:
    """Dr. GRPO: ``A_i = r_i - mean_g``, reward units, shape (N,).

    No std division: that division over-weights groups with a small spread (too easy or too
    hard prompts). Degenerate groups get exactly 0.0.
    """
    m = _moments(rewards, segment_ids, lengths, params.ddof)
    return Segmented(m.centred, m.mean, m.std, m.degenerate)


@_register("rloo")
def rloo(
    rewards: FloatArray, segment_ids: IndexArray, lengths: IndexArray, params: EstimatorParams
) -> Segmented:
    """RLOO: ``A_i = r_i - mean of the other n-1 members``, reward units, shape (N,).

    The leave-one-out baseline does not depend on ``r_i``, which keeps the policy gradient
    unbiased. It equals ``n / (n - 1) * (r_i - mean_g)``, computed that way so that one segmented
    mean serves both. A group of one has no baseline: it is degenerate and gets 0.0.
    """
    m = _moments(rewards, segment_ids, lengths, params.ddof)
    others = lengths - 1
    factor = np.divide(
        lengths, others, out=np.zeros(lengths.shape[0], dtype=np.float64), where=others > 0
    )
    return Segmented(m.centred * factor[segment_ids], m.mean, m.std, m.degenerate)
