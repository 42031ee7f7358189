"""TabFMClassifier: in-context classification with the pretrained model (the shared machinery is tabfm.estimator's).

The members' class probabilities are averaged (or their log-probabilities, average="logit"); with calibrate, a
softmax temperature and a logistic regression's weight (tabfm.linear_base) are fitted on held-out train rows.

More classes than the model's head (max_classes, 10 for the shipped model): each member gets a random balanced
code that maps the K classes onto max_classes groups, with enough members (at least n_estimators, at least
ceil(2 log K / log max_classes) + 1) that every pair of classes is told apart by some member. A member predicts
group probabilities; with classes equally likely inside a group, p_m(c) = p_m(group of c) / |group of c|, and
the class probabilities are the normalised geometric mean of the members' p_m(c) (error-correcting output
codes decoded by log-likelihood).
"""

from __future__ import annotations

import numbers
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sklearn.base import ClassifierMixin
from sklearn.utils._param_validation import Interval, StrOptions

from tabfm import calibration
from tabfm.ensemble import class_codes, code_members
from tabfm.estimator import _BASE_CONSTRAINTS, _TabFMBase
from tabfm.estimator_calls import fit_or_keep, threaded
from tabfm.inference import Context
from tabfm.linear_base import LOGISTIC_CS, LinearChoice, LinearDesign, LogisticModel
from tabfm.model import TabFM
from tabfm.preprocess import Cells
from tabfm.raw_columns import check_table_shape
from tabfm.table_threads import host_work
from tabfm.tree_fits import TreeFits
from tabfm.validation import check_class_labels


def _folds_leave_two_classes(y: np.ndarray, folds: list[np.ndarray]) -> bool:
    """Whether the train rows outside each fold hold at least two classes (class ids y): what the logistic
    regression and the trees fitted without a fold need to be fitted at all."""
    return all(len(np.unique(np.delete(y, fold))) > 1 for fold in folds)


TREE_ROWS_PER_CLASS = 2
"""The trees are fitted only where the rows outside each calibration fold number at least this many per class.
With fewer, a class has a row or so and no leaf (of at least 20 rows) can favour it, yet every round still grows
one tree per class: a 300-row table of 160 classes took 25 s to fit with the trees and 3.3 s without, their
weight 0. It is scikit-learn's own line, past which its classifiers warn, at every fit of the trees, that the
target "could represent a regression problem" (the estimator warns once, at its own check of y)."""


def _trees_can_learn(n_rows: int, n_classes: int, folds: list[np.ndarray]) -> bool:
    """Whether the trees fitted without each fold keep TREE_ROWS_PER_CLASS rows per class of n_classes."""
    return all(n_rows - len(fold) >= TREE_ROWS_PER_CLASS * n_classes for fold in folds)


class TabFMClassifier(ClassifierMixin, _TabFMBase):
    """In-context classification with the pretrained tabular model; scikit-learn API.

    Parameters
    ----------
    n_estimators : int or "auto", default="auto"
        Ensemble members; each encodes the train rows once at fit and runs every test row at predict, so the
        cost is linear in members. "auto": 4, and more on small tables, as many as 4,096 / train rows (at most
        16: 16 up to 256 train rows, 8 at 512), so their fit costs about what 4 members cost on 1,024 train rows;
        the fitted count is `n_members_`. Predicting many rows from a small table costs more per row than from a
        large one then; set 4 to keep it lower. With more classes than the model's head (10), which are decoded
        from class codes, "auto" gives ceil(classes / 10) times as many members, at most 16
        (tabfm.ensemble.code_members).
    numeric_transforms : tuple of {"none", "robust", "quantile", "power"}, default=("none", "power")
        Transforms of the numeric columns, cycled over the members (member m gets entry m % len).
    categorical_views : tuple of {"embed", "ordinal", "onehot"}, default=("ordinal",)
        How categorical columns are shown, cycled over the members: the model's hashed category embedding, the
        category's code as a number, or 0/1 columns (columns of at most 10 categories). The shipped model reads
        codes as numbers far better than through its embedding (docs/accuracy.md, "How the default got here").
    max_features : int, "auto" or None, default="auto"
        Each member of a table with more kept columns sees a random subset of this many (the members together
        see every column, or, on tables wider than n_estimators x max_features, the columns that explain most
        of y alone); None: every member sees all columns, on tables of at most the model's 100 (a wider table
        is refused: set max_features). "auto": 24 on tables of at most the model's 100 columns (the shipped
        model was pretrained mostly on narrow tables: subsets of 24 were better on 7 of the 9 tables of 25-90
        columns), 64 on wider ones, where 24 shows a member a few percent of the columns; TabFMRegressor keeps 24
        there, its ridge base reading every column (tabfm.ensemble.auto_max_features).
    checkpoint : str, path or None, default=None
        A merged .safetensors file or a checkpoint folder; None: the shipped model.
    categorical_features : "auto", list of int or str, or boolean mask, default="auto"
        Columns to treat as categorical besides strings, booleans and categorical dtypes: their indices or names,
        or one boolean per column (as scikit-learn's HistGradientBoosting takes). Name integer group ids here (a
        school, a customer): a column of more than 100 categories reaches the linear part and the trees as its
        target encoding (tabfm.category_encoding), where as a number it means nothing.
    max_context_rows : int or None, default=None
        Subsample the train rows per member; None: all of them (ignored where local contexts are used).
    batch_size : int, default=1024
        Test rows per forward; bounds predict's memory.
    device : {"cpu", "cuda", "auto"}, default="cpu"
    dtype : {"float32", "float64"}, default="float32"
        The weights' dtype; float64 is the exact reference (tests). "bfloat16" is refused: use precision="bf16".
    precision : {"auto", "fp32", "bf16"}, default="auto"
        "bf16": the model's forwards under torch.autocast to bfloat16 with float32 weights, keys/values cached in
        bfloat16 (half the memory); the probabilities after the model stay float64. "auto": bf16 on CUDA, fp32
        elsewhere (tabfm.inference_precision; README, "Inference speed and memory").
    tensor_parallel : (d0, d1) or None, default=None
        Split the model over a d0 x d1 mesh of processes launched by torchrun.
    sequence_parallel : bool, default=True
        With tensor_parallel, also split each stage's rows over mesh axis 0.
    random_state : int, RandomState, Generator or None, default=0
        Seeds the members' views, local contexts and calibration rows: an int gives the same fit every time;
        a RandomState or Generator gives a seed drawn from it at each fit (advancing it); None fresh entropy.
    verbose : bool, default=False
        Progress bars: over the contexts encoded at fit, and over the test batches at predict.
    n_jobs : int or None, default=None
        CPU threads during fit and predict (torch's and BLAS's, restored after); -1: every core; None: torch's
        setting. The contexts' forwards run as that many slices of tables, one thread each (tabfm.table_threads).
        On a busy machine, or under joblib parallelism, 1 is often fastest.
    local_context_rows : int or None, default=256
        With more train rows than this, each member is shown local contexts: overlapping neighbourhoods of this
        many train rows around its own anchors, each test row predicted from the one that holds most of its
        nearest train rows (tabfm.local_context). The shipped model was pretrained on tables of up to 256 rows and
        reads short contexts of near rows better than one long one; the cost then grows linearly in the train
        rows. None: one context of all train rows per member.
    average : {"probability", "logit"}, default="probability"
        Average the members' class probabilities, or their log-probabilities (a geometric mean, renormalised).
    softmax_temperature : float, default=1.0
        Divides the members' logits; used when calibrate is False.
    calibrate : bool, default=True
        Fit the softmax temperature on held-out train rows (a stratified 20%, at most 1,000) predicted from the
        other train rows by the first two members (a quarter of 12 or more). With local contexts and at least 4
        members those members' contexts leave the held rows out, at no extra cost; otherwise a probe costs about
        half of one more encoding of the train rows, and on tables of at most 500 train rows every row is held
        instead, in five stratified folds, each predicted by a probe of the other folds (five probes: few held
        rows choose the weights below noisily; tabfm.calibration.CROSS_FIT_ROWS).
    linear_blend : bool, default=True
        With calibrate, also weigh in a logistic regression: the predicted probabilities are
        (1 - w) * the ensemble's + w * the logistic regression's, w in 0..0.9 chosen with the temperature on the
        same held-out rows (w = 0 where it does not help them), as are whether the logistic regression sees the
        numeric columns as they are, Yeo-Johnson transformed or with hinge columns, and its L2 penalty (C 0.1, 1
        or 10). The model alone draws linear boundaries over many columns poorly (tabfm.linear_base).
    tree_blend : bool, default=True
        With calibrate, also weigh in gradient-boosted trees (scikit-learn's HistGradientBoostingClassifier,
        tabfm.tree_base): the probabilities become (1 - v) x the blend above + v x the trees', v in 0..0.9 chosen
        jointly with the temperature and w on the same held-out rows, the trees fitted on the other train rows
        (v = 0 where they do not help them), then on every train row. Trees keep gaining from rows and sharp
        interactions where the model does not: on the 42 classification tables (5 folds) ROC-AUC 0.8887 ->
        0.8909 and log-loss 0.3902 -> 0.3801 (each better on 23 tables, worse on 14 and 15), for two tree fits
        at fit (1.2-1.4x the fit + predict time at 1,000 x 1,000 x 20 in two runs).
    mix_contexts : bool, default=True
        With local contexts, predict a test row near the edge of a member's context from that member's second
        context too (the one home to the next most of its 16 nearest train rows) and mix the two's class
        probabilities by those votes. On the 42 classification tables (5 folds) log-loss 0.39094 -> 0.39020
        (better on 21, worse on 9), on the 9 of the large suite 0.2148 -> 0.2138 (better on 8), for about 1.5x
        the predict time (1.21x fit + predict at 1,000 x 1,000 x 20); False: one context per member and row.
    """

    _task = "classification"
    _parameter_constraints: dict = {**_BASE_CONSTRAINTS, "average": [StrOptions({"probability", "logit"})],
                                    "softmax_temperature": [Interval(numbers.Real, 0, None, closed="neither")],
                                    "calibrate": ["boolean"], "linear_blend": ["boolean"],
                                    "mix_contexts": ["boolean"], "tree_blend": ["boolean"]}

    def __init__(self, n_estimators: int | str = "auto", *, numeric_transforms: tuple[str, ...] = ("none", "power"),
                 categorical_views: tuple[str, ...] = ("ordinal",), max_features: int | str | None = "auto",
                 checkpoint: str | Path | None = None, categorical_features: str | list[int | str] = "auto",
                 max_context_rows: int | None = None, batch_size: int = 1024, device: str = "cpu",
                 dtype: str = "float32", precision: str = "auto", tensor_parallel: tuple[int, int] | None = None,
                 sequence_parallel: bool = True,
                 random_state: int | np.random.RandomState | np.random.Generator | None = 0, verbose: bool = False,
                 n_jobs: int | None = None, local_context_rows: int | None = 256, average: str = "probability",
                 softmax_temperature: float = 1.0, calibrate: bool = True, linear_blend: bool = True,
                 mix_contexts: bool = True, tree_blend: bool = True):
        super().__init__(n_estimators, numeric_transforms=numeric_transforms, categorical_views=categorical_views,
                         max_features=max_features, checkpoint=checkpoint,
                         categorical_features=categorical_features, max_context_rows=max_context_rows,
                         batch_size=batch_size, device=device, dtype=dtype, precision=precision,
                         tensor_parallel=tensor_parallel,
                         sequence_parallel=sequence_parallel, random_state=random_state, verbose=verbose,
                         n_jobs=n_jobs, local_context_rows=local_context_rows)
        self.average = average
        self.softmax_temperature = softmax_temperature
        self.calibrate = calibrate
        self.linear_blend = linear_blend
        self.mix_contexts = mix_contexts
        self.tree_blend = tree_blend

    @fit_or_keep
    @threaded
    def fit(self, X: Any, y: Any) -> TabFMClassifier:
        """Preprocess and encode the train rows; y: class labels (any hashable values of one kind)."""
        self._validate_params()
        check_table_shape(X)
        y = check_class_labels(y)
        self.classes_, y_ids = np.unique(y, return_inverse=True)
        K = len(self.classes_)
        if K < 2:
            raise ValueError(f"y has 1 class ({self.classes_[:1].tolist()[0]!r}): a classifier needs at least two "
                             "classes")  # tolist: 'a', not numpy 2's np.str_('a')
        model = self._prepare()
        max_classes = model.config.max_classes
        n_members = code_members(self._members_for(len(y_ids)), K, max_classes, auto=self.n_estimators == "auto")
        self.class_codes_ = class_codes(K, max_classes, n_members, np.random.default_rng(self.seed_))
        self.n_groups_ = min(K, max_classes)
        y_ids = y_ids.astype(np.int64)
        rng = self._calibration_rng()
        self.tree_seed_ = self._draw_tree_seed()
        held = calibration.held_out_rows(y_ids, K, rng) if self.calibrate else np.empty(0, np.int64)
        folds, held_members = self._calibration_folds(len(y_ids), held, n_members, rng, y_ids)
        self._fit_common(X, y_ids, n_members, model, encode=False,
                         held=held if held_members else None, held_members=held_members)
        trees_learn = _folds_leave_two_classes(y_ids, folds) and _trees_can_learn(len(y_ids), K, folds)
        with self._tree_fits(folds if trees_learn else [], y_ids, K) as trees:  # beside the forwards below
            if held_members:
                self._encode_contexts()
                logp = self._cell_outputs(self.train_cells_.take(held), members=held_members)
                with host_work(len(y_ids)):  # the logistic regressions and the blend's search, between forwards
                    self.temperature_, self.blend_weight_, self.tree_weight_, linear = self._fit_temperature(
                        logp, folds, trees)
            else:
                self.temperature_, self.blend_weight_, self.tree_weight_, linear = (
                    self._calibrate(folds, rng, trees) if folds else (float(self.softmax_temperature), 0.0, 0.0,
                                                                      None))
                self._encode_contexts()  # after the probes' contexts are freed: their caches never coexist
            with host_work(len(self.y_train_)):
                self.linear_model_ = (LogisticModel.fit(self.train_cells_, self.y_train_, K, linear.view, linear.C,
                                                        start=linear.kept) if self.blend_weight_ > 0 else None)
            self._fit_tree_model(trees)
        return self

    def _tree_targets(self) -> tuple[np.ndarray, int]:
        return self.y_train_, len(self.classes_)

    def _held_members(self, n_members: int, kept: int) -> int:
        """As the base's (0: calibrate through a probe), and 0 with more classes than the model's head: every
        member is then needed to decode them."""
        return 0 if len(self.classes_) > self.n_groups_ else super()._held_members(n_members, kept)

    def _fit_temperature(self, logp: np.ndarray, folds: list[np.ndarray],
                         trees: TreeFits | None) -> tuple[float, float, float, LinearChoice]:
        """(softmax temperature, blend weight, trees' weight, the logistic regression's LinearChoice) that minimise
        the log-loss of the held train rows (those of `folds`, in their order), given the members' predictions of
        them logp [M, h, G] from contexts without their fold, and with linear_blend a logistic regression's fitted
        without their fold too, and the trees' of `trees` (their fits, tabfm.tree_fits; None: no trees). The
        logistic regression's view of the numeric columns (linear_base.LINEAR_VIEWS) is chosen at the first
        penalty of linear_base.LOGISTIC_CS, then its penalty among them in that view, each fit starting from that
        view's first (two stages: a fit per view and per other penalty, not per pair). Ties go to the first view
        and penalty, then the lowest temperature, then the lowest weight."""
        y, K = self.y_train_, len(self.classes_)
        held = np.concatenate(folds)
        kept = [np.setdiff1d(np.arange(len(y)), fold) for fold in folds]
        kept_cells = [self.train_cells_.take(keep) for keep in kept]
        held_cells = [self.train_cells_.take(fold) for fold in folds]

        def held_probabilities(fit) -> tuple[np.ndarray, list]:
            """([h] each held row's true-class probability by fit(kept cells, kept class ids, fold number) of its
            fold's kept rows, [the fitted models, one per fold])."""
            models = [fit(cells, y[keep], f) for f, (cells, keep) in enumerate(zip(kept_cells, kept, strict=True))]
            return np.concatenate([model.predict_proba(cells)[np.arange(len(fold)), y[fold]]
                                   for model, cells, fold in zip(models, held_cells, folds, strict=True)]), models

        ensemble = calibration.true_class_probabilities(lambda t: self._combine(logp, t), y[held])
        weights, linears, choices = np.zeros(1), [np.zeros(len(held))], [LinearChoice("plain", LOGISTIC_CS[0])]
        trainable = _folds_leave_two_classes(y, folds)
        if self.linear_blend and trainable:
            weights = calibration.BLEND_WEIGHTS
            designs = [LinearDesign.fit(cells) for cells in kept_cells]
            views = designs[0].views(len(kept[0]))  # hinges where their lbfgs has room, as the ridge's
            firsts = [held_probabilities(lambda cells, y_keep, f, view=view: LogisticModel.fit_design(
                cells, y_keep, K, designs[f].viewed(view, cells), LOGISTIC_CS[0])) for view in views]
            best = calibration.best_blend(ensemble, np.stack([p for p, _ in firsts]), weights)[0]
            starts = firsts[best][1]
            others = [held_probabilities(lambda cells, y_keep, f, C=C: LogisticModel.fit_design(
                cells, y_keep, K, starts[f].design, C, start=starts[f])) for C in LOGISTIC_CS[1:]]
            linears = [firsts[best][0]] + [p for p, _ in others]
            choices = [LinearChoice(views[best], C, models[0])
                       for C, (_, models) in zip(LOGISTIC_CS, [firsts[best]] + others, strict=True)]
        if trees is not None:
            tree_probs = held_probabilities(lambda cells, y_keep, f: trees.fold_model(f))[0]
            choice, temperature, weight, tree_weight = calibration.best_tree_blend(ensemble, np.stack(linears),
                                                                                   weights, tree_probs)
            return temperature, weight, tree_weight, choices[choice]
        choice, temperature, weight = calibration.best_blend(ensemble, np.stack(linears), weights)
        return temperature, weight, 0.0, choices[choice]

    def _calibrate(self, folds: list[np.ndarray], rng: np.random.Generator,
                   trees: TreeFits | None) -> tuple[float, float, float, LinearChoice]:
        """(softmax temperature, blend weight, trees' weight, LinearChoice) from the rows of each fold predicted by
        a probe (_TabFMBase._probe) of the first calibration.calibration_members members fitted without them, or of
        every member where the classes need them all to be decoded."""
        members = (calibration.calibration_members(self.n_members_) if len(self.classes_) <= self.n_groups_
                   else self.n_members_)
        logp = np.concatenate([self._probe(fold, rng, members)._cell_outputs(self.train_cells_.take(fold))
                               for fold in folds], axis=1)
        with host_work(len(self.y_train_)):
            return self._fit_temperature(logp, folds, trees)

    def _keep_members(self, members: int) -> None:
        self.class_codes_ = self.class_codes_[:members]

    def _blend(self, proba: np.ndarray, cells: Cells) -> np.ndarray:
        """The ensemble's class probabilities of the rows of `cells` with the logistic regression and the trees
        weighed in: (1 - v) x ((1 - w) x the ensemble's + w x the logistic regression's) + v x the trees'."""
        if getattr(self, "linear_model_", None) is not None:  # None also for one saved before the blend existed
            with host_work(len(self.y_train_)):
                linear = self.linear_model_.predict_proba(cells)
            proba = (1 - self.blend_weight_) * proba + self.blend_weight_ * linear
        if getattr(self, "tree_model_", None) is not None:  # None also for one saved before the trees existed
            proba = (1 - self.tree_weight_) * proba + self.tree_weight_ * self.tree_model_.predict_proba(cells)
        return proba

    def _combine(self, logp: np.ndarray, temperature: float) -> np.ndarray:
        """The first M members' group log-probabilities [M, n, G] -> class probabilities [n, K] at a softmax
        temperature."""
        z = logp / temperature
        z = z - z.max(-1, keepdims=True)
        log_groups = z - np.log(np.exp(z).sum(-1, keepdims=True))
        codes = self.class_codes_[:len(logp)]
        per_class = np.take_along_axis(log_groups, codes[:, None, :], axis=2)  # [M, n, K] log p_m
        if len(self.classes_) <= self.n_groups_ and self.average == "probability":
            proba = np.exp(per_class).mean(0)
        else:  # geometric mean; with more classes than groups each group's mass is shared by its classes
            if len(self.classes_) > self.n_groups_:
                sizes = np.stack([np.bincount(code, minlength=self.n_groups_)[code] for code in codes])
                per_class = per_class - np.log(sizes)[:, None, :]
            logp_c = per_class.mean(0)
            proba = np.exp(logp_c - logp_c.max(1, keepdims=True))
        return proba / proba.sum(1, keepdims=True)

    def _mix_contexts(self, first: np.ndarray, second: np.ndarray, share: np.ndarray, first_units: np.ndarray,
                      second_units: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
        """Each member's class-group probabilities of a row near the edge of its context: those from its first
        and second contexts, weighted by their votes (log-probabilities [M, n, G] in and out): one output per
        member, as without the mixture."""
        mixed = first.copy()
        m, r = np.nonzero(share > 0)
        s = share[m, r][:, None]
        mixed[m, r] = np.logaddexp(first[m, r] + np.log1p(-s), second[m, r] + np.log(s))
        return mixed, first_units, None

    def _n_outputs(self) -> int:
        return self.n_groups_

    def _member_labels(self, m: int, y: np.ndarray) -> np.ndarray:
        return self.class_codes_[m][y]

    def _decode_member(self, model: TabFM, context: Context, logits: torch.Tensor) -> torch.Tensor:
        return logits[..., :self.n_groups_].log_softmax(-1)

    @threaded
    def predict_proba(self, X: Any) -> np.ndarray:
        """[n, n_classes] class probabilities, columns in the order of classes_."""
        cells = self._cells_of(X)
        return self._blend(self._cell_outputs(cells, lambda logp, *_: self._combine(logp, self.temperature_)), cells)

    def predict_log_proba(self, X: Any) -> np.ndarray:
        return np.log(np.clip(self.predict_proba(X), 1e-300, None))

    def predict(self, X: Any) -> np.ndarray:
        proba = self.predict_proba(X)
        return self.classes_[proba.argmax(1)]
