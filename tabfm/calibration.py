"""Calibration on held-out train rows: which rows the estimators hold out, the classifier's softmax temperature,
logistic-blend weight and trees' weight that minimise their log-loss, and the regressor's weights of the model's
correction over its ridge and of the trees (tabfm.tree_base). The predictions of the held rows are the
estimators' own (TabFMClassifier._calibrate, TabFMRegressor.fit); what is here reads only arrays, so it is tested
on its own."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

CALIBRATION_ROWS = 1000
"""Most held-out train rows the classifier's temperature is fitted on."""

CALIBRATION_CONTEXT_ROWS = 2000
"""The calibration probe's context holds at most half the train rows, but never fewer than this many (where
there are): it is a second encoding, and its cost (quadratic in its rows) is what halving saves on long tables.
Tables of up to 2,500 train rows keep every non-held row, as before."""

CALIBRATION_MEMBERS = 2
"""The calibration probe runs the ensemble's first this many members (both numeric transforms of the default
members), not all of them: the probe is a second encoding, and the temperature and blend weight are two numbers
that two members estimate as well as four (on the 56 tables with the shipped weights, ROC-AUC 0.88382 -> 0.88412
and log-loss 0.40963 -> 0.40866: benchmarks/results/accuracy_probe_2_members_step2250.csv), at half the probe's
cost. Larger ensembles (n_estimators="auto" on small tables) calibrate on a quarter of their members
(calibration_members). A classifier whose classes need more members to be decoded (more classes than the model's
head) probes with all."""


def calibration_members(n_members: int) -> int:
    """How many of an ensemble's first members predict the calibration rows: CALIBRATION_MEMBERS, or a quarter
    of a larger ensemble, so that the temperature is fitted to an average nearer the whole ensemble's in spread
    (16 members calibrated on 4 instead of 2, on the 24 tables of at most 640 rows: log-loss 0.3678 -> 0.3655 over
    their 17 classification tables, better on 8 and worse on 5; benchmarks/results/accuracy_calibration_quarter.csv).
    At most n_members."""
    return min(n_members, max(CALIBRATION_MEMBERS, n_members // 4))


def held_members(n_members: int) -> int:
    """How many of an ensemble's first members leave the calibration rows out of their local contexts and
    predict them: calibration_members where that is at most half the ensemble, so most members see every train
    row; else 0, and the ensemble calibrates through a probe. One member's predictions fitted the temperature
    worse than the two-member probe's (log-loss 0.264 vs 0.256, 0.364 vs 0.358, 0.354 vs 0.352 on three tables
    of 1,000 train rows with n_estimators=2)."""
    return calibration_members(n_members) if n_members >= 2 * CALIBRATION_MEMBERS else 0


CROSS_FIT_ROWS = 500
"""Tables of at most this many train rows calibrate on every train row (cross_fit_folds), not on a fifth of them:
there a fifth is at most 100 rows, too few to choose the weights of the logistic regression, the trees and the
correction well (skl_iris's 24 held rows gave the trees a weight its test folds did not bear out)."""

CROSS_FIT_FOLDS = 5
"""Folds of a cross-fitted calibration: each fold's rows are predicted by a probe of the other four fifths, as the
single held-out fifth of a larger table is."""


MIN_HELD_ROWS = 10
"""Fewer held rows than this: no calibration (too few to fit a temperature or a weight to)."""


def cross_fits(n: int) -> bool:
    """Whether a table of n train rows calibrates on cross-fitted folds: up to CROSS_FIT_ROWS rows, where each
    fold holds at least MIN_HELD_ROWS on average (smaller tables keep the single held-out fifth, or none)."""
    return CROSS_FIT_FOLDS * MIN_HELD_ROWS <= n <= CROSS_FIT_ROWS


def cross_fit_folds(n: int, rng: np.random.Generator, y: np.ndarray | None = None) -> list[np.ndarray]:
    """CROSS_FIT_FOLDS sorted, disjoint sets of the n train rows, each predicted from the others at calibration.
    With class ids y, stratified: each class's rows are dealt in turn to the folds, so a class's rows fall in
    different folds and a held row's class stays in the context that predicts it; the row of a class of one row
    is in no fold (always in the context, never scored: as held_out_rows leaves it). Without y, every row, in
    random folds of near-equal size."""
    if y is None:
        order = rng.permutation(n)
    else:
        classes = [np.flatnonzero(y == c) for c in range(int(y.max()) + 1)]
        order = np.concatenate([rng.permutation(rows) for rows in classes if len(rows) >= 2] + [np.empty(0, np.int64)])
    start = int(rng.integers(CROSS_FIT_FOLDS))  # which fold the first dealt row goes to
    fold = (start + np.arange(len(order))) % CROSS_FIT_FOLDS
    return [np.sort(order[fold == f]) for f in range(CROSS_FIT_FOLDS)]


def held_out_targets(n: int, rng: np.random.Generator) -> np.ndarray:
    """Sorted train rows the regressor holds out: a random 20% of its n rows, at most CALIBRATION_ROWS."""
    return np.sort(rng.choice(n, min(int(0.2 * n), CALIBRATION_ROWS), replace=False))


def correction_weight(correction: np.ndarray, residual: np.ndarray) -> float:
    """The regressor's weight in [0, 1] of the model's correction [h] (its predicted residuals of the held rows)
    given their residuals [h] (targets less the ridge's out-of-fold prediction), both in normalised units.

    The least-squares w through the origin, clipped to [0, 1], is pulled back towards 1 (the pretrained model
    as it is) by how uncertain it is: w = 1 - (1 - w_ls) x max(0, 1 - se^2 / (1 - w_ls)^2), se its standard
    error (positive-part James-Stein shrinkage, no constant to tune). A few dozen held rows give a noisy w_ls;
    on the 14 regression tables the pull took mean R^2 0.5965 -> 0.5977 and the largest loss -0.034 -> -0.024
    (benchmarks/results/accuracy_correction_weight*.csv). 1 where the corrections are all 0."""
    c, r = np.asarray(correction, np.float64), np.asarray(residual, np.float64)
    scale = float(np.dot(c, c))
    if scale <= 0:
        return 1.0
    w = float(np.clip(np.dot(c, r) / scale, 0.0, 1.0))
    gap2, se2 = (1.0 - w) ** 2, float(np.mean((r - w * c) ** 2)) / scale
    return 1.0 if gap2 == 0 else 1.0 - (1.0 - w) * max(0.0, 1.0 - se2 / gap2)


SPREAD_LEVELS = np.array([0.05, 0.1, 0.25, 0.75, 0.9, 0.95])
"""The quantile levels whose pinball loss the regressor's spread factor is fitted to (both tails and the body)."""
SPREADS = np.exp(np.linspace(np.log(0.5), np.log(2.0), 41))
"""Spread factors tried (1 among them): the predictive distribution is widened or narrowed about its mean."""


def spread_factor(mean: np.ndarray, quantiles: np.ndarray, target: np.ndarray) -> float:
    """The factor s of SPREADS whose distributions, each scaled by s about its mean, give the held rows the
    smallest pinball loss at SPREAD_LEVELS: mean [h], quantiles [h, len(SPREAD_LEVELS)] of each held row's
    predictive distribution (located as predict locates it), target [h] its true value, all in one unit.

    Why: the pretrained model's distributions are about right on average but not per table (the 80% interval
    held 74-88% of the test targets across the 14 regression tables); the pinball loss is a proper score of
    quantiles, so its minimum is the factor that makes them right for the table, not one that games a single
    level's coverage. Ties go to the factor nearest 1."""
    gap = target[:, None] - mean[:, None]                                      # [h, 1]
    spread = quantiles - mean[:, None]                                         # [h, L]
    # in units of a power of two near their largest size: exact, so the same choice, and a mean of a few hundred
    # misses near float64's limit (targets of 1e307) does not overflow
    largest = max(float(np.max(np.abs(gap), initial=0.0)), float(np.max(np.abs(spread), initial=0.0)))
    if 0.0 < largest < np.inf:
        unit = np.ldexp(1.0, int(np.frexp(largest)[1]))
        gap, spread = gap / unit, spread / unit
    losses = []
    for s in SPREADS:
        miss = gap - s * spread
        losses.append(np.mean(np.maximum(SPREAD_LEVELS * miss, (SPREAD_LEVELS - 1) * miss)))
    order = np.argsort(np.abs(np.log(SPREADS)), kind="stable")                 # 1 first, then outwards
    return float(SPREADS[order[int(np.argmin(np.asarray(losses)[order]))]])


BLEND_WEIGHTS = np.linspace(0.0, 0.9, 10)
"""The classifier's logistic-regression weights tried at calibration; below 1, so the ensemble always counts
and a class the logistic regression never saw keeps some probability."""

TEMPERATURES = np.exp(np.linspace(np.log(0.2), np.log(3.0), 41))
"""Softmax temperatures tried at calibration (the shipped model is under-confident: most tables pick 0.2-0.8)."""


def held_out_rows(y: np.ndarray, n_classes: int, rng: np.random.Generator) -> np.ndarray:
    """Sorted train rows to hold out: a stratified 20% of each class's rows (class ids y [n]), and at least one
    of every class of 2 or more rows, at most CALIBRATION_ROWS of them. A class never held out is never scored:
    the temperature could then sharpen the other classes past it (a fuzzer's table of 5 classes of 40 rows and 3
    of 1 to 4 got 0.2, and a row of a rare class p = 4e-7)."""
    held = []
    for c in range(n_classes):
        rows = np.flatnonzero(y == c)
        count = max(int(0.2 * len(rows)), 1 if len(rows) >= 2 else 0)
        held.extend(rng.choice(rows, count, replace=False))
    held = np.sort(np.asarray(held, dtype=np.int64))
    if len(held) > CALIBRATION_ROWS:
        held = np.sort(rng.choice(held, CALIBRATION_ROWS, replace=False))
    return held


def true_class_probabilities(proba_at: Callable[[float], np.ndarray], y: np.ndarray) -> np.ndarray:
    """[len(TEMPERATURES), h] the probability proba_at(temperature) [h, K] gives each held row's true class
    y [h]: all that the log-loss reads of it."""
    truth = np.arange(len(y)), y
    return np.stack([proba_at(t)[truth] for t in TEMPERATURES])


def blend_losses(model: np.ndarray, linears: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """[L, len(TEMPERATURES), len(weights)] mean log-loss of the held rows under (1 - weight) x the model's +
    weight x a linear model's probabilities, given each one's probabilities of the rows' true classes: model
    [len(TEMPERATURES), h] (true_class_probabilities), linears [L, h]. The model's side is computed once for
    every linear model it is weighed against."""
    mix = ((1 - weights)[None, None, :, None] * model[None, :, None, :]
           + weights[None, None, :, None] * linears[:, None, None, :])             # [L, T, W, h]
    return -np.log(np.clip(mix, 1e-15, None)).mean(-1)


def best_blend(ensemble: np.ndarray, linears: np.ndarray, weights: np.ndarray) -> tuple[int, float, float]:
    """(linear model, temperature, weight) of the smallest blend_losses (arguments as there); ties go to the
    first linear model, then the lowest temperature, then the lowest weight."""
    losses = blend_losses(ensemble, linears, weights)
    i, t, w = np.unravel_index(int(np.argmin(losses)), losses.shape)
    return int(i), float(TEMPERATURES[t]), float(weights[w])


TREE_WEIGHTS = np.linspace(0.0, 0.9, 10)
"""The trees' weights tried at calibration (tabfm.tree_base): below 1, so the pretrained model always counts."""


def best_tree_weight(ours: np.ndarray, trees: np.ndarray, target: np.ndarray) -> float:
    """The regressor's weight v in TREE_WEIGHTS of the smallest mean squared error of (1 - v) x ours + v x trees
    against the target (each [h], the held rows' normalised targets); ties go to the lowest weight. (The
    least-squares v pulled towards 0 by its standard error, as correction_weight pulls its weight towards 1, was
    measured and not kept: R^2 0.6252 -> 0.6241 on the 14 regression tables, docs/accuracy.md.)"""
    errors = [np.mean(((1 - v) * ours + v * trees - target) ** 2) for v in TREE_WEIGHTS]
    return float(TREE_WEIGHTS[int(np.argmin(errors))])


def best_tree_blend(ensemble: np.ndarray, linears: np.ndarray, weights: np.ndarray,
                    tree: np.ndarray) -> tuple[int, float, float, float]:
    """(linear model, temperature, linear weight, tree weight) of the smallest mean log-loss of the held rows under
    (1 - v) x ((1 - w) x the model's + w x a linear model's) + v x the trees' probabilities, v in TREE_WEIGHTS;
    ensemble and linears as in blend_losses, tree [h] the trees' probabilities of the rows' true classes. Ties go
    to the lowest tree weight, then as best_blend's."""
    best = None
    for v in TREE_WEIGHTS:
        mixed_model = (1 - v) * ensemble + v * tree[None, :]
        losses = blend_losses(mixed_model, (1 - v) * linears + v * tree[None, :], weights)
        loss = float(losses.min())
        if best is None or loss < best[0] - 1e-12:
            i, t, w = np.unravel_index(int(np.argmin(losses)), losses.shape)
            best = loss, int(i), float(TEMPERATURES[t]), float(weights[w]), float(v)
    return best[1:]
