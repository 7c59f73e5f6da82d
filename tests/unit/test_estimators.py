"""Estimators against a plain-loop reference, hand-computed cases and Hypothesis properties."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from sessionrouter.server.core.estimators import (
    ESTIMATORS,
    ROW_ESTIMATORS,
    EstimatorParams,
    Segmented,
    UnknownEstimatorError,
    validate_params,
)

NAMES = ("grpo", "dr_grpo", "rloo")
ULP = float(np.finfo(np.float64).eps)


# --- the slow, obviously-correct reference -------------------------------------------------


def reference(
    groups: Sequence[Sequence[float]], p: EstimatorParams
) -> list[tuple[list[float], float, float, bool]]:
    """One group at a time, one reward at a time: (advantages, mean, std, degenerate)."""
    everything = [r for group in groups for r in group]
    batch_std = 0.0
    if p.batch_std and len(everything) > p.ddof:
        batch_mean = sum(everything) / len(everything)
        batch_var = sum((r - batch_mean) ** 2 for r in everything) / (len(everything) - p.ddof)
        batch_std = math.sqrt(batch_var)

    out = []
    for group in groups:
        n = len(group)
        degenerate = max(group) == min(group)
        mean = group[0] if degenerate else sum(group) / n
        std = 0.0
        if n > p.ddof:
            std = math.sqrt(sum((r - mean) ** 2 for r in group) / (n - p.ddof))
        advantages = []
        for i, r in enumerate(group):
            if degenerate:
                a = 0.0
            elif p.name == "grpo":
                a = (r - mean) / ((batch_std if p.batch_std else std) + p.eps)
            elif p.name == "dr_grpo":
                a = r - mean
            else:
                others = [group[j] for j in range(n) if j != i]
                a = r - sum(others) / len(others)
            advantages.append(a)
        out.append((advantages, mean, std, degenerate))
    return out


def dense(
    groups: Sequence[Sequence[float]],
) -> tuple[NDArray[np.float64], NDArray[np.intp], NDArray[np.intp]]:
    lengths = np.array([len(g) for g in groups], dtype=np.intp)
    rewards = np.array([r for g in groups for r in g], dtype=np.float64)
    segment_ids = np.repeat(np.arange(len(groups), dtype=np.intp), lengths)
    return rewards, segment_ids, lengths


def run(groups: Sequence[Sequence[float]], p: EstimatorParams) -> Segmented:
    return ESTIMATORS[p.name](*dense(groups), p)


def random_groups(rng: np.random.Generator) -> list[list[float]]:
    """Ragged groups mixing the reward shapes trainers see: binary, discrete and continuous."""
    groups = []
    for _ in range(int(rng.integers(1, 40))):
        n = int(rng.integers(1, 17))
        kind = rng.integers(3)
        if kind == 0:
            rewards = rng.integers(0, 2, n).astype(np.float64)
        elif kind == 1:
            rewards = rng.choice([0.0, 0.25, 0.5, 1.0], n)
        else:
            rewards = rng.normal(rng.normal(0, 5), rng.uniform(0.01, 10), n)
        groups.append(rewards.tolist())
    return groups


ALL_PARAMS = [
    EstimatorParams(name, eps=eps, ddof=ddof)
    for name in NAMES
    for ddof in (0, 1)
    for eps in (0.0, 1e-6)
] + [
    EstimatorParams("grpo", eps=eps, ddof=ddof, batch_std=True)
    for ddof in (0, 1)
    for eps in (0.0, 1e-6)
]


@pytest.mark.parametrize("p", ALL_PARAMS, ids=repr)
def test_matches_loop_reference_on_random_ragged_groups(p: EstimatorParams) -> None:
    for seed in range(60):
        groups = random_groups(np.random.default_rng(seed))
        got = run(groups, p)
        want = reference(groups, p)
        want_adv = np.array([a for adv, *_ in want for a in adv])
        np.testing.assert_allclose(got.advantages, want_adv, rtol=0, atol=1e-12)
        np.testing.assert_allclose(got.mean, [w[1] for w in want], rtol=0, atol=1e-12)
        np.testing.assert_allclose(got.std, [w[2] for w in want], rtol=0, atol=1e-12)
        assert got.degenerate.tolist() == [w[3] for w in want]


def same_bits(a: NDArray[np.generic], b: NDArray[np.generic]) -> bool:
    """Equal shapes, dtypes and bytes: -0.0 differs from 0.0 here, as any ulp does."""
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def assert_paths_agree(matrix: NDArray[np.float64], p: EstimatorParams) -> Segmented:
    """The row path on (G, n) gives the ragged path's bits on the same groups."""
    rows = ROW_ESTIMATORS[p.name](matrix, p)
    groups = matrix.tolist()
    ragged = run(groups, p)
    for field in ("advantages", "mean", "std", "degenerate"):
        assert same_bits(getattr(rows, field), getattr(ragged, field)), field
    return rows


def equal_groups(rng: np.random.Generator, n_groups: int, n: int) -> NDArray[np.float64]:
    """(G, n) rewards of the shapes trainers see, with degenerate rows, -0.0 and 0.1 rows."""
    kind = rng.integers(3)
    if kind == 0:
        matrix = rng.integers(0, 2, (n_groups, n)).astype(np.float64)
    elif kind == 1:
        matrix = rng.choice([0.0, -0.0, 0.25, 0.5, 1.0], (n_groups, n))
    else:
        matrix = rng.normal(rng.normal(0, 5), rng.uniform(0.01, 10), (n_groups, n))
    matrix[rng.integers(n_groups)] = 0.1  # a sum-based mean would be an ulp off
    return matrix


@pytest.mark.parametrize("p", ALL_PARAMS, ids=repr)
def test_row_path_matches_the_loop_reference_and_the_ragged_path(p: EstimatorParams) -> None:
    for seed in range(30):
        rng = np.random.default_rng(seed)
        n = int(rng.choice([1, 2, 3, 8, 16, 33]))
        matrix = equal_groups(rng, int(rng.integers(1, 60)), n)
        got = assert_paths_agree(matrix, p)
        want = reference(matrix.tolist(), p)
        want_adv = np.array([a for adv, *_ in want for a in adv])
        np.testing.assert_allclose(got.advantages, want_adv, rtol=0, atol=1e-12)
        np.testing.assert_allclose(got.mean, [w[1] for w in want], rtol=0, atol=1e-12)
        np.testing.assert_allclose(got.std, [w[2] for w in want], rtol=0, atol=1e-12)
        assert got.degenerate.tolist() == [w[3] for w in want]


@pytest.mark.parametrize("name", NAMES)
def test_row_path_shapes_and_input_left_untouched(name: str) -> None:
    matrix = np.array([[1.0, 2.0], [3.0, 3.0], [0.0, 5.0]])
    before = matrix.copy()
    out = ROW_ESTIMATORS[name](matrix, EstimatorParams(name))
    assert out.advantages.shape == (6,) and out.advantages.dtype == np.float64
    assert out.mean.shape == out.std.shape == out.degenerate.shape == (3,)
    assert out.degenerate.tolist() == [False, True, False]
    assert same_bits(matrix, before)
    # A group of one: the member-major copy of (G, 1) is the input's own memory layout.
    single = np.array([[0.5], [-1.0]])
    ROW_ESTIMATORS[name](single, EstimatorParams(name))
    assert single.tolist() == [[0.5], [-1.0]]


@pytest.mark.parametrize("name", NAMES)
def test_row_path_rejects_what_is_not_a_matrix(name: str) -> None:
    fn = ROW_ESTIMATORS[name]
    with pytest.raises(ValueError, match=r"\(G, n\) with n >= 1"):
        fn(np.zeros(4), EstimatorParams(name))
    with pytest.raises(ValueError, match=r"\(G, n\) with n >= 1"):
        fn(np.zeros((3, 0)), EstimatorParams(name))


def test_row_registry_has_the_same_names() -> None:
    assert list(ROW_ESTIMATORS) == list(ESTIMATORS)
    with pytest.raises(UnknownEstimatorError):
        ROW_ESTIMATORS["ppo"]


@pytest.mark.parametrize("name", NAMES)
def test_outputs_are_float64_with_documented_shapes(name: str) -> None:
    out = run([[1.0, 2.0], [3.0], [4.0, 4.0, 5.0]], EstimatorParams(name))
    assert out.advantages.dtype == np.float64
    assert out.advantages.shape == (6,)
    assert out.mean.dtype == out.std.dtype == np.float64
    assert out.mean.shape == out.std.shape == out.degenerate.shape == (3,)
    assert out.degenerate.dtype == np.bool_


# --- hand-computed cases ---------------------------------------------------------------------


def test_grpo_hand_computed_ddof1() -> None:
    # mean 0.5; squared deviations 4 * 0.25 = 1, / (4 - 1) -> std sqrt(1/3)
    out = run([[1.0, 0.0, 0.0, 1.0]], EstimatorParams("grpo", eps=1e-6, ddof=1))
    a = 0.5 / (0.5773502691896257 + 1e-6)
    assert a == pytest.approx(0.8660239037870368, rel=1e-15)
    np.testing.assert_allclose(out.advantages, [a, -a, -a, a], rtol=1e-15, atol=0)
    assert out.mean.tolist() == [0.5]
    assert out.std[0] == pytest.approx(0.5773502691896257, rel=1e-15)
    assert out.degenerate.tolist() == [False]


def test_grpo_hand_computed_ddof0() -> None:
    # population std of [1, 0, 0, 1] is exactly 0.5
    out = run([[1.0, 0.0, 0.0, 1.0]], EstimatorParams("grpo", eps=1e-6, ddof=0))
    a = 0.999998000004  # 0.5 / (0.5 + 1e-6)
    np.testing.assert_allclose(out.advantages, [a, -a, -a, a], rtol=1e-15, atol=0)
    assert out.std.tolist() == [0.5]


def test_rloo_hand_computed() -> None:
    # 1 - mean(2, 3), 2 - mean(1, 3), 3 - mean(1, 2)
    out = run([[1.0, 2.0, 3.0]], EstimatorParams("rloo"))
    assert out.advantages.tolist() == [-1.5, 0.0, 1.5]
    assert out.mean.tolist() == [2.0]
    assert out.std.tolist() == [1.0]


def test_dr_grpo_hand_computed() -> None:
    out = run([[1.0, 2.0, 3.0, 6.0]], EstimatorParams("dr_grpo"))
    assert out.advantages.tolist() == [-2.0, -1.0, 0.0, 3.0]
    assert out.mean.tolist() == [3.0]


def test_grpo_batch_std_hand_computed() -> None:
    # batch [0, 1, 0, 2]: mean 0.75, squared deviations sum to 2.75, ddof 1 -> std sqrt(2.75 / 3)
    out = run([[0.0, 1.0], [0.0, 2.0]], EstimatorParams("grpo", eps=1e-6, batch_std=True))
    s = 0.9574271077563381
    np.testing.assert_allclose(
        out.advantages,
        [-0.5 / (s + 1e-6), 0.5 / (s + 1e-6), -1 / (s + 1e-6), 1 / (s + 1e-6)],
        rtol=1e-15,
        atol=0,
    )
    # the reported std stays the group's own
    np.testing.assert_allclose(out.std, [math.sqrt(0.5), math.sqrt(2.0)], rtol=1e-15)


def test_batch_std_keeps_the_relative_scale_of_groups() -> None:
    groups = [[0.0, 1.0], [0.0, 10.0]]
    per_group = run(groups, EstimatorParams("grpo", eps=0.0))
    batch = run(groups, EstimatorParams("grpo", eps=0.0, batch_std=True))
    # per-group std erases the 10x spread; batch std keeps it
    assert per_group.advantages[1] == pytest.approx(per_group.advantages[3])
    assert batch.advantages[3] == pytest.approx(10 * batch.advantages[1])


def test_two_pass_variance_survives_a_large_offset() -> None:
    # E[x^2] - E[x]^2 at 1e9 loses every digit (ulp(1e18) = 128); two-pass is exact here.
    out = run([[1e9 + 1, 1e9, 1e9, 1e9 + 1]], EstimatorParams("grpo", eps=0.0))
    assert out.std[0] == pytest.approx(math.sqrt(1 / 3), rel=1e-15)
    np.testing.assert_allclose(out.advantages, np.array([1, -1, -1, 1]) * math.sqrt(0.75))


# --- degenerate groups -----------------------------------------------------------------------


@pytest.mark.parametrize("ddof", [0, 1])
@pytest.mark.parametrize("eps", [0.0, 1e-6])
@pytest.mark.parametrize(
    "p_name_batch", [("grpo", False), ("grpo", True), ("dr_grpo", False), ("rloo", False)]
)
def test_degenerate_groups_are_exactly_zero_and_flagged(
    p_name_batch: tuple[str, bool], eps: float, ddof: int
) -> None:
    name, batch_std = p_name_batch
    p = EstimatorParams(name, eps=eps, ddof=ddof, batch_std=batch_std)
    # 3 * 0.1 / 3 != 0.1 in floats: a sum-based mean would leave 1e-17 deviations behind
    groups = [[0.1, 0.1, 0.1], [5.0], [0.0, 1.0], [-0.0, 0.0], [7.25] * 16]
    out = run(groups, p)
    assert out.degenerate.tolist() == [True, True, False, True, True]
    zero = np.r_[0:3, 3, 6:8, 8:24]
    assert np.array_equal(out.advantages[zero], np.zeros(zero.size))
    assert out.mean[[0, 1, 3, 4]].tolist() == [0.1, 5.0, 0.0, 7.25]
    assert out.std[[0, 1, 3, 4]].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert np.all(np.isfinite(out.advantages))


@pytest.mark.parametrize("name", NAMES)
def test_only_degenerate_groups_with_zero_eps_stay_zero(name: str) -> None:
    p = EstimatorParams(name, eps=0.0, batch_std=name == "grpo")
    out = run([[3.0, 3.0], [1.0]], p)
    assert out.advantages.tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("ddof", [0, 1])
@pytest.mark.parametrize("name", NAMES)
def test_group_of_one(name: str, ddof: int) -> None:
    out = run([[0.7]], EstimatorParams(name, ddof=ddof))
    assert out.advantages.tolist() == [0.0]
    assert out.mean.tolist() == [0.7]
    assert out.std.tolist() == [0.0]
    assert out.degenerate.tolist() == [True]


def test_ddof_changes_std_by_the_bessel_factor() -> None:
    groups = [[1.0, 2.0, 4.0, 8.0], [0.0, 3.0]]
    std0 = run(groups, EstimatorParams("dr_grpo", ddof=0)).std
    std1 = run(groups, EstimatorParams("dr_grpo", ddof=1)).std
    np.testing.assert_allclose(std1, std0 * np.sqrt([4 / 3, 2 / 1]), rtol=1e-15)


@pytest.mark.parametrize("name", NAMES)
def test_empty_batch(name: str) -> None:
    out = run([], EstimatorParams(name))
    assert out.advantages.shape == out.mean.shape == out.std.shape == (0,)
    assert out.degenerate.shape == (0,)


@pytest.mark.parametrize("name", NAMES)
def test_inconsistent_layout_is_rejected(name: str) -> None:
    fn = ESTIMATORS[name]
    p = EstimatorParams(name)
    rewards = np.array([1.0, 2.0, 3.0])
    ids = np.array([0, 0, 1], dtype=np.intp)
    with pytest.raises(ValueError, match="at least one reward"):
        fn(rewards, ids, np.array([2, 0, 1], dtype=np.intp), p)
    with pytest.raises(ValueError, match="sum to N"):
        fn(rewards, ids, np.array([2, 2], dtype=np.intp), p)
    with pytest.raises(ValueError, match="1-D"):
        fn(rewards, ids[:2], np.array([2, 1], dtype=np.intp), p)
    with pytest.raises(ValueError, match="no groups"):
        fn(rewards, ids, np.zeros(0, dtype=np.intp), p)


# --- registry and params validation -----------------------------------------------------------


def test_registry_lists_the_estimators() -> None:
    assert set(ESTIMATORS) == set(NAMES)
    assert len(ESTIMATORS) == 3
    assert "grpo" in ESTIMATORS
    assert "ppo" not in ESTIMATORS
    assert ESTIMATORS.get("ppo") is None


def test_unknown_estimator_names_the_known_ones() -> None:
    with pytest.raises(UnknownEstimatorError) as info:
        ESTIMATORS["ppo"]
    assert isinstance(info.value, ValueError)
    assert str(info.value) == "unknown estimator 'ppo'; known estimators: dr_grpo, grpo, rloo"
    assert info.value.known == ("dr_grpo", "grpo", "rloo")
    with pytest.raises(UnknownEstimatorError, match="known estimators: dr_grpo, grpo, rloo"):
        validate_params(EstimatorParams("ppo"))


@pytest.mark.parametrize(
    ("p", "message"),
    [
        (EstimatorParams(eps=-1e-9), "eps must be finite and >= 0"),
        (EstimatorParams(eps=math.nan), "eps must be finite"),
        (EstimatorParams(eps=math.inf), "eps must be finite"),
        (EstimatorParams(ddof=2), "ddof must be 0 or 1"),
        (EstimatorParams(ddof=-1), "ddof must be 0 or 1"),
        (EstimatorParams(ddof=True), "ddof must be 0 or 1"),
        (EstimatorParams("rloo", batch_std=True), "batch_std applies to 'grpo' only"),
        (EstimatorParams("dr_grpo", batch_std=True), "batch_std applies to 'grpo' only"),
    ],
    ids=repr,
)
def test_validate_params_rejects(p: EstimatorParams, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_params(p)


@given(
    name=st.sampled_from([*NAMES, "ppo", ""]),
    eps=st.floats(allow_nan=True, allow_infinity=True),
    ddof=st.integers(-3, 3),
    batch_std=st.booleans(),
)
def test_validate_params_accepts_exactly_the_valid_ones(
    name: str, eps: float, ddof: int, batch_std: bool
) -> None:
    p = EstimatorParams(name, eps=eps, ddof=ddof, batch_std=batch_std)
    valid = (
        name in NAMES
        and math.isfinite(eps)
        and eps >= 0
        and ddof in (0, 1)
        and (not batch_std or name == "grpo")
    )
    if valid:
        validate_params(p)
    else:
        with pytest.raises(ValueError, match=r"unknown estimator|must be|applies to"):
            validate_params(p)


# --- Hypothesis properties --------------------------------------------------------------------

# Rewards on a 1e-12 grid: distinct rewards differ by far more than the ~1e-154 below which
# squared deviations underflow (a documented precondition of the estimators).
rewards_st = st.floats(-10, 10, allow_nan=False).map(lambda r: round(r, 12))
groups_st = st.lists(st.lists(rewards_st, min_size=1, max_size=16), min_size=1, max_size=8)
params_st = st.builds(
    EstimatorParams,
    name=st.sampled_from(NAMES),
    eps=st.sampled_from([0.0, 1e-6]),
    ddof=st.sampled_from([0, 1]),
)


def rounding_bound(group: Sequence[float], p: EstimatorParams, std: float) -> float:
    """A generous bound on float rounding in one group's advantages.

    Deviations r - mean carry about n ulps of the largest |r|; grpo divides them by std + eps
    and rloo multiplies them by n / (n - 1) <= 2.
    """
    n = len(group)
    slack = 16 * n * ULP * max(1.0, max(abs(r) for r in group))
    if p.name == "grpo":
        return slack / (std + p.eps)
    return 2 * slack


def split(
    values: NDArray[np.float64], groups: Sequence[Sequence[float]]
) -> list[NDArray[np.float64]]:
    return np.split(values, np.cumsum([len(g) for g in groups])[:-1])


@settings(deadline=None)
@given(groups=groups_st, p=params_st)
def test_property_advantages_sum_to_zero_per_group(
    groups: list[list[float]], p: EstimatorParams
) -> None:
    out = run(groups, p)
    for g, (group, adv) in enumerate(zip(groups, split(out.advantages, groups), strict=True)):
        if out.degenerate[g]:
            assert np.array_equal(adv, np.zeros(len(group)))
        else:
            assert abs(float(adv.mean())) <= rounding_bound(group, p, float(out.std[g]))


@settings(deadline=None)
@given(groups=groups_st, p=params_st, data=st.data())
def test_property_permuting_members_permutes_advantages(
    groups: list[list[float]], p: EstimatorParams, data: st.DataObject
) -> None:
    perms = [data.draw(st.permutations(range(len(g)))) for g in groups]
    shuffled = [[g[i] for i in perm] for g, perm in zip(groups, perms, strict=True)]
    out = run(groups, p)
    moved = run(shuffled, p)
    assert moved.degenerate.tolist() == out.degenerate.tolist()
    np.testing.assert_array_equal(moved.std == 0, out.std == 0)
    per_group = zip(
        groups,
        perms,
        split(out.advantages, groups),
        split(moved.advantages, groups),
        strict=True,
    )
    for g, (group, perm, adv, adv_moved) in enumerate(per_group):
        if out.degenerate[g]:
            assert np.array_equal(adv, np.zeros(len(group)))
            assert np.array_equal(adv_moved, np.zeros(len(group)))
            continue
        bound = rounding_bound(group, p, float(out.std[g]))
        np.testing.assert_allclose(adv_moved, adv[list(perm)], rtol=0, atol=2 * bound)


spread_groups_st = st.lists(
    st.lists(rewards_st, min_size=2, max_size=16).filter(lambda g: max(g) - min(g) >= 1e-3),
    min_size=1,
    max_size=8,
)


@settings(deadline=None)
@given(
    groups=spread_groups_st,
    factor=st.floats(1e-2, 1e2),
    shift=st.floats(-100, 100),
    eps=st.sampled_from([0.0, 1e-6]),
    ddof=st.sampled_from([0, 1]),
)
def test_property_grpo_is_invariant_to_positive_affine_maps(
    groups: list[list[float]], factor: float, shift: float, eps: float, ddof: int
) -> None:
    """A(k r + c) == A(r) up to eps and rounding.

    Exactly, A'_i - A_i = d_i * (k / (k s + eps) - 1 / (s + eps)), so
    |A'_i - A_i| = |A_i| * eps * |k - 1| / (k s + eps): zero for eps = 0 or k = 1, and
    small as long as eps << k s. Rounding adds about n ulps of max |k r + c|, divided by k s.
    """
    p = EstimatorParams("grpo", eps=eps, ddof=ddof)
    mapped = [[factor * r + shift for r in g] for g in groups]
    assume(all(max(g) > min(g) for g in mapped))
    out = run(groups, p)
    moved = run(mapped, p)
    assert not out.degenerate.any()
    assert not moved.degenerate.any()
    for g, group in enumerate(groups):
        s = float(out.std[g])
        adv = split(out.advantages, groups)[g]
        adv_moved = split(moved.advantages, groups)[g]
        eps_term = np.abs(adv) * eps * abs(factor - 1) / (factor * s + eps)
        rounding = rounding_bound(group, p, s) + rounding_bound(mapped[g], p, factor * s)
        assert np.all(np.abs(adv_moved - adv) <= eps_term * 1.01 + 4 * rounding)


equal_groups_st = st.integers(1, 12).flatmap(
    lambda n: st.lists(st.lists(rewards_st, min_size=n, max_size=n), min_size=1, max_size=12)
)
all_params_st = st.sampled_from(ALL_PARAMS)


@settings(deadline=None)
@given(groups=equal_groups_st, p=all_params_st)
def test_property_row_and_ragged_paths_give_the_same_bits(
    groups: list[list[float]], p: EstimatorParams
) -> None:
    assert_paths_agree(np.array(groups, dtype=np.float64), p)
