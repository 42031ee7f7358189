"""Categorical columns of many levels: their cross-fitted target encodings, read by the linear models and the
trees, and what the estimators gain from them."""

import numpy as np
import pandas as pd
import pytest
from sklearn.linear_model import LogisticRegression, RidgeCV
from sklearn.metrics import log_loss, r2_score, roc_auc_score
from sklearn.model_selection import KFold, StratifiedKFold
from sklearn.preprocessing import TargetEncoder

from tabfm import TabFMClassifier, TabFMRegressor
from tabfm import category_encoding
from tabfm.category_encoding import (MAX_CLASSES, MAX_MANY_CLASS_WIDTH, MIN_LEVELS, N_FOLDS, CategoryEncoding,
                                      encodes)
from tabfm.linear_base import LinearDesign
from tabfm.preprocess import UNSEEN, TablePreprocessor
from tabfm.tree_base import fit_trees, tree_design


def _levels_table(n: int, levels: int, seed: int = 0) -> tuple[pd.DataFrame, np.ndarray]:
    """A column of `levels` categories whose per-level effects carry most of the target, and two numeric columns
    (one of them informative): a school, a destination, a brand."""
    rng = np.random.default_rng(seed)
    level = rng.integers(0, levels, n)
    x = rng.normal(size=(n, 2))
    y = 2 * rng.normal(size=levels)[level] + x[:, 0] + 0.5 * rng.normal(size=n)
    return pd.DataFrame({"g": [f"l{v}" for v in level], "a": x[:, 0], "b": x[:, 1]}), y


def _cells(X):
    return TablePreprocessor().fit(X).transform(X)


@pytest.mark.parametrize("task", ["continuous", "binary", "multiclass"])
def test_train_rows_get_cross_fitted_encodings_and_new_rows_those_of_every_train_row(task):
    X, y = _levels_table(600, 150)
    X["h"] = [f"m{v}" for v in np.random.default_rng(1).integers(0, 120, 600)]
    X.loc[::37, "g"] = None  # missing cells: a category of their own
    if task != "continuous":
        y = np.digitize(y, np.quantile(y, [0.5] if task == "binary" else [0.3, 0.6])).astype(np.int64)
    cells = _cells(X)
    n_classes = None if task == "continuous" else len(np.unique(y))
    encoding, encoded = CategoryEncoding.fit(cells, y, n_classes, seed=7)
    columns = np.flatnonzero(cells.is_cat)
    np.testing.assert_array_equal(encoding.columns, columns)
    split = KFold if task == "continuous" else StratifiedKFold
    reference = TargetEncoder(target_type=task, cv=split(N_FOLDS, shuffle=True, random_state=7))
    np.testing.assert_array_equal(encoded.encoded, reference.fit_transform(cells.codes[:, columns], y))
    assert encoded.values is cells.values and encoded.codes is cells.codes  # the cells themselves are kept
    X_new = X.sample(50, random_state=0)
    X_new.iloc[:3, 0] = "never seen"
    new = TablePreprocessor().fit(X).transform(X_new)
    np.testing.assert_allclose(encoding.transform(new).encoded, reference.transform(new.codes[:, columns]),
                               rtol=0, atol=1e-15)
    assert encoded.take(np.arange(5, 9)).encoded.shape == (4, len(columns) * (1 if task != "multiclass" else 3))


def test_an_unseen_category_reads_as_the_overall_mean_and_a_missing_cell_as_the_missing_rows_mean():
    X, y = _levels_table(400, 120)
    X.loc[:39, "g"] = None
    y[:40] += 10.0  # missing cells that say something: a new category is not one of them
    pre = TablePreprocessor().fit(X)
    encoding, _ = CategoryEncoding.fit(pre.transform(X), y, None, seed=0)
    with pytest.warns(UserWarning, match="never seen at fit"):
        new = pre.transform(pd.DataFrame({"g": ["unknown", None], "a": [0.0, 0.0], "b": [0.0, 0.0]}))
    np.testing.assert_array_equal(new.codes[:, 0], [UNSEEN, -1])
    unseen, missing = encoding.transform(new).encoded[:, 0]
    assert unseen == pytest.approx(y.mean(), abs=1e-12)
    assert missing > y.mean() + 5  # the missing train cells' mean, shrunk a little towards the overall mean
    reference = TargetEncoder(cv=KFold(N_FOLDS, shuffle=True, random_state=0)).fit(pre.transform(X).codes[:, [0]], y)
    np.testing.assert_allclose([unseen, missing], reference.transform([[10**6], [-1]])[:, 0], rtol=0, atol=1e-12)


def test_without_an_encoding_an_unseen_category_predicts_as_a_missing_cell():
    X, y = _levels_table(300, 20)  # no column to encode: the model, the linear model and the trees read both alike
    X.loc[:9, "g"] = None
    y = (y > np.median(y)).astype(int)
    est = TabFMClassifier(n_estimators=2, n_jobs=1).fit(X, y)
    assert est.category_encoding_ is None and est.blend_weight_ > 0
    rows = X.iloc[:4].copy()
    rows["g"] = None
    unseen = rows.assign(g="never seen")
    with pytest.warns(UserWarning, match="never seen at fit"):
        np.testing.assert_array_equal(est.predict_proba(unseen), est.predict_proba(rows))
        unseen_cells = est._cells_of(unseen)
    assert (unseen_cells.codes[:, 0] == UNSEEN).all() and (est._cells_of(rows).codes[:, 0] == -1).all()
    trees = fit_trees(est.train_cells_, est.y_train_, 2, seed=0)  # weighed out here; the trees alike too
    np.testing.assert_array_equal(trees.predict_proba(unseen_cells), trees.predict_proba(est._cells_of(rows)))


def test_tables_of_few_levels_or_of_too_many_classes_for_their_columns_are_not_encoded():
    X, y = _levels_table(400, MIN_LEVELS - 1)
    cells = _cells(X)
    assert cells.n_cats.max() == MIN_LEVELS - 1
    assert CategoryEncoding.fit(cells, y, None, seed=0) == (None, cells)
    X, _ = _levels_table(400, 150)
    X["h"] = X["g"] + "x"  # a second column of 150 levels
    cells = _cells(X)
    assert cells.is_cat.sum() == 2
    for K in (2, MAX_CLASSES, MAX_MANY_CLASS_WIDTH // 2):  # one output per class and column (two classes: one)
        encoding, encoded = CategoryEncoding.fit(cells, np.arange(400) % K, K, seed=0)
        outputs = 1 if K == 2 else K
        assert encoded.encoded.shape == (400, 2 * outputs) and encoding.tables.shape[2] == outputs
    K = MAX_MANY_CLASS_WIDTH // 2 + 1  # 2 x 51 outputs: past the width many classes may take
    assert CategoryEncoding.fit(cells, np.arange(400) % K, K, seed=0) == (None, cells)
    assert encodes(1, MAX_MANY_CLASS_WIDTH) and not encodes(1, MAX_MANY_CLASS_WIDTH + 1)
    assert encodes(50, MAX_CLASSES) and encodes(50, None)  # up to MAX_CLASSES classes or a regression: any width


def test_classes_of_fewer_rows_than_folds_are_encoded_over_unstratified_folds():
    X, _ = _levels_table(300, 120)
    y = np.arange(300) % 75  # 4 rows a class: StratifiedKFold's 5 folds cannot each hold one
    cells = _cells(X)
    assert cells.n_cats[cells.is_cat].min() >= MIN_LEVELS
    encoding, encoded = CategoryEncoding.fit(cells, y, 75, seed=3)
    reference = TargetEncoder(target_type="multiclass", cv=KFold(N_FOLDS, shuffle=True, random_state=3))
    np.testing.assert_array_equal(encoding.columns, np.flatnonzero(cells.is_cat))
    np.testing.assert_array_equal(encoded.encoded, reference.fit_transform(cells.codes[:, encoding.columns], y))


def _many_class_levels_table(n: int, levels: int, K: int, seed: int) -> tuple[pd.DataFrame, np.ndarray]:
    """K classes: 60% of the rows take their level's class (a level of 300 names each row's likely class), the rest a
    class from the bins of a numeric column."""
    rng = np.random.default_rng(seed)
    level, x = rng.integers(0, levels, n), rng.normal(size=(n, 2))
    bins = np.digitize(x[:, 0] + 0.3 * rng.normal(size=n), np.quantile(x[:, 0], np.linspace(0, 1, K + 1)[1:-1]))
    y = np.where(rng.random(n) < 0.6, rng.integers(0, K, levels)[level], bins)
    return pd.DataFrame({"g": [f"l{v}" for v in level], "a": x[:, 0], "b": x[:, 1]}), y


def test_a_table_of_more_classes_than_the_head_learns_a_column_of_300_levels(monkeypatch, tmp_path):
    K = 2 * MAX_CLASSES
    X, y = _many_class_levels_table(1500, 300, K, seed=0)
    train, test = slice(0, 1200), slice(1200, None)
    est = TabFMClassifier(n_estimators=4, n_jobs=1).fit(X[train], y[train])
    assert est.category_encoding_.tables.shape[2] == K
    ours = log_loss(y[test], est.predict_proba(X[test]), labels=np.arange(K))
    monkeypatch.setattr(category_encoding, "MAX_MANY_CLASS_WIDTH", 0)  # as before: no encoding past 10 classes
    plain = TabFMClassifier(n_estimators=4, n_jobs=1).fit(X[train], y[train])
    assert plain.category_encoding_ is None
    before = log_loss(y[test], plain.predict_proba(X[test]), labels=np.arange(K))
    assert ours < before - 0.4  # 2.02 vs 2.74
    est.save(tmp_path / "est")
    np.testing.assert_array_equal(TabFMClassifier.load(tmp_path / "est").predict_proba(X[test]),
                                  est.predict_proba(X[test]))


def test_the_trees_read_the_encodings_after_the_cells_columns():
    X, y = _levels_table(800, 400)
    encoding, cells = CategoryEncoding.fit(_cells(X), y, None, seed=0)
    design, categorical = tree_design(cells)
    assert cells.n_cats[0] > 255  # ordered codes, not native categories
    assert design.shape == (800, 4) and not categorical.any()
    np.testing.assert_array_equal(design[:, 3], cells.encoded[:, 0])


def test_the_linear_design_reads_the_encodings_as_numeric_columns():
    X, y = _levels_table(400, 150)
    X["h"] = X["g"].str.len().map({2: "short", 3: "long", 4: "long"})  # a column of few categories: one-hot
    pre = TablePreprocessor().fit(X)
    encoding, cells = CategoryEncoding.fit(pre.transform(X), y, None, seed=0)
    design = LinearDesign.fit(cells)
    np.testing.assert_array_equal(design.numeric, [1, 2, 4])  # a, b and the encoding of g (after the C = 4)
    np.testing.assert_array_equal(design.categorical, [3])
    D = design(cells)
    standard = (cells.encoded[:, 0] / design.peaks[2] - design.means[2]) / design.scales[2]
    np.testing.assert_allclose(D[:, 2], np.clip(standard, design.lows[2], design.highs[2]), rtol=1e-12)
    new = encoding.transform(pre.transform(X.iloc[:5]))  # new rows: the encodings of every train row
    np.testing.assert_array_equal(design(new)[:, :2], D[:5, :2])
    assert not np.array_equal(design(new)[:, 2], D[:5, 2])


def _encoded_reference(X, y, train, test, model):
    """scikit-learn's own pipeline of the same idea: TargetEncoder's cross-fitted encodings of g beside the
    numeric columns, into `model`."""
    encoder = TargetEncoder(cv=KFold(5, shuffle=True, random_state=0))
    fitted = model.fit(np.c_[encoder.fit_transform(X[train][["g"]], y[train]), X[train][["a", "b"]]], y[train])
    design = np.c_[encoder.transform(X[test][["g"]]), X[test][["a", "b"]]]
    return fitted.predict(design) if isinstance(model, RidgeCV) else fitted.predict_proba(design)[:, 1]


def test_the_regressor_learns_the_effects_of_a_column_of_300_levels():
    X, y = _levels_table(1500, 300)
    train, test = slice(0, 1000), slice(1000, None)
    est = TabFMRegressor(n_estimators=2, n_jobs=1).fit(X[train], y[train])
    reference = r2_score(y[test], _encoded_reference(X, y, train, test, RidgeCV(np.logspace(-3, 3, 13))))
    ours = r2_score(y[test], est.predict(X[test]))
    assert ours >= reference - 0.02 and ours > 0.8  # 0.826 vs 0.839; without the encoding 0.30
    assert est.category_encoding_ is not None and len(est.linear_base_.design.numeric) == 3


def test_the_classifier_ranks_by_the_levels_of_a_column_of_300_levels():
    X, y = _levels_table(1500, 300, seed=1)
    y = (y > np.median(y)).astype(int)
    train, test = slice(0, 1000), slice(1000, None)
    est = TabFMClassifier(n_estimators=2, n_jobs=1).fit(X[train], y[train])
    reference = roc_auc_score(y[test], _encoded_reference(X, y, train, test, LogisticRegression()))
    ours = roc_auc_score(y[test], est.predict_proba(X[test])[:, 1])
    assert ours >= reference - 0.01 and ours > 0.88  # 0.898 vs 0.900; without the encoding 0.73


def test_save_and_load_keep_the_encoding(tmp_path):
    X, y = _levels_table(500, 200)
    est = TabFMRegressor(n_estimators=2, n_jobs=1).fit(X[:400], y[:400])
    est.save(tmp_path / "est")
    loaded = TabFMRegressor.load(tmp_path / "est")
    np.testing.assert_array_equal(loaded.category_encoding_.tables, est.category_encoding_.tables)
    np.testing.assert_array_equal(loaded.train_cells_.encoded, est.train_cells_.encoded)
    np.testing.assert_array_equal(loaded.predict(X[400:]), est.predict(X[400:]))


@pytest.mark.parametrize("cls", [TabFMClassifier, TabFMRegressor])
def test_a_fit_of_random_state_none_encodes_with_fresh_folds(cls, tmp_path):
    X, y = _levels_table(300, 120)
    if cls is TabFMClassifier:
        y = (y > np.median(y)).astype(int)
    est = cls(n_estimators=2, n_jobs=1, random_state=None).fit(X[:250], y[:250])
    assert est.category_encoding_ is not None and np.isfinite(est.train_cells_.encoded).all()
    predict = est.predict_proba if cls is TabFMClassifier else est.predict
    est.save(tmp_path / "est")
    np.testing.assert_array_equal(cls.load(tmp_path / "est").predict(X[250:]), est.predict(X[250:]))
    assert np.isfinite(predict(X[250:])).all()
