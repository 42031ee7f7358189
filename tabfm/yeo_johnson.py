"""The Yeo-Johnson power transform, its exponents fitted for all columns at once.

scikit-learn's PowerTransformer fits each column's exponent with its own scipy search (yeojohnson_normmax: a
bounded Brent search of ~14 likelihood evaluations, each a Python round trip) and transforms column by column: on
a 50,000 x 100 table that was 0.75 s of fit and 0.45 s of the members' scaling, the largest piece of host work
next to the local contexts. Here every step is one numpy operation over all columns: the same likelihood, the
same per-column bounds (scipy's, which keep the transform and its variance inside float64), searched on a grid
and refined by golden sections, so a column whose likelihood has two maxima gets the better one rather than the
one a local search falls into. On single-maximum columns (all we have met) the exponents agree with scipy's to
its tolerance (tests/test_yeo_johnson.py).

Hand-written rather than a library call because no kept library fits many Yeo-Johnson exponents at once.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import numpy as np
from sklearn.base import BaseEstimator, OneToOneFeatureMixin, TransformerMixin
from sklearn.utils.validation import check_is_fitted

GRID_POINTS = 64
"""Evaluations over each column's whole exponent range before the refinement: with one maximum, it lies between
the grid's best point's neighbours."""
TOLERANCE = 1e-9
"""Width of the final bracket around each exponent (scipy's search stops at about 1.5e-8 relative)."""
_GOLDEN = (np.sqrt(5.0) - 1) / 2
_EPS = np.finfo(np.float64).eps


class _Logs(NamedTuple):
    """The pieces every exponent's transform of some cells is built from, computed once per search or transform:
    which cells are >= 0 (and which below: NaN cells count as below and stay NaN), their signs as +-1, and
    log1p(|x|)."""
    pos: np.ndarray
    neg: np.ndarray
    sign: np.ndarray
    log_abs: np.ndarray

    def columns(self, cols: np.ndarray) -> _Logs:
        return _Logs(*(a[:, cols] for a in self))


def _logs(x: np.ndarray) -> _Logs:
    pos = x >= 0
    sign = pos.astype(np.int8)
    sign *= 2
    sign -= 1
    return _Logs(pos, ~pos, sign, np.log1p(np.abs(x)))


def _apply(logs: _Logs, lmbda: np.ndarray) -> np.ndarray:
    """Yeo-Johnson of the cells whose _logs are given, lmbda broadcast over the columns (last axis):
    ((1 + x)^l - 1) / l for x >= 0 and -((1 - x)^(2 - l) - 1) / (2 - l) below, i.e. +-expm1(p log1p|x|) / p
    with p = l or 2 - l, and +-log1p|x| where p is 0. Products with 0/1 and +-1 masks rather than np.where and
    masked ufuncs (3x faster, every value the same): this runs at every step of the exponents' search and on
    every member's rows."""
    power = np.multiply(logs.pos, lmbda)
    power += np.multiply(logs.neg, 2 - lmbda)           # exactly l or 2 - l: the other term is 0
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        out = np.multiply(power, logs.log_abs)
        np.expm1(out, out=out)
        np.divide(out, power, out=out)
    per_column = np.broadcast_to(lmbda, logs.log_abs.shape[-1:])
    for c in np.flatnonzero((np.abs(per_column) < _EPS) | (np.abs(2 - per_column) < _EPS)):
        cells = np.abs(power[..., c]) < _EPS            # a power of 0 in this column: log1p|x| there
        out[..., c][cells] = logs.log_abs[..., c][cells]
    out *= logs.sign
    return out


def yeo_johnson(x: np.ndarray, lmbdas: np.ndarray) -> np.ndarray:
    """x [n, C] transformed with exponent lmbdas[c] in column c (NaN stays NaN)."""
    x = np.asarray(x, np.float64)
    return _apply(_logs(x), np.asarray(lmbdas, np.float64))


def row_subset(x: np.ndarray, limit: int) -> np.ndarray:
    """x's rows, or a fixed random `limit` of them (seed 0, in their order) where there are more and every column
    with a value keeps one there: an exponent is pinned down well by a few thousand rows, and its search costs an
    evaluation of every cell per step (a 50,000 x 100 table took 17 s)."""
    if len(x) <= limit:
        return x
    some = x[np.sort(np.random.default_rng(0).choice(len(x), limit, replace=False))]
    observed = ~np.isnan(x)
    if ((~np.isnan(some)).any(0) | ~observed.any(0)).all():
        return some
    return x  # a sparse column has no value among them: all rows


def _bounds(x: np.ndarray, observed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """scipy's search range per column: exponents under which values up to 20x the largest observed one neither
    overflow nor underflow, and whose transform's variance stays finite (scipy.stats.yeojohnson_normmax)."""
    big = np.log1p(20 * np.nanmax(np.abs(np.where(observed, x, np.nan)), axis=0))
    log_eps = np.log(_EPS)
    low = (np.log(np.finfo(np.float64).tiny) - log_eps) / 2 / big
    high = (np.log(np.finfo(np.float64).max) + log_eps) / 2 / big
    negative = np.where(observed, x < 0, False)
    all_neg, any_neg = negative.sum(0) == observed.sum(0), negative.any(0)
    low, high = (np.where(all_neg, 2 - high, np.where(any_neg, np.maximum(2 - high, low), low)),
                 np.where(all_neg, 2 - low, np.where(any_neg, np.minimum(2 - low, high), high)))
    return low, high


def fit_lambdas(x: np.ndarray) -> np.ndarray:
    """[C] maximum-likelihood Yeo-Johnson exponents of the columns of x [n, C] over their observed (non-NaN)
    cells; 1 (the identity) for a column with fewer than two distinct values, as scikit-learn leaves it."""
    x = np.asarray(x, np.float64)
    observed = ~np.isnan(x)
    count = observed.sum(0)
    logs = _logs(x)
    # the Jacobian term of the log-likelihood: (l - 1) * sum of sign(x) log1p(|x|) over the observed cells
    jacobian = np.where(observed, logs.sign * logs.log_abs, 0.0).sum(0)

    def neg_llf(lmbda: np.ndarray) -> np.ndarray:
        y = _apply(logs, lmbda)
        if missing:
            y = np.where(observed, y, 0.0)
        with np.errstate(over="ignore", invalid="ignore"):
            mean = y.sum(0) / count
            y -= mean
            if missing:
                y = np.where(observed, y, 0.0)
            var = np.square(y, out=y).sum(0) / count
            out = count / 2 * np.log(np.where(var >= np.finfo(np.float64).smallest_normal, var, 1.0)) \
                - (lmbda - 1) * jacobian
        return np.where(np.isfinite(var) & (var >= np.finfo(np.float64).smallest_normal), out, np.inf)

    varies = (count >= 2) & (np.nanmax(np.where(observed, x, np.nan), axis=0, initial=-np.inf)
                             > np.nanmin(np.where(observed, x, np.nan), axis=0, initial=np.inf))
    lmbdas = np.ones(x.shape[1])
    if not varies.any():
        return lmbdas
    cols = np.flatnonzero(varies)
    x, observed, count = x[:, cols], observed[:, cols], count[cols]
    logs, jacobian = logs.columns(cols), jacobian[cols]
    missing = not observed.all()                          # else every np.where(observed, ...) would be a copy

    low, high = _bounds(x, observed)
    grid = low + (high - low) * np.linspace(0.0, 1.0, GRID_POINTS)[:, None]          # [G, C]
    values = np.stack([neg_llf(g) for g in grid])
    best = values.argmin(0)
    take = np.arange(len(cols))
    a = grid[np.maximum(best - 1, 0), take]
    b = grid[np.minimum(best + 1, GRID_POINTS - 1), take]
    # golden sections on [a, b], all columns in step
    c, d = b - _GOLDEN * (b - a), a + _GOLDEN * (b - a)
    fc, fd = neg_llf(c), neg_llf(d)
    while (b - a).max() > TOLERANCE:
        left = fc <= fd                                  # the minimum is in [a, d]: d becomes b, c becomes d
        a, b = np.where(left, a, c), np.where(left, d, b)
        c_new, d_new = b - _GOLDEN * (b - a), a + _GOLDEN * (b - a)
        probe = np.where(left, c_new, d_new)
        f_probe = neg_llf(probe)
        c, d = np.where(left, c_new, d), np.where(left, c, d_new)
        fc, fd = np.where(left, f_probe, fd), np.where(left, fc, f_probe)
    lmbdas[cols] = (a + b) / 2
    return lmbdas


class YeoJohnson(OneToOneFeatureMixin, TransformerMixin, BaseEstimator):
    """Yeo-Johnson with maximum-likelihood exponents per column, then standardised to zero mean and unit variance
    over the fit rows (scikit-learn's PowerTransformer(method="yeo-johnson"), fitted all columns at once). NaN
    cells are ignored at fit and stay NaN. With `fit_rows`, the exponents are searched on at most that many rows
    (row_subset) and the standardisation uses every row."""

    def __init__(self, fit_rows: int | None = None):
        self.fit_rows = fit_rows

    def fit(self, X: np.ndarray, y: object = None) -> YeoJohnson:
        X = np.asarray(X, np.float64)
        if X.ndim != 2:
            raise ValueError(f"YeoJohnson takes a 2-d array [rows, columns], got shape {X.shape}")
        self.n_features_in_ = X.shape[1]
        self.lambdas_ = fit_lambdas(X if self.fit_rows is None else row_subset(X, self.fit_rows))
        Y = yeo_johnson(X, self.lambdas_)
        with np.errstate(invalid="ignore", over="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN column: its mean and scale are set below
            mean, std = np.nanmean(Y, axis=0), np.nanstd(Y, axis=0)
        self.mean_ = np.where(np.isfinite(mean), mean, 0.0)
        self.scale_ = np.where(np.isfinite(std) & (std > 10 * _EPS * np.maximum(np.abs(mean), 1.0)), std, 1.0)
        return self

    def _check(self, X: np.ndarray) -> np.ndarray:
        check_is_fitted(self, "lambdas_")
        X = np.asarray(X, np.float64)
        if X.ndim != 2 or X.shape[1] != self.n_features_in_:
            raise ValueError(f"X has shape {X.shape}, but YeoJohnson was fitted on {self.n_features_in_} columns")
        return X

    def transform(self, X: np.ndarray) -> np.ndarray:
        out = yeo_johnson(self._check(X), self.lambdas_)
        out -= self.mean_
        out /= self.scale_
        return out

    def inverse_transform(self, X: np.ndarray) -> np.ndarray:
        """x from standardised transformed values; NaN where a value lies outside the transform's range."""
        y = self._check(X) * self.scale_ + self.mean_
        up, down = self.lambdas_, 2 - self.lambdas_
        pos = y >= 0
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            x_pos = np.where(np.abs(up) < _EPS, np.expm1(y), np.power(y * up + 1, 1 / np.where(up == 0, 1, up)) - 1)
            x_neg = np.where(np.abs(down) < _EPS, -np.expm1(-y),
                             1 - np.power(1 - down * y, 1 / np.where(down == 0, 1, down)))
        return np.where(pos, x_pos, x_neg)

