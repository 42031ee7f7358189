"""Linear models beside the pretrained one: a ridge regression under the regressor (the model learns what it
leaves) and a logistic regression weighed into the classifier's probabilities.

Why: the pretrained model fits smooth, local structure well but linear trends over many columns poorly (a
noise-free linear target of 10 normal columns, 320 train rows: R^2 0.66, where ridge gets 1.0); the rows it has
behave like neighbours, not like a plane. So the regressor fits a ridge regression first (RidgeCV: its penalty
chosen by efficient leave-one-out), shows the model the ridge's out-of-fold residuals as the train targets, and
adds the ridge's prediction back to the model's predicted distribution. Each part does what it is good at: the
plane and the local corrections (fold 0 of the 14 regression tables in benchmarks/: mean R^2 0.43 -> 0.53).

Out-of-fold residuals, not in-sample ones: in-sample residuals are smaller than the errors the ridge makes on
new rows, so the model would learn too narrow a distribution. The ridge is kept only where it predicts better
than the mean out of fold; otherwise the base is the constant mean and the model sees the targets as before.

A plane misses curved and multiplicative structure (a price that grows as a power of size, a strength that
saturates with age, a count that peaks at two hours of the day): there a plane in the Yeo-Johnson transforms
of the numeric columns or in hinge columns of them (a piecewise-linear curve of each column), predicting the
target or its Yeo-Johnson transform (mapped back), is the better base. Which of the six a table gets is decided
the same way, out of fold on the same folds: the one whose out-of-fold predictions, in the target's units, have
the smallest squared error. The base stays a deterministic function of the row, so the model still learns what
it leaves and nothing downstream changes (a mean of transformed predictions mapped back is biased, but the
model's residuals correct the bias along with the rest).

The classifier cannot hand the model residuals of class labels, so it blends instead: (1 - w) * the ensemble's
probabilities + w * a logistic regression's, w fitted with the softmax temperature on the calibration's held-out
rows (TabFMClassifier, linear_blend); w stays 0 where the held-out rows do not prefer the blend. How the
logistic regression sees the numeric columns (LINEAR_VIEWS: as they are, Yeo-Johnson transformed, with hinge
columns) and its penalty (LOGISTIC_CS) are chosen there too.

Everything here is float64 numpy over the preprocessed cells (tabfm.preprocess.Cells), in the normalised target
units of tabfm.target_transform.TargetScale, and the fitted base is a handful of arrays (saved as such).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from tabfm.numeric_bounds import NumericBounds
from tabfm.target_transform import TargetTransform
from tabfm.yeo_johnson import YeoJohnson

N_FOLDS = 5
MIN_ROWS = 4 * N_FOLDS
"""Fewer train rows than this: no ridge, the base is the mean (too few rows for out-of-fold residuals)."""
MAX_ONEHOT = 100
"""Categorical columns of more categories than this get no one-hot columns: the design reads their target
encoding (tabfm.category_encoding), a numeric column."""
HINGE_KNOTS = 7
"""Knots per numeric column of the hinge design (LinearDesign.with_hinges), at the train values' eighths."""
HINGE_CELLS = 20_000_000
"""Largest rows x columns of a hinge design the base tries (its ridge is then the base's largest cost; past this
the hinge candidate is skipped)."""
ALPHAS = np.logspace(-5, 3, 17)
"""The ridge penalties RidgeCV chooses from (on standardised columns). Down to 1e-5: modeldata_concrete's hinge
design chose 1e-3, the lowest of an earlier grid."""
LOGISTIC_CS = (1.0, 0.1, 10.0)
"""The logistic regression's L2 penalties (C, on the standardised design) the classifier chooses from on its held
rows (TabFMClassifier._fit_temperature): its view of the columns is chosen at the first, then the penalty in that
view."""
NEWTON_MAX_WIDTH = 1024
NEWTON_MAX_PRODUCTS = 2**34
"""Two classes on a design of at most NEWTON_MAX_WIDTH columns and rows x width^2 within NEWTON_MAX_PRODUCTS:
the logistic regression is solved by Newton's method (scikit-learn's "newton-cholesky"), else by L-BFGS. Why:
hinge columns of one numeric column are strongly correlated, and L-BFGS took 465 iterations (9.2 s) on 19,000 rows
x 800 hinge columns and stopped short of the optimum (probabilities 0.02 off it), where Newton's method reached it
in 5 (1.8 s). Each Newton step forms the rows x width^2 products of the Hessian and solves a system of the width,
so past these bounds (or with more classes: the width times the classes) the cheap steps of L-BFGS cost less."""
LINEAR_VIEWS = ("plain", "power", "hinges")
"""How a linear model may see the numeric columns (LinearDesign.viewed): as they are, Yeo-Johnson transformed,
with hinge columns."""
LINEAR_POWER_ROWS = 5_000
"""Train rows (a fixed random subset, tabfm.yeo_johnson.row_subset) the "power" view's exponents are searched on:
the search's cost grows with the rows (17 s at 50,000 x 100), their precision hardly; tables of up to 5,000 rows
(every table of the 56 and the holdout suite) use every row. (The preprocessing's own "power" transform searches
on 500: preprocess.POWER_FIT_ROWS.)"""


@dataclass
class LinearDesign:
    """The columns a linear model sees, fitted on the train cells: standardised numeric columns (median-imputed,
    with a missing indicator where the train rows had missing values) and one-hot categorical columns."""

    numeric: np.ndarray
    """[Cn] positions of the numeric columns used, among Cells.numeric()'s (the target encodings after the C)."""
    peaks: np.ndarray
    """[Cn] each column's largest train magnitude (1 for an all-zero column): values are divided by it first, so
    statistics of values near float64's limits do not overflow."""
    medians: np.ndarray
    """[Cn] train medians of the divided values (imputed for missing values)."""
    means: np.ndarray
    """[Cn] train means of the imputed columns."""
    scales: np.ndarray
    """[Cn] train deviations of the imputed columns (1 for a constant column)."""
    lows: np.ndarray
    """[Cn] smallest standardised train value of each column: a new row's values are held inside [lows, highs],
    so a linear model never extrapolates past what its train rows showed (one test cell far outside them made a
    ridge predict 16 target deviations off on a 176-row table)."""
    highs: np.ndarray
    """[Cn] largest standardised train value of each column."""
    indicators: np.ndarray
    """[Cm] positions (into `numeric`) of the columns that get a missing-value indicator."""
    categorical: np.ndarray
    """[Cc] positions of the one-hot categorical columns."""
    n_cats: np.ndarray
    """[Cc] their category counts (missing / unseen: no category)."""
    squeeze: np.ndarray | None = None
    """[Cn] whether each column's values past its inliers are squeezed (tabfm.numeric_bounds: `means` and
    `scales` are then its inliers' statistics, so one extreme cell does not flatten the column for the linear
    model either); None in estimators saved before, which standardise by the plain statistics."""
    numeric_map: YeoJohnson | None = None
    """The Yeo-Johnson transform of the standardised numeric columns (fitted on the train rows' values, after
    the hold inside [lows, highs]), or None: the columns as they are."""
    hinges: np.ndarray | None = None
    """[Cn, HINGE_KNOTS] knots of each standardised numeric column (NaN: none there), or None. Each knot k adds
    the column max(0, x - k): a ridge on them fits a piecewise-linear curve of each column (an additive model),
    e.g. a count that peaks at two hours of the day, where a plane fits one slope."""

    @classmethod
    def fit(cls, cells) -> LinearDesign:
        values, is_numeric = cells.numeric()  # with the target encodings of many-level categorical columns
        numeric = np.flatnonzero(is_numeric)
        values = values[:, numeric]
        observed = ~np.isnan(values)
        peaks = np.nanmax(np.abs(values), 0, initial=0.0) if len(values) else np.zeros(len(numeric))
        peaks = np.where(peaks > 0, peaks, 1.0)
        values = values / peaks
        medians = np.array([np.median(values[observed[:, j], j]) if observed[:, j].any() else 0.0
                            for j in range(len(numeric))])
        filled = np.where(observed, values, medians)
        bounds = NumericBounds.fit(filled)
        categorical = np.flatnonzero(cells.is_cat & (cells.n_cats <= MAX_ONEHOT))
        standard = bounds.apply(filled)
        lows = standard.min(0) if len(standard) else np.zeros(len(numeric))
        highs = standard.max(0) if len(standard) else np.zeros(len(numeric))
        return cls(numeric=numeric, peaks=peaks, medians=medians, means=bounds.center, scales=bounds.spread,
                   lows=lows, highs=highs, indicators=np.flatnonzero((~observed).any(0)), categorical=categorical,
                   n_cats=cells.n_cats[categorical].astype(np.int64), squeeze=bounds.squeeze)

    def viewed(self, view: str, cells) -> LinearDesign:
        """This design in one of LINEAR_VIEWS: "plain" itself, "power" with_numeric_map, "hinges" with_hinges,
        fitted on `cells` (the train rows)."""
        if view not in LINEAR_VIEWS:
            raise ValueError(f"view must be one of {LINEAR_VIEWS}, got {view!r}")
        if view == "power":
            return self.with_numeric_map(cells)
        if view == "hinges":
            return self.with_hinges(cells)
        return self

    def views(self, rows: int | None = None) -> list[str]:
        """The LINEAR_VIEWS that differ on this design: "plain", and the others only where it has numeric
        columns (viewed gives the design itself otherwise); "hinges" only where its design of `rows` rows stays
        within HINGE_CELLS (None: no limit)."""
        if not len(self.numeric):
            return ["plain"]
        too_wide = rows is not None and rows * (self.width + len(self.numeric) * HINGE_KNOTS) > HINGE_CELLS
        return [v for v in LINEAR_VIEWS if not (v == "hinges" and too_wide)]

    def with_numeric_map(self, cells) -> LinearDesign:
        """This design with its numeric columns Yeo-Johnson transformed, the transform fitted on `cells` (the
        train rows); itself where there is no numeric column."""
        if not len(self.numeric):
            return self
        standard = np.ascontiguousarray(self._numeric(cells)[0])  # row-major, as the fit's sums always saw it
        return dataclasses.replace(self, numeric_map=YeoJohnson(LINEAR_POWER_ROWS).fit(standard))

    def with_hinges(self, cells) -> LinearDesign:
        """This design with hinge columns at the eighths of each numeric column's train values (`cells`: the
        train rows); a knot that repeats a lower one or reaches the column's largest value adds nothing (NaN).
        Itself where there is no numeric column."""
        if not len(self.numeric):
            return self
        standard = self._numeric(cells)[0]
        knots = np.quantile(standard, np.arange(1, HINGE_KNOTS + 1) / (HINGE_KNOTS + 1), axis=0).T.copy()
        for j, row in enumerate(knots):
            row[np.r_[False, np.diff(row) <= 0] | (row >= self.highs[j])] = np.nan
        return dataclasses.replace(self, hinges=knots.reshape(len(self.numeric), HINGE_KNOTS))

    @property
    def width(self) -> int:
        hinges = 0 if self.hinges is None else self.hinges.size
        return len(self.numeric) + hinges + len(self.indicators) + int(self.n_cats.sum())

    def _numeric(self, cells) -> tuple[np.ndarray, np.ndarray]:
        """([n, Cn] the numeric columns as the design shows them: standardised, held inside [lows, highs], through
        numeric_map; [n, Cn] which of their cells were missing)."""
        values = cells.numeric()[0][:, self.numeric] / self.peaks
        missing = np.isnan(values)
        filled = np.where(missing, self.medians, values)
        with np.errstate(all="ignore"):  # a test value far past the train rows may overflow: held in range
            if self.squeeze is None:
                standard = (filled - self.means) / self.scales
            else:
                standard = NumericBounds(self.means, self.scales, self.squeeze).apply(filled)
        standard = np.clip(np.nan_to_num(standard, nan=0.0, posinf=np.inf, neginf=-np.inf), self.lows, self.highs)
        if self.numeric_map is not None:
            standard = self.numeric_map.transform(standard)
        return standard, missing

    def __call__(self, cells) -> np.ndarray:
        """[n, width] float64 design matrix of the rows of `cells`."""
        standard, missing = self._numeric(cells)
        parts = [standard]
        if self.hinges is not None:
            hinge = np.maximum(standard[:, :, None] - self.hinges[None], 0.0)  # [n, Cn, K]; NaN knot: NaN
            parts.append(np.nan_to_num(hinge, nan=0.0).reshape(len(standard), -1))
        parts.append(missing[:, self.indicators].astype(np.float64))
        for c, k in zip(self.categorical, self.n_cats, strict=True):
            code = cells.codes[:, c]
            parts.append((code[:, None] == np.arange(k)).astype(np.float64))  # missing / unseen (-1): all zero
        return np.concatenate(parts, 1)


@dataclass
class LinearBase:
    """A fitted ridge regression of the normalised target on the LinearDesign of the cells."""

    design: LinearDesign
    coef: np.ndarray
    """[width] weights of the design columns (zeros: the constant base)."""
    intercept: float
    bounds: np.ndarray
    """[2] predictions are held inside the train targets' range widened by its own width on each side."""
    target_map: TargetTransform | None = None
    """The Yeo-Johnson map whose output the ridge predicts (its prediction is mapped back), or None: the ridge
    predicts the target itself (and in estimators saved before the map existed)."""

    @classmethod
    def fit(cls, cells, u: np.ndarray, random_state: int | None = 0) -> tuple[LinearBase, np.ndarray]:
        """The base fitted on all rows and its out-of-fold predictions [n] of the rows' targets u (float64): the
        constant mean, or a ridge on the design's columns as they are, Yeo-Johnson transformed or with hinge
        columns, predicting u or u's Yeo-Johnson transform (mapped back), whichever predicts u out of fold with
        the smallest squared error (the first of equals, in that order)."""
        u = np.asarray(u, np.float64)
        design = LinearDesign.fit(cells)
        span = float(np.ptp(u)) if len(u) else 0.0
        base = cls(design, np.zeros(design.width), float(u.mean()) if len(u) else 0.0,
                   np.array([u.min() - span, u.max() + span]) if len(u) else np.zeros(2))
        if len(u) < MIN_ROWS or design.width == 0 or span == 0:
            return base, np.full(len(u), base.intercept)
        power = TargetTransform("power").fit(u)
        targets = [(None, u)] + ([(power, power.transform(u))] if power.impl_ is not None else [])
        designs = [design.viewed(v, cells) for v in design.views(len(u))]  # hinges where their ridge has room
        candidates = []
        for d in designs:
            D = d(cells)
            oofs = _out_of_fold(D, np.column_stack([t for _, t in targets]), random_state)  # both targets at once
            for (target_map, fitted_on), oof in zip(targets, oofs.T, strict=True):
                oof = np.clip(oof, *base.bounds) if target_map is None else _mapped_back(target_map, oof)
                candidates.append((float(np.mean((u - oof) ** 2)), d, D, target_map, fitted_on, oof))
        error, design, D, target_map, fitted_on, oof = min(candidates, key=lambda c: c[0])
        if error >= np.var(u):  # no ridge predicts new rows better than the mean
            return base, np.full(len(u), base.intercept)
        ridge = _ridge().fit(D, fitted_on)
        base.design, base.target_map = design, target_map
        base.coef, base.intercept = np.asarray(ridge.coef_, np.float64), float(ridge.intercept_)
        return base, oof

    def predict(self, cells) -> np.ndarray:
        """[n] the base's prediction of the normalised target, inside `bounds`."""
        if not self.coef.any():
            return np.full(len(cells.values), self.intercept)
        plane = self.design(cells) @ self.coef + self.intercept
        if self.target_map is not None:
            return _mapped_back(self.target_map, plane)
        return np.clip(plane, *self.bounds)


def _mapped_back(target_map: TargetTransform, plane: np.ndarray) -> np.ndarray:
    """A plane fitted in the transformed target's units, held inside the transformed train targets' range and
    mapped back. Why held there: Yeo-Johnson's inverse grows like an exponential or a pole past that range (a
    plane 15% past the largest transformed train target came back as twice the largest target)."""
    lo, hi = target_map.transform(np.asarray(target_map.u_range_))
    return target_map.inverse(np.clip(plane, lo, hi))


@dataclass
class LogisticModel:
    """A fitted logistic regression on the LinearDesign of the cells, for the classifier's blend: the class
    probabilities of a model that does what the pretrained model does worst (a linear boundary over many
    columns), weighted against it on held-out rows (TabFMClassifier, linear_blend)."""

    design: LinearDesign
    coef: np.ndarray
    """[K', width] (K' = 1 for two classes seen, else the classes seen)."""
    intercept: np.ndarray
    """[K']"""
    classes: np.ndarray
    """[k] the class ids (0..K-1) the train rows held, in the columns' order."""
    n_classes: int

    @classmethod
    def fit(cls, cells, y: np.ndarray, n_classes: int, view: str = "plain", C: float = 1.0,
            start: LogisticModel | None = None) -> LogisticModel:
        """Fitted on the rows' class ids y (0..n_classes-1); L2 penalty C on the standardised design, its
        numeric columns in `view`, one of LINEAR_VIEWS (LinearDesign.viewed); from `start` (fit_design)."""
        return cls.fit_design(cells, y, n_classes, LinearDesign.fit(cells).viewed(view, cells), C, start)

    @classmethod
    def fit_design(cls, cells, y: np.ndarray, n_classes: int, design: LinearDesign, C: float = 1.0,
                   start: LogisticModel | None = None) -> LogisticModel:
        """Fitted on `design` (fitted on these cells). The solver begins at `start`'s weights where it has the
        same classes and width (a model of a subset of these rows, or of another penalty: the same optimum in
        fewer iterations; 128 hinge columns of 8,600 rows x 26 classes took 411 iterations from zero, 128 from
        the model of 90% of the rows), else at zero. A design without columns (every column categorical with
        more than MAX_ONEHOT categories, in a table of too many classes for their target encodings:
        category_encoding.encodes) gives the class frequencies, what a logistic regression's unpenalised intercept
        alone fits."""
        from sklearn.linear_model import LogisticRegression

        if design.width == 0:
            classes, counts = np.unique(y, return_counts=True)
            log_prior = np.log(counts / counts.sum())
            intercept = log_prior[1:] - log_prior[:1] if len(classes) == 2 else log_prior
            return cls(design, np.zeros((len(intercept), 0)), intercept, classes.astype(np.int64), n_classes)
        newton = (len(np.unique(y)) == 2 and design.width <= NEWTON_MAX_WIDTH
                  and len(y) * design.width**2 <= NEWTON_MAX_PRODUCTS)
        lr = LogisticRegression(C=C, max_iter=1000, warm_start=start is not None,
                                solver="newton-cholesky" if newton else "lbfgs")
        if start is not None and start.coef.shape[1] == design.width and np.array_equal(start.classes, np.unique(y)):
            lr.coef_, lr.intercept_ = start.coef.copy(), start.intercept.copy()  # where warm_start begins
        with warnings.catch_warnings():  # "more classes than half the rows ... a regression problem?": the
            warnings.filterwarnings("ignore", "The number of unique classes", UserWarning)  # classes are given
            lr.fit(design(cells), y)
        # row-major as save writes it back: scikit-learn's multinomial coef_ is column-major, and a product with the
        # other layout rounds differently (a fuzzer's loaded estimator moved probabilities by 1e-16)
        return cls(design, np.ascontiguousarray(lr.coef_, np.float64), np.asarray(lr.intercept_, np.float64),
                   np.asarray(lr.classes_, np.int64), n_classes)

    def predict_proba(self, cells) -> np.ndarray:
        """[n, n_classes] probabilities (0 for a class the train rows did not hold)."""
        from scipy.special import softmax

        z = self.design(cells) @ self.coef.T + self.intercept
        if len(self.classes) == 2:
            z = np.concatenate([np.zeros_like(z), z], 1)
        out = np.zeros((len(z), self.n_classes))
        out[:, self.classes] = softmax(z, axis=1)
        return out


class LinearChoice(NamedTuple):
    """How the classifier's logistic regression is fitted to all train rows, as chosen on the held rows: its
    view of the numeric columns (LINEAR_VIEWS), its penalty C, and its model of the kept rows (where the
    solver begins; None: no logistic regression was fitted)."""

    view: str
    C: float
    kept: LogisticModel | None = None


def _ridge():
    """RidgeCV over ALPHAS, its penalty chosen per target column where given several (the same fits as one
    target at a time, from one decomposition of the design)."""
    from sklearn.linear_model import RidgeCV

    return RidgeCV(alphas=ALPHAS, alpha_per_target=True)


def _out_of_fold(design: np.ndarray, u: np.ndarray, random_state: int | None) -> np.ndarray:
    """Each row's prediction [n] (or [n, T] of targets u [n, T]) by a ridge fitted without its fold. The
    estimators take any non-negative seed; KFold's RandomState takes those below 2**32, so larger ones are folded
    into that range."""
    from sklearn.model_selection import KFold, cross_val_predict

    seed = None if random_state is None else random_state % 2**32
    return cross_val_predict(_ridge(), design, u, cv=KFold(N_FOLDS, shuffle=True, random_state=seed))
