"""scikit-learn estimators on the pretrained model: `TabFMClassifier` here, `TabFMRegressor` in tabfm.regressor,
and the machinery they share (_TabFMBase: preprocessing, ensemble, encoding, batched predict, save / load).

fit() learns nothing by gradient: it preprocesses the train rows (tabfm.preprocess), draws the ensemble and
encodes the train rows once per member (tabfm.inference.encode_context, keys/values cached). predict() runs only
the test rows, in batches of `batch_size`, against those caches; test rows never see one another, so a
prediction does not depend on the other rows of X or their order.

Ensemble (tabfm.ensemble): member m sees the columns in its own order (member 0: the original order; a random
subset when max_features is set), numeric columns under its entry of numeric_transforms, categorical columns in
its entry of categorical_views and, for classification, its own permutation of the class ids; the members' class
probabilities are averaged (or their log-probabilities, average="logit"), and with calibrate a temperature and
a logistic regression's weight (tabfm.linear_base) are fitted on held-out train rows.

More classes than the model's head (max_classes, 10 for the shipped model): each member gets a random balanced
code that maps the K classes onto max_classes groups, with enough members (at least n_estimators, at least
ceil(2 log K / log max_classes) + 1) that every pair of classes is told apart by some member. A member predicts
group probabilities; with classes equally likely inside a group, p_m(c) = p_m(group of c) / |group of c|, and
the class probabilities are the normalised geometric mean of the members' p_m(c) (error-correcting output
codes decoded by log-likelihood).

Sharded inference: with `tensor_parallel=(d0, d1)` under torchrun (d0 * d1 processes), the model is split over a
d0 x d1 mesh (heads by tensor parallelism, rows by sequence parallelism when `sequence_parallel`): every rank
calls fit / predict with the same data and gets the one-process result.
"""

from __future__ import annotations

import copy
import functools
import numbers
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.utils._param_validation import Interval, StrOptions
from sklearn.utils.validation import check_is_fitted, validate_data

from tabfm import calibration, forward_sizes, heap_release
from tabfm.data.encode import IGNORE_LABEL, Batch
from tabfm.ensemble import (Member, auto_members, class_codes, draw_members,  # noqa: F401 (class_codes re-exported)
                            code_members, member_cells, member_width)
from tabfm.estimator_model import (DEFAULT_CHECKPOINT, load_estimator_model,  # noqa: F401 (re-exported)
                                   shared_plain_model)
from tabfm.inference import Context, encode_context, predict_logits
from tabfm.inference_precision import resolve_precision, resolve_weight_dtype
from tabfm.linear_base import LOGISTIC_CS, LinearChoice, LinearDesign, LogisticModel
from tabfm.local_context import LocalContexts, column_relevance, padded_chunks
from tabfm.model import TabFM
from tabfm.precision import autocast
from tabfm.preprocess import Cells, TablePreprocessor, arrow_as_polars, check_table_shape
from tabfm.table_threads import map_tables, table_workers
from tabfm.validation import (ESTIMATOR_PARAMETER_CONSTRAINTS, _PositiveInt, check_class_labels, resolve_device,
                              resolve_seed, torch_threads)


def _threaded(method):
    """Run an estimator method with torch's (and BLAS's) threads set by the estimator's n_jobs, restored after."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with torch_threads(self.n_jobs):
            return method(self, *args, **kwargs)
    return run


def _fit_or_keep(fit):
    """A fit that raises leaves the estimator as it was before the call: fitted with its old model and classes, or
    unfitted (NotFittedError), never with the new classes or columns read before the error and the old contexts.
    The fitted attributes are rebound by a fit, never changed in place, so the old ones are whole."""
    @functools.wraps(fit)
    def run(self, *args, **kwargs):
        before = dict(self.__dict__)
        try:
            return fit(self, *args, **kwargs)
        except BaseException:
            self.__dict__.clear()
            self.__dict__.update(before)
            raise
    return run


_VIEW_LIST = [tuple, list, str]
_BASE_CONSTRAINTS = {**ESTIMATOR_PARAMETER_CONSTRAINTS, "numeric_transforms": _VIEW_LIST,
                     "categorical_views": _VIEW_LIST, "max_features": [_PositiveInt(), None],
                     "local_context_rows": [Interval(numbers.Integral, 2, None, closed="left"), None]}
_BASE_CONSTRAINTS.pop("calibrate")


class _TabFMBase(BaseEstimator):
    """What the classifier and the regressor share: input checks, the ensemble, caches, batched prediction."""

    _task: str = ""
    _parameter_constraints: dict = _BASE_CONSTRAINTS

    def __init__(self, n_estimators: int | str = "auto", *, numeric_transforms: tuple[str, ...] = ("none", "power"),
                 categorical_views: tuple[str, ...] = ("ordinal",), max_features: int | None = 24,
                 checkpoint: str | Path | None = None, categorical_features: str | list[int | str] = "auto",
                 max_context_rows: int | None = None, batch_size: int = 1024, device: str = "cpu",
                 dtype: str = "float32", precision: str = "auto", tensor_parallel: tuple[int, int] | None = None,
                 sequence_parallel: bool = True,
                 random_state: int | np.random.RandomState | np.random.Generator | None = 0, verbose: bool = False,
                 n_jobs: int | None = None, local_context_rows: int | None = 256):
        self.n_estimators = n_estimators
        self.numeric_transforms = numeric_transforms
        self.categorical_views = categorical_views
        self.max_features = max_features
        self.checkpoint = checkpoint
        self.categorical_features = categorical_features
        self.max_context_rows = max_context_rows
        self.batch_size = batch_size
        self.device = device
        self.dtype = dtype
        self.precision = precision
        self.tensor_parallel = tensor_parallel
        self.sequence_parallel = sequence_parallel
        self.random_state = random_state
        self.verbose = verbose
        self.n_jobs = n_jobs
        self.local_context_rows = local_context_rows

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.input_tags.allow_nan = True
        tags.input_tags.categorical = True
        tags.input_tags.string = True
        tags.non_deterministic = False
        return tags

    # -- fit ---------------------------------------------------------------------------------------------

    def _prepare(self) -> TabFM:
        """Check the parameters and load the model, once per fit, as `model_` (before anything is learnt from the
        data); every later step of fit and predict uses it."""
        self.device_ = resolve_device(self.device)
        self.seed_ = resolve_seed(self.random_state)
        self.dtype_ = resolve_weight_dtype(self.dtype)
        self.precision_ = resolve_precision(self.precision, self.dtype_, self.device_)
        self.__dict__.pop("model_", None)  # a refit loads afresh: the checkpoint, device or layout may have changed
        return self._model()

    def _fit_common(self, X: Any, y: np.ndarray, n_members: int, model: TabFM, encode: bool = True,
                    held: np.ndarray | None = None, held_members: int = 0) -> None:
        """Preprocess, draw the ensemble and (unless encode is False) encode the contexts; y is [n] class ids or
        float targets; held: train rows the first held_members members' local contexts leave out (the
        classifier's calibration rows)."""
        X = arrow_as_polars(X)
        validate_data(self, X, reset=True, skip_check_array=True)
        kinds = (self.numeric_transforms,) if isinstance(self.numeric_transforms, str) else tuple(self.numeric_transforms)
        used = sorted({kinds[m % len(kinds)] for m in range(n_members)}) if kinds else []  # fit only what is used
        self.preprocessor_ = TablePreprocessor(self.categorical_features, max_columns=model.config.max_columns,
                                               transforms=used).fit(X)
        cells = self.preprocessor_.transform(X)
        if len(y) != len(cells.values):
            raise ValueError(f"X has {len(cells.values)} rows but y has {len(y)}")
        C = cells.values.shape[1]
        shown, limit = min(C, self.max_features or C), model.config.max_columns
        if shown > limit:
            raise ValueError(f"X has {C} informative features and max_features={self.max_features} shows each "
                             f"member {shown}, but the model takes at most {limit}: set max_features to at most "
                             f"{limit} (members then see subsets; the default is 24)")
        self.n_members_ = n_members
        y = self._context_targets(cells, y)
        rng = np.random.default_rng(self.seed_)
        relevance = (column_relevance(cells, self._relevance_targets(y))
                     if self.max_features is not None and C > self.max_features else None)
        self.members_ = draw_members(n_members, C, self.numeric_transforms, self.categorical_views,
                                     self.max_features, rng, relevance)
        self._draw_contexts(cells, y, rng, relevance=relevance, held=held, held_members=held_members)
        self.train_cells_, self.y_train_ = cells, y
        self.contexts_ = None
        if encode:
            self._encode_contexts()

    def _members_for(self, n_train: int) -> int:
        """The members of a fit on n_train rows: n_estimators, or with "auto" tabfm.ensemble.auto_members."""
        return auto_members(n_train) if self.n_estimators == "auto" else int(self.n_estimators)

    def _calibration_rng(self) -> np.random.Generator:
        """Calibration's own draws (its held rows, its probe's contexts), apart from the ensemble's."""
        return np.random.default_rng(None if self.seed_ is None else self.seed_ + 1)

    def _held_members(self, n_members: int, kept: int) -> int:
        """How many first members leave the calibration rows out of their local contexts and predict them
        (calibration.held_members), with `kept` train rows left; 0 without local contexts or with too few rows
        left to fill one."""
        if self.local_context_rows is None or kept <= self.local_context_rows:
            return 0
        return calibration.held_members(n_members)

    def _relevance_targets(self, y: np.ndarray) -> np.ndarray:
        """[n, T] the context targets y_train_ as tabfm.local_context.column_relevance reads them: one-hot class
        ids (the classifier), or the regressor's targets as one column."""
        if self._task == "classification":
            return (y[:, None] == np.arange(int(y.max()) + 1)[None]).astype(np.float64)
        return np.asarray(y, np.float64)[:, None]

    def _context_targets(self, cells: Cells, y: np.ndarray) -> np.ndarray:
        """Hook: the train targets the members' contexts are built from, kept as `y_train_` (the classifier's
        class ids; the regressor's normalised residuals of its linear base)."""
        return y

    def _draw_contexts(self, cells: Cells, y: np.ndarray, rng: np.random.Generator,
                       limit: int | None = None, relevance: np.ndarray | None = None,
                       held: np.ndarray | None = None, held_members: int = 0) -> None:
        """The contexts the members are encoded from, as `context_rows_` [U, T] (the train rows of each) and
        `context_members_` [U] (whose they are). With more than local_context_rows train rows, each member gets
        its own local contexts of that many rows (tabfm.local_context, kept as `local_`); otherwise one context
        per member holding every train row, or max_context_rows (or `limit`, the smaller) drawn per member.
        relevance: the column relevance of these cells and targets, where the caller computed it already; held:
        rows the first held_members members' local contexts leave out (only with local contexts)."""
        n = len(cells.values)
        if self.local_context_rows is not None and n > self.local_context_rows:
            self.local_ = LocalContexts.fit(cells, self._relevance_targets(y), self.n_members_,
                                            self.local_context_rows, rng, relevance, self.device_, held=held,
                                            held_members=held_members)
            self.context_rows_, self.context_members_ = self.local_.rows, self.local_.members
            return
        if held is not None and held_members:
            raise ValueError("held rows are left out of local contexts only")
        self.local_ = None
        self.context_members_ = np.arange(self.n_members_)
        rows = min((r for r in (self.max_context_rows, limit) if r is not None), default=None)
        if rows is not None and n > rows:
            self.context_rows_ = np.stack([np.sort(rng.choice(n, rows, replace=False))
                                           for _ in range(self.n_members_)])
        else:
            self.context_rows_ = np.tile(np.arange(n), (self.n_members_, 1))

    def _model(self) -> TabFM:
        """The fitted `model_`; loaded here (with its mesh under tensor_parallel) when absent: at fit, and once
        after unpickling or `load`, which do not store it."""
        model = self.__dict__.get("model_")
        if model is None:
            tp = None if self.tensor_parallel is None else tuple(self.tensor_parallel)
            model = self.model_ = load_estimator_model(self.checkpoint, self.device_, self.dtype_, tp,
                                                       self.sequence_parallel)
        return model

    def _scaled(self, cells: Cells, units: np.ndarray) -> dict[str, np.ndarray]:
        """The numeric values of every row of `cells` under each numeric transform the contexts `units` use: every
        transform is row by row, so the rows are scaled once here and each forward takes its rows."""
        kinds = {self.members_[self.context_members_[u]].numeric for u in units}
        return {kind: self.preprocessor_.scale(cells, kind) for kind in sorted(kinds)}

    def _unit_values(self, cells: Cells, units: np.ndarray, rows: np.ndarray,
                     scaled: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
        """Tensors [g, r, C'] of the contexts `units` (indices into context_rows_), each through its member's view
        of the rows rows[i] of `cells` for units[i] (rows [g, r]); scaled: self._scaled(cells, these units or
        more), computed here when not given. The units of one call show the model the same number of columns
        (tabfm.forward_sizes.context_groups)."""
        scaled = self._scaled(cells, units) if scaled is None else scaled
        views = []
        for i, u in enumerate(units):
            member: Member = self.members_[self.context_members_[u]]
            views.append(member_cells(self.preprocessor_, cells.take(rows[i]), member, scaled[member.numeric][rows[i]]))
        values = torch.from_numpy(np.stack([v.values for v in views]))
        cat_codes = torch.from_numpy(np.stack([v.codes for v in views]))
        is_cat = torch.from_numpy(np.stack([v.is_cat for v in views]))
        return {
            "values": torch.nan_to_num(values, nan=0.0).to(self.dtype_),
            "missing": torch.where(is_cat[:, None, :], cat_codes < 0, torch.isnan(values)),
            "cat_codes": cat_codes,
            "is_cat": is_cat,
            "n_cats": torch.from_numpy(np.stack([v.n_cats for v in views])),
        }

    def _batch(self, parts: dict[str, Any], labels: torch.Tensor, n_train: int, n_classes: int) -> Batch:
        g, r, C = parts["values"].shape
        return Batch(**parts, labels=labels, n_train=torch.full((g,), n_train), n_classes=torch.full((g,), n_classes),
                     row_pad=torch.zeros(g, r, dtype=torch.bool), col_pad=torch.zeros(g, C, dtype=torch.bool),
                     task=self._task).to(self.device_)

    def _forward_sizes(self) -> forward_sizes.ForwardSizes:
        """How this estimator cuts its forwards (tabfm.forward_sizes)."""
        heap = forward_sizes.HEAP_BLOCK_BYTES if self.device_.type == "cpu" else None  # read here: benchmarks set it
        return forward_sizes.ForwardSizes(self._model().config, torch.finfo(self.dtype_).bits // 8, heap,
                                          self._table_workers())

    def _table_workers(self) -> int:
        """Threads the contexts' forwards are spread over (tabfm.table_threads)."""
        return table_workers(self.device_, sharded=self.tensor_parallel is not None)

    def _encode_contexts(self) -> None:
        """Encode every context once, each group in forwards sized by tabfm.forward_sizes, spread over the table
        threads; each forward's tables are kept as the Context it made. They were copied into one Context per
        group once (fewer, larger predict forwards), but the copy moved every cached key and value again: 7% of
        fit at 10,000 train rows on a CPU, 14% at 50,000, while predict forwards on a CPU are heap-sized anyway
        and off a CPU a group is one forward."""
        model, sizes = self._model(), self._forward_sizes()
        scaled = self._scaled(self.train_cells_, np.arange(len(self.context_rows_)))

        def encode(units: np.ndarray) -> Context:
            parts = self._unit_values(self.train_cells_, units, self.context_rows_[units], scaled)
            labels = torch.from_numpy(np.stack([
                self._member_labels(self.context_members_[u], self.y_train_[self.context_rows_[u]]) for u in units]))
            batch = self._batch(parts, labels, self.context_rows_.shape[1], self._n_outputs())
            with self._autocast():
                return encode_context(model, batch)

        cells, max_columns = self.train_cells_, self.preprocessor_.max_columns
        widths = np.array([member_width(m, cells.is_cat, cells.n_cats, max_columns) for m in self.members_])
        self.contexts_, rows = [], self.context_rows_.shape[1]
        for units, width in forward_sizes.context_groups(widths[self.context_members_], rows):
            forwards = np.array_split(units, sizes.tables(len(units), rows, width, encoding=True))
            self.contexts_ += zip(forwards, map_tables(encode, forwards, sizes.workers), strict=True)
            self._release_heap()
        self._contexts_encoded()

    def _release_heap(self) -> None:
        """On a CPU, give the heap's freed memory back between forwards (tabfm.heap_release: without it resident
        memory grew with every batch predicted)."""
        if self.device_.type == "cpu":
            heap_release.release_free_heap()

    def _contexts_encoded(self) -> None:
        """Hook: what a subclass reads from freshly encoded contexts."""

    def _autocast(self):
        """The context model forwards run in: pretraining's (tabfm.precision.autocast) at precision_; an estimator
        pickled before precision existed was fitted in fp32."""
        return autocast(getattr(self, "precision_", "fp32"), self.device_)

    # -- predict -----------------------------------------------------------------------------------------

    def _cells_of(self, X: Any) -> Cells:
        """The preprocessed cells of the rows of X, checked against what fit saw."""
        check_is_fitted(self, "preprocessor_")
        X = arrow_as_polars(X)
        check_table_shape(X)
        validate_data(self, X, reset=False, skip_check_array=True)  # feature count and names as at fit
        return self.preprocessor_.transform(X)

    def _cell_outputs(self, cells: Cells, finalize=None, members: int | None = None) -> np.ndarray:
        """Per-member outputs [M, n, Y] of the rows of `cells` (class-group log-probabilities, or regression bin
        probabilities), or finalize(outputs, contexts, weights) of each test batch concatenated over the batches,
        where contexts [K, rows] says which context (index into context_rows_) each output [K, rows, Y] came from
        and weights [K, rows] its weight in the average (None: equal; the regressor's second-context mixture
        gives K = 2M weighted outputs); members: only the first this many members (M of them), where not all."""
        if self.contexts_ is None:  # after unpickling: the caches are rebuilt, not stored
            self._encode_contexts()
        model = self._model()
        n = len(cells.values)
        results = []
        from tqdm.auto import tqdm

        # the train rows that local contexts route by, moved to the device once per call, not once per batch
        train_points = None if self.local_ is None else torch.from_numpy(self.local_.points).to(self.device_)
        starts = range(0, n, self.batch_size)
        for start in tqdm(starts, desc="predict", unit="batch", disable=not self.verbose or len(starts) < 2):
            sub = cells.take(slice(start, start + self.batch_size))
            out, units, weights = self._batch_outputs(model, sub, train_points, members)
            if finalize is None and weights is not None:
                raise ValueError("weighted outputs need a finalize that reads their weights")
            results.append(out if finalize is None else finalize(out, units, weights))
            self._release_heap()
        return np.concatenate(results, axis=0 if finalize is not None else 1)

    def _mixes_contexts(self) -> bool:
        """Whether a test row near the edge of its local context is also predicted from each member's second
        context (LocalContexts.routes), the two mixed by _mix_contexts: the mix_contexts parameter."""
        return bool(getattr(self, "mix_contexts", False))  # an estimator pickled before the parameter: as it was

    def _batch_outputs(self, model: TabFM, cells: Cells, train_points: torch.Tensor | None,
                       members: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(outputs [M, n, Y], contexts [M, n], None) of one test batch: every row against each member's one
        context, or with local contexts against the context each member routes it to (tabfm.local_context;
        train_points: its `points` on device_); where _mixes_contexts also against its second context, the two
        mixed by _mix_contexts. The forwards spread over the table threads. members: the first M members only
        (None: all)."""
        n, M = len(cells.values), self.n_members_ if members is None else members
        route = second = share = None
        if self.local_ is not None:
            route, second, share = (a[:M] for a in self.local_.routes(cells, train_points))  # [M, n] each
            if not self._mixes_contexts():
                second, share = route, np.zeros_like(share)
        units_of = (np.tile(self.context_members_[:M, None], (1, n)) if route is None else route)
        scaled = self._scaled(cells, np.unique(units_of))  # a member's contexts share its numeric transform
        sizes = self._forward_sizes()
        jobs = []  # (context, its tables in this forward, their units, each one's test rows, how many of them first)
        for units, context in self.contexts_:
            if route is None:  # every table reads every row: split the rows, not the tables (and their caches)
                tables = np.flatnonzero(self.context_members_[units] < M)
                if len(tables) == 0:
                    continue
                count = sizes.test_rows(n, len(tables), context.num_columns)
                jobs += [(context, tables, units[tables], [part] * len(tables), [len(part)] * len(tables))
                         for part in np.array_split(np.arange(n), count)]
                continue
            firsts, rows = [], []  # a unit's rows: those it is first for, then those it is second for
            for u in units:
                m = self.context_members_[u]
                first = np.flatnonzero(route[m] == u) if m < M else np.empty(0, np.int64)
                also = np.flatnonzero((second[m] == u) & (share[m] > 0)) if m < M else np.empty(0, np.int64)
                firsts.append(len(first))
                rows.append(np.concatenate([first, also]))
            for tables in padded_chunks([len(r) for r in rows]):
                count = sizes.tables(len(tables), len(rows[tables[0]]), context.num_columns,
                                     cache_rows=context.n_train)
                jobs += [(context, part, units[part], [rows[t] for t in part], [firsts[t] for t in part])
                         for part in (tables[i::count] for i in range(count))]  # dealt round: equal shares

        def forward(job) -> np.ndarray:
            context, tables, units, rows, _ = job
            width = max(len(r) for r in rows)
            padded = np.stack([np.resize(r, width) for r in rows])  # repeats: harmless extra queries
            if not np.array_equal(tables, np.arange(context.num_tables)):
                context = context.select(torch.as_tensor(tables))  # in the thread: one slice's copy at a time
            return self._context_outputs(model, context, self._unit_values(cells, units, padded, scaled))

        mixing = share is not None and bool(share.any())
        out = also = None
        for (_, _, units, rows, firsts), res in zip(jobs, map_tables(forward, jobs, sizes.workers), strict=True):
            if out is None:
                out = np.empty((M, n, res.shape[-1]), np.float64)
                also = np.zeros_like(out) if mixing else None
            for j, (r, f) in enumerate(zip(rows, firsts, strict=True)):
                m = self.context_members_[units[j]]
                out[m, r[:f]] = res[j, :f]
                if f < len(r):
                    also[m, r[f:]] = res[j, f:len(r)]
        return self._mix_contexts(out, also, share, route, second) if mixing else (out, units_of, None)

    def _mix_contexts(self, first: np.ndarray, second: np.ndarray, share: np.ndarray, first_units: np.ndarray,
                      second_units: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Hook (where _mixes_contexts()): the members' outputs [M, n, Y] from the rows' first and second contexts
        (first_units, second_units [M, n]), the second weighted by share [M, n], as _batch_outputs returns them:
        (outputs [K, n, Y], contexts [K, n], each output's weight [K, n] in the average, or None: equal)."""
        raise NotImplementedError

    def _context_outputs(self, model: TabFM, context: Context, parts: dict[str, Any]) -> np.ndarray:
        """Decoded outputs [g, r, Y] of test rows `parts` (every row a test row) against the g tables of `context`."""
        labels = torch.full(parts["values"].shape[:2], IGNORE_LABEL if self._task == "classification" else 0)
        if self._task == "regression":
            labels = labels.to(self.dtype_)
        batch = self._batch(parts, labels, 0, self._n_outputs())
        with self._autocast():
            logits = predict_logits(model, context, batch)
        logits = logits.double()  # decoded in float64 whatever the model's dtype or precision
        return self._decode_member(model, context, logits).cpu().numpy()

    _UNSTORED = ("model_",)
    """Fitted attributes that pickling and `save` leave out: the model (and its mesh) is rebuilt from the
    checkpoint on first use, as scikit-learn and TabICL do."""

    def __getstate__(self) -> dict:
        state = {k: v for k, v in self.__dict__.items() if k not in self._UNSTORED}
        if "contexts_" in state:
            state["contexts_"] = None  # large and device-bound: re-encoded from the stored train rows on first use
        return state

    def save(self, path: str | Path) -> None:
        """Save the fitted estimator to the folder `path` (tabfm.persist: JSON and safetensors, no pickle), with its
        encoded train rows, so that `load` gives an estimator that predicts at once."""
        from tabfm.persist import save_estimator

        save_estimator(self, path)

    @classmethod
    def load(cls, path: str | Path, device: str | None = None) -> _TabFMBase:
        """The fitted estimator saved at `path`; its caches on `device` (default: the saved one if present, else
        cpu)."""
        from tabfm.persist import load_estimator

        return load_estimator(cls, path, device)


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
    max_features : int or None, default=24
        Each member of a table with more kept columns sees a random subset of this many (the members together
        see every column, or, on tables wider than n_estimators x max_features, the columns that explain most
        of y alone); None: every member sees all columns (at most the model's 100). The shipped model was
        pretrained mostly on narrow tables: subsets of 24 were better on 7 of the 9 tables wider than that.
    checkpoint : str, path or None, default=None
        A merged .safetensors file or a checkpoint folder; None: the shipped model.
    categorical_features : "auto", list of int or str, or boolean mask, default="auto"
        Columns to treat as categorical besides strings, booleans and categorical dtypes: their indices or names,
        or one boolean per column (as scikit-learn's HistGradientBoosting takes).
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
        A progress bar over test batches.
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
        half of one more encoding of the train rows.
    linear_blend : bool, default=True
        With calibrate, also weigh in a logistic regression: the predicted probabilities are
        (1 - w) * the ensemble's + w * the logistic regression's, w in 0..0.9 chosen with the temperature on the
        same held-out rows (w = 0 where it does not help them), as are whether the logistic regression sees the
        numeric columns as they are, Yeo-Johnson transformed or with hinge columns, and its L2 penalty (C 0.1, 1
        or 10). The model alone draws linear boundaries over many columns poorly (tabfm.linear_base).
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
                                    "mix_contexts": ["boolean"]}

    def __init__(self, n_estimators: int | str = "auto", *, numeric_transforms: tuple[str, ...] = ("none", "power"),
                 categorical_views: tuple[str, ...] = ("ordinal",), max_features: int | None = 24,
                 checkpoint: str | Path | None = None, categorical_features: str | list[int | str] = "auto",
                 max_context_rows: int | None = None, batch_size: int = 1024, device: str = "cpu",
                 dtype: str = "float32", precision: str = "auto", tensor_parallel: tuple[int, int] | None = None,
                 sequence_parallel: bool = True,
                 random_state: int | np.random.RandomState | np.random.Generator | None = 0, verbose: bool = False,
                 n_jobs: int | None = None, local_context_rows: int | None = 256, average: str = "probability",
                 softmax_temperature: float = 1.0, calibrate: bool = True, linear_blend: bool = True,
                 mix_contexts: bool = True):
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

    @_fit_or_keep
    @_threaded
    def fit(self, X: Any, y: Any) -> TabFMClassifier:
        """Preprocess and encode the train rows; y: class labels (any hashable values of one kind)."""
        self._validate_params()
        check_table_shape(X)
        y = check_class_labels(y)
        self.classes_, y_ids = np.unique(y, return_inverse=True)
        K = len(self.classes_)
        if K < 2:
            raise ValueError(f"y has 1 class ({self.classes_[0]!r}): a classifier needs at least two classes")
        model = self._prepare()
        max_classes = model.config.max_classes
        n_members = code_members(self._members_for(len(y_ids)), K, max_classes, auto=self.n_estimators == "auto")
        self.class_codes_ = class_codes(K, max_classes, n_members, np.random.default_rng(self.seed_))
        self.n_groups_ = min(K, max_classes)
        y_ids = y_ids.astype(np.int64)
        rng = self._calibration_rng()
        held = self._calibration_rows(y_ids, rng) if self.calibrate else np.empty(0, np.int64)
        held_members = self._held_members(n_members, len(y_ids) - len(held))
        if len(held) and held_members:
            self._fit_common(X, y_ids, n_members, model, held=held, held_members=held_members)
            self.temperature_, self.blend_weight_, linear = self._fit_temperature(
                self._cell_outputs(self.train_cells_.take(held), members=held_members), held)
        else:
            self._fit_common(X, y_ids, n_members, model, encode=False)
            self.temperature_, self.blend_weight_, linear = (
                self._calibrate(held, rng) if len(held) else (float(self.softmax_temperature), 0.0, None))
            self._encode_contexts()  # after the probe's contexts are freed: their caches never coexist with these
        self.linear_model_ = (LogisticModel.fit(self.train_cells_, self.y_train_, K, linear.view, linear.C,
                                                start=linear.kept) if self.blend_weight_ > 0 else None)
        return self

    def _calibration_rows(self, y: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """The train rows (class ids y) calibration predicts (tabfm.calibration.held_out_rows); none where fewer
        than 10, too few to fit a temperature to."""
        held = calibration.held_out_rows(y, len(self.classes_), rng)
        return held if len(held) >= 10 else np.empty(0, np.int64)

    def _held_members(self, n_members: int, kept: int) -> int:
        """As the base's (0: calibrate through a probe), and 0 with more classes than the model's head: every
        member is then needed to decode them."""
        return 0 if len(self.classes_) > self.n_groups_ else super()._held_members(n_members, kept)

    def _fit_temperature(self, logp: np.ndarray, held: np.ndarray) -> tuple[float, float, LinearChoice]:
        """(softmax temperature, blend weight, the logistic regression's LinearChoice) that minimise the log-loss
        of the train rows `held`, given the members' predictions of them logp [M, h, G] from contexts without
        them, and with linear_blend a logistic regression's fitted on the other train rows. Its view of the
        numeric columns (linear_base.LINEAR_VIEWS) is chosen at the first penalty of linear_base.LOGISTIC_CS,
        then its penalty among them in that view, each fit starting from that view's first (two stages: a fit
        per view and per other penalty, not per pair). Ties go to the first view and penalty, then the lowest
        temperature, then the lowest weight."""
        y, K = self.y_train_, len(self.classes_)
        keep = np.setdiff1d(np.arange(len(y)), held)
        held_cells, keep_cells = self.train_cells_.take(held), self.train_cells_.take(keep)

        truth = np.arange(len(held)), y[held]  # the log-loss reads each held row's true class only
        ensemble = calibration.true_class_probabilities(lambda t: self._combine(logp, t), y[held])
        weights, linears, choices = np.zeros(1), [np.zeros(len(held))], [LinearChoice("plain", LOGISTIC_CS[0])]
        if self.linear_blend and len(np.unique(y[keep])) > 1:
            weights, design = calibration.BLEND_WEIGHTS, LinearDesign.fit(keep_cells)
            views = design.views(len(keep))  # hinges where their lbfgs has room, as the ridge's
            firsts = [LogisticModel.fit_design(keep_cells, y[keep], K, design.viewed(view, keep_cells),
                                               LOGISTIC_CS[0]) for view in views]
            linears = [model.predict_proba(held_cells)[truth] for model in firsts]
            best = calibration.best_blend(ensemble, np.stack(linears), weights)[0]
            models = [firsts[best]] + [LogisticModel.fit_design(keep_cells, y[keep], K, firsts[best].design, C,
                                                                start=firsts[best]) for C in LOGISTIC_CS[1:]]
            linears = [linears[best]] + [model.predict_proba(held_cells)[truth] for model in models[1:]]
            choices = [LinearChoice(views[best], C, model) for C, model in zip(LOGISTIC_CS, models, strict=True)]
        choice, temperature, weight = calibration.best_blend(ensemble, np.stack(linears), weights)
        return temperature, weight, choices[choice]

    def _calibrate(self, held: np.ndarray, rng: np.random.Generator) -> tuple[float, float, LinearChoice]:
        """(softmax temperature, blend weight, LinearChoice) from the calibration rows `held`
        predicted by a probe: the same ensemble fitted on the other train rows. Where the first members' local
        contexts cannot leave the rows out (no local contexts, too few rows left, fewer than 4 members, or too
        many classes), an honest held-out prediction needs a second encoding: nothing of the full contexts
        carries over to one, since every stage that reads train rows mixes all of them (the cell statistics, the
        attention down each column, the in-context transformer). It is kept cheap: its context holds at most
        half the train rows (never fewer than CALIBRATION_CONTEXT_ROWS), drawn per member, and it runs before the
        full contexts are encoded, its caches freed first, so peak memory is the larger encoding, not both; and
        it runs the first calibration.calibration_members members only, where the classes allow.
        """
        y, n = self.y_train_, len(self.y_train_)
        keep = np.setdiff1d(np.arange(n), held)
        probe = copy.copy(self)  # through __getstate__: no model_, no contexts
        probe.model_ = self._model()
        if len(self.classes_) <= self.n_groups_:  # else every member is needed to decode the classes
            members = calibration.calibration_members(self.n_members_)
            probe.n_members_, probe.members_ = members, self.members_[:members]
            probe.class_codes_ = self.class_codes_[:members]
        probe.train_cells_, probe.y_train_ = self.train_cells_.take(keep), y[keep]
        probe._draw_contexts(probe.train_cells_, probe.y_train_, rng,
                             max(calibration.CALIBRATION_CONTEXT_ROWS, n // 2))
        probe.contexts_ = None
        return self._fit_temperature(probe._cell_outputs(self.train_cells_.take(held)), held)

    def _blend(self, proba: np.ndarray, cells: Cells) -> np.ndarray:
        """The ensemble's class probabilities of the rows of `cells` with the logistic regression weighed in."""
        if getattr(self, "linear_model_", None) is None:  # also an estimator saved before the blend existed
            return proba
        return (1 - self.blend_weight_) * proba + self.blend_weight_ * self.linear_model_.predict_proba(cells)

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

    @_threaded
    def predict_proba(self, X: Any) -> np.ndarray:
        """[n, n_classes] class probabilities, columns in the order of classes_."""
        cells = self._cells_of(X)
        return self._blend(self._cell_outputs(cells, lambda logp, *_: self._combine(logp, self.temperature_)), cells)

    def predict_log_proba(self, X: Any) -> np.ndarray:
        return np.log(np.clip(self.predict_proba(X), 1e-300, None))

    def predict(self, X: Any) -> np.ndarray:
        proba = self.predict_proba(X)
        return self.classes_[proba.argmax(1)]


def __getattr__(name: str):
    """TabFMRegressor lives in tabfm.regressor (which imports this module): read it from here on first use."""
    if name == "TabFMRegressor":
        from tabfm.regressor import TabFMRegressor

        return TabFMRegressor
    raise AttributeError(f"module 'tabfm.estimator' has no attribute {name!r}")
