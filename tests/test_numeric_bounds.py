"""tabfm.numeric_bounds: one extreme train cell no longer sets a numeric column's scale (a fuzzer's finding: one
cell of 1e12 took a separable table from 0.97 to 0.61 accuracy), while columns without outliers reach the model
as before."""

from __future__ import annotations

import numpy as np
import pytest

from tabfm.estimator import TabFMClassifier
from tabfm.regressor import TabFMRegressor
from tabfm.numeric_bounds import CLIP_SIGMA, NumericBounds
from tabfm.preprocess import TablePreprocessor
from tabfm.target_transform import TargetScale


def test_one_extreme_cell_is_squeezed_and_the_other_rows_keep_their_spread():
    x = np.random.default_rng(0).normal(size=(300, 1))
    x[7, 0] = 1e12
    bounds = NumericBounds.fit(x / 1e12)  # as the preprocessor passes it: divided by the largest magnitude
    z = bounds.apply(x / 1e12)[:, 0]
    others, raw = np.delete(z, 7), np.delete(x[:, 0], 7)
    np.testing.assert_allclose(others, (raw - raw.mean()) / raw.std(), atol=1e-6)  # standardised as if alone
    assert CLIP_SIGMA < z[7] <= CLIP_SIGMA + 1 and z[7] > others.max()  # still the largest, by at most one deviation


@pytest.mark.parametrize("column", [
    np.random.default_rng(1).normal(5.0, 3.0, 500),  # Gaussian: nothing past 6 inlier deviations
    np.r_[np.zeros(290), np.ones(10)],  # rare ones: outliers of the plain deviation, but the inliers are all 0
    np.r_[np.zeros(299), 1e9],  # one event in a column of zeros: its only information
])
def test_columns_without_outliers_are_only_standardised(column):
    x = column[:, None].copy()
    x[3, 0] = np.nan
    z = NumericBounds.fit(x).apply(x)
    assert np.isnan(z[3, 0])
    seen = ~np.isnan(x[:, 0])
    a, b = np.polyfit(x[seen, 0], z[seen, 0], 1)  # an affine map of the column, increasing
    assert a > 0
    np.testing.assert_allclose(z[seen, 0], a * x[seen, 0] + b, atol=1e-9 * np.abs(z[seen]).max())


@pytest.mark.parametrize("transforms", [("none", "power"), ("quantile",)])
def test_one_extreme_train_cell_does_not_wipe_out_the_column(transforms):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(400, 4))
    y = (X[:, 0] + 0.5 * X[:, 1] > 0).astype(int)
    clean = TabFMClassifier(n_estimators=2, numeric_transforms=transforms).fit(X[:200], y[:200])
    X[3, 0] = 1e12
    dirty = TabFMClassifier(n_estimators=2, numeric_transforms=transforms).fit(X[:200], y[:200])
    acc_clean, acc_dirty = clean.score(X[200:], y[200:]), dirty.score(X[200:], y[200:])
    assert acc_clean > 0.9 and acc_dirty > acc_clean - 0.03, (acc_clean, acc_dirty)  # it read 0.61 before
    scaled = dirty.preprocessor_.scale(dirty.preprocessor_.transform(X[200:]), transforms[0])[:, 0]
    assert len(np.unique(scaled.astype(np.float32))) > 150  # the test rows keep their own values in float32


def test_the_quantile_transform_keeps_a_column_with_an_extreme_value_apart():
    """After the division by the largest magnitude, QuantileTransformer's absolute tolerance merged every ordinary
    value of an amount column with one 1e8 into one quantile."""
    x = np.r_[np.linspace(0.0, 5.0, 299), 1e8][:, None]
    pre = TablePreprocessor(transforms=("quantile",)).fit(x)
    assert len(np.unique(pre.scale(pre.transform(x), "quantile")[:, 0])) == 300


def test_one_extreme_regression_target_does_not_set_the_scale():
    """A fuzzer's finding: one target of 1e9 among values of about 1 put the median prediction 665 off the clean
    signal and the mean 4e5 (a random forest: 0.1); the target is now scaled by its inliers and the outlier
    squeezed like a feature's."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(400, 4))
    signal = X[:, 0] + 0.5 * X[:, 1] ** 2
    y = signal.copy()
    y[5] = 1e9
    scale = TargetScale.fit(y[:200])
    assert abs(scale.scale - np.delete(y[:200], 5).std()) < 1e-9 * scale.scale
    est = TabFMRegressor(n_estimators=2).fit(X[:200], y[:200])
    error = np.abs(est.predict(X[200:]) - signal[200:])
    assert np.median(error) < 0.3, np.median(error)
    assert error.max() < 10  # nothing near the outlier's 1e9
