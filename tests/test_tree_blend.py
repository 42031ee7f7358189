"""tabfm.tree_base and the estimators' tree blend: gradient-boosted trees weighed into the predictions where the
held-out train rows prefer them, saved with skops and read back at load."""

import pickle

import numpy as np
import pandas as pd
import pytest
from sklearn.metrics import log_loss, r2_score

from tabfm import TabFMClassifier, TabFMRegressor, calibration
from tabfm.preprocess import TablePreprocessor
from tabfm.tree_base import MAX_TREE_CATEGORIES, fit_trees, tree_design

FAST = dict(n_estimators=4, local_context_rows=64, n_jobs=1)


def _steps(n: int, seed: int = 0):
    """Classes split by thresholds on two columns (an axis-aligned interaction, no noise) beside two noise
    columns: trees draw it exactly, the pretrained model only near its neighbours."""
    rng = np.random.default_rng(seed)
    X = rng.uniform(-1, 1, size=(n, 4))
    y = ((X[:, 0] > 0.3) ^ (X[:, 1] > -0.2)).astype(int)
    return X, y


def _step_target(n: int, seed: int = 0):
    """A real target that jumps at thresholds of two columns, with a little noise."""
    rng = np.random.default_rng(seed)
    X = rng.uniform(-1, 1, size=(n, 4))
    y = 3.0 * (X[:, 0] > 0.3) - 2.0 * (X[:, 1] > -0.2) * (X[:, 2] > 0) + 0.05 * rng.normal(size=n)
    return X, y


def test_tree_design_reads_categories_as_categories_and_missing_cells_as_nan():
    rng = np.random.default_rng(0)
    n = 600
    X = pd.DataFrame({"num": np.where(rng.random(n) < 0.2, np.nan, rng.normal(size=n)),
                      "colour": rng.choice(["red", "green", None], n),
                      "many": [f"id{i}" for i in rng.integers(0, 400, n)]})
    pre = TablePreprocessor(categorical_features=["colour", "many"]).fit(X)
    cells = pre.transform(X)
    design, categorical = tree_design(cells)
    num, colour, many = ([c.name for c in pre.columns_].index(name) for name in ("num", "colour", "many"))
    np.testing.assert_array_equal(np.isnan(design[:, num]), X["num"].isna().to_numpy())
    np.testing.assert_array_equal(np.isnan(design[:, colour]), X["colour"].isna().to_numpy())
    present = cells.codes[:, colour] >= 0
    np.testing.assert_array_equal(design[present, colour], cells.codes[present, colour])
    assert cells.n_cats[many] > MAX_TREE_CATEGORIES
    assert categorical[colour] and not categorical[num] and not categorical[many]  # too many: ordered codes


def test_trees_give_every_class_a_column_in_class_id_order():
    X, y = _steps(200)
    y = np.where(y == 1, 2, 0)  # class 1 of 3 is absent from the trees' rows
    cells = TablePreprocessor().fit(pd.DataFrame(X)).transform(pd.DataFrame(X))
    proba = fit_trees(cells, y, 3, seed=0).predict_proba(cells)
    assert proba.shape == (200, 3) and (proba[:, 1] == 0).all()
    np.testing.assert_allclose(proba.sum(1), 1)
    assert (proba.argmax(1) == y).mean() > 0.95


def test_the_joint_blend_is_the_brute_force_minimum():
    rng = np.random.default_rng(1)
    h = 50
    ensemble = rng.uniform(0.05, 1, size=(len(calibration.TEMPERATURES), h))
    linears = rng.uniform(0.05, 1, size=(2, h))
    trees = rng.uniform(0.05, 1, size=h)
    weights = calibration.BLEND_WEIGHTS
    i, t, w, v = calibration.best_tree_blend(ensemble, linears, weights, trees)
    best = min((-np.log((1 - v_) * ((1 - w_) * ensemble[t_] + w_ * linears[i_]) + v_ * trees).mean(), i_, t_, w_, v_)
               for v_ in calibration.TREE_WEIGHTS for i_ in range(2) for t_ in range(len(calibration.TEMPERATURES))
               for w_ in weights)
    assert (i, t, w, v) == (best[1], float(calibration.TEMPERATURES[best[2]]), float(best[3]), float(best[4]))


def test_trees_that_know_nothing_get_no_weight_and_perfect_ones_the_most():
    h = 40
    ensemble = np.full((len(calibration.TEMPERATURES), h), 0.7)
    linears = np.full((1, h), 0.6)
    assert calibration.best_tree_blend(ensemble, linears, calibration.BLEND_WEIGHTS, np.full(h, 0.3))[3] == 0.0
    assert calibration.best_tree_blend(ensemble, linears, calibration.BLEND_WEIGHTS, np.ones(h))[3] == 0.9
    target = np.linspace(-1, 1, h)
    assert calibration.best_tree_weight(target, np.zeros(h), target) == 0.0
    assert calibration.best_tree_weight(np.zeros(h), target, target) == 0.9
    assert calibration.best_tree_weight(np.zeros(h), 2 * target, target) == 0.5  # least squares: v = 1/2


def test_classifier_weighs_in_the_trees_where_the_held_rows_prefer_them():
    X, y = _steps(500)
    clf = TabFMClassifier(**FAST).fit(X[:400], y[:400])
    alone = TabFMClassifier(**FAST, tree_blend=False).fit(X[:400], y[:400])
    assert clf.tree_weight_ > 0 and clf.tree_model_ is not None
    assert alone.tree_weight_ == 0 and alone.tree_model_ is None
    proba = clf.predict_proba(X[400:])
    np.testing.assert_allclose(proba.sum(1), 1)
    trees = fit_trees(clf.train_cells_, clf.y_train_, 2, clf.tree_seed_).predict_proba(clf._cells_of(X[400:]))
    model = clf.tree_model_
    clf.tree_model_ = None  # the blend without the trees: the model and the logistic regression
    without = clf.predict_proba(X[400:])
    clf.tree_model_ = model
    np.testing.assert_allclose(proba, (1 - clf.tree_weight_) * without + clf.tree_weight_ * trees, rtol=1e-12)
    assert log_loss(y[400:], proba) < log_loss(y[400:], alone.predict_proba(X[400:]))
    raw = TabFMClassifier(**FAST, calibrate=False).fit(X[:400], y[:400])
    assert raw.tree_weight_ == 0 and raw.tree_model_ is None  # the weight is fitted on the held rows


def test_classifier_calibrated_through_a_probe_weighs_the_trees_too():
    X, y = _steps(300, seed=2)
    clf = TabFMClassifier(n_estimators=2, n_jobs=1).fit(X[:250], y[:250])  # 2 members: the probe
    assert clf.tree_weight_ > 0 and clf.tree_model_ is not None


def test_regressor_weighs_in_the_trees_and_moves_its_quantiles_with_its_mean():
    X, y = _step_target(500)
    reg = TabFMRegressor(**FAST).fit(X[:400], y[:400])
    alone = TabFMRegressor(**FAST, tree_blend=False).fit(X[:400], y[:400])
    assert reg.tree_weight_ > 0 and reg.tree_model_ is not None
    assert alone.tree_weight_ == 0 and alone.tree_model_ is None
    mean, quantiles = reg.predict(X[400:]), reg.predict_quantiles(X[400:], [0.1, 0.5, 0.9])
    model = reg.tree_model_
    reg.tree_model_ = None
    without, without_q = reg.predict(X[400:]), reg.predict_quantiles(X[400:], [0.1, 0.5, 0.9])
    reg.tree_model_ = model
    trees = reg.target_scale_.inverse(model.predict(reg._cells_of(X[400:])))
    np.testing.assert_allclose(mean, (1 - reg.tree_weight_) * without + reg.tree_weight_ * trees, rtol=1e-12)
    np.testing.assert_allclose(quantiles - mean[:, None], without_q - without[:, None], rtol=1e-9, atol=1e-9)
    assert r2_score(y[400:], mean) > r2_score(y[400:], alone.predict(X[400:]))


@pytest.mark.parametrize("random_state", [0, None])
def test_save_writes_the_trees_and_load_reads_them_without_fitting(tmp_path, random_state, monkeypatch):
    """The trees go to trees.skops (not the JSON), and load reads them back: the same predictions, no fit."""
    from sklearn.ensemble import HistGradientBoostingClassifier, HistGradientBoostingRegressor

    X, y = _steps(300, seed=3)
    clf = TabFMClassifier(**FAST, random_state=random_state).fit(X[:250], y[:250])
    assert clf.tree_weight_ > 0
    clf.save(tmp_path / "clf")
    assert "tree_model" not in (tmp_path / "clf" / "estimator.json").read_text()
    without = TabFMClassifier(**FAST, tree_blend=False).fit(X[:250], y[:250])
    without.save(tmp_path / "without")
    assert not (tmp_path / "without" / "trees.skops").exists()
    assert TabFMClassifier.load(tmp_path / "without").tree_model_ is None  # as fit left it
    Xr, yr = _step_target(300, seed=3)
    reg = TabFMRegressor(**FAST, random_state=random_state).fit(Xr[:250], yr[:250])
    assert reg.tree_weight_ > 0
    reg.save(tmp_path / "reg")

    def no_fit(*args, **kwargs):
        raise AssertionError("load fitted the trees again")

    monkeypatch.setattr(HistGradientBoostingClassifier, "fit", no_fit)
    monkeypatch.setattr(HistGradientBoostingRegressor, "fit", no_fit)
    back = TabFMClassifier.load(tmp_path / "clf")
    assert back.tree_model_ is not None and back.tree_model_ is not clf.tree_model_
    np.testing.assert_array_equal(back.predict_proba(X[250:]), clf.predict_proba(X[250:]))
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(clf)).predict_proba(X[250:]), clf.predict_proba(X[250:]))
    back = TabFMRegressor.load(tmp_path / "reg")
    np.testing.assert_array_equal(back.predict_quantiles(Xr[250:]), reg.predict_quantiles(Xr[250:]))
    clf.save(tmp_path / "reg2")  # a saved estimator with trees is replaced by another save at its path
    reg.save(tmp_path / "reg2")
    np.testing.assert_array_equal(TabFMRegressor.load(tmp_path / "reg2").predict(Xr[250:]), reg.predict(Xr[250:]))


def test_load_under_another_scikit_learn_fits_the_same_trees_again(tmp_path, monkeypatch):
    from tabfm import persist

    X, y = _steps(300, seed=3)
    clf = TabFMClassifier(**FAST).fit(X[:250], y[:250])
    clf.save(tmp_path / "clf")
    monkeypatch.setattr(persist, "_sklearn_version", lambda: "0.0.0")
    with pytest.warns(UserWarning, match="saved with scikit-learn"):
        back = TabFMClassifier.load(tmp_path / "clf")
    np.testing.assert_array_equal(back.predict_proba(X[250:]), clf.predict_proba(X[250:]))


def test_a_changed_trees_file_is_refused(tmp_path):
    X, y = _steps(300, seed=3)
    TabFMClassifier(**FAST).fit(X[:250], y[:250]).save(tmp_path / "clf")
    trees = tmp_path / "clf" / "trees.skops"
    data = bytearray(trees.read_bytes())
    data[len(data) // 2] ^= 1
    trees.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="trees.skops in .* is not the file saved with estimator.json"):
        TabFMClassifier.load(tmp_path / "clf")
    trees.unlink()
    with pytest.raises(ValueError, match="trees.skops is missing"):
        TabFMClassifier.load(tmp_path / "clf")


def _openmp_threads_of_each_tree_fit(monkeypatch) -> list[set[int]]:
    """The OpenMP thread counts in force at each HistGradientBoostingClassifier fit from now on, as they happen."""
    from sklearn.ensemble import HistGradientBoostingClassifier
    from threadpoolctl import threadpool_info

    seen = []
    real = HistGradientBoostingClassifier.fit

    def spy(self, X, y):
        seen.append({pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "openmp"})
        return real(self, X, y)

    monkeypatch.setattr(HistGradientBoostingClassifier, "fit", spy)
    return seen


def test_trees_run_on_the_estimators_threads(monkeypatch):
    """n_jobs=1 keeps the trees' OpenMP to one thread too (it takes every core unless told)."""
    seen = _openmp_threads_of_each_tree_fit(monkeypatch)
    X, y = _steps(300, seed=4)
    clf = TabFMClassifier(**FAST).fit(X[:250], y[:250])
    assert clf.tree_weight_ > 0 and len(seen) == 2 and all(threads == {1} for threads in seen)


def test_on_a_cpu_every_tree_fit_runs_on_one_openmp_thread(tmp_path, monkeypatch):
    """With n_jobs=2 the forwards get two threads and the trees one, also the fit on every row of more than two
    classes (started once their weight is known, after the forwards) and the fit again at load under another
    scikit-learn: a team of two OpenMP threads beside busy processes took 4.5-140 s where one took 1.5 s."""
    from tabfm import persist

    seen = _openmp_threads_of_each_tree_fit(monkeypatch)
    X, y = _three_steps(300, seed=4)
    clf = TabFMClassifier(**{**FAST, "n_jobs": 2}).fit(X[:250], y[:250])
    clf.save(tmp_path / "clf")
    monkeypatch.setattr(persist, "_sklearn_version", lambda: "0.0.0")
    with pytest.warns(UserWarning, match="saved with scikit-learn"):
        TabFMClassifier.load(tmp_path / "clf")
    assert clf.tree_weight_ > 0 and len(seen) == 3 and all(threads == {1} for threads in seen), seen


def _tree_threads_left() -> list:
    import threading

    return [t for t in threading.enumerate() if t.name.startswith("tabfm-trees")]


@pytest.mark.parametrize("estimator, data", [(TabFMClassifier, _steps), (TabFMRegressor, _step_target)])
def test_the_trees_are_fitted_on_their_own_thread_while_the_contexts_are_encoded(monkeypatch, estimator, data):
    """tabfm.tree_fits: the held fold's trees and the final ones are fitted on one 'tabfm-trees' thread, the first
    before the contexts' encoding ends (it waits here until a tree fit has started: run one after the other, it
    would wait in vain), and no such thread outlives fit; the final trees are the ones fit_trees gives."""
    import threading

    from tabfm import estimator as estimator_module
    from tabfm import tree_fits

    started, threads, waited = threading.Event(), [], []
    real_fit, real_encode = tree_fits.fit_trees, estimator_module._TabFMBase._encode_contexts

    def fit(*args):
        threads.append(threading.current_thread().name)
        started.set()
        return real_fit(*args)

    def encode(self):
        waited.append(started.wait(timeout=60))
        return real_encode(self)

    monkeypatch.setattr(tree_fits, "fit_trees", fit)
    monkeypatch.setattr(estimator_module._TabFMBase, "_encode_contexts", encode)
    X, y = data(500)
    est = estimator(**FAST).fit(X[:400], y[:400])
    assert waited == [True] and len(threads) == 2 and all(name.startswith("tabfm-trees") for name in threads)
    assert est.tree_weight_ > 0 and not _tree_threads_left()
    targets, n_classes = est._tree_targets()
    alone = fit_trees(est.train_cells_, targets, n_classes, est.tree_seed_)
    cells = est._cells_of(X[400:])
    if n_classes is None:
        np.testing.assert_array_equal(est.tree_model_.predict(cells), alone.predict(cells))
    else:
        np.testing.assert_array_equal(est.tree_model_.predict_proba(cells), alone.predict_proba(cells))


def _three_steps(n: int, seed: int = 0):
    """Three classes cut by thresholds on two columns: trees draw them exactly."""
    X, _ = _steps(n, seed)
    return X, (X[:, 0] > 0.3).astype(int) + (X[:, 1] > -0.2).astype(int)


@pytest.mark.parametrize("tree_weight", [0.0, None])
def test_with_more_than_two_classes_the_trees_on_every_row_wait_for_their_weight(monkeypatch, tree_weight):
    """Each round grows a tree per class, so the fit on every train row is not started ahead: only once the
    weight is known and above 0, on the trees' thread too (tabfm.tree_fits: its one OpenMP thread on a CPU; on the
    fit's, a team of two took 4.5-140 s beside busy processes where one took 1.5 s); with two classes it is started
    ahead (the test above)."""
    import threading

    from tabfm import tree_fits

    fitted = []
    real_fit, real_choice = tree_fits.fit_trees, calibration.best_tree_blend
    monkeypatch.setattr(tree_fits, "fit_trees", lambda cells, *a: fitted.append(
        (len(cells.values), threading.current_thread().name.startswith("tabfm-trees"))) or real_fit(cells, *a))
    if tree_weight is not None:  # the held rows' choice, but the trees weighed out
        monkeypatch.setattr(calibration, "best_tree_blend", lambda *a: (*real_choice(*a)[:3], tree_weight))
    X, y = _three_steps(500)
    clf = TabFMClassifier(**FAST).fit(X[:400], y[:400])
    assert (clf.tree_weight_ > 0) == (tree_weight is None) and (clf.tree_model_ is None) == (tree_weight == 0)
    # the held fold's kept rows on the trees' thread, then every row there too
    assert fitted[0][0] < 400 and fitted[0][1] and fitted[1:] == [(400, True)] * (tree_weight is None)
    assert not _tree_threads_left()


def test_no_trees_where_a_class_has_fewer_than_two_rows_to_learn_from(monkeypatch):
    """120 rows of 70 classes (the calibration's folds keep 100): no tree is fitted, its weight is 0 and
    scikit-learn's "could represent a regression problem" warning comes once, from the estimator's own check of y,
    not again from every fit of the trees; 120 rows of 40 classes still get them."""
    import warnings

    from tabfm import tree_fits

    fitted = []
    real_fit = tree_fits.fit_trees
    monkeypatch.setattr(tree_fits, "fit_trees", lambda cells, *a: fitted.append(len(cells.values)) or
                        real_fit(cells, *a))
    rng = np.random.default_rng(0)
    X = rng.normal(size=(120, 3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        clf = TabFMClassifier(**FAST).fit(X, np.arange(120) % 70)
    assert fitted == [] and clf.tree_weight_ == 0 and clf.tree_model_ is None
    hints = [w for w in caught if "could represent a regression problem" in str(w.message)]
    assert len(hints) == 1 and hints[0].filename.endswith("validation.py")
    TabFMClassifier(**FAST).fit(X, np.arange(120) % 40)
    assert len(fitted) >= 1


def test_a_failed_tree_fit_fails_the_fit_and_a_failed_forward_stops_the_trees(monkeypatch):
    from tabfm import estimator as estimator_module
    from tabfm import tree_fits

    def broken(*args):
        raise RuntimeError("the trees broke")

    X, y = _steps(500)
    with monkeypatch.context() as patch:
        patch.setattr(tree_fits, "fit_trees", broken)
        with pytest.raises(RuntimeError, match="the trees broke"):
            TabFMClassifier(**FAST).fit(X[:400], y[:400])
    with monkeypatch.context() as patch:
        patch.setattr(estimator_module._TabFMBase, "_encode_contexts", lambda self: broken())
        with pytest.raises(RuntimeError, match="the trees broke"):
            TabFMClassifier(**FAST).fit(X[:400], y[:400])
    for thread in _tree_threads_left():  # the fit that was running ends; the one queued behind it never starts
        thread.join(timeout=60)
    assert not _tree_threads_left()


def test_the_speed_benchmark_times_one_row_after_load_with_the_trees_read_back():
    from builders import benchmark_module

    bench = benchmark_module("inference")
    log = bench.Log()
    X, y = _steps(400, seed=1)  # the default gives the trees a weight here
    bench.one_row_after_load(log, (X[:350], y[:350], X[350:], y[350:]), fit_predict_s=10.0, repeats=3)
    assert "the trees read from trees.skops" in log.lines[0] and "median of 3" in log.lines[0]
    assert log.lines[1].startswith("target: one row predicted by a loaded estimator under 50 ms: M")


def test_trees_past_ten_thousand_rows_take_a_class_of_one_row():
    """A fuzzer's finding: scikit-learn's early stopping, on past 10,000 rows, split off validation rows
    stratified by class and failed on a class of one row."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(10_100, 2))
    y = (X[:, 0] > 0).astype(int)
    y[7] = 2
    cells = TablePreprocessor().fit(pd.DataFrame(X)).transform(pd.DataFrame(X))
    proba = fit_trees(cells, y, 3, seed=0).predict_proba(cells.take(slice(0, 5)))
    assert proba.shape == (5, 3) and np.allclose(proba.sum(1), 1)


def test_a_pickle_from_before_the_trees_gets_their_parameter():
    """A fuzzer's finding: unpickled estimators from before tree_blend existed failed in get_params, clone and
    fit; they get the parameter's default, and still predict (fitted without trees, as they were then)."""
    from sklearn.base import clone

    X, y = _steps(300, seed=6)
    clf = TabFMClassifier(**FAST, tree_blend=False).fit(X[:250], y[:250])
    state = pickle.loads(pickle.dumps(clf)).__getstate__()
    for name in ("tree_blend", "tree_weight_", "tree_model_", "tree_seed_"):
        del state[name]
    old = TabFMClassifier.__new__(TabFMClassifier)
    old.__setstate__(state)
    assert old.get_params()["tree_blend"] is True and clone(old).tree_blend is True
    np.testing.assert_array_equal(old.predict_proba(X[250:]), clf.predict_proba(X[250:]))
