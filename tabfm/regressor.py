"""TabFMRegressor: in-context regression with the pretrained model (the shared machinery is tabfm.estimator's).

The targets are normalised in float64, a ridge regression is fitted under the model (tabfm.linear_base: the model
learns its out-of-fold residuals), the residuals are transformed per member (tabfm.target_transform), and each
member's binned distribution is mapped back to target units exactly, the ridge's prediction added. With local
contexts and 4+ members, the weight of the model's correction over the ridge is fitted on held-out train rows
(tabfm.calibration.correction_weight): where the residuals are noise, the model's neighbours-driven corrections
are too, and the weight takes them back towards the ridge. The same held rows fit how wide the distributions are
(tabfm.calibration.spread_factor), which the quantiles read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from sklearn.base import RegressorMixin
from sklearn.utils.validation import column_or_1d

from tabfm import calibration
from tabfm.ensemble import NARROW_MAX_FEATURES
from tabfm.estimator import _BASE_CONSTRAINTS, _VIEW_LIST, _TabFMBase
from tabfm.estimator_calls import fit_or_keep, threaded
from tabfm.inference import Context
from tabfm.linear_base import LinearBase
from tabfm.model import TabFM
from tabfm.numeric_bounds import squeeze_outliers
from tabfm.preprocess import Cells
from tabfm.raw_columns import check_table_shape, unmask
from tabfm.table_threads import host_work
from tabfm.target_transform import (TargetScale, TargetTransform, bin_points, mapped_mean, mixture_quantiles,
                                    sub_edges)
from tabfm.tree_fits import TreeFits
from tabfm.validation import check_real_targets


MAX_TARGET = 1e307
"""Largest target magnitude: the bins of a prediction reach beyond the train targets, and their ends, the ridge's
part and the model's must all stay below float64's limit (1.8e308)."""


class TabFMRegressor(RegressorMixin, _TabFMBase):
    """In-context regression with the pretrained tabular model; scikit-learn API.

    The targets are normalised in float64 before the model (any magnitude works) and, per member, transformed
    (tabfm.target_transform); each member's predicted distribution is mapped back to target units exactly.
    `predict` gives the mean of the members' mixture, `predict_quantiles` its quantiles.

    Parameters are those of TabFMClassifier (without average, softmax_temperature and linear_blend; calibrate
    and tree_blend have their own meaning here), and:

    target_transforms : tuple of {"none", "power", "quantile"}, default=("none", "power")
        Transforms of the (normalised) target, cycled over the members.
    linear_base : bool, default=True
        Fit a ridge regression first and show the model its out-of-fold residuals; predictions add the ridge
        back (tabfm.linear_base). The model alone fits linear trends over many columns poorly. The ridge sees the
        numeric columns as they are, Yeo-Johnson transformed or with hinge columns (a piecewise-linear curve of
        each), and predicts the target or its Yeo-Johnson transform (mapped back), whichever of the six predicts
        held-out folds best.
    calibrate : bool, default=True
        Weigh the model's correction over the ridge (over the targets' centre without linear_base) by a w in
        [0, 1] fitted on held-out train rows (20%, at most 1,000), predicted by the first two members, whose
        local contexts leave them out at no extra cost: the distribution's location moves to
        ridge + w x the model's correction. The same rows fit a spread factor s in [0.5, 2]: each distribution
        is widened or narrowed by s about its mean, s minimising the rows' pinball loss at six quantile levels
        (tabfm.calibration.spread_factor; predict is unchanged, predict_quantiles moves). With local contexts and
        at least 4 members the held rows are predicted by members whose contexts leave them out; otherwise (small
        tables, fewer members, one global context) by a probe as the classifier's: the first members fitted on the
        other rows, half of one more encoding at most; there, on tables of at most 500 train rows, every row is
        held, in five folds each predicted by a probe of the others (tabfm.calibration.CROSS_FIT_ROWS).
    tree_blend : bool, default=True
        With calibrate, also fit gradient-boosted trees (scikit-learn's HistGradientBoostingRegressor) on the
        other train rows and weigh them in: predictions (and quantiles, moved with them) become (1 - v) x the
        model's + v x the trees', v in 0..0.9 the held rows' least squared error (v = 0 where the trees do not
        help them); the trees are then fitted on every train row (tabfm.tree_base). On the 14 regression tables
        (5 folds) R^2 0.6092 -> 0.6233 (better on 10, worse on 1; islp_bikeshare 0.79 -> 0.92), for two tree
        fits at fit.
    mix_contexts : bool, default=False
        As the classifier's: a test row near the edge of a member's local context is also predicted from that
        member's second context, and the member's distribution is the mixture of the two (each in its own
        context's bins), weighted by the votes of the row's 16 nearest train rows.
    """

    _task = "regression"
    _wide_max_features: int = NARROW_MAX_FEATURES
    """max_features="auto" keeps subsets of 24 on tables wider than the model too: the ridge base reads every column
    and the model learns what it leaves, and 64 lost R^2 on 3 of the 4 such regression tables of the wide suites
    (tabfm.ensemble.WIDE_MAX_FEATURES)."""
    _parameter_constraints: dict = {**_BASE_CONSTRAINTS, "target_transforms": _VIEW_LIST, "linear_base": ["boolean"],
                                    "calibrate": ["boolean"], "mix_contexts": ["boolean"], "tree_blend": ["boolean"]}

    def __init__(self, n_estimators: int | str = "auto", *, numeric_transforms: tuple[str, ...] = ("none", "power"),
                 categorical_views: tuple[str, ...] = ("ordinal",), max_features: int | str | None = "auto",
                 checkpoint: str | Path | None = None, categorical_features: str | list[int | str] = "auto",
                 max_context_rows: int | None = None, batch_size: int = 1024, device: str = "cpu",
                 dtype: str = "float32", precision: str = "auto", tensor_parallel: tuple[int, int] | None = None,
                 sequence_parallel: bool = True,
                 random_state: int | np.random.RandomState | np.random.Generator | None = 0, verbose: bool = False,
                 n_jobs: int | None = None, local_context_rows: int | None = 256,
                 target_transforms: tuple[str, ...] = ("none", "power"), linear_base: bool = True,
                 calibrate: bool = True, mix_contexts: bool = False, tree_blend: bool = True):
        super().__init__(n_estimators, numeric_transforms=numeric_transforms, categorical_views=categorical_views,
                         max_features=max_features, checkpoint=checkpoint,
                         categorical_features=categorical_features, max_context_rows=max_context_rows,
                         batch_size=batch_size, device=device, dtype=dtype, precision=precision,
                         tensor_parallel=tensor_parallel,
                         sequence_parallel=sequence_parallel, random_state=random_state, verbose=verbose,
                         n_jobs=n_jobs, local_context_rows=local_context_rows)
        self.target_transforms = target_transforms
        self.linear_base = linear_base
        self.calibrate = calibrate
        self.mix_contexts = mix_contexts
        self.tree_blend = tree_blend

    @fit_or_keep
    @threaded
    def fit(self, X: Any, y: Any) -> TabFMRegressor:
        """Preprocess and encode the train rows; y: real targets (any magnitude: normalised in float64)."""
        self._validate_params()
        check_table_shape(X)
        y = unmask(y)  # masked targets become NaN, refused below
        check_real_targets(y)
        y = column_or_1d(y, warn=True)
        if y.dtype.kind in "mM":
            raise ValueError("y holds dates or durations; a regressor needs numbers in a unit you choose: convert "
                             "them, e.g. (y - start) / np.timedelta64(1, 'D') for days")
        try:
            y = y.astype(np.float64)
        except (TypeError, ValueError):
            raise ValueError("y must hold numbers for a regressor (use TabFMClassifier for labels)") from None
        if not np.isfinite(y).all():
            raise ValueError("y holds NaN or inf: drop those rows or fill in their targets")
        if np.abs(y).max(initial=0.0) > MAX_TARGET:
            raise ValueError(f"y reaches {np.abs(y).max():.3g}: targets beyond +-{MAX_TARGET:g} leave the predictive "
                             "distribution no room below float64's limit (1.8e308); divide y by a power of ten first")
        self._target_kinds()
        model = self._prepare()
        n_members = self._members_for(len(y))
        rng = self._calibration_rng()
        folds, held_members = self._held_rows(len(y), n_members, rng)
        self._fit_common(X, y, n_members, model, encode=False, held=folds[0] if held_members else None,
                         held_members=held_members)
        self.correction_weight_, self.spread_, self.tree_weight_ = 1.0, 1.0, 0.0
        self.tree_seed_, self.tree_target_ = self._draw_tree_seed(), None
        # the trees learn the targets as the members see them before the linear base: normalised, outliers squeezed
        tree_target = squeeze_outliers(self.target_scale_.forward(y))
        with self._tree_fits(folds, tree_target, None) as trees:  # beside the forwards below
            if folds:
                self._calibrate(folds, held_members, rng, tree_target, trees)
            else:
                self._encode_contexts()
            self._fit_tree_model(trees)
        return self

    def _calibrate(self, folds: list[np.ndarray], held_members: int, rng: np.random.Generator,
                   tree_target: np.ndarray, trees: TreeFits | None) -> None:
        """Encode the contexts and set correction_weight_, spread_ and (with `trees`) the trees' weight from the
        rows of `folds`: predicted by the first held_members members, whose contexts leave them out, or (0) by a
        probe per fold fitted without them, run before the contexts are encoded so that the caches never
        coexist."""
        held = np.concatenate(folds)
        if held_members:
            self._encode_contexts()
            out = self._cell_outputs(self.train_cells_.take(held), self._held_outputs(), members=held_members)
        else:
            members = calibration.calibration_members(self.n_members_)
            out = np.concatenate([self._probe_outputs(fold, rng, members) for fold in folds])
            self._encode_contexts()
        mean, quantiles = out[:, 0], out[:, 1:]
        scale = self.target_scale_
        self.correction_weight_ = calibration.correction_weight((mean - scale.center) / scale.scale,
                                                                self.y_train_[held])
        shift = self._correction(mean)[:, None]
        if trees is not None:
            shift = shift + self._weigh_trees(tree_target, folds, mean + shift[:, 0], trees)[:, None]
        self.spread_ = calibration.spread_factor(mean + shift[:, 0], quantiles + shift,
                                                 scale.inverse(self.y_train_[held]))

    def _weigh_trees(self, target: np.ndarray, folds: list[np.ndarray], corrected: np.ndarray,
                     trees: TreeFits) -> np.ndarray:
        """Set tree_weight_ (and tree_target_ where it is above 0) from the held rows (those of `folds`, in their
        order), given their model means with the correction weight applied (corrected [h], target units), each
        fold predicted by the trees of `trees` fitted on the other train rows (tabfm.tree_fits); returns how far
        the blend moves their predictions [h] (target units). target: what the trees learn, the targets as the
        members see them before the linear base (normalised, outliers squeezed: tabfm.numeric_bounds)."""
        scale = self.target_scale_
        held = np.concatenate(folds)
        base = target[held] - self.y_train_[held]  # the linear base's out-of-fold predictions (y_train_: residuals)
        ours = base + scale.forward(corrected)
        predicted = np.concatenate([trees.fold_model(f).predict(self.train_cells_.take(fold))
                                    for f, fold in enumerate(folds)])
        self.tree_weight_ = calibration.best_tree_weight(ours, predicted, target[held])
        if self.tree_weight_ > 0:
            self.tree_target_ = target
        return scale.scale * self.tree_weight_ * (predicted - ours)

    def _tree_targets(self) -> tuple[np.ndarray, None]:
        return self.tree_target_, None

    def _held_rows(self, n: int, n_members: int, rng: np.random.Generator) -> tuple[list[np.ndarray], int]:
        """_TabFMBase._calibration_folds of a random fifth of the n train rows (calibration.held_out_targets);
        ([], 0) without calibrate."""
        if not self.calibrate:
            return [], 0
        return self._calibration_folds(n, calibration.held_out_targets(n, rng), n_members, rng)

    def _probe_outputs(self, held: np.ndarray, rng: np.random.Generator, members: int) -> np.ndarray:
        """_held_outputs of the rows `held` by a probe of the first `members` members fitted without them."""
        probe = self._probe(held, rng, members)
        return probe._cell_outputs(self.train_cells_.take(held), probe._held_outputs())

    def _held_outputs(self) -> Any:
        """The finalize of _cell_outputs that calibration reads: [n, 1 + len(SPREAD_LEVELS)] each row's mean, then
        its quantiles at calibration.SPREAD_LEVELS."""
        levels = calibration.SPREAD_LEVELS
        return lambda probs, units, weights: np.column_stack(
            [self._mean_of(probs, units, weights), self._quantiles_of(probs, units, levels, weights)])

    def _keep_members(self, members: int) -> None:
        self.target_maps_ = self.target_maps_[:members]

    def _correction(self, mean: np.ndarray) -> np.ndarray:
        """[n] how far the model's predictive distributions move given their means: -(1 - w) x the model's
        correction (its mean less the targets' centre); 0 for estimators saved before the weight existed."""
        w = getattr(self, "correction_weight_", 1.0)
        return (w - 1.0) * (mean - self.target_scale_.center) if w != 1.0 else np.zeros_like(mean)

    def _target_kinds(self) -> tuple[str, ...]:
        from tabfm.target_transform import TARGET_TRANSFORMS

        kinds = (self.target_transforms,) if isinstance(self.target_transforms, str) else tuple(self.target_transforms)
        if not kinds or any(k not in TARGET_TRANSFORMS for k in kinds):
            raise ValueError(f"target_transforms must be a non-empty list of {list(TARGET_TRANSFORMS)}, "
                             f"got {self.target_transforms!r}")
        return kinds

    def _encoding_targets(self, y: np.ndarray) -> tuple[np.ndarray, None]:
        return squeeze_outliers(TargetScale.fit(y).forward(y)), None

    def _context_targets(self, cells: Cells, y: np.ndarray) -> np.ndarray:
        """The members' train targets: y normalised (float64) by its inliers and squeezed past CLIP_SIGMA (one
        target of 1e9 among values near 1 put predictions 4e5 off; tabfm.numeric_bounds), less the linear base's
        out-of-fold prediction; each member's target map is fitted on these residuals."""
        self.target_scale_ = TargetScale.fit(y)
        u = squeeze_outliers(self.target_scale_.forward(y))
        if self.linear_base:
            self.linear_base_, fitted = LinearBase.fit(cells, u, self.seed_)
            u = u - fitted
        else:
            self.linear_base_ = None
        kinds = self._target_kinds()
        self.target_maps_ = [TargetTransform(kinds[m % len(kinds)]).fit(u) for m in range(self.n_members_)]
        return u

    def _offset(self, cells: Cells) -> np.ndarray:
        """[n] what the linear base adds to the model's prediction of each row, in target units."""
        if self.linear_base_ is None:
            return np.zeros(len(cells.values))
        with host_work(len(self.y_train_)):
            return self.target_scale_.scale * self.linear_base_.predict(cells)

    def _n_outputs(self) -> int:
        return 0

    def _member_labels(self, m: int, y: np.ndarray) -> np.ndarray:
        return self.target_maps_[m].transform(y).astype(np.float64)

    def _decode_member(self, model: TabFM, context: Context, logits: torch.Tensor) -> torch.Tensor:
        return logits.softmax(-1)  # bin probabilities [g, n, num_bins]

    def _contexts_encoded(self) -> None:
        """Each context's bins in target units: the model's bin edges over its standardised labels, through the
        context's train-label statistics (as the model computed them), its member's target map and the float64
        scale: bin_points_y_ [U, nb, S] and bin_edges_y_ [U, nb * S + 1]."""
        model = self._model()
        edges = model.bin_edges().double().cpu().numpy()
        stats = np.empty((len(self.context_rows_), 2))
        for units, context in self.contexts_:
            mean, std = context.target_stats
            stats[units, 0] = mean.double().cpu().numpy()[:, 0]
            stats[units, 1] = std.double().cpu().numpy()[:, 0]
        points, edges_y = [], []
        top = np.finfo(np.float64).max
        for u, m in enumerate(self.context_members_):
            to_y = lambda z, u=u, m=m: self.target_scale_.inverse(self.target_maps_[m].inverse(z * stats[u, 1] + stats[u, 0]))  # noqa: E731
            with np.errstate(over="ignore"):  # bins past float64's range (targets near 1e308) end at its limit
                points.append(np.clip(to_y(bin_points(edges)), -top, top))
                edges_y.append(np.maximum.accumulate(np.clip(to_y(sub_edges(edges)), -top, top)))
        self.bin_points_y_, self.bin_edges_y_ = np.stack(points), np.stack(edges_y)

    def _quantiles_of(self, probs: np.ndarray, units: np.ndarray, q: np.ndarray,
                      weights: np.ndarray | None = None) -> np.ndarray:
        """The quantiles [n, len(q)] of the mixture of the outputs (bin probabilities [K, n, nb], contexts [K, n],
        weights [K, n] or None: equal)."""
        return mixture_quantiles(list(probs), [self.bin_edges_y_[u] for u in units], q, weights)

    def _mean_of(self, probs: np.ndarray, units: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
        """The ensemble's mean [n] from the outputs' bin probabilities [K, n, nb], their rows' contexts [K, n] and
        weights [K, n] (None: equal)."""
        K = len(probs)  # divided (weighted) before the sum, as in mapped_mean: no overflow for targets near 1e308
        means = [mapped_mean(probs[k], self.bin_points_y_[units[k]]) for k in range(K)]
        if weights is None:
            return np.sum([mean / K for mean in means], axis=0)
        return np.sum([mean * w for mean, w in zip(means, weights, strict=True)], axis=0)

    def _mix_contexts(self, first: np.ndarray, second: np.ndarray, share: np.ndarray, first_units: np.ndarray,
                      second_units: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A row near the edge of a member's context: the member's distribution is the mixture of its first and
        second contexts' (each in its context's own bins), weighted by their votes: 2M weighted outputs."""
        M = len(first)
        weights = np.concatenate([1.0 - share, share]) / M
        return np.concatenate([first, second]), np.concatenate([first_units, second_units]), weights

    @threaded
    def predict(self, X: Any) -> np.ndarray:
        """[n] predicted targets: the mean of the ensemble's predictive distribution."""
        cells = self._cells_of(X)
        mean = self._cell_outputs(cells, self._mean_of)  # finalize(probs, units, weights)
        return self._tree_blend(mean + self._correction(mean) + self._offset(cells), cells)

    def _tree_blend(self, prediction: np.ndarray, cells: Cells) -> np.ndarray:
        """[n] the predictions (target units) of the rows of `cells` with the trees weighed in: (1 - v) x the
        prediction + v x the trees'."""
        if getattr(self, "tree_model_", None) is None:  # None also for one saved before the trees existed
            return prediction
        trees = self.target_scale_.inverse(self.tree_model_.predict(cells))
        return (1 - self.tree_weight_) * prediction + self.tree_weight_ * trees

    @threaded
    def predict_quantiles(self, X: Any, quantiles: Any = (0.1, 0.5, 0.9)) -> np.ndarray:
        """[n, len(quantiles)] quantiles of the ensemble's predictive distribution (an equal mixture of the
        members', scaled about its mean by the spread factor and moved by the correction weight as predict's
        mean is), in target units."""
        given = np.atleast_1d(np.asarray(quantiles))
        q = given.astype(np.float64) if given.dtype.kind in "iuf" else np.full(1, np.nan)  # "0.5" is no number
        if q.ndim != 1 or not len(q) or not ((q > 0) & (q < 1)).all():
            raise ValueError(f"quantiles must be a non-empty list of numbers strictly between 0 and 1, got "
                             f"{quantiles!r}")
        # bin_edges_y_ is read when the first batch is finalised: after _cell_outputs has (re-)encoded the contexts
        cells = self._cells_of(X)
        out = self._cell_outputs(cells, lambda probs, units, weights: np.column_stack([
            self._quantiles_of(probs, units, q, weights), self._mean_of(probs, units, weights)]))
        mean = out[:, -1:]
        spread = getattr(self, "spread_", 1.0)  # 1 in estimators saved before the factor existed
        quantiles = out[:, :-1] if spread == 1.0 else mean + spread * (out[:, :-1] - mean)
        moved = self._correction(mean[:, 0]) + self._offset(cells)
        if getattr(self, "tree_model_", None) is not None:  # the trees move the distribution as they move its mean
            moved = moved + self._tree_blend(mean[:, 0] + moved, cells) - (mean[:, 0] + moved)
        return quantiles + moved[:, None]
