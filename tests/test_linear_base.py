"""tabfm.linear_base: the regressor's ridge under the model (its residuals, what it adds back) and the
classifier's logistic regression weighed in at calibration."""

import dataclasses
import warnings

import numpy as np
import pandas as pd
import pytest
from sklearn.linear_model import LogisticRegression, RidgeCV
from sklearn.metrics import log_loss, r2_score

from tabfm import TabFMClassifier, TabFMRegressor
from tabfm.linear_base import (ALPHAS, HINGE_CELLS, HINGE_KNOTS, LINEAR_VIEWS, LOGISTIC_CS, MIN_ROWS, LinearBase,
                               LinearDesign, LogisticModel)
from tabfm.preprocess import Cells, TablePreprocessor


def _linear_table(n: int, seed: int = 0, noise: float = 0.0, missing: float = 0.1):
    """Four numeric columns (one with missing values) and a three-level category, y linear in all of them."""
    rng = np.random.default_rng(seed)
    X = pd.DataFrame(rng.normal(size=(n, 4)), columns=list("abcd"))
    X["shelf"] = rng.choice(["bad", "good", "medium"], n)
    y = X[list("abcd")].to_numpy() @ np.array([1.5, -2.0, 0.5, 1.0]) + X["shelf"].map(
        {"bad": -3.0, "good": 2.0, "medium": 0.0}).to_numpy()
    y = y + noise * rng.normal(size=n)
    X.loc[rng.random(n) < missing, "a"] = np.nan
    return X, y


def _multiplicative_table(n: int, seed: int = 0):
    """Three numeric columns and a target that is their plane exponentiated (a price growing as a power of its
    sizes), with 10% multiplicative noise: linear in the target's logarithm, not in the target."""
    rng = np.random.default_rng(seed)
    X = pd.DataFrame(rng.normal(size=(n, 3)), columns=list("abc"))
    y = np.exp(X.to_numpy() @ np.array([0.8, -0.5, 0.3]) + 0.1 * rng.normal(size=n))
    return X, y


def _saturating_table(n: int, seed: int = 0):
    """Two skewed positive columns and a target linear in their logarithms (a yield that saturates with its
    inputs), with a little noise: linear in the columns' Yeo-Johnson transforms, not in the columns."""
    rng = np.random.default_rng(seed)
    X = pd.DataFrame(np.exp(rng.normal(size=(n, 2))), columns=list("ab"))
    y = np.log(X["a"].to_numpy()) - 0.5 * np.log(X["b"].to_numpy()) + 0.1 * rng.normal(size=n)
    return X, y


def _cells(X_fit, X=None):
    pre = TablePreprocessor().fit(X_fit)
    return pre.transform(X_fit if X is None else X)


def test_base_recovers_a_linear_target_with_categories_and_missing_values():
    X, y = _linear_table(400, missing=0.0)
    cells = _cells(X)
    base, oof = LinearBase.fit(cells, y)
    assert base.coef.any() and base.target_map is None and base.design.numeric_map is None  # no map beats it
    assert r2_score(y, base.predict(cells)) > 0.999
    assert r2_score(y, oof) > 0.99  # out of fold, still close: the target is exactly linear
    assert len(base.design.indicators) == 0  # no missing value left in the train rows
    assert base.design(cells).shape[1] == 4 + 3  # four standardised columns and three one-hot levels


def test_a_multiplicative_target_gets_the_plane_of_its_transform():
    X, y = _multiplicative_table(600)
    train, test = slice(0, 400), slice(400, None)
    cells = _cells(X.iloc[train])
    base, oof = LinearBase.fit(cells, y[train])
    assert base.target_map is not None and base.target_map.kind == "power"
    new = _cells(X.iloc[train], X.iloc[test])
    plain = RidgeCV(alphas=ALPHAS).fit(base.design(cells), y[train])  # what the base was before the map
    ours, theirs = r2_score(y[test], base.predict(new)), r2_score(y[test], plain.predict(base.design(new)))
    assert ours > theirs + 0.2 and ours > 0.85, (ours, theirs)  # 0.88 against 0.59
    assert r2_score(y[train], oof) > 0.9  # the out-of-fold predictions are mapped back to the target's units
    lo, hi = base.bounds
    far = X.iloc[:3].copy()
    far[list("abc")] = 1e6  # the map's inverse of a far plane is held inside the bounds, never NaN or inf
    with pytest.warns(UserWarning, match="over 10 times larger"):
        pred = base.predict(_cells(X.iloc[train], far))
    assert np.isfinite(pred).all() and (pred >= lo).all() and (pred <= hi).all()


def test_a_target_linear_in_transformed_columns_gets_the_plane_of_their_transforms():
    X, y = _saturating_table(600)
    train, test = slice(0, 400), slice(400, None)
    cells = _cells(X.iloc[train])
    base, _ = LinearBase.fit(cells, y[train])
    assert base.design.numeric_map is not None or base.design.hinges is not None  # a curve of each column
    new = _cells(X.iloc[train], X.iloc[test])
    plain_design = dataclasses.replace(base.design, numeric_map=None, hinges=None)
    plain = RidgeCV(alphas=ALPHAS).fit(plain_design(cells), y[train])
    ours, theirs = r2_score(y[test], base.predict(new)), r2_score(y[test], plain.predict(plain_design(new)))
    assert ours > theirs + 0.2 and ours > 0.9, (ours, theirs)  # 0.95 against 0.67
    assert base.design(new).shape[1] == base.design.width


def test_a_target_that_peaks_twice_along_a_column_gets_the_hinge_design():
    """A count that peaks at two hours of the day: no plane fits it, in the column or its transform; a ridge on
    hinge columns (max(0, hour - knot) at the hours' eighths) fits the curve piecewise."""
    rng = np.random.default_rng(3)
    X = pd.DataFrame({"hour": rng.uniform(0, 24, 800), "noise": rng.normal(size=800),
                      "busy": rng.integers(0, 2, 800).astype(float)})
    hour = X["hour"].to_numpy()
    y = np.exp(-(hour - 8) ** 2 / 4) + 1.5 * np.exp(-(hour - 18) ** 2 / 4) + 0.1 * rng.normal(size=800)
    train, test = slice(0, 600), slice(600, None)
    cells, new = _cells(X.iloc[train]), _cells(X.iloc[train], X.iloc[test])
    base, _ = LinearBase.fit(cells, y[train])
    assert base.design.hinges is not None and base.design(new).shape[1] == base.design.width == 3 * (1 + 7)
    plain = dataclasses.replace(base.design, hinges=None)
    ridge = RidgeCV(alphas=ALPHAS).fit(plain(cells), y[train])
    ours, theirs = r2_score(y[test], base.predict(new)), r2_score(y[test], ridge.predict(plain(new)))
    assert ours > 0.6 and ours > theirs + 0.5, (ours, theirs)
    knots = base.design.hinges[list(base.design.numeric).index(2)]  # the 0/1 column: one knot at 0 at most
    assert np.isfinite(knots).sum() <= 1


def test_logistic_model_on_transformed_columns_fits_a_boundary_curved_in_the_columns():
    rng = np.random.default_rng(2)
    X = pd.DataFrame(np.exp(rng.normal(size=(1000, 2))), columns=list("ab"))
    y = (np.log(X["a"]) + np.log(X["b"]) + 0.3 * rng.normal(size=1000) > 0).to_numpy().astype(int)  # a * b > 1
    cells, new = _cells(X.iloc[:700]), _cells(X.iloc[:700], X.iloc[700:])
    plain = LogisticModel.fit(cells, y[:700], 2)
    mapped = LogisticModel.fit(cells, y[:700], 2, view="power")
    assert plain.design.numeric_map is None and mapped.design.numeric_map is not None
    loss = {name: log_loss(y[700:], m.predict_proba(new)) for name, m in (("plain", plain), ("mapped", mapped))}
    assert loss["mapped"] < 0.8 * loss["plain"], loss  # 0.16 against 0.31
    with pytest.raises(ValueError, match="view must be one of"):
        LogisticModel.fit(cells, y[:700], 2, view="log")


def test_a_design_offers_the_views_that_differ_and_hinges_where_they_fit():
    X, _ = _linear_table(200)
    design = LinearDesign.fit(_cells(X))
    assert design.views() == list(LINEAR_VIEWS) == design.views(200)
    per_row = design.width + len(design.numeric) * HINGE_KNOTS
    assert design.views(HINGE_CELLS // per_row) == list(LINEAR_VIEWS)
    assert design.views(HINGE_CELLS // per_row + 1) == ["plain", "power"]  # the hinge design would not fit
    categorical = LinearDesign.fit(_cells(X[["shelf"]]))
    assert categorical.views() == ["plain"]  # no numeric column: every view is the plain design
    assert all(categorical.viewed(v, _cells(X[["shelf"]])) is categorical for v in LINEAR_VIEWS)


def test_logistic_model_on_hinge_columns_fits_a_band_along_a_column():
    """Class 1 between two values of a column (a band): no single slope separates it; hinge columns do."""
    rng = np.random.default_rng(4)
    X = pd.DataFrame({"x": rng.uniform(-3, 3, 1000), "z": rng.normal(size=1000)})
    y = (np.abs(X["x"].to_numpy()) < 1).astype(int)
    cells, new = _cells(X.iloc[:700]), _cells(X.iloc[:700], X.iloc[700:])
    plain = LogisticModel.fit(cells, y[:700], 2)
    hinged = LogisticModel.fit(cells, y[:700], 2, view="hinges")
    assert hinged.design.hinges is not None and hinged.design(new).shape[1] == hinged.design.width
    loss = {name: log_loss(y[700:], m.predict_proba(new)) for name, m in (("plain", plain), ("hinges", hinged))}
    assert loss["hinges"] < 0.5 * loss["plain"], loss  # 0.14 against 0.64


def test_logistic_fits_from_a_start_reach_the_same_optimum_in_fewer_steps():
    """A fit that begins at another model's weights (of a subset of the rows, or of another penalty) reaches the
    optimum a fit from zero does (the loss is convex: one optimum, both within the solver's tolerance), in
    fewer iterations; a start of another width begins at zero; a weaker penalty (larger C) gives larger
    weights."""
    rng = np.random.default_rng(5)
    X = pd.DataFrame(rng.normal(size=(400, 6)), columns=list("abcdef"))
    y = (X.to_numpy() @ np.array([2.0, -1.0, 0.5, 0, 0, 0]) + rng.normal(size=400) > 0).astype(int)
    cells, part = _cells(X.iloc[:300]), _cells(X.iloc[:240])
    design = LinearDesign.fit(cells).viewed("hinges", cells)

    def objective(model, C):  # what LogisticRegression minimises: C x the summed log-loss + |w|^2 / 2
        p = model.predict_proba(cells)[np.arange(300), y[:300]]
        return C * -np.log(p).sum() + 0.5 * (model.coef ** 2).sum()

    iterations = []
    real_fit = LogisticRegression.fit
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LogisticRegression, "fit", lambda lr, *a, **k: iterations.append(
            int(real_fit(lr, *a, **k).n_iter_[0])) or lr)
        subset = LogisticModel.fit(part, y[:240], 2, view="hinges")
        cold = [LogisticModel.fit_design(cells, y[:300], 2, design, C) for C in sorted(LOGISTIC_CS)]
        warm = [LogisticModel.fit_design(cells, y[:300], 2, design, C, start=subset) for C in sorted(LOGISTIC_CS)]
        plain = LogisticModel.fit(cells, y[:300], 2)
        narrow = LogisticModel.fit(cells, y[:300], 2, start=subset)  # 6 columns, the start 48: from zero
    np.testing.assert_array_equal(plain.coef, narrow.coef)
    n = len(LOGISTIC_CS)
    assert sum(iterations[1 + n:1 + 2 * n]) < sum(iterations[1:1 + n]), iterations
    norms = [np.linalg.norm(m.coef) for m in cold]
    assert all(a < b for a, b in zip(norms, norms[1:], strict=False)), norms
    for C, a, b in zip(sorted(LOGISTIC_CS), cold, warm, strict=True):
        assert objective(b, C) == pytest.approx(objective(a, C), rel=1e-4), C


def test_missing_values_get_an_indicator_and_unseen_categories_no_weight():
    X, y = _linear_table(300)
    cells = _cells(X)
    base, _ = LinearBase.fit(cells, y)
    assert list(base.design.indicators) == [0]  # column "a" had missing values at fit
    test = X.iloc[:5].copy()
    test["shelf"] = "unheard-of"
    test["a"] = np.nan
    with pytest.warns(UserWarning, match="never seen at fit"):
        unseen = _cells(X, test)
    pred = base.predict(unseen)
    assert np.isfinite(pred).all()
    design = base.design(unseen)
    assert (design[:, -3:] == 0).all()  # an unseen category switches no one-hot column on


def test_base_falls_back_to_the_mean_when_the_ridge_does_not_predict_new_rows():
    rng = np.random.default_rng(1)
    X = pd.DataFrame(rng.normal(size=(200, 6)))
    y = rng.normal(size=200)  # unrelated to X
    cells = _cells(X)
    base, oof = LinearBase.fit(cells, y)
    assert not base.coef.any()
    np.testing.assert_array_equal(oof, np.full(200, y.mean()))
    np.testing.assert_array_equal(base.predict(cells), np.full(200, y.mean()))


@pytest.mark.parametrize("n", [1, 2, MIN_ROWS - 1])
def test_too_few_rows_give_the_constant_base(n):
    X, y = _linear_table(n)
    base, oof = LinearBase.fit(_cells(X), y)
    assert not base.coef.any()
    np.testing.assert_allclose(oof, y.mean())


def test_predictions_are_held_near_the_train_targets():
    X, y = _linear_table(200)
    cells = _cells(X)
    base, _ = LinearBase.fit(cells, y)
    far = X.iloc[:3].copy()
    far[list("bcd")] = 1e6  # far outside the train rows: the plane would predict ~1e6
    with pytest.warns(UserWarning, match="over 10 times larger"):
        pred = base.predict(_cells(X, far))
    span = y.max() - y.min()
    assert (pred >= y.min() - span - 1e-9).all() and (pred <= y.max() + span + 1e-9).all()


def test_a_value_past_the_train_rows_counts_as_the_nearest_train_value():
    X, y = _linear_table(200, missing=0.0)
    cells = _cells(X)
    base, _ = LinearBase.fit(cells, y)
    far, edge = X.iloc[:3].copy(), X.iloc[:3].copy()
    far["b"] = X["b"].max() + 50        # one cell far outside: the plane alone would move -2.0 * 50
    edge["b"] = X["b"].max()
    low, low_edge = X.iloc[:3].copy(), X.iloc[:3].copy()
    low["b"] = X["b"].min() - 1e300
    low_edge["b"] = X["b"].min()
    with pytest.warns(UserWarning, match="over 10 times larger"):  # the far cells are read as the extremes
        far_cells = _cells(X, far)
    with pytest.warns(UserWarning, match="over 10 times larger"):
        low_cells = _cells(X, low)
    np.testing.assert_allclose(base.predict(far_cells), base.predict(_cells(X, edge)), rtol=1e-12)
    np.testing.assert_allclose(base.predict(low_cells), base.predict(_cells(X, low_edge)), rtol=1e-12)
    logistic = LogisticModel.fit(cells, (y > 0).astype(int), 2)
    np.testing.assert_allclose(logistic.predict_proba(far_cells), logistic.predict_proba(_cells(X, edge)))


def test_regressor_fits_a_linear_target_as_well_as_ridge():
    X, y = _linear_table(500, noise=0.0)
    est = TabFMRegressor(n_estimators=2, n_jobs=1).fit(X.iloc[:400], y[:400])
    assert est.linear_base_ is not None and est.linear_base_.coef.any()
    assert r2_score(y[400:], est.predict(X.iloc[400:])) > 0.97


def test_without_the_base_the_members_see_the_normalised_targets():
    X, y = _linear_table(100, noise=0.5)
    est = TabFMRegressor(n_estimators=2, n_jobs=1, linear_base=False).fit(X, y)
    assert est.linear_base_ is None
    np.testing.assert_allclose(est.y_train_, est.target_scale_.forward(y))
    with_base = TabFMRegressor(n_estimators=2, n_jobs=1).fit(X, y)
    residual = with_base.target_scale_.forward(y) - with_base.y_train_
    assert np.std(with_base.y_train_) < 0.5 * np.std(residual + with_base.y_train_)  # the ridge took most of y


def test_quantiles_move_with_the_base_and_cover_the_noise():
    X, y = _linear_table(700, seed=3, noise=1.0)
    est = TabFMRegressor(n_estimators=2, n_jobs=1).fit(X.iloc[:500], y[:500])
    q = est.predict_quantiles(X.iloc[500:], [0.1, 0.5, 0.9])
    assert (np.diff(q, axis=1) >= 0).all()
    cover = np.mean((y[500:] >= q[:, 0]) & (y[500:] <= q[:, 2]))
    assert 0.65 < cover < 0.95, cover  # nominal 80%
    # the interval follows each row's linear prediction: its centre tracks the targets
    assert np.corrcoef(q[:, 1], y[500:])[0, 1] > 0.9


@pytest.mark.parametrize("table", [_linear_table, _multiplicative_table, _saturating_table])
def test_save_and_load_keep_the_base(tmp_path, table):
    X, y = table(120) if table is not _linear_table else table(120, noise=0.3)
    est = TabFMRegressor(n_estimators=2, n_jobs=1).fit(X, y)
    base = est.linear_base_
    if table is not _linear_table:  # the maps or hinges that make these targets a plane are chosen, and kept
        assert base.target_map is not None or base.design.numeric_map is not None or base.design.hinges is not None
    est.save(tmp_path / "est")
    back = TabFMRegressor.load(tmp_path / "est")
    np.testing.assert_array_equal(back.linear_base_.coef, est.linear_base_.coef)
    assert type(back.linear_base_.target_map) is type(est.linear_base_.target_map)
    assert type(back.linear_base_.design.numeric_map) is type(est.linear_base_.design.numeric_map)
    if base.design.hinges is not None:
        np.testing.assert_array_equal(back.linear_base_.design.hinges, base.design.hinges)
    cells = est.train_cells_
    np.testing.assert_array_equal(back.linear_base_.predict(cells), est.linear_base_.predict(cells))
    np.testing.assert_allclose(back.predict(X.iloc[:20]), est.predict(X.iloc[:20]), rtol=1e-6, atol=1e-6)


def _wide_linear_classes(n: int, k: int = 2, seed: int = 0):
    """30 numeric columns and a class given by a linear score: what a logistic regression gets and the model
    alone does not."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 30))
    score = X @ rng.normal(size=(30, k))
    return X, score.argmax(1)


def test_logistic_model_reads_a_linear_boundary_and_gives_unseen_classes_nothing():
    X, y = _wide_linear_classes(400, k=3)
    cells = _cells(X[:300])
    lr = LogisticModel.fit(cells, y[:300], n_classes=4)  # class 3 never seen
    proba = lr.predict_proba(_cells(X[:300], X[300:]))
    assert proba.shape == (100, 4) and np.allclose(proba.sum(1), 1) and (proba[:, 3] == 0).all()
    assert np.mean(proba.argmax(1) == y[300:]) > 0.85
    binary = LogisticModel.fit(cells, (y[:300] == 0).astype(int), n_classes=2)
    assert binary.coef.shape == (1, 30)
    p = binary.predict_proba(_cells(X[:300], X[300:]))
    assert np.mean(p.argmax(1) == (y[300:] == 0)) > 0.85


@pytest.mark.parametrize("k", [2, 3])
def test_a_design_without_columns_gives_the_class_frequencies(k):
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 150, 240)
    X = pd.DataFrame({"zip": [f"z{c:03d}" for c in codes]})
    y = np.r_[np.zeros(120, int), rng.integers(1, k, 120)]
    cells = Cells(np.empty((240, 0)), np.empty((240, 0), np.int64), np.empty(0, bool), np.empty(0, np.int64))
    lr = LogisticModel.fit(cells, y, n_classes=k + 1)  # one class more than the rows hold
    assert lr.design.width == 0
    want = np.r_[np.bincount(y, minlength=k) / len(y), 0.0]
    np.testing.assert_allclose(lr.predict_proba(cells), np.tile(want, (len(y), 1)), rtol=1e-12, atol=1e-15)
    proba = TabFMClassifier(n_estimators=2, n_jobs=1).fit(X[:200], codes[:200] % 2).predict_proba(X[200:])
    assert proba.shape == (40, 2) and np.allclose(proba.sum(1), 1)  # the blend no longer fails on it


def test_classifier_weighs_in_the_logistic_regression_where_held_out_rows_prefer_it():
    from sklearn.metrics import log_loss

    X, y = _wide_linear_classes(500, seed=2)
    blended = TabFMClassifier(n_estimators=2, n_jobs=1).fit(X[:400], y[:400])
    alone = TabFMClassifier(n_estimators=2, n_jobs=1, linear_blend=False).fit(X[:400], y[:400])
    assert blended.blend_weight_ > 0 and blended.linear_model_ is not None
    assert alone.blend_weight_ == 0 and alone.linear_model_ is None
    assert alone.temperature_ == pytest.approx(TabFMClassifier(n_estimators=2, n_jobs=1, linear_blend=False)
                                               .fit(X[:400], y[:400]).temperature_)
    p_blend, p_alone = blended.predict_proba(X[400:]), alone.predict_proba(X[400:])
    assert np.allclose(p_blend.sum(1), 1)
    assert log_loss(y[400:], p_blend) < log_loss(y[400:], p_alone)
    raw = TabFMClassifier(n_estimators=2, n_jobs=1, calibrate=False).fit(X[:400], y[:400])
    assert raw.blend_weight_ == 0 and raw.linear_model_ is None  # the weight is fitted with the temperature


@pytest.mark.parametrize("seed", [0, 1])
def test_held_rows_choose_the_weakest_penalty_for_a_boundary_without_noise(seed):
    """Classes split by a plane without noise: the sharper the logistic regression, the better it predicts the
    held rows, so of LOGISTIC_CS the largest C is chosen (the model's own prediction uniform here, so the
    choice is the logistic regression's alone), in the plain view."""
    from tabfm import calibration

    X, y = _wide_linear_classes(600, seed=seed)
    clf = TabFMClassifier(n_estimators=1, calibrate=False, n_jobs=1, tree_blend=False).fit(X, y)
    held = calibration.held_out_rows(y, 2, np.random.default_rng(seed))
    _, weight, _, choice = clf._fit_temperature(np.zeros((1, len(held), 2)), [held], None)
    assert weight > 0 and (choice.view, choice.C) == ("plain", max(LOGISTIC_CS))


def test_the_classifiers_logistic_regression_skips_hinges_past_hinge_cells(monkeypatch):
    """The classifier's logistic regression tries the hinge view only where its design of the kept rows stays
    within HINGE_CELLS, as the ridge does: its lbfgs would be the fit's largest cost past that."""
    from tabfm import calibration, linear_base

    X, y = _wide_linear_classes(400, seed=2)
    clf = TabFMClassifier(n_estimators=1, calibrate=False, n_jobs=1).fit(X, y)
    held = calibration.held_out_rows(y, 2, np.random.default_rng(2))
    tried = []
    real = LinearDesign.viewed
    monkeypatch.setattr(LinearDesign, "viewed", lambda self, view, cells: tried.append(view) or real(self, view, cells))
    clf._fit_temperature(np.zeros((1, len(held), 2)), [held], None)
    assert tried == list(LINEAR_VIEWS)
    tried.clear()
    monkeypatch.setattr(linear_base, "HINGE_CELLS", len(y) - len(held))  # under one column of the kept rows
    clf._fit_temperature(np.zeros((1, len(held), 2)), [held], None)
    assert tried == ["plain", "power"]


def test_save_and_load_keep_the_blend(tmp_path):
    X, y = _wide_linear_classes(300, seed=5)
    clf = TabFMClassifier(n_estimators=2, n_jobs=1).fit(X[:250], y[:250])
    assert clf.blend_weight_ > 0
    clf.save(tmp_path / "clf")
    back = TabFMClassifier.load(tmp_path / "clf")
    np.testing.assert_allclose(back.predict_proba(X[250:]), clf.predict_proba(X[250:]), rtol=1e-6, atol=1e-7)


def test_a_useless_logistic_regression_gets_no_weight():
    rng = np.random.default_rng(7)
    X = rng.uniform(-1, 1, size=(300, 2))
    y = ((X[:, 0] > 0) ^ (X[:, 1] > 0)).astype(int)  # XOR: no linear boundary does better than chance
    clf = TabFMClassifier(n_estimators=2, n_jobs=1).fit(X[:250], y[:250])
    assert clf.blend_weight_ == 0 and clf.linear_model_ is None


def test_columns_of_extreme_magnitudes_give_a_finite_design():
    rng = np.random.default_rng(3)
    X = pd.DataFrame({"tiny": np.r_[np.zeros(38), 5e-324, 1e-310], "big": rng.normal(size=40) * 1e300,
                      "edge": np.r_[np.zeros(38), 1.7e308, 1.7e308]})
    y = rng.normal(size=40)
    cells = _cells(X)
    base, oof = LinearBase.fit(cells, y)
    assert np.isfinite(base.design(cells)).all() and np.isfinite(oof).all()
    assert np.isfinite(base.predict(cells)).all()
    assert base.design(cells)[:, 2].std() > 0  # the column near float64's limit still carries its values


def test_many_classes_fit_without_scikit_learn_asking_whether_it_is_regression():
    """A fuzzer's finding: LogisticRegression's "more unique classes than half the samples" warning reached users
    who had given classes."""
    X = pd.DataFrame({"a": np.random.default_rng(0).normal(size=60)})
    pre = TablePreprocessor().fit(X)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LogisticModel.fit(pre.transform(X), np.arange(60) % 40, 40)



def test_two_classes_on_hinge_columns_reach_the_penalised_optimum():
    """Hinge columns of one numeric column are strongly correlated: L-BFGS stopped short of the optimum there (here
    9e-5 above it, probabilities 0.01 off it, with NEWTON_MAX_WIDTH 0), Newton's method reaches it."""
    rng = np.random.default_rng(6)
    X = pd.DataFrame(rng.normal(size=(800, 20)), columns=[f"x{j}" for j in range(20)])
    y = (np.sin(X.to_numpy()[:, :5]).sum(1) + rng.normal(size=800) > 0).astype(int)
    cells = _cells(X)
    design = LinearDesign.fit(cells).viewed("hinges", cells)
    D, C = design(cells), 10.0

    def objective(coef, intercept):  # what LogisticRegression minimises: C x the summed log-loss + |w|^2 / 2
        z = D @ coef + intercept
        return C * np.sum(np.logaddexp(0, z) - y * z) + 0.5 * coef @ coef

    tight = LogisticRegression(C=C, tol=1e-12, max_iter=100_000).fit(D, y)
    fitted = LogisticModel.fit_design(cells, y, 2, design, C)
    gap = objective(fitted.coef[0], fitted.intercept[0]) / objective(tight.coef_[0], tight.intercept_[0]) - 1
    assert gap < 1e-6, gap  # 6e-8
    assert np.abs(fitted.predict_proba(cells)[:, 1] - tight.predict_proba(D)[:, 1]).max() < 1e-3  # 2e-4
