"""Target encodings of categorical columns of many levels, for the linear models and the trees beside the
pretrained one (tabfm.linear_base, tabfm.tree_base); the pretrained model still reads the column's categories.

Why: a categorical column of more than linear_base.MAX_ONEHOT levels (a school, a person, a route, a brand)
reached neither the linear part (no one-hot past 100 levels) nor, past tree_base.MAX_TREE_CATEGORIES, the trees
(its codes in string order, which mean nothing), and the model alone does not learn a per-level effect from a few
rows per level. Each such column gets the mean target of its level, shrunk towards the overall mean by how few
rows the level has (scikit-learn's TargetEncoder, smooth="auto": an empirical-Bayes blend), as one more numeric
column for a regression or two-class table, one per class otherwise (past MAX_CLASSES classes only while the
encodings stay within MAX_MANY_CLASS_WIDTH columns). On the 12 real tables of
the highcard suite (a categorical column of 160-1,725 levels each) it took ROC-AUC 0.788 -> 0.824, log-loss 0.467
-> 0.412 and R^2 0.401 -> 0.460 (logistic regression / ridge on one-hot columns of every level: 0.798, 0.468,
0.432); on 12 more such tables scored after this was chosen (highcard_holdout) 0.761 -> 0.768, 0.651 -> 0.647 and
0.483 -> 0.509.

Cross-fitted, as TargetEncoder.fit_transform does: a train row's encoding comes from the other folds' rows, so
its own target is not in its feature (in-sample means would let the linear part and the trees fit the targets
through the feature, most on the rarest levels). New rows get the encoding of every train row. A category not
seen at fit (preprocess.UNSEEN) gets the overall mean, a missing cell the missing train cells' mean (the overall
mean where the train rows had none): a new school is not a school of unknown name.

Tried for the linear models instead and not kept: one-hot columns of the most frequent levels (as many as a
ridge of rows x columns^2 affords): best where levels are pure random effects (a synthetic 300-level column: R^2
0.915 against 0.841 through the encoding), but on the highcard suite 0.818 / 0.414 / 0.456, and 1.6x the fit
time. The fitted encoding is one array of each column's levels (a lookup table), saved with the estimator; a
table of at most 100 levels per categorical column (every table of the 56, large and holdout suites) is not
encoded at all.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import numpy as np

from tabfm.linear_base import MAX_ONEHOT
from tabfm.preprocess import UNSEEN, Cells

MIN_LEVELS = MAX_ONEHOT + 1
"""Categorical columns of at least this many levels are encoded (those the linear part shows no one-hot)."""
MAX_CLASSES = 10
"""A classification table of up to this many classes has every column of MIN_LEVELS levels encoded, one output
per class and column."""
MAX_MANY_CLASS_WIDTH = 100
"""A table of more than MAX_CLASSES classes is encoded only while its encodings (columns x classes) stay within
this many columns: the linear model's and the trees' cost grows with their width times the classes, already the
largest factor of such a fit. One column of per-class rates up to 100 classes (a synthetic table of 12 and 20
classes whose 300-level column names each row's likely class, n_estimators="auto", three seeds: log-loss 2.26 ->
1.69 and 2.76 -> 2.05; the 10 most frequent classes and one for the rest gave 1.71 and 2.28; with 4 members and
one seed, tests/test_category_encoding.py's 20 classes: 2.74 -> 2.02)."""
N_FOLDS = 5
"""Folds of the cross-fitted train rows' encodings (TargetEncoder's default)."""


def encodes(n_columns: int, n_classes: int | None) -> bool:
    """Whether a table with n_columns categorical columns of MIN_LEVELS levels or more and n_classes classes (None:
    regression) gets their encodings: always up to MAX_CLASSES classes, and past that while the encodings, one per
    class and column, stay within MAX_MANY_CLASS_WIDTH columns."""
    return n_classes is None or n_classes <= MAX_CLASSES or n_columns * n_classes <= MAX_MANY_CLASS_WIDTH


@dataclass
class CategoryEncoding:
    """The fitted encodings of some categorical columns: tables[j, code + 2, t] is output t of category `code`
    of column columns[j] (code -1: missing, -2: a category not seen at fit, preprocess.UNSEEN)."""

    columns: np.ndarray
    """[Ce] int64 positions of the encoded categorical columns among the cells' columns."""
    tables: np.ndarray
    """[Ce, L + 2, T] float64: each column's encodings by code + 2, padded to the most levels L."""

    @classmethod
    def fit(cls, cells: Cells, targets: np.ndarray, n_classes: int | None,
            seed: int | None) -> tuple[CategoryEncoding | None, Cells]:
        """The encoding of the cells' columns of at least MIN_LEVELS categories, fitted on all their rows, and the
        cells with the rows' cross-fitted encodings (Cells.encoded); (None, cells) where no column qualifies or the
        classes are too many for them (encodes). targets: class ids 0..n_classes-1, or real targets (n_classes
        None; normalised, so that the encodings have the targets' scale). seed: the folds' (None: fresh entropy,
        as a fit of random_state=None draws; the train rows' encodings are kept, so a saved estimator does not
        need it again)."""
        from sklearn.model_selection import KFold, StratifiedKFold
        from sklearn.preprocessing import TargetEncoder

        columns = np.flatnonzero(cells.is_cat & (cells.n_cats >= MIN_LEVELS))
        if not len(columns) or not encodes(len(columns), n_classes):
            return None, cells
        classes = None if n_classes is None else len(np.unique(targets))
        target_type = "continuous" if classes is None else "binary" if classes == 2 else "multiclass"
        # stratified where every fold can hold a row of the largest class (many classes of a row or two each cannot)
        stratify = target_type != "continuous" and np.bincount(targets).max() >= N_FOLDS
        split = StratifiedKFold if stratify else KFold
        encoder = TargetEncoder(target_type=target_type, smooth="auto",
                                cv=split(N_FOLDS, shuffle=True, random_state=None if seed is None else seed % 2**32))
        codes = cells.codes[:, columns]
        with warnings.catch_warnings():  # a class of fewer rows than folds: StratifiedKFold still splits
            warnings.filterwarnings("ignore", "The least populated class", UserWarning)
            crossed = encoder.fit_transform(codes, targets)
        levels = int(cells.n_cats[columns].max())
        # every code of every column; UNSEEN as `levels`, a code no train row holds: TargetEncoder's unknown category
        lookup = np.tile(np.r_[levels, np.arange(-1, levels)][:, None], (1, len(columns)))
        table = encoder.transform(lookup)                                   # [L + 2, Ce * T], by column
        T = table.shape[1] // len(columns)
        encoding = cls(columns.astype(np.int64), np.ascontiguousarray(
            table.reshape(levels + 2, len(columns), T).transpose(1, 0, 2), np.float64))
        return encoding, dataclasses.replace(cells, encoded=np.asarray(crossed, np.float64))

    def transform(self, cells: Cells) -> Cells:
        """The cells of new rows with their encodings (Cells.encoded)."""
        codes = cells.codes[:, self.columns] - UNSEEN                       # [n, Ce]
        encoded = self.tables[np.arange(len(self.columns)), codes]          # [n, Ce, T]
        return dataclasses.replace(cells, encoded=encoded.reshape(len(codes), -1))

    def check(self, train: Cells) -> None:
        """ValueError unless this encoding fits the saved train cells: categorical columns of at least MIN_LEVELS
        categories, a table row per category and per missing and unseen code, finite encodings, and the train
        rows' encodings of its width (a saved estimator's JSON or arrays edited by hand)."""
        columns, tables = np.asarray(self.columns), np.asarray(self.tables)
        C = len(train.is_cat)
        if (columns.ndim != 1 or tables.ndim != 3 or len(tables) != len(columns) or not len(columns)
                or not np.isin(columns, np.arange(C)).all()):
            raise ValueError(f"the target encoding of columns {columns.tolist()} does not fit {C} columns")
        if not (train.is_cat[columns].all() and (train.n_cats[columns] >= MIN_LEVELS).all()
                and tables.shape[1] == train.n_cats[columns].max() + 2 and np.isfinite(tables).all()):
            raise ValueError("the target encodings do not match the categorical columns they encode")
        if train.encoded is None or train.encoded.shape != (len(train.values), len(columns) * tables.shape[2]):
            raise ValueError("the train rows' target encodings do not match the encoding")
