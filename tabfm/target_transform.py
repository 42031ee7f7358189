"""Regression targets: normalised in float64 before the model, transformed per member, mapped back exactly.

The model predicts a binned distribution over the target standardised with its train rows (TabFM.bin_edges,
+-bin_range deviations). What the model is shown, per member:

    y  ->  u = (y - center) / scale          float64, so targets of any magnitude (1e-30 .. 1e300) fit float32;
                                             center and scale are the inliers' (tabfm.numeric_bounds), so one
                                             extreme target does not flatten the others (the regressor then
                                             squeezes its train targets past 6 units)
       ->  t = T_m(u)                        T_m: "none", "power" (Yeo-Johnson) or "quantile" (to a normal),
                                             fitted on the train targets: skewed or heavy-tailed targets fill
                                             the bins instead of crowding a few of them

and a predicted distribution over t is mapped back through T_m^-1 at many points inside each bin, so the mean,
the quantiles and the CDF in target units are those of the model's distribution (within the resolution of
SUBPOINTS per bin), not of its mean pushed through a non-linear map.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from tabfm.numeric_bounds import NumericBounds
from tabfm.preprocess import array_output

TARGET_TRANSFORMS = ("none", "power", "quantile")
SUBPOINTS = 8
"""Points per bin at which a member's distribution is mapped back to target units."""


@dataclass
class TargetScale:
    """y = center + scale * u, in float64; `scale` is 1 for a constant target."""

    center: float
    scale: float

    @classmethod
    def fit(cls, y: np.ndarray) -> TargetScale:
        y = np.asarray(y, np.float64)
        peak = float(np.max(np.abs(y)))
        if peak == 0:
            return cls(0.0, 1.0)
        bounds = NumericBounds.fit((y / peak)[:, None])  # / peak: no overflow in the variance of targets near 1e300
        center, spread = float(bounds.center[0]), float(bounds.spread[0])  # the inliers': tabfm.numeric_bounds
        return cls(center * peak, spread * peak if spread > 0 else peak)

    def forward(self, y: np.ndarray) -> np.ndarray:
        return (np.asarray(y, np.float64) - self.center) / self.scale

    def inverse(self, u: np.ndarray) -> np.ndarray:
        return self.center + self.scale * u


class TargetTransform:
    """A monotone map T of the normalised target, fitted on the train targets, with an inverse defined on the
    whole real line (values beyond the fitted range map to the range's ends, never to NaN)."""

    def __init__(self, kind: str):
        if kind not in TARGET_TRANSFORMS:
            raise ValueError(f"unknown target transform {kind!r}; choose from {TARGET_TRANSFORMS}")
        self.kind = kind

    def fit(self, u: np.ndarray) -> TargetTransform:
        from sklearn.preprocessing import QuantileTransformer

        from tabfm.yeo_johnson import YeoJohnson

        u = np.asarray(u, np.float64).reshape(-1, 1)
        self.impl_ = None
        if self.kind == "power" and np.ptp(u) > 0:
            with warnings.catch_warnings(), array_output():
                warnings.simplefilter("ignore", RuntimeWarning)
                self.impl_ = YeoJohnson().fit(u)
        elif self.kind == "quantile" and np.ptp(u) > 0:
            with array_output():
                self.impl_ = QuantileTransformer(output_distribution="normal",
                                                 n_quantiles=max(2, min(1000, len(u))), subsample=None,
                                                 random_state=0).fit(u)
        self.u_range_ = (float(u.min()), float(u.max()))
        return self

    def transform(self, u: np.ndarray) -> np.ndarray:
        if self.impl_ is None:
            return np.asarray(u, np.float64)
        with warnings.catch_warnings(), array_output():
            warnings.simplefilter("ignore", RuntimeWarning)
            return self.impl_.transform(np.asarray(u, np.float64).reshape(-1, 1)).reshape(np.shape(u))

    def inverse(self, t: np.ndarray) -> np.ndarray:
        """T^-1 on the whole real line, monotone: where Yeo-Johnson's inverse leaves its domain (NaN) or runs
        far past the train targets, it is held at the train range widened by its own width on each side (the
        quantile transform's inverse stays inside the train range by construction)."""
        t = np.asarray(t, np.float64)
        if self.impl_ is None:
            return t
        with warnings.catch_warnings(), array_output():
            warnings.simplefilter("ignore", RuntimeWarning)
            u = self.impl_.inverse_transform(t.reshape(-1, 1)).reshape(t.shape)
        if self.kind == "power":
            lo, hi = self.u_range_
            width = hi - lo
            u = np.where(np.isnan(u), np.where(t > 0, np.inf, -np.inf), u)
            u = np.clip(u, lo - width, hi + width)
        return u


def bin_points(edges: np.ndarray, subpoints: int = SUBPOINTS) -> np.ndarray:
    """[num_bins, subpoints] evenly spaced points inside each bin (midpoints of equal sub-intervals)."""
    lo, hi = edges[:-1, None], edges[1:, None]
    frac = (np.arange(subpoints) + 0.5) / subpoints
    return lo + (hi - lo) * frac


def sub_edges(edges: np.ndarray, subpoints: int = SUBPOINTS) -> np.ndarray:
    """[num_bins * subpoints + 1] edges of `subpoints` equal sub-intervals of every bin (bin_points are their
    midpoints)."""
    lo, hi = edges[:-1, None], edges[1:, None]
    inner = lo + (hi - lo) * (np.arange(subpoints) / subpoints)
    return np.append(inner.ravel(), edges[-1])


def mapped_mean(probs: np.ndarray, points_y: np.ndarray) -> np.ndarray:
    """Mean in target units [n] of a binned distribution probs [n, nb] whose bins' points map to points_y
    ([nb, S] for every row, or [n, nb, S] per row; uniform density inside a bin). Each point is divided before
    the sums, so targets near the float64 limit (1e307) do not overflow them: every partial sum stays within the
    largest point."""
    return (probs * (points_y / points_y.shape[-1]).sum(-1)).sum(-1)


def mixture_quantiles(probs: list[np.ndarray], edges_y: list[np.ndarray], q: np.ndarray,
                      weights: np.ndarray | None = None) -> np.ndarray:
    """Quantiles [n, Q] of the mixture of the members' binned distributions, weighted by weights [K, n] (each
    row's summing to 1; None: equal weights).

    probs[m] [n, nb]: member m's bin probabilities; edges_y[m]: the member's sub-bin edges mapped to target units
    (monotone), [nb * S + 1] shared by all rows or [n, nb * S + 1] per row (a member whose rows came from
    different contexts). Each member's CDF is linear between its mapped sub-edges; the mixture's CDF is evaluated
    on the union of all members' edges and inverted by linear interpolation. Edges beyond 2^1000 in magnitude
    (targets near the float64 limit) are divided by 2^64 first and the quantiles multiplied back, exactly, so that
    the differences of edges cannot overflow."""
    if max(float(np.max(np.abs(e))) for e in edges_y) > 2.0 ** 1000:
        return 2.0 ** 64 * mixture_quantiles(probs, [np.asarray(e) * 2.0 ** -64 for e in edges_y], q, weights)
    n = probs[0].shape[0]
    edges = [np.broadcast_to(e, (n, np.shape(e)[-1])) for e in edges_y]
    grid = np.ascontiguousarray(np.sort(np.concatenate(edges, axis=1), axis=1))  # [n, G], C order
    cdf = np.zeros_like(grid)
    rows = np.arange(n)[:, None]
    for c, (p, e) in enumerate(zip(probs, edges, strict=True)):                # c: the mixture's component
        S = (e.shape[1] - 1) // p.shape[1]
        cum = np.concatenate([np.zeros((n, 1)), np.cumsum(np.repeat(p / S, S, axis=1), 1)], 1)  # at edges e
        idx = torch.searchsorted(torch.from_numpy(np.array(e, order="C")), torch.from_numpy(grid), right=True)
        idx = np.clip(idx.numpy() - 1, 0, e.shape[1] - 2)
        lo, hi = e[rows, idx], e[rows, idx + 1]
        with np.errstate(over="ignore"):  # a point past an empty sub-bin: inf, which the clip makes 1
            frac = np.clip((grid - lo) / np.maximum(hi - lo, 1e-300), 0, 1)
        part = cum[rows, idx] + (cum[rows, idx + 1] - cum[rows, idx]) * frac
        cdf += part if weights is None else np.asarray(weights[c], np.float64)[:, None] * part
    if weights is None:
        cdf /= len(probs)
    out = np.empty((n, len(q)))
    for j, qj in enumerate(np.asarray(q, np.float64)):
        k = np.clip((cdf < qj).sum(1), 1, grid.shape[1] - 1)[:, None]      # first grid point with cdf >= q
        c0, c1 = np.take_along_axis(cdf, k - 1, 1), np.take_along_axis(cdf, k, 1)
        g0, g1 = np.take_along_axis(grid, k - 1, 1), np.take_along_axis(grid, k, 1)
        frac = np.clip((qj - c0) / np.maximum(c1 - c0, 1e-300), 0, 1)
        out[:, j] = (g0 + frac * (g1 - g0))[:, 0]
    return out

