"""reduce_groups and AdvantageReducer: packing, result shape, validation and batching by params."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import pytest

from sessionrouter.server.core.estimators import (
    ESTIMATORS,
    EstimatorParams,
    UnknownEstimatorError,
)
from sessionrouter.server.core.reducer import AdvantageReducer, GroupAdvantages, reduce_groups

GRPO = EstimatorParams("grpo")
RLOO = EstimatorParams("rloo")
DR = EstimatorParams("dr_grpo", ddof=0)


def direct(groups: Sequence[Sequence[float]], p: EstimatorParams) -> list[list[float]]:
    """The estimator called by hand on the dense layout, split back per group."""
    lengths = np.array([len(g) for g in groups], dtype=np.intp)
    rewards = np.array([r for g in groups for r in g], dtype=np.float64)
    ids = np.repeat(np.arange(len(groups), dtype=np.intp), lengths)
    adv = ESTIMATORS[p.name](rewards, ids, lengths, p).advantages
    return [a.tolist() for a in np.split(adv, np.cumsum(lengths)[:-1])]


def test_reduce_groups_hand_computed() -> None:
    [a, b, c] = reduce_groups([[1.0, 0.0, 0.0, 1.0], [1.0, 2.0, 3.0], [4.0]], RLOO)
    assert a.advantages.tolist() == [2 / 3, -2 / 3, -2 / 3, 2 / 3]
    assert (a.mean, a.degenerate) == (0.5, False)
    assert a.std == pytest.approx(math.sqrt(1 / 3), rel=1e-15)
    assert b.advantages.tolist() == [-1.5, 0.0, 1.5]
    assert (b.mean, b.std, b.degenerate) == (2.0, 1.0, False)
    assert c.advantages.tolist() == [0.0]
    assert (c.mean, c.std, c.degenerate) == (4.0, 0.0, True)


@pytest.mark.parametrize(
    "p",
    [GRPO, RLOO, DR, EstimatorParams("grpo", ddof=0, batch_std=True)],
    ids=lambda p: p.name,
)
def test_reduce_groups_is_one_estimator_call_split_back(p: EstimatorParams) -> None:
    rng = np.random.default_rng(7)
    groups = [rng.integers(0, 3, int(rng.integers(1, 17))).tolist() for _ in range(200)]
    got = [r.advantages.tolist() for r in reduce_groups(groups, p)]
    assert got == direct(groups, p)


def test_input_kinds_give_identical_results() -> None:
    as_lists = [[0.0, 1.0, 1.0], [2.0, 5.0], [3.0]]
    kinds: list[Sequence[Sequence[float] | np.ndarray]] = [
        as_lists,
        [tuple(g) for g in as_lists],
        [np.array(g) for g in as_lists],
        [np.array(g, dtype=np.float32) for g in as_lists],
        [[0, 1, 1], [2, 5], [3]],
        [np.array([0.0, 1.0, 1.0]), [2.0, 5.0], (3.0,)],
    ]
    want = reduce_groups(as_lists, GRPO)
    for groups in kinds:
        got = reduce_groups(groups, GRPO)
        assert [g.advantages.tolist() for g in got] == [w.advantages.tolist() for w in want]
        assert [(g.mean, g.std, g.degenerate) for g in got] == [
            (w.mean, w.std, w.degenerate) for w in want
        ]


def test_result_fields_are_plain_python_and_frozen() -> None:
    [result] = reduce_groups([[1.0, 2.0]], GRPO)
    assert isinstance(result, GroupAdvantages)
    assert type(result.mean) is float
    assert type(result.std) is float
    assert type(result.degenerate) is bool
    assert result.advantages.dtype == np.float64
    assert result.advantages.shape == (2,)
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.mean = 0.0  # type: ignore[misc]
    with pytest.raises(ValueError, match="read-only"):
        result.advantages[0] = 1.0


def test_empty_batch_gives_empty_list() -> None:
    assert reduce_groups([], GRPO) == []
    reducer = AdvantageReducer()
    assert reducer.reduce([]) == []
    assert reducer.calls == 0


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        ([[1.0], []], r"groups without rewards at positions \[1\]"),
        ([[1.0, 2.0], [0.0, math.nan]], r"non-finite rewards in groups at positions \[1\]"),
        ([[math.inf], [1.0], [-math.inf]], r"non-finite rewards in groups at positions \[0, 2\]"),
        ([np.ones((2, 2))], "flat"),
    ],
)
def test_reduce_groups_rejects_bad_groups(groups: list[Sequence[float]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        reduce_groups(groups, GRPO)


def test_reduce_groups_validates_params() -> None:
    with pytest.raises(UnknownEstimatorError):
        reduce_groups([[1.0, 2.0]], EstimatorParams("ppo"))
    with pytest.raises(ValueError, match="ddof"):
        reduce_groups([[1.0, 2.0]], EstimatorParams(ddof=3))


def test_reducer_one_call_when_params_are_shared() -> None:
    reducer = AdvantageReducer()
    batch = [([float(i), float(i) + 1, 0.0], GRPO) for i in range(50)]
    results = reducer.reduce(batch)
    assert reducer.calls == 1
    assert [r.advantages.tolist() for r in results] == direct([g for g, _ in batch], GRPO)


def test_reducer_mixed_params_keep_order_and_make_one_call_per_params() -> None:
    groups = [[0.0, 1.0], [1.0, 2.0, 6.0], [5.0], [0.0, 0.0, 1.0], [3.0, 1.0], [2.0, 2.0]]
    params = [GRPO, RLOO, GRPO, DR, RLOO, EstimatorParams("grpo")]  # last equals GRPO
    reducer = AdvantageReducer()
    results = reducer.reduce(list(zip(groups, params, strict=True)))
    assert reducer.calls == 3
    assert len(results) == len(groups)
    for group, p, result in zip(groups, params, results, strict=True):
        [alone] = reduce_groups([group], p)
        assert result.advantages.tolist() == alone.advantages.tolist()
        assert (result.mean, result.std, result.degenerate) == (
            alone.mean,
            alone.std,
            alone.degenerate,
        )
    reducer.reduce([([1.0, 2.0], RLOO)])
    assert reducer.calls == 4


def test_reducer_batch_std_spans_only_groups_with_the_same_params() -> None:
    batch_grpo = EstimatorParams("grpo", batch_std=True)
    groups = [[0.0, 1.0], [0.0, 100.0], [0.0, 3.0]]
    params = [batch_grpo, GRPO, batch_grpo]
    results = AdvantageReducer().reduce(list(zip(groups, params, strict=True)))
    alone = reduce_groups([groups[0], groups[2]], batch_grpo)
    assert results[0].advantages.tolist() == alone[0].advantages.tolist()
    assert results[2].advantages.tolist() == alone[1].advantages.tolist()


def test_reducer_validates_every_params_before_any_work() -> None:
    reducer = AdvantageReducer()
    batch = [([1.0, 2.0], GRPO), ([1.0, 2.0], EstimatorParams(eps=-1.0))]
    with pytest.raises(ValueError, match="eps"):
        reducer.reduce(batch)
    assert reducer.calls == 0
