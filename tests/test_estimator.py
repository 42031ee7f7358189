"""TabFMClassifier / TabFMRegressor: scikit-learn's estimator checks, mixed inputs, bad input, invariances, pickling,
many classes, and sharded inference on 2 and 4 gloo ranks against one process."""

from __future__ import annotations

import pickle

import numpy as np
import pandas as pd
import polars as pl
import pytest
import torch
from builders import mixed_frame
from sklearn.utils.estimator_checks import parametrize_with_checks

from tabfm import calibration, estimator, estimator_model, inference, tree_fits
from tabfm.ensemble import NARROW_MAX_FEATURES, WIDE_MAX_FEATURES, auto_max_features, class_codes
from tabfm.estimator import TabFMClassifier, TabFMRegressor
from tabfm.linear_base import LogisticModel

FLOAT32_ROUNDING = ("float32 matmuls over batches of different sizes round differently (about 1e-7 relative); "
                    "the float64 instance passes this check exactly")


def _expected_failures(est) -> dict[str, str]:
    out = {}
    if est.dtype == "float32" and isinstance(est, TabFMRegressor):  # the classifier's probabilities stay within
        out["check_methods_subset_invariance"] = FLOAT32_ROUNDING   # the check's tolerance with these weights
    return out


# The regressors have 4 members (what "auto" gives tables of 1,024 rows or more; the checks' small tables would get
# 16, four times the time): check_regressors_train rounds X to integers (the tags accept categorical input) and
# wants a training R^2 above 0.5, which the shipped model reaches with 4 members (0.67) but not with 2 (0.48).
# The last two run the checks in float64 through local contexts (tables of more than 24 train rows are split);
# float64 with one context is test_predictions_do_not_depend_on_test_row_order's (subset invariance, exactly).
@parametrize_with_checks([TabFMClassifier(n_estimators=2), TabFMRegressor(n_estimators=4),
                          TabFMClassifier(n_estimators=2, dtype="float64", local_context_rows=24),
                          TabFMRegressor(n_estimators=4, dtype="float64", local_context_rows=24)],
                         expected_failed_checks=_expected_failures)
def test_sklearn_compatible(estimator, check):
    check(estimator)


def test_mixed_pandas_and_polars_inputs_agree():
    df, y = mixed_frame(160)
    clf = TabFMClassifier(n_estimators=2).fit(df[:120], y[:120])
    proba = clf.predict_proba(df[120:])
    assert proba.shape == (40, 2) and np.allclose(proba.sum(1), 1)
    assert list(clf.classes_) == ["no", "yes"]
    assert clf.score(df[120:], y[120:]) > 0.7  # x and colour decide the class
    kinds = {c.name: c.kind for c in clf.preprocessor_.columns_}
    assert kinds == {"x": "numeric", "noise": "numeric", "colour": "categorical", "flag": "categorical",
                     "gappy": "numeric"}  # the constant column is dropped
    as_polars = TabFMClassifier(n_estimators=2).fit(pl.from_pandas(df[:120]), y[:120])
    assert np.allclose(as_polars.predict_proba(pl.from_pandas(df[120:])), proba, atol=1e-6)
    # A category no train row has, and a missing one, are accepted at predict.
    test = df[120:].copy()
    test.loc[test.index[:3], "colour"] = ["purple", None, "red"]
    assert np.isfinite(clf.predict_proba(test)).all()


def test_numpy_object_array_with_strings():
    df, y = mixed_frame(100)
    X = df[["x", "colour"]].to_numpy(dtype=object)
    clf = TabFMClassifier(n_estimators=1).fit(X[:80], y[:80])
    assert [c.kind for c in clf.preprocessor_.columns_] == ["numeric", "categorical"]
    assert clf.predict(X[80:]).shape == (20,)


def test_categorical_features_option_forces_codes():
    rng = np.random.default_rng(0)
    X = rng.integers(0, 4, size=(60, 2)).astype(float)
    y = (X[:, 0] == 2).astype(int)
    clf = TabFMClassifier(n_estimators=1, categorical_features=[0]).fit(X, y)
    assert [c.kind for c in clf.preprocessor_.columns_] == ["categorical", "numeric"]
    assert clf.preprocessor_.columns_[0].categories == ("0", "1", "2", "3")


@pytest.mark.parametrize("make, match", [
    (lambda: (np.ones((5, 2)), np.array([0, 1, np.nan, 0, 1])), "missing labels .* in 1 rows"),
    (lambda: (np.ones((5, 2)), np.array([0, 1, np.inf, 0, 1])), "inf in 1 rows"),
    (lambda: (np.random.default_rng(0).normal(size=(5, 2)), np.zeros(5)), "1 class"),
    (lambda: (np.array([[1.0, "a"], [2.0, 3.0]], dtype=object), np.array([0, 1])), "mixes numbers and strings"),
    (lambda: (np.empty((0, 3)), np.empty(0)), "0 sample"),
    (lambda: (np.empty((4, 0)), np.array([0, 1, 0, 1])), "0 feature"),
    (lambda: (np.array([[1.0, np.inf], [2.0, 3.0]]), np.array([0, 1])), "inf"),
])
def test_bad_fit_input_gets_a_clear_error(make, match):
    X, y = make()
    with pytest.raises(ValueError, match=match):
        TabFMClassifier(n_estimators=1).fit(X, y)


def test_members_that_would_see_more_columns_than_the_model_takes_are_refused():
    X, y = np.random.default_rng(0).normal(size=(20, 101)), np.arange(20) % 2
    for max_features in (None, 101):
        with pytest.raises(ValueError, match="model takes at most 100: set max_features to at most 100"):
            TabFMClassifier(n_estimators=1, max_features=max_features).fit(X, y)


def test_auto_max_features_shows_members_24_columns_up_to_the_models_100_and_the_classifiers_64_past_them():
    rng = np.random.default_rng(0)
    for columns, width in ((30, NARROW_MAX_FEATURES), (100, NARROW_MAX_FEATURES), (101, WIDE_MAX_FEATURES),
                           (150, WIDE_MAX_FEATURES)):
        X = rng.normal(size=(60, columns))
        est = TabFMClassifier(n_estimators=2).fit(X, (X[:, 0] > 0).astype(int))
        assert est.max_features == "auto" and {len(m.columns) for m in est.members_} == {width}, columns
    X = rng.normal(size=(60, 150))
    est = TabFMRegressor(n_estimators=2).fit(X, X[:, 0])  # the regressor's ridge base reads every column: 24
    assert {len(m.columns) for m in est.members_} == {NARROW_MAX_FEATURES}
    est = TabFMClassifier(n_estimators=2, max_features=40).fit(X, (X[:, 0] > 0).astype(int))
    assert {len(m.columns) for m in est.members_} == {40}  # a number is taken as given
    assert auto_max_features(150, 100) == 64 and auto_max_features(150, 48) == 48  # never past the model's
    assert auto_max_features(150, 100, NARROW_MAX_FEATURES) == NARROW_MAX_FEATURES


@pytest.mark.parametrize("cls", [TabFMClassifier, TabFMRegressor])
def test_a_table_wider_than_the_model_is_read_through_its_most_relevant_columns(cls):
    """150 columns, of which the last 3 decide y: max_features=24 fits it; 2 members x 24 columns
    cannot see all 150, so they see columns of the 48 that explain y best alone, the 3 that matter among them
    (48 drawn at random would hold all 3 about 3% of the time): the 12 best in both (the core, CORE_SHARE of 24)
    and 12 more each, dealt from the other 36. The classifier's core holds the 3; the regressor's relevance
    reads the ridge's residuals, where that linear signal is gone, so its 3 may be dealt instead."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(200, 150))
    signal = X[:, 147] + X[:, 148] - X[:, 149]
    y = (signal > 0).astype(int) if cls is TabFMClassifier else signal
    est = cls(n_estimators=2, dtype="float64", max_features=24).fit(X[:120], y[:120])
    seen = np.unique(np.concatenate([m.columns for m in est.members_]))
    shared = set(est.members_[0].columns.tolist()) & set(est.members_[1].columns.tolist())
    assert len(seen) == 12 + 2 * 12 and len(shared) == 12 and {147, 148, 149} <= set(seen.tolist())
    if cls is TabFMClassifier:
        assert {147, 148, 149} <= shared
    pred = est.predict(X[120:])
    if cls is TabFMClassifier:
        assert (pred == y[120:]).mean() > 0.65  # chance: 0.5
    else:
        assert np.corrcoef(pred, y[120:])[0, 1] > 0.6


def test_a_wide_table_with_local_contexts_computes_column_relevance_once(monkeypatch):
    """The member subsets and the local contexts read the same relevance of the same train rows: one pass over
    the 120 columns, not one each (calibrate=False: the probe's own rows would need their own)."""
    from tabfm import local_context

    calls = []
    real = local_context.column_relevance

    def counted(*args, **kwargs):
        calls.append(args[0].values.shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(local_context, "column_relevance", counted)
    monkeypatch.setattr(estimator, "column_relevance", counted)
    rng = np.random.default_rng(1)
    X = rng.normal(size=(300, 120))
    y = (X[:, 3] > 0).astype(int)
    clf = TabFMClassifier(n_estimators=2, calibrate=False, local_context_rows=100).fit(X, y)
    assert clf.local_ is not None and calls == [(300, 120)]


def test_bad_regression_target():
    X = np.random.default_rng(0).normal(size=(6, 2))
    with pytest.raises(ValueError, match="NaN or inf"):
        TabFMRegressor(n_estimators=1).fit(X, np.array([1.0, 2, np.nan, 3, 4, 5]))
    with pytest.raises(ValueError, match="must hold numbers"):
        TabFMRegressor(n_estimators=1).fit(X, np.array(list("abcdef"), dtype=object))
    dates = pd.Series(pd.date_range("2020-01-01", periods=6))  # read as the counts of its unit: 1e9 apart by unit
    for y in (dates, dates - dates[0], dates.to_numpy()):
        with pytest.raises(ValueError, match=r"^y holds dates or durations; a regressor needs numbers"):
            TabFMRegressor(n_estimators=1).fit(X, y)
    with pytest.raises(ValueError, match=r"^y holds complex numbers"):
        TabFMRegressor(n_estimators=1).fit(X, X[:, 0] + 0j)


def test_quantiles_must_be_numbers_between_0_and_1():
    X = np.random.default_rng(0).normal(size=(40, 2))
    reg = TabFMRegressor(n_estimators=1).fit(X, X[:, 0])
    for bad in ([], ["0.5"], [0.0, 0.5], [1.5], [[0.1], [0.9]]):
        with pytest.raises(ValueError, match="quantiles must be a non-empty list of numbers strictly between 0 and 1"):
            reg.predict_quantiles(X, bad)
    assert reg.predict_quantiles(X, 0.5).shape == (40, 1)


def test_any_seed_the_parameters_accept_fits():
    """Seeds of 2**32 and more: the regressor's ridge folds (scikit-learn's KFold) take only 32-bit ones."""
    X = np.random.default_rng(0).normal(size=(40, 2))
    for est, y in ((TabFMRegressor(n_estimators=1, random_state=2**40), X[:, 0]),
                   (TabFMClassifier(n_estimators=1, random_state=2**40), X[:, 0] > 0)):
        first = est.fit(X, y).predict(X)
        np.testing.assert_array_equal(est.fit(X, y).predict(X), first)


def test_bad_predict_input_gets_a_clear_error():
    df, y = mixed_frame(60)
    clf = TabFMClassifier(n_estimators=1).fit(df, y)
    strings = df.copy()
    strings["x"] = strings["x"].astype(object)
    strings.loc[strings.index[0], "x"] = "oops"
    with pytest.raises(ValueError, match="mixes numbers and strings"):
        clf.predict(strings)
    all_strings = df.assign(x=["s"] * len(df))
    with pytest.raises(ValueError, match="held numbers at fit but holds strings"):
        clf.predict(all_strings)
    with pytest.raises(ValueError, match="feature names"):
        clf.predict(df.rename(columns={"x": "renamed"}))
    with pytest.raises(ValueError, match="missing:\n- noise"):
        clf.predict(df.drop(columns=["noise"]))
    with pytest.raises(ValueError, match="X has 5 features, but TabFMClassifier is expecting 6"), \
            pytest.warns(UserWarning, match="does not have valid feature names"):  # scikit-learn's, before the error
        clf.predict(df.drop(columns=["noise"]).to_numpy())
    with pytest.raises(ValueError, match="0 sample"):
        clf.predict(df[:0])
    with pytest.raises(ValueError, match="Reshape your data"):
        TabFMClassifier(n_estimators=1).fit(np.ones((4, 2)), [0, 1, 0, 1]).predict(np.ones(2))


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("float64", 1e-12)])
@pytest.mark.parametrize("Est", [TabFMClassifier, TabFMRegressor])
def test_predictions_do_not_depend_on_test_row_order(Est, dtype, tol):
    """Test rows are independent: permuted, split into batches of 7 or predicted alone, each row gets the same
    output (float32 within its rounding across batch sizes; float64 to 1e-12, scikit-learn's subset invariance
    exactly)."""
    df, y = mixed_frame(150, seed=1)
    y = (y == "yes").astype(float) + df["x"].to_numpy() if Est is TabFMRegressor else y
    est = Est(n_estimators=3, batch_size=7, dtype=dtype).fit(df[:100], y[:100])
    predict = est.predict_proba if Est is TabFMClassifier else est.predict
    test = df[100:]
    out = predict(test)
    perm = np.random.default_rng(0).permutation(len(test))
    np.testing.assert_allclose(predict(test.iloc[perm]), out[perm], rtol=tol, atol=tol / 10)
    for rows in ([5], [0, 7, 11, 30]):  # a row alone, and a few, give what they get among the others
        np.testing.assert_allclose(predict(test.iloc[rows]), out[rows], rtol=tol, atol=tol / 10)


def test_pickled_estimator_predicts_the_same(monkeypatch):
    df, y = mixed_frame(120)
    clf = TabFMClassifier(n_estimators=2).fit(df[:90], y[:90])
    proba = clf.predict_proba(df[90:])
    blob = pickle.dumps(clf)
    assert len(blob) < 1_000_000  # the caches are not stored; the model is the shipped file, not its weights
    restored = pickle.loads(blob)
    assert "model_" not in vars(restored)  # the model is rebuilt from the checkpoint on first use
    np.testing.assert_array_equal(restored.predict_proba(df[90:]), proba)
    assert restored.model_ is clf.model_  # the same shipped weights: the one shared plain model


def test_fit_loads_the_model_once_and_refits_reload(monkeypatch):
    df, y = mixed_frame(120)
    calls = []
    real = estimator.load_estimator_model
    monkeypatch.setattr(estimator, "load_estimator_model", lambda *a, **k: calls.append(a) or real(*a, **k))
    clf = TabFMClassifier(n_estimators=2).fit(df[:90], y[:90])  # calibrated: probe and contexts share model_
    assert len(calls) == 1 and clf.temperature_ != 1.0
    clf.predict_proba(df[90:])
    assert len(calls) == 1
    clf.set_params(dtype="float64").fit(df[:90], y[:90])
    assert len(calls) == 2 and next(clf.model_.parameters()).dtype == torch.float64


def test_train_rows_are_encoded_once(monkeypatch):
    df, y = mixed_frame(120)
    calls = []
    real = inference.encode_context
    monkeypatch.setattr("tabfm.estimator.encode_context", lambda *a, **k: calls.append(1) or real(*a, **k))
    clf = TabFMClassifier(n_estimators=4).fit(df[:90], y[:90])
    n_fit = len(calls)
    first = clf.predict_proba(df[90:])
    np.testing.assert_array_equal(clf.predict_proba(df[90:]), first)
    assert n_fit >= 1 and len(calls) == n_fit  # predicts reuse the contexts encoded at fit


def test_calibration_probe_runs_first_on_at_most_half_the_rows(monkeypatch):
    """One held-out set (tables past calibration.CROSS_FIT_ROWS: here lowered to 0): one probe on the other rows,
    its context at most half the train rows but not fewer than CALIBRATION_CONTEXT_ROWS."""
    df, y = mixed_frame(120)
    rows = []
    real = inference.encode_context
    monkeypatch.setattr("tabfm.estimator.encode_context", lambda m, b: rows.append(b.values.shape[1]) or real(m, b))
    monkeypatch.setattr(calibration, "CROSS_FIT_ROWS", 0)
    # n_jobs=1: one forward per encoding (with more threads each encoding is cut into one forward per thread)
    TabFMClassifier(n_estimators=2, n_jobs=1).fit(df[:100], y[:100])
    held = 100 - rows[0]
    assert rows == [100 - held, 100] and 15 <= held <= 25  # the probe (every row not held out), then the contexts
    rows.clear()
    monkeypatch.setattr(calibration, "CALIBRATION_CONTEXT_ROWS", 10)
    TabFMClassifier(n_estimators=2, n_jobs=1).fit(df[:100], y[:100])
    assert rows == [50, 100]  # the probe's context: half the train rows, as the floor is lower


def test_a_small_table_calibrates_every_row_through_cross_fitted_probes(monkeypatch):
    """On tables of at most calibration.CROSS_FIT_ROWS train rows that need a probe, each of five stratified folds
    is predicted by a probe fitted on the other folds, and the logistic regression and trees that are weighed
    against them are fitted without the fold too; the weights are those _fit_temperature picks from every held
    row."""
    df, y = mixed_frame(140, seed=3)
    y_ids = np.unique(y[:120], return_inverse=True)[1]
    probed, fitted, chosen = [], [], []
    real_probe, real_trees = TabFMClassifier._probe, tree_fits.fit_trees

    def probe(self, held, rng, members):
        made = real_probe(self, held, rng, members)
        probed.append((held, made.y_train_))
        return made

    real_choice = TabFMClassifier._fit_temperature
    monkeypatch.setattr(TabFMClassifier, "_fit_temperature", lambda self, logp, folds, trees: chosen.append(
        (logp, folds, real_choice(self, logp, folds, trees))) or chosen[-1][2])
    monkeypatch.setattr(TabFMClassifier, "_probe", probe)
    monkeypatch.setattr(tree_fits, "fit_trees", lambda cells, y, *a: fitted.append(len(y)) or real_trees(cells, y, *a))
    clf = TabFMClassifier(n_estimators=4, n_jobs=1).fit(df[:120], y[:120])
    folds = [held for held, _ in probed]
    assert len(folds) == calibration.CROSS_FIT_FOLDS
    assert np.array_equal(np.sort(np.concatenate(folds)), np.arange(120))  # every row predicted once
    for held, context_y in probed:  # each probe fitted on the rows outside its fold
        assert len(context_y) == 120 - len(held)
        assert np.array_equal(np.bincount(context_y, minlength=2) + np.bincount(y_ids[held], minlength=2),
                              np.bincount(y_ids, minlength=2))
    # then on every row (started before the trees' weight is known, so perhaps fitted and not kept: tree_fits)
    assert fitted[:len(folds)] == [120 - len(f) for f in folds] and fitted[len(folds):] in ([], [120])
    assert (clf.tree_model_ is not None) == (clf.tree_weight_ > 0)
    assert [f.tolist() for f in chosen[0][1]] == [f.tolist() for f in folds]
    assert chosen[0][0].shape == (2, 120, clf.n_groups_)  # the probes' 2 members' predictions of every row
    assert (clf.temperature_, clf.blend_weight_, clf.tree_weight_) == chosen[0][2][:3]


def test_calibration_probe_runs_the_first_members_unless_the_classes_need_all(monkeypatch):
    """The probe encodes calibration.CALIBRATION_MEMBERS members' contexts (the first members: their views), the
    fit then every member's; with more classes than the model's head every member is needed to decode them."""
    df, y = mixed_frame(120)
    tables = []
    real = inference.encode_context
    monkeypatch.setattr("tabfm.estimator.encode_context",
                        lambda m, b: tables.append(tuple(b.values.shape[:2])) or real(m, b))
    clf = TabFMClassifier(n_estimators=4, n_jobs=1).fit(df[:100], y[:100])
    probe_rows = [rows for _, rows in tables[:-1]]  # each fold's probe (a table of 100 rows cross-fits)
    assert tables == [(calibration.CALIBRATION_MEMBERS, r) for r in probe_rows] + [(4, 100)]
    assert len(probe_rows) == calibration.CROSS_FIT_FOLDS and sum(100 - r for r in probe_rows) == 100
    assert 0.2 <= clf.temperature_ <= 3.0
    tables.clear()
    TabFMClassifier(n_jobs=1).fit(df[:100], y[:100])  # "auto": 16 members, calibrated on a quarter of them
    assert tables == [(4, r) for r in probe_rows] + [(16, 100)]
    tables.clear()
    rng = np.random.default_rng(0)
    many = rng.integers(0, 12, 120)  # 12 classes, the head has 10
    X = rng.normal(size=(120, 3)) + many[:, None]
    clf = TabFMClassifier(n_estimators=2, n_jobs=1).fit(X, many)
    assert clf.n_members_ > calibration.CALIBRATION_MEMBERS
    assert [t for t, _ in tables] == [clf.n_members_] * (calibration.CROSS_FIT_FOLDS + 1)


def test_local_contexts_calibrate_from_the_first_members_without_a_probe(monkeypatch):
    """With local contexts and at least 2 x CALIBRATION_MEMBERS members, calibration encodes nothing more: the
    first members' contexts leave the calibration rows out, and those members' predictions of them (and a
    logistic regression fitted without them) set the temperature and blend weight; with fewer members the probe
    still runs."""
    df, y = mixed_frame(300, seed=4)
    shapes = []
    real = inference.encode_context
    monkeypatch.setattr("tabfm.estimator.encode_context",
                        lambda m, b: shapes.append(tuple(b.values.shape[:2])) or real(m, b))
    clf = TabFMClassifier(n_estimators=4, local_context_rows=64, dtype="float64", n_jobs=1).fit(df, y)
    assert clf.local_ is not None and sum(t for t, _ in shapes) == len(clf.context_rows_)  # each context once
    assert {r for _, r in shapes} == {64}
    held = calibration.held_out_rows(np.unique(y, return_inverse=True)[1], 2, np.random.default_rng(1))
    assert calibration.held_members(4) == calibration.CALIBRATION_MEMBERS == 2
    for m in range(4):
        holds = np.isin(held, clf.context_rows_[clf.context_members_ == m]).any()
        assert holds == (m >= 2)
    held_cells = clf.train_cells_.take(held)
    logp = clf._cell_outputs(held_cells, members=2)
    np.testing.assert_allclose(logp, clf._cell_outputs(held_cells)[:2], rtol=0, atol=1e-12)
    with clf._tree_fits([held], clf.y_train_, 2) as trees:  # the same trees as the fit's
        temperature, weight, tree_weight, linear = clf._fit_temperature(logp, [held], trees)
    assert (clf.temperature_, clf.blend_weight_, clf.tree_weight_) == (temperature, weight, tree_weight)
    assert (clf.linear_model_ is None) == (clf.blend_weight_ == 0)
    if clf.linear_model_ is not None:  # the view and penalty chosen, refitted on every train row
        design = clf.linear_model_.design
        assert (design.numeric_map is not None) == (linear.view == "power")
        assert (design.hinges is not None) == (linear.view == "hinges")
        again = LogisticModel.fit(clf.train_cells_, clf.y_train_, 2, linear.view, linear.C, start=linear.kept)
        np.testing.assert_array_equal(clf.linear_model_.coef, again.coef)
    shapes.clear()
    two = TabFMClassifier(n_estimators=2, local_context_rows=64, n_jobs=1).fit(df, y)
    assert sum(t for t, _ in shapes) > len(two.context_rows_)  # the probe's contexts, then the fit's


def test_the_regressor_weighs_its_correction_on_rows_the_first_members_never_saw(tmp_path):
    """On targets that are noise, the model's corrections over the ridge are noise too: the weight fitted on the
    held rows (predicted by the first two members, whose local contexts leave them out) takes them back, and the
    test R^2 rises towards the ridge's (about 0). Quantiles move with the mean; calibrate=False keeps w = 1."""
    rng = np.random.default_rng(5)
    X, y = rng.normal(size=(900, 4)), rng.normal(size=900)
    kwargs = dict(n_estimators=4, local_context_rows=64, n_jobs=1)
    reg = TabFMRegressor(**kwargs).fit(X[:600], y[:600])
    (held,), members = reg._held_rows(600, 4, reg._calibration_rng())
    assert members == 2 and len(held) == 120
    for m in range(4):
        assert np.isin(held, reg.context_rows_[reg.context_members_ == m]).any() == (m >= 2)
    assert 0 <= reg.correction_weight_ < 0.3
    plain = TabFMRegressor(calibrate=False, **kwargs).fit(X[:600], y[:600])
    assert plain.correction_weight_ == 1.0
    error = {name: np.mean((est.predict(X[600:]) - y[600:]) ** 2) for name, est in (("w", reg), ("1", plain))}
    assert error["w"] < 0.9 * error["1"], error

    mean, quantiles = reg.predict(X[600:]), reg.predict_quantiles(X[600:], [0.1, 0.5, 0.9])
    reg.save(tmp_path / "reg")
    loaded = TabFMRegressor.load(tmp_path / "reg")
    assert loaded.correction_weight_ == reg.correction_weight_
    np.testing.assert_array_equal(loaded.predict(X[600:]), mean)
    reg.correction_weight_ = 1.0
    moved = mean - reg.predict(X[600:])
    np.testing.assert_allclose(quantiles - reg.predict_quantiles(X[600:], [0.1, 0.5, 0.9]),
                               np.repeat(moved[:, None], 3, 1), rtol=0, atol=1e-9)
    unweighted = reg.predict(X[600:])
    del reg.correction_weight_  # saved before the weight existed: w = 1
    np.testing.assert_array_equal(reg.predict(X[600:]), unweighted)

    signal = np.sin(2 * X[:, 0]) * 3
    assert TabFMRegressor(**kwargs).fit(X[:600], signal[:600]).correction_weight_ > 0.8


def test_the_regressor_scales_its_distributions_by_the_spread_its_held_rows_ask_for(tmp_path):
    """The held rows also fit the spread factor: predict_quantiles scales each distribution about its mean by it
    (q - predict = s x the unscaled q - predict, exactly), predict is unchanged, save and load keep it, and the
    test rows' 80% interval holds close to 80% of them; calibrate=False keeps s = 1."""
    rng = np.random.default_rng(6)
    X = rng.normal(size=(1200, 4))
    y = X[:, 0] + np.sin(3 * X[:, 1]) + 0.5 * rng.normal(size=1200)
    reg = TabFMRegressor(n_estimators=4, local_context_rows=64, n_jobs=1).fit(X[:900], y[:900])
    assert reg.spread_ in calibration.SPREADS
    mean, q = reg.predict(X[900:]), reg.predict_quantiles(X[900:], [0.1, 0.5, 0.9])
    spread = reg.spread_
    reg.spread_ = 1.0
    np.testing.assert_array_equal(reg.predict(X[900:]), mean)
    np.testing.assert_allclose(q - mean[:, None], spread * (reg.predict_quantiles(X[900:], [0.1, 0.5, 0.9])
                                                            - mean[:, None]), rtol=1e-9, atol=1e-9)
    cover = np.mean((y[900:] >= q[:, 0]) & (y[900:] <= q[:, 2]))
    assert 0.7 < cover < 0.9, cover
    reg.spread_ = spread
    reg.save(tmp_path / "reg")
    assert TabFMRegressor.load(tmp_path / "reg").spread_ == spread
    del reg.spread_  # saved before the factor existed: 1
    np.testing.assert_allclose(reg.predict_quantiles(X[900:], [0.1, 0.5, 0.9]) - mean[:, None],
                               (q - mean[:, None]) / spread, rtol=1e-9, atol=1e-9)
    assert TabFMRegressor(calibrate=False, n_estimators=4, local_context_rows=64, n_jobs=1).fit(
        X[:900], y[:900]).spread_ == 1.0


def test_a_small_regression_table_calibrates_every_row_through_cross_fitted_probes(monkeypatch):
    """Where no members can leave the held rows out (one context of every train row: tables of up to
    local_context_rows kept rows), probes predict them, as the classifier's do; on a table of at most
    calibration.CROSS_FIT_ROWS rows every row, fold by fold, each probe fitted on the other folds' rows only. The
    probes' contexts are encoded first, then the fit's, and the correction weight, spread factor and trees' weight
    are fitted from them."""
    rng = np.random.default_rng(8)
    X = rng.normal(size=(260, 3))
    y = 2 * (X[:, 0] > 0) + np.sin(2 * X[:, 1]) + 0.2 * rng.normal(size=260)
    shapes, probed = [], []
    real, real_probe = inference.encode_context, TabFMRegressor._probe
    monkeypatch.setattr("tabfm.estimator.encode_context",
                        lambda m, b: shapes.append(tuple(b.values.shape[:2])) or real(m, b))

    def probe(self, held, rng, members):
        made = real_probe(self, held, rng, members)
        probed.append((held, self.train_cells_.values[held, 0], made.train_cells_.values[:, 0]))
        return made

    monkeypatch.setattr(TabFMRegressor, "_probe", probe)
    reg = TabFMRegressor(n_estimators=4, n_jobs=1).fit(X[:200], y[:200])
    folds, members = reg._held_rows(200, 4, reg._calibration_rng())
    assert [len(f) for f in folds] == [40] * 5 and members == 0 and reg.local_ is None
    assert np.array_equal(np.sort(np.concatenate([held for held, _, _ in probed])), np.arange(200))
    for _, held, context in probed:  # each probe's context: every train row but its fold's (values all differ)
        assert len(context) == 160 and not np.isin(held, context).any()
    assert [rows for _, rows in shapes] == [160] * 5 + [200]  # the probes' 2 members, then the fit's 4
    assert [groups for groups, _ in shapes] == [2] * 5 + [4]
    assert reg.spread_ in calibration.SPREADS and 0 <= reg.correction_weight_ <= 1 and reg.tree_weight_ > 0
    plain = TabFMRegressor(n_estimators=4, n_jobs=1, calibrate=False).fit(X[:200], y[:200])
    assert (plain.correction_weight_, plain.spread_, plain.tree_weight_) == (1.0, 1.0, 0.0)


def test_auto_members_fit_more_members_on_small_tables(tmp_path):
    """n_estimators="auto" (the default) fits tabfm.ensemble.auto_members(train rows) members: exactly the fit
    that count gives when asked for; the parameter stays "auto" (clone, get_params) and a saved estimator keeps
    its members."""
    df, y = mixed_frame(160)
    clf = TabFMClassifier(n_jobs=1).fit(df[:100], y[:100])
    assert clf.get_params()["n_estimators"] == "auto" and clf.n_members_ == 16 == len(clf.members_)
    assert clf.class_codes_.shape[0] == 16
    sixteen = TabFMClassifier(n_estimators=16, n_jobs=1).fit(df[:100], y[:100])
    np.testing.assert_array_equal(clf.predict_proba(df[100:]), sixteen.predict_proba(df[100:]))
    clf.save(tmp_path / "clf")
    loaded = TabFMClassifier.load(tmp_path / "clf")
    assert loaded.n_members_ == 16 and loaded.get_params()["n_estimators"] == "auto"
    np.testing.assert_array_equal(loaded.predict_proba(df[100:]), sixteen.predict_proba(df[100:]))
    assert TabFMClassifier(n_estimators=3, n_jobs=1).fit(df[:100], y[:100]).n_members_ == 3

    rng = np.random.default_rng(1)
    X = rng.normal(size=(700, 3))
    target = X[:, 0] + np.sin(X[:, 1])
    reg = TabFMRegressor(n_jobs=1).fit(X[:600], target[:600])  # 4096 // 600 = 6 members, local contexts
    assert reg.n_members_ == 6 == len(reg.target_maps_) and set(reg.context_members_) == set(range(6))
    six = TabFMRegressor(n_estimators=6, n_jobs=1).fit(X[:600], target[:600])
    assert six.correction_weight_ == reg.correction_weight_
    np.testing.assert_array_equal(reg.predict(X[600:]), six.predict(X[600:]))


def test_more_classes_than_the_head():
    rng = np.random.default_rng(0)
    K = 14
    centres = rng.normal(size=(K, 2)) * 8
    y = np.repeat(np.arange(K), 12)
    X = centres[y] + rng.normal(size=(len(y), 2)) * 0.3
    order = rng.permutation(len(y))
    X, y = X[order], y[order]
    clf = TabFMClassifier(n_estimators=2).fit(X[:130], y[:130])
    assert clf.n_members_ == 4 and clf.n_groups_ == 10  # the separating floor: ceil(2 ln 14 / ln 10) + 1
    auto = TabFMClassifier(n_estimators="auto").fit(X[:130], y[:130])
    assert auto.n_members_ == 16  # 16 members for 130 rows already: at most 16
    four = TabFMClassifier(n_estimators="auto").fit(np.tile(X[:130], (9, 1)), np.tile(y[:130], 9))
    assert four.n_members_ == 8 == len(four.class_codes_)  # 4 members for 1,170 rows, twice over for 14 classes
    proba = clf.predict_proba(X[130:])
    assert proba.shape == (len(y) - 130, K) and np.allclose(proba.sum(1), 1)
    assert clf.score(X[130:], y[130:]) > 3 / K  # far above chance (1/14)


def test_class_codes_separate_every_pair():
    codes = class_codes(37, 10, 4, np.random.default_rng(0))
    assert codes.shape == (4, 37) and codes.max() == 9
    same = (codes[:, :, None] == codes[:, None, :]).all(0)
    assert same.sum() == 37
    assert all(np.bincount(c).max() - np.bincount(c).min() <= 1 for c in codes)  # balanced groups
    small = class_codes(3, 10, 3, np.random.default_rng(0))
    assert list(small[0]) == [0, 1, 2] and all(sorted(r) == [0, 1, 2] for r in small)


def test_checkpoint_option(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        TabFMClassifier(checkpoint="/no/such/model.safetensors").fit(np.ones((4, 2)), [0, 1, 0, 1])
    # the checkpoint's own checks named a file but not the parameter, nor what to pass; "" read the working folder
    (tmp_path / "notes.txt").write_text("not weights")
    what_to_pass = ("; pass a merged .safetensors file or a checkpoint folder (`tabfm ckpt merge RUN_DIR -o "
                    "model.safetensors`), or checkpoint=None for the shipped model")
    for checkpoint, message in [
            (tmp_path, f"checkpoint={str(tmp_path)!r} cannot be used: {tmp_path} has no manifest.json: not a "
                       "checkpoint, or its write never finished"),
            (tmp_path / "notes.txt", f"checkpoint={str(tmp_path / 'notes.txt')!r} cannot be used: "
                                     f"{tmp_path / 'notes.txt'} cannot be read as safetensors"),
            ("", "checkpoint is an empty string")]:
        with pytest.raises(ValueError) as err:
            TabFMClassifier(checkpoint=checkpoint).fit(np.ones((4, 2)), [0, 1, 0, 1])
        assert str(err.value).startswith(message) and str(err.value).endswith(what_to_pass), err.value


def test_one_class_is_named_as_the_user_wrote_it():
    """numpy 2's repr had it as np.str_('a')."""
    with pytest.raises(ValueError, match=r"^y has 1 class \('a'\): a classifier needs at least two classes$"):
        TabFMClassifier(n_estimators=1).fit(np.ones((4, 2)), np.array(["a"] * 4))


def _sharded_predictions(tp: tuple[int, int] | None, sp: bool) -> tuple[np.ndarray, np.ndarray]:
    """The classifier's probabilities and the regressor's predictions, fitted with tensor_parallel=tp (None: one
    process)."""
    df, y = mixed_frame(90, seed=2)
    target = df["x"].to_numpy() * 2 + (y == "yes")
    kwargs = dict(n_estimators=2, dtype="float64", batch_size=16, tensor_parallel=tp, sequence_parallel=sp)
    clf = TabFMClassifier(**kwargs).fit(df[:60], y[:60])
    reg = TabFMRegressor(**kwargs).fit(df[:60], target[:60])
    return clf.predict_proba(df[60:]), reg.predict(df[60:])


@pytest.mark.parametrize("world,d0,d1,sp", [(2, 2, 1, True), (2, 1, 2, False), (4, 2, 2, True), (4, 4, 1, False)])
def test_sharded_inference_equals_one_process(ranks, world, d0, d1, sp):
    # the one-process reference here, once, while the ranks work
    (clf, reg), results = ranks(world).submit(_sharded_predictions, (d0, d1), sp).beside(
        lambda: _sharded_predictions(None, sp))
    for tp_clf, tp_reg in results:
        np.testing.assert_allclose(tp_clf, clf, rtol=0, atol=1e-10)
        np.testing.assert_allclose(tp_reg, reg, rtol=1e-10, atol=1e-10)


def _tensor_parallel_fit_calls(d0: int, d1: int) -> tuple[dict[str, int], np.ndarray, np.ndarray, bool]:
    """On each rank: a calibrated tensor-parallel fit, then a pickling round trip; how often the checkpoint was
    loaded (and parallelized) and a mesh built, the predictions before and after, and whether pickling kept the
    model."""
    import tabfm.checkpoint
    from tabfm.parallel.mesh import ParallelDims

    calls = {"load": 0, "mesh": 0, "built": 0}
    real_load, real_mesh, real_build = tabfm.checkpoint.load_model, estimator_model._mesh, ParallelDims.build

    def load(*a, **k):
        calls["load"] += 1
        return real_load(*a, **k)

    def mesh(*a, **k):
        calls["mesh"] += 1
        return real_mesh(*a, **k)

    def build(*a, **k):
        calls["built"] += 1
        return real_build(*a, **k)

    estimator_model._layout_mesh.cache_clear()
    tabfm.checkpoint.load_model, estimator_model._mesh, ParallelDims.build = load, mesh, build
    try:
        df, y = mixed_frame(90, seed=2)
        clf = TabFMClassifier(n_estimators=2, dtype="float64", tensor_parallel=(d0, d1)).fit(df[:60], y[:60])
        assert clf.temperature_ != 1.0  # calibrated: the probe ran on the same model_
        before = clf.predict_proba(df[60:])
        fitted = dict(calls)
        restored = pickle.loads(pickle.dumps(clf))
        kept = "model_" in vars(restored)
        after = restored.predict_proba(df[60:])  # rebuilds model_ (and its mesh) once
        return {"fit_load": fitted["load"], "fit_mesh": fitted["mesh"], **calls}, before, after, kept
    finally:
        tabfm.checkpoint.load_model, estimator_model._mesh, ParallelDims.build = real_load, real_mesh, real_build


def test_tensor_parallel_fit_loads_the_checkpoint_once(ranks):
    for calls, before, after, kept in ranks(2).run(_tensor_parallel_fit_calls, 2, 1):
        # the restored estimator loads the model again but reuses the layout's mesh (its process groups)
        assert calls == {"fit_load": 1, "fit_mesh": 1, "load": 2, "mesh": 2, "built": 1}
        assert not kept
        np.testing.assert_array_equal(after, before)


def test_tensor_parallel_needs_the_processes():
    with pytest.raises(ValueError, match="torchrun --nproc-per-node 4"):
        TabFMClassifier(tensor_parallel=(2, 2)).fit(np.random.default_rng(0).normal(size=(8, 2)), [0, 1] * 4)


def test_calibration_fits_a_temperature_on_held_out_train_rows():
    df, y = mixed_frame(200, seed=4)
    clf = TabFMClassifier(n_estimators=2).fit(df[:150], y[:150])
    raw = TabFMClassifier(n_estimators=2, calibrate=False).fit(df[:150], y[:150])
    assert raw.temperature_ == 1.0 and 0.2 <= clf.temperature_ <= 3.0
    # The temperature only rescales the members' logits: the same members, the same ranking of one member (the
    # blends, which can move a row's class, left out).
    one = TabFMClassifier(n_estimators=1, linear_blend=False, tree_blend=False).fit(df[:150], y[:150])
    one_raw = TabFMClassifier(n_estimators=1, calibrate=False).fit(df[:150], y[:150])
    np.testing.assert_array_equal(one.predict(df[150:]), one_raw.predict(df[150:]))
    tiny = TabFMClassifier(n_estimators=1).fit(df[:12], y[:12])
    assert tiny.temperature_ == 1.0  # too few rows to hold any out


def test_verbose_shows_the_fits_progress_over_its_contexts(capsys):
    """verbose=True: a bar over the contexts a fit encodes (most of a long fit), on stderr; quiet by default."""
    X = np.random.default_rng(0).normal(size=(600, 4))
    y = (X[:, 0] > 0).astype(int)
    TabFMClassifier(n_estimators=2, n_jobs=1).fit(X, y)
    assert "encode contexts" not in capsys.readouterr().err
    est = TabFMClassifier(n_estimators=2, n_jobs=1, verbose=True).fit(X, y)
    err = capsys.readouterr().err
    assert "fit: encode contexts: 100%" in err and f"{len(est.context_rows_)}/{len(est.context_rows_)}" in err
