"""Gradient-boosted trees beside the pretrained model, weighed into the estimators' predictions where held-out
train rows prefer them (TabFMClassifier and TabFMRegressor, tree_blend).

Why: the pretrained model reads a table as neighbourhoods of rows, and trees keep gaining from rows and from
sharp interactions where it does not: on the 56 tables a tree ensemble beat its ROC-AUC on 20 of the 42
classification tables and its R^2 on 3 of the 14 regression tables (islp_bikeshare 0.79 against 0.93). The
model and the trees err differently, so a blend beats either alone on most tables where both are good; where the
held rows prefer the model alone the trees' weight is 0 and the predictions are the model's. scikit-learn's
HistGradientBoosting is the partner (not a hand-written one): native missing values and categories, well kept,
deterministic for a seed, and fast enough to fit twice (on the rows the calibration keeps, to score the held
rows; then on every train row) beside a CPU fit of the model.

The trees read the preprocessed cells (tabfm.preprocess.Cells): numeric values as they are (NaN where missing),
category codes as categories (missing and unseen codes as NaN), or as ordered numbers in a column of more
categories than the trees bin natively; and the target encodings of the categorical columns of more than 100
levels (tabfm.category_encoding) as numeric columns. `save` writes the fitted trees with skops (tabfm.tree_io), so
that `load` does not fit them again (0.2-0.4 s on 1,000 rows, seconds on many classes); where the scikit-learn at load
is not the one that saved them, `load` fits them again from the saved train cells and seed instead: the same
trees for that version.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch
from sklearn.ensemble import HistGradientBoostingClassifier, HistGradientBoostingRegressor

from tabfm.native_threads import limit_threads
from tabfm.preprocess import Cells

MAX_TREE_CATEGORIES = 255
"""Categorical columns of more categories than this go to the trees as ordered codes (HistGradientBoosting bins a
native categorical column into at most 255 categories)."""

def tree_design(cells: Cells) -> tuple[np.ndarray, np.ndarray]:
    """(X [n, C] float64, categorical mask [C]) of the cells as the trees read them."""
    codes = cells.codes.astype(np.float64)
    codes[cells.codes < 0] = np.nan
    X = np.where(cells.is_cat[None, :], codes, cells.values)
    categorical = cells.is_cat & (cells.n_cats <= MAX_TREE_CATEGORIES)
    if cells.encoded is None:
        return X, categorical
    # the target encodings of many-level columns (tabfm.category_encoding) as numeric columns after the cells'
    return np.concatenate([X, cells.encoded], 1), np.r_[categorical, np.zeros(cells.encoded.shape[1], bool)]


def tree_design_width(cells: Cells) -> int:
    """The columns of tree_design(cells): the cells' and their target encodings'."""
    return cells.values.shape[1] + (0 if cells.encoded is None else cells.encoded.shape[1])


@contextlib.contextmanager
def _tree_threads() -> Iterator[None]:
    """HistGradientBoosting's OpenMP threads at torch's count within the block, for a fit: the thread count its
    caller chose (tabfm.tree_fits: one on a CPU), which OpenMP would otherwise ignore and take every core. The
    trees' outputs do not depend on it."""
    with limit_threads(torch.get_num_threads(), "openmp"):
        yield


@contextlib.contextmanager
def _predict_threads() -> Iterator[None]:
    """One OpenMP thread for predicting. Why: predicting a tree is one parallel region, and on a machine whose
    cores are busy each region of a team waits for a thread that has no core: 1,000 test rows took 1.3 s of a
    predict on 2 threads beside other processes, 8 ms on one; on one thread 100,000 rows take about 0.5 s, against
    0.43 s on two when the machine is quiet."""
    with limit_threads(1, "openmp"):
        yield


def fit_trees(cells: Cells, y: np.ndarray, n_classes: int | None, seed: int) -> TreeModel:
    """Trees fitted on the cells' rows: class ids y 0..n_classes-1, or real targets y with n_classes None."""
    X, categorical = tree_design(cells)
    # a numeric column with no value in these rows (a fold without a column's only value, or the one placeholder
    # column of a table of constant columns) fails scikit-learn's binning: as one constant value it is never split
    X[:, np.isnan(X).all(0) & ~categorical] = 0.0
    # early_stopping off: scikit-learn's "auto" turns it on past 10,000 rows, with a validation split stratified
    # by class that fails on a class of one row (always among the kept rows), and would make the trees of the
    # held rows and the final ones differ in kind
    options = dict(categorical_features=categorical, early_stopping=False, random_state=seed)
    if n_classes is None:
        model = HistGradientBoostingRegressor(**options)
    else:
        model = HistGradientBoostingClassifier(**options)
    with _tree_threads():
        return TreeModel(model.fit(X, y), n_classes)


class TreeModel:
    """Fitted trees: class probabilities over every class id 0..n_classes-1 (a class absent from the trees' rows
    gets 0, so the columns line up with the ensemble's), or predicted targets."""

    def __init__(self, model: HistGradientBoostingClassifier | HistGradientBoostingRegressor,
                 n_classes: int | None):
        self.model, self.n_classes = model, n_classes

    def predict_proba(self, cells: Cells) -> np.ndarray:
        """[n, n_classes]."""
        proba = np.zeros((len(cells.values), self.n_classes))
        with _predict_threads():
            proba[:, self.model.classes_] = self.model.predict_proba(tree_design(cells)[0])
        return proba

    def predict(self, cells: Cells) -> np.ndarray:
        """[n] predicted targets."""
        with _predict_threads():
            return self.model.predict(tree_design(cells)[0])

