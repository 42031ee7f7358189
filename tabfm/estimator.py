"""The machinery the scikit-learn estimators share (_TabFMBase: preprocessing, ensemble, encoding, batched predict,
save / load); `TabFMClassifier` is in tabfm.classifier, `TabFMRegressor` in tabfm.regressor.

fit() learns nothing by gradient: it preprocesses the train rows (tabfm.preprocess), draws the ensemble and encodes
the train rows once per member (tabfm.inference.encode_context, keys/values cached). predict() runs only the test
rows, in batches of `batch_size`, against those caches: a prediction does not depend on the other rows of X.

Ensemble (tabfm.ensemble): member m sees the columns in its own order (member 0: the original order; a random
subset when max_features is set), numeric columns under its entry of numeric_transforms, categorical columns in
its entry of categorical_views and, for classification, its own permutation of the class ids; the members' class
probabilities are averaged (or their log-probabilities, average="logit"), and with calibrate a temperature and
a logistic regression's weight (tabfm.linear_base) are fitted on held-out train rows.

Sharded inference: with `tensor_parallel=(d0, d1)` under torchrun (d0 * d1 processes), the model is split over a
d0 x d1 mesh (heads by tensor parallelism, rows by sequence parallelism when `sequence_parallel`): every rank
calls fit / predict with the same data and gets the one-process result.
"""

from __future__ import annotations

import contextlib
import copy
import numbers
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sklearn.base import BaseEstimator
from sklearn.utils._param_validation import Interval, StrOptions
from sklearn.utils.validation import check_is_fitted, validate_data

from tabfm import calibration, forward_sizes, heap_release
from tabfm.cache_memory import check_contexts
from tabfm.category_encoding import CategoryEncoding
from tabfm.data.encode import IGNORE_LABEL, Batch
from tabfm.ensemble import (WIDE_MAX_FEATURES, Member, auto_max_features, auto_members, draw_members, member_cells,
                            member_width)
from tabfm.estimator_model import load_estimator_model, weights_digest
from tabfm.inference import Context, encode_context, predict_logits
from tabfm.inference_precision import resolve_precision, resolve_weight_dtype
from tabfm.local_context import LocalContexts, column_relevance, padded_chunks
from tabfm.model import TabFM
from tabfm.precision import autocast
from tabfm.preprocess import Cells, TablePreprocessor
from tabfm.raw_columns import arrow_as_polars, check_table_shape
from tabfm.table_threads import host_work, map_tables, table_workers
from tabfm.tree_base import fit_trees
from tabfm.tree_fits import TreeFits
from tabfm.validation import (ESTIMATOR_PARAMETER_CONSTRAINTS, _PositiveInt, resolve_device, resolve_seed,
                              torch_threads)


_VIEW_LIST = [tuple, list, str]
_BASE_CONSTRAINTS = {**ESTIMATOR_PARAMETER_CONSTRAINTS, "numeric_transforms": _VIEW_LIST,
                     "categorical_views": _VIEW_LIST, "max_features": [_PositiveInt(), StrOptions({"auto"}), None],
                     "local_context_rows": [Interval(numbers.Integral, 2, None, closed="left"), None]}
_BASE_CONSTRAINTS.pop("calibrate")


class _TabFMBase(BaseEstimator):
    """What the classifier and the regressor share: input checks, the ensemble, caches, batched prediction."""

    _task: str = ""
    _parameter_constraints: dict = _BASE_CONSTRAINTS
    _wide_max_features: int = WIDE_MAX_FEATURES
    """What max_features="auto" shows a member of a table wider than the model (tabfm.ensemble.auto_max_features)."""

    def __init__(self, n_estimators: int | str = "auto", *, numeric_transforms: tuple[str, ...] = ("none", "power"),
                 categorical_views: tuple[str, ...] = ("ordinal",), max_features: int | str | None = "auto",
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
        self.__dict__.pop("weights_digest_", None)
        model = self._model()
        self.weights_digest_ = weights_digest(self.checkpoint)  # what the encoded train rows belong to
        return model

    def _fit_common(self, X: Any, y: np.ndarray, n_members: int, model: TabFM, encode: bool = True,
                    held: np.ndarray | None = None, held_members: int = 0) -> None:
        """Preprocess, draw the ensemble and (unless encode is False) encode the contexts; y is [n] class ids or
        float targets; held: train rows the first held_members members' local contexts leave out (the
        classifier's calibration rows)."""
        with host_work(len(y)):  # the forwards come after, on table threads
            X = arrow_as_polars(X)
            validate_data(self, X, reset=True, skip_check_array=True)
            kinds = ((self.numeric_transforms,) if isinstance(self.numeric_transforms, str)
                     else tuple(self.numeric_transforms))
            used = sorted({kinds[m % len(kinds)] for m in range(n_members)}) if kinds else []  # only what is used
            self.preprocessor_ = TablePreprocessor(self.categorical_features, max_columns=model.config.max_columns,
                                                   transforms=used).fit(X)
            cells = self.preprocessor_.transform(X)
            if len(y) != len(cells.values):
                raise ValueError(f"X has {len(cells.values)} rows but y has {len(y)}")
            self.category_encoding_, cells = CategoryEncoding.fit(cells, *self._encoding_targets(y), self.seed_)
            C, limit = cells.values.shape[1], model.config.max_columns
            width = (auto_max_features(C, limit, self._wide_max_features) if self.max_features == "auto"
                     else self.max_features)
            shown = min(C, width or C)
            if shown > limit:
                raise ValueError(f"X has {C} informative features and max_features={self.max_features} shows each "
                                 f"member {shown}, but the model takes at most {limit}: set max_features to at most "
                                 f"{limit} (members then see subsets), or to \"auto\"")
            self.n_members_ = n_members
            y = self._context_targets(cells, y)
            rng = np.random.default_rng(self.seed_)
            relevance = (column_relevance(cells, self._relevance_targets(y))
                         if width is not None and C > width else None)
            self.members_ = draw_members(n_members, C, self.numeric_transforms, self.categorical_views, width, rng,
                                         relevance)
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

    def _calibration_folds(self, n: int, held: np.ndarray, n_members: int, rng: np.random.Generator,
                           classes: np.ndarray | None = None) -> tuple[list[np.ndarray], int]:
        """([the sets of train rows calibration predicts, each from the rows outside it], how many first members
        leave them out of their local contexts and predict them) of n train rows, given `held`, the one set drawn
        for it: that set where members can hold it (_held_members); otherwise probes predict the rows, and on
        tables of at most calibration.CROSS_FIT_ROWS train rows, where one set is a few dozen rows, every row
        instead, in folds (calibration.cross_fit_folds, stratified by class ids `classes`). ([], 0) where none is
        drawn (calibrate=False), or fewer than calibration.MIN_HELD_ROWS would be held and the table is not
        cross-fitted (a fuzzer's 50-row tables of 26 and 24 rows drew 9 and went uncalibrated). Why not cross-fit
        every small table: where members hold the rows there is no second encoding to pay for, and on the 56
        tables the folds gained where a probe runs anyway (docs/accuracy.md)."""
        few = len(held) < calibration.MIN_HELD_ROWS
        if not len(held) or (few and not calibration.cross_fits(n)):
            return [], 0
        members = 0 if few else self._held_members(n_members, n - len(held))
        if members or not calibration.cross_fits(n):
            return [held], members
        return calibration.cross_fit_folds(n, rng, classes), 0

    def _probe(self, held: np.ndarray, rng: np.random.Generator, members: int) -> _TabFMBase:
        """The calibration's probe: this ensemble's first `members` members fitted on the train rows other than
        `held`, its contexts drawn (not yet encoded: the first predict encodes them) from at most half the train
        rows, never fewer than calibration.CALIBRATION_CONTEXT_ROWS. Where the first members' local contexts cannot
        leave the held rows out (no local contexts, too few rows left, fewer than 4 members, or more classes than
        the head), an honest held-out prediction needs a second encoding: nothing of the full contexts carries
        over, since every stage that reads train rows mixes all of them. The estimators run it before their own
        contexts are encoded, its caches freed first, so peak memory is the larger encoding, not both."""
        n = len(self.y_train_)
        keep = np.setdiff1d(np.arange(n), held)
        probe = copy.copy(self)  # through __getstate__: no model_, no contexts
        probe.model_ = self._model()
        probe.n_members_, probe.members_ = members, self.members_[:members]
        probe._keep_members(members)
        probe.train_cells_, probe.y_train_ = self.train_cells_.take(keep), self.y_train_[keep]
        probe._draw_contexts(probe.train_cells_, probe.y_train_, rng,
                             max(calibration.CALIBRATION_CONTEXT_ROWS, n // 2))
        probe.contexts_ = None
        return probe

    def _keep_members(self, members: int) -> None:
        """Keep the per-member fitted state of the first `members` members only (the probe's)."""

    def _relevance_targets(self, y: np.ndarray) -> np.ndarray:
        """[n, T] the context targets y_train_ as tabfm.local_context.column_relevance reads them: one-hot class
        ids (the classifier), or the regressor's targets as one column."""
        if self._task == "classification":
            return (y[:, None] == np.arange(int(y.max()) + 1)[None]).astype(np.float64)
        return np.asarray(y, np.float64)[:, None]

    def _encoding_targets(self, y: np.ndarray) -> tuple[np.ndarray, int | None]:
        """Hook: (targets, classes) the target encodings of many-level categorical columns are fitted to
        (tabfm.category_encoding): the classifier's class ids and class count; the regressor's normalised
        targets and None."""
        return y, len(self.classes_)

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
            # the memory check before the searches for each context's rows (minutes at a million rows)
            self.local_ = LocalContexts.fit(
                cells, self._relevance_targets(y), self.n_members_, self.local_context_rows, rng, relevance,
                self.device_, held=held, held_members=held_members,
                check_counts=lambda counts: self._check_cache_memory(cells, counts, self.local_context_rows))
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
        self._check_cache_memory(cells, np.bincount(self.context_members_, minlength=self.n_members_),
                                 self.context_rows_.shape[1])

    def _model(self) -> TabFM:
        """The fitted `model_`; loaded here (with its mesh under tensor_parallel) when absent: at fit, and once
        after unpickling or `load`, which do not store it."""
        model = self.__dict__.get("model_")
        if model is None:
            tp = None if self.tensor_parallel is None else tuple(self.tensor_parallel)
            model = load_estimator_model(self.checkpoint, self.device_, self.dtype_, tp, self.sequence_parallel)
            self._check_weights()
            self.model_ = model
        return model

    def _check_weights(self) -> None:
        """After `load` or unpickling: refuse weights other than those fit encoded the train rows with (absent in
        estimators saved before the digest was kept: nothing to compare)."""
        fitted = self.__dict__.get("weights_digest_")
        if fitted is None:
            return
        now = weights_digest(self.checkpoint)
        if now == fitted:
            return
        name = type(self).__name__
        if self.checkpoint is None:
            raise ValueError(f"this {name} was fitted with other shipped weights (SHA-256 {fitted[:12]}..., this "
                             f"tabfm's are {now[:12]}...) and its cached train rows belong to those: refit it, or "
                             "load it with the tabfm version that saved it")
        raise ValueError(f"this {name} was fitted with checkpoint={str(self.checkpoint)!r} (SHA-256 {fitted[:12]}...), "
                         f"which now names other weights ({now[:12]}..., {Path(self.checkpoint).resolve()}) and its "
                         "cached train rows belong to the old ones: put those back at that path, or refit")

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

        from tqdm.auto import tqdm
        widths = self._member_widths(self.train_cells_)
        self.contexts_, rows = [], self.context_rows_.shape[1]
        with tqdm(total=len(self.context_rows_), desc="fit: encode contexts", unit="context",
                  disable=not self.verbose) as bar:  # most of a long fit; a step per forward
            for units, width in forward_sizes.context_groups(widths[self.context_members_], rows):
                forwards = np.array_split(units, sizes.tables(len(units), rows, width, encoding=True))
                encoded = map_tables(encode, forwards, sizes.workers, lambda units: bar.update(len(units)))
                self.contexts_ += zip(forwards, encoded, strict=True)
                self._release_heap()
        self._contexts_encoded()

    def _member_widths(self, cells: Cells) -> np.ndarray:
        """[M] the columns each member shows the model of `cells` (its view: one-hot columns counted)."""
        return np.array([member_width(m, cells.is_cat, cells.n_cats, self.preprocessor_.max_columns)
                         for m in self.members_])

    def _check_cache_memory(self, cells: Cells, counts: list[int] | np.ndarray, rows: int) -> None:
        """Refuse (MemoryError) contexts of `rows` rows of `cells` (counts [M]: each member's) whose cached keys and
        values would not fit in the memory available, before any is encoded (tabfm.cache_memory); not under
        torch.distributed (cache_memory.check_contexts says why)."""
        element = 2 if self.precision_ == "bf16" else torch.finfo(self.dtype_).bits // 8  # autocast caches: bf16
        check_contexts(self._model().config, rows, counts, self._member_widths(cells), element, len(cells.values),
                       self.device_)

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
        with host_work(len(self.y_train_)):
            X = arrow_as_polars(X)
            check_table_shape(X)
            validate_data(self, X, reset=False, skip_check_array=True)  # feature count and names as at fit
            cells = self.preprocessor_.transform(X)
            encoding = getattr(self, "category_encoding_", None)  # absent in estimators saved before it existed
            return cells if encoding is None else encoding.transform(cells)

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
            with host_work(len(self.y_train_)):
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

    _SAVED_APART = ("tree_model_",)
    """Fitted attributes that `save` leaves out of its JSON: the trees, written to their own file with skops
    (tabfm.persist), or fitted again at load from what the JSON keeps; pickling keeps them."""

    def _draw_tree_seed(self) -> int:
        """The trees' random_state (tabfm.tree_base): the fit's seed folded into 32 bits, or one drawn where the fit
        has none (random_state=None), kept so that `load` fits the same trees again."""
        if self.seed_ is None:
            return int(np.random.default_rng().integers(2**31))  # fresh entropy, as the fit's own
        return self.seed_ % 2**32

    def _tree_fits(self, folds: list[np.ndarray], targets: np.ndarray,
                   n_classes: int | None) -> contextlib.AbstractContextManager[TreeFits | None]:
        """The trees' fits of this fit started beside its forwards (tabfm.tree_fits), on the train cells and
        `targets`, where the calibration weighs trees in (tree_blend, and `folds` to score them on); else None.
        Their threads: on a CPU one (two OpenMP teams on the same cores made a 1,000-row fit 1.7x slower on two
        cores); on an accelerator n_jobs less the one that launches the device's work. The fit on every row starts
        ahead of the trees' weight only where they grow one tree per round (tabfm.tree_fits)."""
        if not (self.tree_blend and folds):
            return contextlib.nullcontext()
        threads = 1 if self.device_.type == "cpu" else max(1, torch.get_num_threads() - 1)
        return TreeFits(self.train_cells_, targets, n_classes, self.tree_seed_, folds, threads,
                        ahead=n_classes is None or n_classes <= 2)

    def _fit_tree_model(self, trees: TreeFits | None = None) -> None:
        """tree_model_: the trees on every train row where they have a weight (those of `trees` where given),
        else None (at fit, and at load under another scikit-learn than save's, from the saved cells and seed, on one
        thread on a CPU as at fit; None too for an estimator saved before they existed)."""
        if getattr(self, "tree_weight_", 0.0) <= 0:
            self.tree_model_ = None
            return
        with torch_threads(1) if self.device_.type == "cpu" and trees is None else contextlib.nullcontext():
            self.tree_model_ = trees.all_rows_model() if trees is not None else fit_trees(
                self.train_cells_, *self._tree_targets(), self.tree_seed_)

    def _tree_targets(self) -> tuple[np.ndarray, int | None]:
        """(what the trees learn of the train rows, the class count or None for regression)."""
        raise NotImplementedError

    def __getstate__(self) -> dict:
        state = {k: v for k, v in self.__dict__.items() if k not in self._UNSTORED}
        if "contexts_" in state:
            state["contexts_"] = None  # large and device-bound: re-encoded from the stored train rows on first use
        return state

    def __setstate__(self, state: dict) -> None:
        """A pickle from before a parameter existed gets its default (tree_blend, ...): get_params, clone and a
        refit read every parameter."""
        import inspect

        self.__dict__.update(state)
        for name, param in inspect.signature(type(self).__init__).parameters.items():
            if name != "self" and param.default is not inspect.Parameter.empty and name not in self.__dict__:
                setattr(self, name, param.default)

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


def __getattr__(name: str):
    """The estimators live in tabfm.classifier and tabfm.regressor (which import this module): read them from here
    on first use, so `from tabfm.estimator import TabFMClassifier` and estimators pickled before the split load."""
    if name == "TabFMClassifier":
        from tabfm.classifier import TabFMClassifier

        return TabFMClassifier
    if name == "TabFMRegressor":
        from tabfm.regressor import TabFMRegressor

        return TabFMRegressor
    raise AttributeError(f"module 'tabfm.estimator' has no attribute {name!r}")
