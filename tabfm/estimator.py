"""scikit-learn estimators on the pretrained model: `TabFMClassifier` and `TabFMRegressor`.

fit() learns nothing by gradient: it preprocesses the train rows (tabfm.preprocess), draws the ensemble and
encodes the train rows once per member (tabfm.inference.encode_context, keys/values cached). predict() runs only
the test rows, in batches of `batch_size`, against those caches; test rows never see one another, so a
prediction does not depend on the other rows of X or their order.

Ensemble: member m sees the columns in its own order (member 0: the original order), numeric columns scaled
"robust" (even m) or "quantile" (odd m), and, for classification, its own permutation of the class ids; the
members' class probabilities (or, for regression, predictive means) are averaged.

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
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sklearn.base import BaseEstimator, ClassifierMixin, RegressorMixin
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import check_is_fitted, column_or_1d, validate_data

from tabfm.data.encode import IGNORE_LABEL, Batch
from tabfm.inference import Context, encode_context, predict_logits
from tabfm.model import TabFM
from tabfm.preprocess import SCALINGS, Cells, TablePreprocessor, check_table_shape

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent / "weights" / "tabfm-small.safetensors"
CONTEXT_CELL_BUDGET = 1 << 22
"""Most train cells (rows x columns x members) encoded in one forward: how many ensemble members share a forward
at fit. One member's context is always encoded in one forward (its memory grows with its rows x columns)."""

CALIBRATION_ROWS = 1000
"""Most held-out train rows the classifier's temperature is fitted on."""

_MODELS: dict[tuple, TabFM] = {}  # loaded plain models, shared by estimators (weights are read-only here)
_MESHES: dict[tuple, Any] = {}


def _resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available; use device='cpu' or 'auto'")
    return device


def _resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
             "float16": torch.float16}
    if dtype not in names:
        raise ValueError(f"dtype must be one of {sorted(names)} or a torch.dtype, got {dtype!r}")
    return names[dtype]


def _mesh(d0: int, d1: int, device: torch.device):
    import torch.distributed as dist

    from tabfm.parallel.mesh import LayoutError, ParallelDims

    world = dist.get_world_size() if dist.is_initialized() else 1
    if d0 * d1 != world:
        raise LayoutError(f"tensor_parallel=({d0}, {d1}) needs {d0 * d1} processes, this run has {world}: launch "
                          f"with `torchrun --nproc-per-node {d0 * d1}` (or `tabfm predict --nproc {d0 * d1}`)")
    key = (d0, d1, device.type, world)
    if key not in _MESHES:
        _MESHES[key] = ParallelDims(d0=d0, d1=d1).build(device.type)
    return _MESHES[key]


def load_estimator_model(checkpoint: str | Path | None, device: torch.device, dtype: torch.dtype,
                         tensor_parallel: tuple[int, int] | None = None, sequence_parallel: bool = True) -> TabFM:
    """The model of a merged file or checkpoint folder (default: the shipped weights), in eval mode."""
    from tabfm.checkpoint import load_model

    path = Path(checkpoint) if checkpoint is not None else DEFAULT_CHECKPOINT
    if not path.exists():
        raise ValueError(f"checkpoint {str(path)!r} does not exist; pass a merged .safetensors file or a checkpoint "
                         "folder (`tabfm ckpt merge RUN_DIR -o model.safetensors`), or checkpoint=None for the "
                         "shipped model")
    if tensor_parallel is None or tuple(tensor_parallel) == (1, 1):
        key = (str(path.resolve()), path.stat().st_mtime_ns, str(device), dtype)
        if key not in _MODELS:
            _MODELS[key] = load_model(path, dtype=dtype).to(device).eval()
        return _MODELS[key]
    d0, d1 = (int(d) for d in tensor_parallel)
    return load_model(path, _mesh(d0, d1, device), sequence_parallel, dtype=dtype).to(device).eval()


def class_codes(n_classes: int, n_groups: int, n_codes: int, rng: np.random.Generator) -> np.ndarray:
    """[n_codes, n_classes] group of each class per code: balanced random codes (a permutation when
    n_classes <= n_groups), redrawn until every pair of classes is separated by at least one code."""
    if n_classes <= n_groups:
        return np.stack([np.arange(n_classes)] + [rng.permutation(n_classes) for _ in range(n_codes - 1)])
    for _ in range(100):
        codes = np.empty((n_codes, n_classes), np.int64)
        for m in range(n_codes):
            codes[m, rng.permutation(n_classes)] = np.arange(n_classes) % n_groups
        same = (codes[:, :, None] == codes[:, None, :]).all(0)
        if same.sum() == n_classes:  # only the diagonal: all pairs separated
            return codes
    raise RuntimeError(f"could not separate {n_classes} classes with {n_codes} codes of {n_groups} groups")


class _TabFMBase(BaseEstimator):
    """What the classifier and the regressor share: input checks, the ensemble, caches, batched prediction."""

    _task: str = ""

    def __init__(self, n_estimators: int = 4, *, checkpoint: str | Path | None = None,
                 categorical_features: str | list[int | str] = "auto", max_context_rows: int | None = None,
                 batch_size: int = 1024, device: str = "cpu", dtype: str = "float32",
                 tensor_parallel: tuple[int, int] | None = None, sequence_parallel: bool = True,
                 random_state: int | None = 0, verbose: bool = False):
        self.n_estimators = n_estimators
        self.checkpoint = checkpoint
        self.categorical_features = categorical_features
        self.max_context_rows = max_context_rows
        self.batch_size = batch_size
        self.device = device
        self.dtype = dtype
        self.tensor_parallel = tensor_parallel
        self.sequence_parallel = sequence_parallel
        self.random_state = random_state
        self.verbose = verbose

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.input_tags.allow_nan = True
        tags.input_tags.categorical = True
        tags.input_tags.string = True
        tags.non_deterministic = False
        return tags

    # -- fit ---------------------------------------------------------------------------------------------

    def _check_params(self) -> None:
        for name in ("n_estimators", "batch_size"):
            v = getattr(self, name)
            if not isinstance(v, int | np.integer) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.max_context_rows is not None and (not isinstance(self.max_context_rows, int | np.integer)
                                                  or self.max_context_rows < 1):
            raise ValueError(f"max_context_rows must be a positive integer or None, got {self.max_context_rows!r}")

    def _prepare(self) -> TabFM:
        """Check the parameters and load the model (before anything is learnt from the data)."""
        self._check_params()
        self.device_ = _resolve_device(self.device)
        self.dtype_ = _resolve_dtype(self.dtype)
        return self._model()

    def _fit_common(self, X: Any, y: np.ndarray, n_members: int, model: TabFM) -> None:
        """Preprocess, draw the ensemble and encode the contexts; y is [n] class ids or float targets."""
        validate_data(self, X, reset=True, skip_check_array=True)
        self.preprocessor_ = TablePreprocessor(self.categorical_features, max_columns=model.config.max_columns).fit(X)
        cells = self.preprocessor_.transform(X)
        if len(y) != len(cells.values):
            raise ValueError(f"X has {len(cells.values)} rows but y has {len(y)}")
        rng = np.random.default_rng(self.random_state)
        n, C = cells.values.shape
        self.n_members_ = n_members
        self.feature_orders_ = np.stack([np.arange(C)] + [rng.permutation(C) for _ in range(n_members - 1)])
        self.scalings_ = [SCALINGS[m % len(SCALINGS)] for m in range(n_members)]
        self.context_rows_ = self._draw_context_rows(n, rng)
        self.train_cells_, self.y_train_ = cells, y
        self.contexts_ = None
        self._encode_contexts()

    def _draw_context_rows(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """[M, T] the train rows each member's context holds: all of them, or max_context_rows drawn per member."""
        rows = self.max_context_rows
        if rows is not None and n > rows:
            return np.stack([np.sort(rng.choice(n, rows, replace=False)) for _ in range(self.n_members_)])
        return np.tile(np.arange(n), (self.n_members_, 1))

    def _model(self) -> TabFM:
        tp = None if self.tensor_parallel is None else tuple(self.tensor_parallel)
        return load_estimator_model(self.checkpoint, self.device_, self.dtype_, tp, self.sequence_parallel)

    def _member_values(self, cells: Cells, members: np.ndarray, rows: np.ndarray | None = None) -> dict[str, Any]:
        """Per-member tensors [g, r, C] of the given rows (rows[m] per member, or all rows of `cells`)."""
        scaled = {kind: self.preprocessor_.scale(cells, kind) for kind in {self.scalings_[m] for m in members}}
        vals, codes = [], []
        for m in members:
            r = slice(None) if rows is None else rows[m]
            order = self.feature_orders_[m]
            vals.append(scaled[self.scalings_[m]][r][:, order])
            codes.append(cells.codes[r][:, order])
        values, cat_codes = torch.from_numpy(np.stack(vals)), torch.from_numpy(np.stack(codes))
        is_cat = torch.from_numpy(cells.is_cat[self.feature_orders_[members]])[:, None, :]
        return {
            "values": torch.nan_to_num(values, nan=0.0).to(self.dtype_),
            "missing": torch.where(is_cat, cat_codes < 0, torch.isnan(values)),
            "cat_codes": cat_codes,
            "is_cat": torch.from_numpy(cells.is_cat[self.feature_orders_[members]]),
            "n_cats": torch.from_numpy(cells.n_cats[self.feature_orders_[members]]),
        }

    def _batch(self, parts: dict[str, Any], labels: torch.Tensor, n_train: int, n_classes: int) -> Batch:
        g, r, C = parts["values"].shape
        return Batch(**parts, labels=labels, n_train=torch.full((g,), n_train), n_classes=torch.full((g,), n_classes),
                     row_pad=torch.zeros(g, r, dtype=torch.bool), col_pad=torch.zeros(g, C, dtype=torch.bool),
                     task=self._task).to(self.device_)

    def _member_groups(self) -> list[np.ndarray]:
        per_member = self.context_rows_.shape[1] * self.train_cells_.values.shape[1]
        size = max(1, CONTEXT_CELL_BUDGET // max(per_member, 1))
        return np.array_split(np.arange(self.n_members_), math.ceil(self.n_members_ / size))

    def _encode_contexts(self) -> None:
        model = self._model()
        contexts: list[tuple[np.ndarray, Context]] = []
        for members in self._member_groups():
            parts = self._member_values(self.train_cells_, members, self.context_rows_)
            labels = torch.from_numpy(np.stack([self._member_labels(m, self.y_train_[self.context_rows_[m]])
                                                for m in members]))
            batch = self._batch(parts, labels, self.context_rows_.shape[1], self._n_outputs())
            contexts.append((members, encode_context(model, batch)))
        self.contexts_ = contexts

    # -- predict -----------------------------------------------------------------------------------------

    def _member_outputs(self, X: Any) -> np.ndarray:
        """[M, n, Y] per-member outputs (class-group log-probabilities, or predictive means [M, n, 1])."""
        check_is_fitted(self, "preprocessor_")
        check_table_shape(X)
        validate_data(self, X, reset=False, skip_check_array=True)  # feature count and names as at fit
        return self._cell_outputs(self.preprocessor_.transform(X))

    def _cell_outputs(self, cells: Cells) -> np.ndarray:
        if self.contexts_ is None:  # after unpickling: the caches are rebuilt, not stored
            self._encode_contexts()
        model = self._model()
        n = len(cells.values)
        out = None
        from tqdm.auto import tqdm

        starts = range(0, n, self.batch_size)
        for start in tqdm(starts, desc="predict", unit="batch", disable=not self.verbose or len(starts) < 2):
            sub = cells.take(slice(start, start + self.batch_size))
            for members, context in self.contexts_:
                parts = self._member_values(sub, members)
                labels = torch.full(parts["values"].shape[:2], IGNORE_LABEL if self._task == "classification" else 0)
                if self._task == "regression":
                    labels = labels.to(self.dtype_)
                batch = self._batch(parts, labels, 0, self._n_outputs())
                logits = predict_logits(model, context, batch).double()  # decoded in float64 whatever the model's dtype
                res = self._decode_member(model, context, logits).cpu().numpy()
                if out is None:
                    out = np.empty((self.n_members_, n, res.shape[-1]), np.float64)
                out[members, start:start + len(sub.values)] = res
        return out

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["contexts_"] = None  # large and device-bound: re-encoded from the stored train rows on first use
        return state


class TabFMClassifier(ClassifierMixin, _TabFMBase):
    """In-context classification with the pretrained tabular model; scikit-learn API.

    Parameters: n_estimators (ensemble members), checkpoint (merged .safetensors or checkpoint folder; None:
    the shipped model), categorical_features ("auto" or column indices / names), max_context_rows (subsample
    the train rows per member; None: all), batch_size (test rows per forward), device ("cpu", "cuda", "auto"),
    dtype ("float32", "float64", "bfloat16"), tensor_parallel ((d0, d1) under torchrun), sequence_parallel,
    random_state, verbose (a progress bar over test batches), calibrate (fit a softmax temperature on held-out
    train rows: the shipped model is under-confident, and this costs about one more fit).
    """

    _task = "classification"

    def __init__(self, n_estimators: int = 4, *, checkpoint: str | Path | None = None,
                 categorical_features: str | list[int | str] = "auto", max_context_rows: int | None = None,
                 batch_size: int = 1024, device: str = "cpu", dtype: str = "float32",
                 tensor_parallel: tuple[int, int] | None = None, sequence_parallel: bool = True,
                 random_state: int | None = 0, verbose: bool = False, calibrate: bool = True):
        super().__init__(n_estimators, checkpoint=checkpoint, categorical_features=categorical_features,
                         max_context_rows=max_context_rows, batch_size=batch_size, device=device, dtype=dtype,
                         tensor_parallel=tensor_parallel, sequence_parallel=sequence_parallel,
                         random_state=random_state, verbose=verbose)
        self.calibrate = calibrate

    def fit(self, X: Any, y: Any) -> TabFMClassifier:
        """Preprocess and encode the train rows; y: class labels (any hashable values)."""
        check_table_shape(X)
        y = column_or_1d(y, warn=True)
        if y.dtype.kind == "f" and not np.isfinite(y).all():
            raise ValueError("y holds NaN or inf: drop those rows or give them a class")
        check_classification_targets(y)
        if any(v is None for v in y.tolist()):
            raise ValueError("y holds None: drop those rows or give them a class")
        self.classes_, y_ids = np.unique(y, return_inverse=True)
        K = len(self.classes_)
        if K < 2:
            raise ValueError(f"y has 1 class ({self.classes_[0]!r}): a classifier needs at least two classes")
        model = self._prepare()
        max_classes = model.config.max_classes
        n_members = self.n_estimators
        if K > max_classes:
            n_members = max(n_members, math.ceil(2 * math.log(K) / math.log(max_classes)) + 1)
        self.class_codes_ = class_codes(K, max_classes, n_members, np.random.default_rng(self.random_state))
        self.n_groups_ = min(K, max_classes)
        self._fit_common(X, y_ids.astype(np.int64), n_members, model)
        self.temperature_ = self._fit_temperature() if self.calibrate else 1.0
        return self

    def _fit_temperature(self) -> float:
        """The softmax temperature that minimises the log-loss of held-out train rows (a stratified 20%, at most
        1,000 rows) predicted from the other train rows by the same ensemble; 1.0 when too few rows."""
        y, n = self.y_train_, len(self.y_train_)
        rng = np.random.default_rng(None if self.random_state is None else self.random_state + 1)
        held = []
        for c in range(len(self.classes_)):
            rows = np.flatnonzero(y == c)
            held.extend(rng.choice(rows, int(0.2 * len(rows)), replace=False))
        held = np.sort(np.asarray(held, dtype=np.int64))
        if len(held) > CALIBRATION_ROWS:
            held = np.sort(rng.choice(held, CALIBRATION_ROWS, replace=False))
        if len(held) < 10:
            return 1.0
        keep = np.setdiff1d(np.arange(n), held)
        probe = copy.copy(self)
        probe.train_cells_, probe.y_train_ = self.train_cells_.take(keep), y[keep]
        probe.context_rows_ = probe._draw_context_rows(len(keep), rng)
        probe.contexts_ = None
        logp = probe._cell_outputs(self.train_cells_.take(held))
        temps = np.exp(np.linspace(np.log(0.2), np.log(3.0), 41))
        losses = [-np.log(np.clip(self._combine(logp, t)[np.arange(len(held)), y[held]], 1e-15, None)).mean()
                  for t in temps]
        return float(temps[int(np.argmin(losses))])

    def _combine(self, logp: np.ndarray, temperature: float) -> np.ndarray:
        """Members' group log-probabilities [M, n, G] -> class probabilities [n, K] at a softmax temperature."""
        z = logp / temperature
        groups = np.exp(z - z.max(-1, keepdims=True))
        groups /= groups.sum(-1, keepdims=True)
        per_class = np.take_along_axis(groups, self.class_codes_[:, None, :], axis=2)  # [M, n, K]
        if len(self.classes_) <= self.n_groups_:
            proba = per_class.mean(0)
        else:
            sizes = np.stack([np.bincount(code, minlength=self.n_groups_)[code] for code in self.class_codes_])
            logp_c = (np.log(np.clip(per_class, 1e-12, None)) - np.log(sizes)[:, None, :]).mean(0)
            proba = np.exp(logp_c - logp_c.max(1, keepdims=True))
        return proba / proba.sum(1, keepdims=True)

    def _n_outputs(self) -> int:
        return self.n_groups_

    def _member_labels(self, m: int, y: np.ndarray) -> np.ndarray:
        return self.class_codes_[m][y]

    def _decode_member(self, model: TabFM, context: Context, logits: torch.Tensor) -> torch.Tensor:
        return logits[..., :self.n_groups_].log_softmax(-1)

    def predict_proba(self, X: Any) -> np.ndarray:
        """[n, n_classes] class probabilities, columns in the order of classes_."""
        return self._combine(self._member_outputs(X), self.temperature_)

    def predict_log_proba(self, X: Any) -> np.ndarray:
        return np.log(np.clip(self.predict_proba(X), 1e-300, None))

    def predict(self, X: Any) -> np.ndarray:
        proba = self.predict_proba(X)
        return self.classes_[proba.argmax(1)]


class TabFMRegressor(RegressorMixin, _TabFMBase):
    """In-context regression with the pretrained tabular model; scikit-learn API. predict gives the mean of
    the model's predictive distribution, averaged over the ensemble. Parameters as TabFMClassifier."""

    _task = "regression"

    def fit(self, X: Any, y: Any) -> TabFMRegressor:
        """Preprocess and encode the train rows; y: real targets."""
        check_table_shape(X)
        y = column_or_1d(y, warn=True)
        try:
            y = y.astype(np.float64)
        except (TypeError, ValueError):
            raise ValueError("y must hold numbers for a regressor (use TabFMClassifier for labels)") from None
        if not np.isfinite(y).all():
            raise ValueError("y holds NaN or inf: drop those rows or fill in their targets")
        self._fit_common(X, y, self.n_estimators, self._prepare())
        return self

    def _n_outputs(self) -> int:
        return 0

    def _member_labels(self, m: int, y: np.ndarray) -> np.ndarray:
        return y

    def _decode_member(self, model: TabFM, context: Context, logits: torch.Tensor) -> torch.Tensor:
        return model.regression_mean(context.target_stats, logits).unsqueeze(-1)

    def predict(self, X: Any) -> np.ndarray:
        """[n] predicted targets."""
        return self._member_outputs(X)[..., 0].mean(0)


