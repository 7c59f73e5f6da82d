"""reduce_groups, reduce_matrix, reduce_segments and AdvantageReducer: packing, the batch's
arrays, the choice of path, validation and batching by params."""

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
from sessionrouter.server.core.reducer import (
    AdvantageReducer,
    GroupAdvantages,
    ReducedBatch,
    reduce_groups,
    reduce_matrix,
    reduce_segments,
)

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


ALL = [
    GRPO,
    RLOO,
    DR,
    EstimatorParams("grpo", eps=0.0, ddof=0),
    EstimatorParams("rloo", ddof=0),
    EstimatorParams("grpo", batch_std=True),
]


def offsets_of(lengths: Sequence[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def assert_batches_equal(a: ReducedBatch, b: ReducedBatch) -> None:
    for field in ("values", "advantages", "offsets", "mean", "std", "degenerate"):
        x, y = getattr(a, field), getattr(b, field)
        assert x.shape == y.shape and x.dtype == y.dtype and x.tobytes() == y.tobytes(), field


@pytest.mark.parametrize("p", ALL, ids=repr)
def test_matrix_and_segments_and_per_group_agree_to_the_bit(p: EstimatorParams) -> None:
    rng = np.random.default_rng(3)
    matrix = rng.integers(0, 3, (300, 8)).astype(np.float64)
    matrix[5] = 0.1
    rows = reduce_matrix(matrix, p)
    segments = reduce_segments(matrix.reshape(-1), offsets_of([8] * 300), p)
    assert rows.width == segments.width == 8
    assert_batches_equal(rows, segments)
    # The ragged path on the same groups, forced by one group of another size at the end.
    ragged = reduce_segments(
        np.concatenate([matrix.reshape(-1), [1.0, 2.0]]), offsets_of([8] * 300 + [2]), p
    )
    assert ragged.width == 0
    if not p.batch_std:  # the extra group changes the batch std, nothing else
        assert ragged.advantages[:2400].tobytes() == rows.advantages.tobytes()
        assert ragged.mean[:300].tobytes() == rows.mean.tobytes()
        assert ragged.std[:300].tobytes() == rows.std.tobytes()
    per_group = reduce_groups(matrix.tolist(), p)
    assert [g.advantages.tolist() for g in per_group] == [
        g.advantages.tolist() for g in rows.groups()
    ]


def test_reduced_batch_arrays_have_the_documented_shapes_and_are_read_only() -> None:
    batch = reduce_segments(np.array([1.0, 0.0, 3.0, 3.0, 3.0]), np.array([0, 2, 5]), GRPO)
    assert len(batch) == 2 and batch.width == 0 and batch.params == GRPO
    assert batch.values.dtype == batch.advantages.dtype == np.float64
    assert batch.values.shape == batch.advantages.shape == (5,)
    assert batch.offsets.dtype == np.int64 and batch.offsets.tolist() == [0, 2, 5]
    assert batch.lengths.tolist() == [2, 3]
    assert batch.mean.shape == batch.std.shape == batch.degenerate.shape == (2,)
    assert batch.degenerate.tolist() == [False, True]
    assert batch.advantages[2:].tolist() == [0.0, 0.0, 0.0]
    for array in (batch.values, batch.advantages, batch.offsets, batch.mean, batch.std):
        with pytest.raises(ValueError, match="read-only"):
            array[0] = 1
    one = batch.group(1)
    assert (one.mean, one.std, one.degenerate) == (3.0, 0.0, True)
    assert one.advantages.tolist() == [0.0, 0.0, 0.0]
    assert [g.mean for g in batch.groups()] == [0.5, 3.0]


def test_an_empty_batch_of_segments() -> None:
    batch = reduce_segments(np.zeros(0), np.zeros(1, dtype=np.int64), GRPO)
    assert len(batch) == 0 and batch.values.shape == batch.advantages.shape == (0,)
    assert batch.groups() == []


@pytest.mark.parametrize(
    ("values", "offsets", "message"),
    [
        ([1.0, 2.0], [1, 2], "offsets must run from 0 to N = 2"),
        ([1.0, 2.0], [0, 1], "offsets must run from 0 to N = 2"),
        ([1.0, 2.0], [0, 2, 2], r"groups without rewards at positions \[1\]"),
        ([1.0, 2.0, math.nan], [0, 2, 3], r"non-finite rewards in groups at positions \[1\]"),
        ([math.inf, 2.0], [0, 1, 2], r"non-finite rewards in groups at positions \[0\]"),
        ([1.0, 2.0], [], r"offsets \(G \+ 1,\)"),
    ],
)
def test_reduce_segments_rejects_bad_layouts(
    values: list[float], offsets: list[int], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        reduce_segments(np.array(values), np.array(offsets, dtype=np.int64), GRPO)


def test_reduce_matrix_rejects_bad_matrices_and_names_the_group_of_a_nan() -> None:
    with pytest.raises(ValueError, match=r"\(G, n\) with n >= 1"):
        reduce_matrix(np.zeros(3), GRPO)
    with pytest.raises(ValueError, match=r"\(G, n\) with n >= 1"):
        reduce_matrix(np.zeros((2, 0)), GRPO)
    matrix = np.zeros((4, 3))
    matrix[2, 1] = math.nan
    with pytest.raises(ValueError, match=r"non-finite rewards in groups at positions \[2\]"):
        reduce_matrix(matrix, GRPO)
    with pytest.raises(UnknownEstimatorError):
        reduce_matrix(np.zeros((1, 2)), EstimatorParams("ppo"))


def test_reducer_counts_matrix_and_segment_calls() -> None:
    reducer = AdvantageReducer()
    reducer.reduce_matrix(np.ones((3, 2)), GRPO)
    reducer.reduce_segments(np.ones(3), np.array([0, 1, 3]), GRPO)
    assert reducer.calls == 2
