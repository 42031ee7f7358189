"""Soft bounds on each numeric column, fitted on the train rows before any scaling.

The model standardises every column by its train rows' mean and deviation, so one extreme cell (a typo, a
sentinel such as 999999 or 1e12) sets a column's deviation, and every other row of that column collapses into
one value: one cell of 1e12 among 300 rows took a separable two-class table from 0.97 to 0.61 accuracy, where a
random forest, which only compares values, stayed at 0.96. Here each column is standardised by the mean and
deviation of its inliers (the rows within DETECT_SIGMA deviations of the plain mean: a single outlier among n rows
sits near sqrt(n) deviations out, so this finds it from about 20 rows on), and values past CLIP_SIGMA inlier
deviations are squeezed into one more deviation by a tanh: the order of the rows is kept (an extreme value still
reads as the largest), their distance is not. A column whose inliers are all equal (a rare event in a column of
zeros) is left as it is: its extreme values are its information. Every numeric transform (tabfm.preprocess) starts
from these values; all of them are affine-invariant, so a column without outliers reaches the model as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DETECT_SIGMA = 4.0
"""Rows further than this many plain deviations from the plain mean do not count towards the inlier statistics."""

CLIP_SIGMA = 6.0
"""Values further than this many inlier deviations from the inlier mean are squeezed (a Gaussian column has none:
the bound is wide so that long but real tails keep their spread up to it)."""


@dataclass(frozen=True)
class NumericBounds:
    """Per column [C]: the inlier mean and deviation, and whether the column is squeezed at all."""

    center: np.ndarray
    spread: np.ndarray
    squeeze: np.ndarray

    @classmethod
    def fit(cls, x: np.ndarray) -> NumericBounds:
        """Fitted on the train rows' numeric values x [n, C] (NaN missing; finite and moderate, e.g. divided by
        each column's largest magnitude, so that squares do not overflow)."""
        seen = ~np.isnan(x)
        count = np.maximum(seen.sum(0), 1)
        mean = np.where(seen, x, 0.0).sum(0) / count
        std = np.sqrt(np.where(seen, (x - mean) ** 2, 0.0).sum(0) / count)
        inlier = seen & (np.abs(x - mean) <= DETECT_SIGMA * std)
        count_in = np.maximum(inlier.sum(0), 1)
        center = np.where(inlier, x, 0.0).sum(0) / count_in
        spread_in = np.sqrt(np.where(inlier, (x - center) ** 2, 0.0).sum(0) / count_in)
        squeeze = spread_in > 0
        center = np.where(squeeze, center, mean)
        spread = np.where(squeeze, spread_in, np.where(std > 0, std, 1.0))
        return cls(center, spread, squeeze)

    def apply(self, x: np.ndarray) -> np.ndarray:
        """x [n, C] standardised by the inlier statistics, values past CLIP_SIGMA squeezed (NaN stays NaN)."""
        z = (x - self.center) / self.spread
        return np.where(self.squeeze, squeeze_outliers(z), z)


def squeeze_outliers(z: np.ndarray) -> np.ndarray:
    """Standardised values z past CLIP_SIGMA squeezed into one more unit by a tanh, keeping their order."""
    excess = np.abs(z) - CLIP_SIGMA
    return np.where(excess > 0, np.sign(z) * (CLIP_SIGMA + np.tanh(np.maximum(excess, 0.0))), z)
