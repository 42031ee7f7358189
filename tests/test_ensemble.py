"""Ensemble members (tabfm.ensemble) and regression targets (tabfm.target_transform): views, transforms and the
exact mapping of a binned distribution back to target units."""

import numpy as np
import pandas as pd
import pytest

from tabfm.ensemble import (AUTO_MEMBER_ROWS, MAX_AUTO_MEMBERS, ONEHOT_MAX_CATEGORIES, Member, code_members,
                            auto_members, draw_members, member_cells, member_width)
from tabfm.preprocess import NUMERIC_TRANSFORMS, TablePreprocessor
from tabfm.target_transform import (TargetScale, TargetTransform, bin_points, mapped_mean, mixture_quantiles,
                                    sub_edges)


def _table(n=40, seed=0):
    rng = np.random.default_rng(seed)
    wide = [f"c{i}" for i in range(ONEHOT_MAX_CATEGORIES + 3)]
    return pd.DataFrame({
        "x": rng.normal(size=n) * 100 + 5,
        "yes_no": rng.choice(["no", "yes"], n),
        "three": pd.Series(rng.choice(["a", "b", "c", None], n), dtype=object),
        "wide": rng.choice(wide, n),
    })


def test_auto_members_spend_on_small_tables_what_four_members_cost_on_1024_rows():
    assert [auto_members(n) for n in (1, 10, 256, 257, 300, 512, 800, 1023, 1024, 5000, 10**7)] == \
        [16, 16, 16, 15, 13, 8, 5, 4, 4, 4, 4]
    counts = [auto_members(n) for n in range(1, 3000)]
    assert all(a >= b for a, b in zip(counts, counts[1:]))  # never more members for more rows
    assert all(m * n <= AUTO_MEMBER_ROWS for n, m in enumerate(counts, 1) if m > 4)


def test_draw_members_orders_subsets_and_cycles():
    rng = np.random.default_rng(0)
    members = draw_members(5, 4, ("none", "power"), ("embed", "onehot", "ordinal"), None, rng)
    assert np.array_equal(members[0].columns, np.arange(4))
    assert all(sorted(m.columns) == [0, 1, 2, 3] for m in members)
    assert [m.numeric for m in members] == ["none", "power", "none", "power", "none"]
    assert [m.categorical for m in members] == ["embed", "onehot", "ordinal", "embed", "onehot"]
    sub = draw_members(4, 10, ("none",), ("embed",), 5, rng)
    assert all(len(m.columns) == 5 and len(set(m.columns)) == 5 for m in sub)
    assert set(np.concatenate([m.columns for m in sub[:2]])) == set(range(10))  # every column used before repeats
    with pytest.raises(ValueError, match="numeric_transforms"):
        draw_members(2, 3, ("log",), ("embed",), None, rng)
    with pytest.raises(ValueError, match="categorical_views"):
        draw_members(2, 3, ("none",), (), None, rng)


def test_every_subset_holds_the_most_relevant_columns_and_every_column_is_seen():
    rng = np.random.default_rng(0)
    relevance = rng.random(30)
    top = np.argsort(-relevance)
    members = draw_members(2, 30, ("none",), ("embed",), 4, rng, relevance)
    for m in members:  # the core (CORE_SHARE x 4 = 2 columns) in each; 2 members cannot see 30 columns: the top 8
        assert len(m.columns) == 4 and set(top[:2]) <= set(m.columns) <= set(top[:8])
    # three informative columns of 20, seen whole by 4 members of 8: those three in every member (fewer than the
    # core's 4 places: a column that explains nothing is no core column), every other column in some member
    relevance = np.r_[np.zeros(10), 0.9, 0.8, 0.7, np.zeros(7)]
    members = draw_members(4, 20, ("none",), ("embed",), 8, np.random.default_rng(1), relevance)
    assert all(len(m.columns) == 8 and {10, 11, 12} <= set(m.columns) for m in members)
    assert set(np.concatenate([m.columns for m in members])) == set(range(20))
    # no column informative: no core, the same draw as without relevance
    flat = draw_members(4, 20, ("none",), ("embed",), 8, np.random.default_rng(1), np.zeros(20))
    plain = draw_members(4, 20, ("none",), ("embed",), 8, np.random.default_rng(1))
    assert all(np.array_equal(a.columns, b.columns) for a, b in zip(flat, plain, strict=True))


def test_member_cells_views():
    df = _table()
    pre = TablePreprocessor(transforms=NUMERIC_TRANSFORMS).fit(df)
    cells = pre.transform(df)
    cols = np.arange(cells.values.shape[1])
    embed = member_cells(pre, cells, Member(cols, "none", "embed"))
    assert embed.is_cat.tolist() == [False, True, True, True]
    x = df["x"].to_numpy()
    assert np.allclose(embed.values[:, 0], (x - x.mean()) / x.std())  # "none": standardised, as the model does
    onehot = member_cells(pre, cells, Member(cols, "robust", "onehot"))
    # x, one column for the binary, three for a/b/c, the wide column still embedded
    assert onehot.values.shape[1] == 1 + 1 + 3 + 1 == member_width(Member(cols, "robust", "onehot"), cells.is_cat,
                                                                   cells.n_cats, 100)
    assert onehot.is_cat.tolist() == [False, False, False, False, False, True]
    assert np.array_equal(onehot.values[:, 1], (df["yes_no"] == "yes").to_numpy(float))
    missing = df["three"].isna().to_numpy()
    assert np.isnan(onehot.values[missing, 2:5]).all()
    assert np.array_equal(np.nansum(onehot.values[~missing, 2:5], 1), np.ones((~missing).sum()))
    ordinal = member_cells(pre, cells, Member(cols, "quantile", "ordinal"))
    assert not ordinal.is_cat.any() and np.isnan(ordinal.values[missing, 2]).all()
    assert set(np.unique(ordinal.values[:, 3])) <= set(range(len(set(df["wide"]))))
    # one-hot that would pass the model's column limit falls back to the embedding
    narrow = TablePreprocessor(max_columns=5, transforms=("none",)).fit(df)
    fallback = member_cells(narrow, narrow.transform(df), Member(cols, "none", "onehot"))
    assert fallback.values.shape[1] == 4 and fallback.is_cat.tolist() == [False, True, True, True]


@pytest.mark.parametrize("kind", NUMERIC_TRANSFORMS)
def test_numeric_transforms_keep_missing_and_order(kind):
    df = _table()
    df.loc[3, "x"] = np.nan
    pre = TablePreprocessor(transforms=(kind,)).fit(df)
    cells = pre.transform(df)
    scaled = pre.scale(cells, kind)[:, 0]
    assert np.isnan(scaled[3]) and np.isfinite(np.delete(scaled, 3)).all()
    order = np.argsort(np.delete(df["x"].to_numpy(), 3), kind="stable")
    assert np.all(np.diff(np.delete(scaled, 3)[order]) >= -1e-12)  # monotone in the raw value
    with pytest.raises(ValueError, match="was not fitted"):
        pre.scale(cells, next(k for k in NUMERIC_TRANSFORMS if k != kind))


@pytest.mark.parametrize("kind", NUMERIC_TRANSFORMS)
def test_numeric_transforms_scale_each_column_alike_with_or_without_categorical_columns(kind):
    """scale() takes whole arrays when every column is numeric and gathers the numeric ones otherwise: the same
    numbers either way, categorical columns NaN, and the cells it reads left as they were."""
    df = _table(60)
    df["z"] = np.random.default_rng(1).lognormal(size=60)
    df.loc[5, "z"] = np.nan
    mixed = TablePreprocessor(transforms=(kind,)).fit(df)
    numeric = TablePreprocessor(transforms=(kind,)).fit(df[["x", "z"]])
    cells_mixed, cells_numeric = mixed.transform(df), numeric.transform(df[["x", "z"]])
    before = cells_numeric.values.copy()
    a, b = mixed.scale(cells_mixed, kind), numeric.scale(cells_numeric, kind)
    names = [c.name for c in mixed.columns_]
    cols = [names.index("x"), names.index("z")]
    assert np.allclose(a[:, cols], b, rtol=1e-12, atol=1e-12, equal_nan=True) and np.isnan(b[5, 1])
    assert np.isnan(np.delete(a, cols, axis=1)).all()
    assert np.array_equal(cells_numeric.values, before, equal_nan=True) and not np.shares_memory(b, cells_numeric.values)


def test_numeric_columns_near_float64_limits_reach_the_model_finite():
    X = np.array([[1.7e308, 1.0], [-1.0e308, 2.0], [5e307, 3.0], [np.nan, 4.0]])
    pre = TablePreprocessor(transforms=NUMERIC_TRANSFORMS).fit(X)
    for kind in NUMERIC_TRANSFORMS:
        scaled = pre.scale(pre.transform(X), kind)
        assert np.isfinite(scaled[:3]).all() and np.isnan(scaled[3, 0]), kind
        assert np.abs(scaled.astype(np.float32)[:3]).max() < 1e3, kind


@pytest.mark.parametrize("magnitude", [1e-30, 1e-12, 1.0, 1e20, 1e39, 1e300])
def test_target_scale_round_trips_any_magnitude(magnitude):
    y = np.random.default_rng(0).normal(3, 1, 50) * magnitude
    scale = TargetScale.fit(y)
    u = scale.forward(y)
    assert np.isfinite(u).all() and abs(u.mean()) < 1e-9 and abs(u.std() - 1) < 1e-9
    assert np.allclose(scale.inverse(u), y, rtol=1e-12, atol=0)
    assert TargetScale.fit(np.full(5, 7.0)).inverse(np.zeros(1))[0] == 7.0  # a constant target


@pytest.mark.parametrize("kind", ["none", "power", "quantile"])
def test_target_transform_inverse_is_monotone_and_finite(kind):
    u = np.random.default_rng(1).lognormal(0, 1.5, 300)
    u = (u - u.mean()) / u.std()
    tt = TargetTransform(kind).fit(u)
    assert np.allclose(tt.inverse(tt.transform(u)), u, atol=1e-6)
    t = np.linspace(-50, 50, 2001)
    back = tt.inverse(t)
    assert np.isfinite(back).all() and np.all(np.diff(back) >= 0)
    if kind != "none":  # held near the train targets, however far the model's bins reach
        width = u.max() - u.min()
        assert back.min() >= u.min() - width - 1e-9 and back.max() <= u.max() + width + 1e-9


def test_binned_distribution_maps_back_exactly_for_the_identity():
    edges = np.linspace(-4, 4, 9)
    probs = np.zeros((2, 8))
    probs[0, 3] = 1.0                      # all mass in [-1, 0]
    probs[1] = 1 / 8                       # uniform over [-4, 4]
    points = bin_points(edges)
    assert np.allclose(mapped_mean(probs, points), [-0.5, 0.0])
    q = mixture_quantiles([probs], [sub_edges(edges)], np.array([0.25, 0.5, 0.75]))
    assert np.allclose(q[0], [-0.75, -0.5, -0.25]) and np.allclose(q[1], [-2.0, 0.0, 2.0])
    # an equal mixture of the two: CDF 0.5 (x + 1) + (x + 4) / 16 on [-1, 0], so the median is -4/9
    q = mixture_quantiles([probs, probs[::-1]], [sub_edges(edges), sub_edges(edges)], np.array([0.5]))
    assert np.allclose(q, [[-4 / 9], [-4 / 9]], atol=1e-12)


def test_weighted_mixture_quantiles():
    """Weights [K, n] per component and row: equal weights give the equal mixture, a weight of 0 drops its
    component, and a 3:1 mixture of two point-like bins has its quantiles where the weights put them."""
    rng = np.random.default_rng(1)
    edges = np.linspace(-4, 4, 9)
    probs = [rng.dirichlet(np.ones(8), size=4) for _ in range(3)]
    per = [sub_edges(edges) * s + o for s, o in ((1, 0), (2, 1), (0.5, -3))]
    q = np.array([0.05, 0.3, 0.5, 0.9])
    np.testing.assert_allclose(mixture_quantiles(probs, per, q, np.full((3, 4), 1 / 3)),
                               mixture_quantiles(probs, per, q), rtol=1e-12, atol=1e-12)
    drop = np.array([[0.4] * 4, [0.0] * 4, [0.6] * 4])
    np.testing.assert_allclose(mixture_quantiles(probs, per, q, drop),
                               mixture_quantiles([probs[0], probs[2]], [per[0], per[2]], q, drop[[0, 2]]),
                               rtol=1e-12, atol=1e-12)
    one = np.zeros((1, 8))
    one[0, 0] = 1.0                                                      # all mass in [-4, -3]
    other = np.zeros((1, 8))
    other[0, 7] = 1.0                                                    # all mass in [3, 4]
    got = mixture_quantiles([one, other], [sub_edges(edges)] * 2, np.array([0.375, 0.875]), np.array([[0.75], [0.25]]))
    np.testing.assert_allclose(got, [[-3.5, 3.5]], atol=1e-12)           # the middle of each component's bin


def test_mixture_quantiles_with_edges_per_row_equal_each_row_alone():
    """Members whose rows came from different contexts carry edges per row: each row's quantiles are those of its
    own members' edges, as if it were predicted alone."""
    rng = np.random.default_rng(0)
    edges = np.linspace(-4, 4, 9)
    probs = [rng.dirichlet(np.ones(8), size=3) for _ in range(2)]
    per_row = [np.stack([sub_edges(edges) * s + o for s, o in ((1, 0), (2, 1), (0.5, -3))]),
               np.stack([sub_edges(edges) * s + o for s, o in ((3, 2), (1, 0), (1, 5))])]
    q = np.array([0.1, 0.5, 0.9])
    together = mixture_quantiles(probs, per_row, q)
    for i in range(3):
        alone = mixture_quantiles([p[i:i + 1] for p in probs], [e[i] for e in per_row], q)
        np.testing.assert_allclose(together[i], alone[0], rtol=1e-12, atol=1e-12)
    shared = mixture_quantiles(probs, [sub_edges(edges)] * 2, q)  # edges for all rows, 1-D
    np.testing.assert_allclose(mixture_quantiles(probs, [np.tile(sub_edges(edges), (3, 1))] * 2, q), shared,
                               rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(mapped_mean(probs[0], np.stack([bin_points(edges)] * 3)),
                               mapped_mean(probs[0], bin_points(edges)), rtol=1e-12)


def test_regressor_handles_extreme_target_scales_and_gives_quantiles():
    from tabfm.estimator import TabFMRegressor

    rng = np.random.default_rng(0)
    X = rng.normal(size=(80, 3))
    base = X[:, 0] + 0.5 * X[:, 1] + 3
    for magnitude in (1e-30, 1e-12, 1e20, 1e39):
        y = base * magnitude
        reg = TabFMRegressor(n_estimators=2).fit(X[:60], y[:60])
        pred = reg.predict(X[60:])
        assert np.isfinite(pred).all()
        lo, hi = y[:60].min(), y[:60].max()
        width = hi - lo
        assert (pred >= lo - width).all() and (pred <= hi + width).all(), magnitude
        assert np.corrcoef(pred, y[60:])[0, 1] > 0.5
    q = reg.predict_quantiles(X[60:], [0.05, 0.5, 0.95])
    assert q.shape == (20, 3) and np.all(np.diff(q, axis=1) >= 0)
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        reg.predict_quantiles(X[60:], [0.5, 1.0])
    with pytest.raises(ValueError, match="target_transforms"):
        TabFMRegressor(target_transforms=("log",)).fit(X, base)


def test_code_members_of_auto_scale_with_the_classes_each_member_tells_apart():
    assert [code_members(4, k, 10, auto=True) for k in (2, 10, 11, 20, 21, 26, 100)] == [4, 4, 8, 8, 12, 12, 16]
    assert code_members(14, 15, 10, auto=True) == MAX_AUTO_MEMBERS == 16
    assert code_members(5, 11, 10, auto=True) == 10


def test_code_members_given_a_count_keep_it_above_the_floor_that_separates_every_pair():
    assert [code_members(2, k, 10, auto=False) for k in (2, 10, 14, 26, 100)] == [2, 2, 4, 4, 5]
    assert code_members(6, 26, 10, auto=False) == 6
    assert code_members(1, 1000, 10, auto=False) == 7
