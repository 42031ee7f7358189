"""Calibration (tabfm.calibration): which rows the estimators hold out, the classifier's temperature and blend
weight, and the regressor's correction weight, picked from the held rows' predictions."""

from __future__ import annotations

import numpy as np

from scipy.stats import norm
from sklearn.metrics import log_loss

from tabfm.calibration import (CALIBRATION_ROWS, CROSS_FIT_FOLDS, CROSS_FIT_ROWS, SPREAD_LEVELS, SPREADS,
                               TEMPERATURES, best_blend, blend_losses, calibration_members, correction_weight,
                               cross_fit_folds, cross_fits, held_members, held_out_rows, held_out_targets,
                               spread_factor, true_class_probabilities)


def test_held_out_rows_are_a_stratified_fifth_capped_at_calibration_rows():
    y = np.repeat([0, 1, 2], [500, 300, 200])
    held = held_out_rows(y, 3, np.random.default_rng(0))
    assert np.all(np.diff(held) > 0)                                  # sorted, no repeats
    assert [int((y[held] == c).sum()) for c in range(3)] == [100, 60, 40]
    many = held_out_rows(np.zeros(20_000, np.int64), 1, np.random.default_rng(0))
    assert len(many) == CALIBRATION_ROWS and len(np.unique(many)) == CALIBRATION_ROWS

    rare = np.repeat([0, 1, 2, 3, 4], [50, 4, 3, 2, 1])  # classes of 2 to 4 rows are scored too; a single row stays
    held = held_out_rows(rare, 5, np.random.default_rng(0))
    assert [int((rare[held] == c).sum()) for c in range(5)] == [10, 1, 1, 1, 0]


def _softmax(logits: np.ndarray, t: float) -> np.ndarray:
    z = np.exp(logits / t - (logits / t).max(1, keepdims=True))
    return z / z.sum(1, keepdims=True)


def test_the_temperature_that_generated_the_labels_is_recovered():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(4000, 3)) * 2
    truth_t = TEMPERATURES[25]
    p = _softmax(logits, truth_t)
    y = np.array([rng.choice(3, p=row) for row in p])
    _, t, w = best_blend(true_class_probabilities(lambda t: _softmax(logits, t), y), np.zeros((1, len(y))),
                         np.zeros(1))
    assert w == 0.0 and abs(np.log(t) - np.log(truth_t)) < 0.15      # within about two grid steps


def test_the_blend_goes_to_the_better_model_and_ties_to_the_lowest_values():
    y = np.array([0, 1] * 50)
    good = np.eye(2)[y] * 0.9 + 0.05                                   # the linear model is right
    coin = np.full((100, 2), 0.5)                                      # the ensemble knows nothing, at any t
    _, t, w = best_blend(true_class_probabilities(lambda t: coin, y), good[np.arange(100), y][None],
                         np.linspace(0.0, 0.9, 10))
    assert w == 0.9 and t == TEMPERATURES[0]                           # every t ties: the lowest


def test_blend_losses_of_several_linear_models_are_each_ones_log_loss():
    """blend_losses reads only the true classes' probabilities and scores every linear model against the
    model's once: each entry is the log-loss of that blend of the full probability matrices."""
    rng = np.random.default_rng(3)
    logits, y = rng.normal(size=(60, 4)), rng.integers(0, 4, 60)
    linears = rng.dirichlet(np.ones(4), size=(3, 60))                 # [L, h, K]
    weights = np.linspace(0.0, 0.9, 10)
    losses = blend_losses(true_class_probabilities(lambda t: _softmax(logits, t), y),
                          linears[:, np.arange(60), y], weights)
    assert losses.shape == (3, len(TEMPERATURES), 10)
    for i, j, k in [(0, 0, 0), (1, 17, 3), (2, 40, 9)]:
        blend = (1 - weights[k]) * _softmax(logits, TEMPERATURES[j]) + weights[k] * linears[i]
        assert np.isclose(losses[i, j, k], log_loss(y, blend, labels=range(4)), rtol=1e-12)


def test_cross_fitted_folds_hold_every_row_once_in_near_equal_random_folds():
    folds = cross_fit_folds(103, np.random.default_rng(0))
    assert len(folds) == CROSS_FIT_FOLDS and all(np.all(np.diff(f) > 0) for f in folds)
    assert np.array_equal(np.sort(np.concatenate(folds)), np.arange(103))  # every row, in exactly one fold
    assert sorted(map(len, folds)) == [20, 20, 21, 21, 21]
    assert not np.array_equal(folds[0], np.arange(len(folds[0])))       # drawn, not the first rows
    again = cross_fit_folds(103, np.random.default_rng(0))
    assert all(np.array_equal(a, b) for a, b in zip(folds, again, strict=True))


def test_cross_fitted_folds_of_classes_spread_each_class_and_leave_a_single_row_out():
    y = np.repeat([0, 1, 2, 3, 4], [50, 12, 5, 2, 1])
    folds = cross_fit_folds(len(y), np.random.default_rng(3), y)
    held = np.concatenate(folds)
    assert len(np.unique(held)) == len(held) == len(y) - 1 and not np.isin(np.flatnonzero(y == 4), held).any()
    counts = np.array([[int((y[f] == c).sum()) for c in range(4)] for f in folds])  # [fold, class]
    assert (counts.max(0) - counts.min(0) <= 1).all()               # each class dealt evenly over the folds
    assert counts[:, 3].sum() == 2 and counts[:, 3].max() == 1        # a class of two rows: in two folds
    for f in folds:                                                   # a held row's class is in its context
        kept = np.setdiff1d(np.arange(len(y)), f)
        assert np.isin(y[f], y[kept]).all()
    assert sorted(map(len, folds)) == [13, 14, 14, 14, 14]


def test_tables_cross_fit_up_to_cross_fit_rows_where_each_fold_holds_ten_rows():
    assert not cross_fits(49) and cross_fits(50) and cross_fits(CROSS_FIT_ROWS) and not cross_fits(CROSS_FIT_ROWS + 1)


def test_the_regressor_holds_out_a_random_fifth_capped_at_calibration_rows():
    held = held_out_targets(500, np.random.default_rng(0))
    assert len(held) == 100 and np.all(np.diff(held) > 0) and held[-1] < 500
    assert not np.array_equal(held, np.arange(100))                    # drawn, not the first rows
    assert len(held_out_targets(20_000, np.random.default_rng(0))) == CALIBRATION_ROWS


def test_the_correction_weight_is_least_squares_clipped_to_0_1_and_pulled_to_1_by_its_error():
    rng = np.random.default_rng(2)
    c = rng.normal(size=4000)
    assert abs(correction_weight(c, 0.3 * c + 0.2 * rng.normal(size=4000)) - 0.3) < 0.01  # se tiny: no pull
    c40, r40 = c[:40], 0.3 * c[:40] + rng.normal(size=40)               # se about 0.16: pulled towards 1
    w_ls = float(np.dot(c40, r40) / np.dot(c40, c40))
    se2 = float(np.mean((r40 - w_ls * c40) ** 2) / np.dot(c40, c40))
    assert 0 < w_ls < 1 and 0 < se2 < (1 - w_ls) ** 2
    assert np.isclose(correction_weight(c40, r40), 1 - (1 - w_ls) * (1 - se2 / (1 - w_ls) ** 2))
    noise = rng.normal(size=40)
    noise -= np.dot(noise, c40) / np.dot(c40, c40) * c40                   # w_ls = 0.9 exactly, se^2 > 0.1^2
    assert correction_weight(c40, 0.9 * c40 + noise) == 1.0                  # within its error of 1: not moved
    noise = rng.normal(size=4000)                                       # corrections that predict nothing
    assert correction_weight(c, noise) < 0.05
    assert correction_weight(c, -c) < 1e-3 and correction_weight(c, 2 * c) == 1.0
    assert correction_weight(np.zeros(5), rng.normal(size=5)) == 1.0    # no correction to weigh


def test_larger_ensembles_calibrate_on_a_quarter_of_their_members():
    assert [calibration_members(n) for n in (1, 2, 3, 4, 8, 11, 12, 16)] == [1, 2, 2, 2, 2, 2, 3, 4]
    assert [held_members(n) for n in (1, 2, 3, 4, 8, 12, 16)] == [0, 0, 0, 2, 2, 3, 4]  # at most half of them


def test_the_spread_factor_is_the_one_that_makes_the_quantiles_right():
    """Each row predicted as N(its mean, 1): targets spread 1.5 (or 0.7) around the means want the distributions
    widened (narrowed) by about that factor; spread 1 keeps them; past the grid, its end."""
    rng = np.random.default_rng(0)
    mean = rng.normal(size=4000) * 3
    quantiles = mean[:, None] + norm.ppf(SPREAD_LEVELS)[None]
    for sigma in (0.7, 1.0, 1.5):
        s = spread_factor(mean, quantiles, mean + sigma * rng.normal(size=4000))
        assert abs(np.log(s / sigma)) < 0.05, (sigma, s)
    assert spread_factor(mean, quantiles, mean + 5 * rng.normal(size=4000)) == SPREADS.max() == 2.0
    assert spread_factor(mean, quantiles, mean) == SPREADS.min() == 0.5
    assert spread_factor(mean, np.repeat(mean[:, None], len(SPREAD_LEVELS), 1), mean + 1.0) == 1.0  # no spread: tie


def test_the_spread_factor_does_not_depend_on_the_targets_unit_and_survives_targets_near_float64s_limit():
    """The pinball loss's minimum does not move with the unit: the same factor for targets in any unit, also where
    the misses of a few hundred rows summed past float64's limit (targets of 1e307 once gave an overflow)."""
    rng = np.random.default_rng(1)
    mean = rng.normal(size=400)
    quantiles = mean[:, None] + 1.3 * norm.ppf(SPREAD_LEVELS)[None]
    target = mean + rng.normal(size=400)
    chosen = spread_factor(mean, quantiles, target)
    assert 0.7 < chosen < 0.85
    with np.errstate(all="raise"):
        for unit in (1e-3, 3.0, 1e150, 1e306):
            assert spread_factor(mean * unit, quantiles * unit, target * unit) == chosen, unit
