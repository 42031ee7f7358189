"""Checks of what a user hands the estimators, each failing with one line that says what to do.

    parameters   ESTIMATOR_PARAMETER_CONSTRAINTS: scikit-learn's `_parameter_constraints` for the estimators'
                 constructor arguments (types and ranges; `_validate_params()` reports a bad one by name), then
                 resolve_device for the values a type cannot rule out ("gpu", "meta"); the dtype and precision
                 values (dtype="bfloat16" refused, naming precision) in tabfm.inference_precision
    class labels check_class_labels(y): 1-D, no missing label (None, NaN, pd.NA, NaT), one kind of label
                 (strings, numbers or booleans: never a mix, whose sort order and equality would be a guess)
    threads      torch_threads(n_jobs): torch's (and BLAS's) thread count for the length of a block, restored after
"""

from __future__ import annotations

import contextlib
import numbers
import os
from collections.abc import Iterator
from pathlib import PurePath
from typing import Any

import numpy as np
import torch
from sklearn.utils._param_validation import Interval, InvalidParameterError, Options, StrOptions
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import column_or_1d

from tabfm.inference_precision import PRECISIONS
from tabfm.raw_columns import is_missing, refuse_lazy_frame, unmask

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The dtype values the constraints let through: bfloat16 and float16 reach resolve_weight_dtype, whose message
names precision="bf16" (scikit-learn's would only list the options)."""

DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")
"""torch device types the model can run on (when present on the machine)."""


class _PositiveInt(Interval):
    """An int >= `left`, booleans excluded (scikit-learn's Interval takes True for 1)."""

    def __init__(self, left: int = 1):
        super().__init__(numbers.Integral, left, None, closed="left")

    def is_satisfied_by(self, val: Any) -> bool:
        return not isinstance(val, bool | np.bool_) and super().is_satisfied_by(val)


class _LayoutPair(Options):
    """(d0, d1): two positive ints, booleans excluded, as a tuple or list. Checked here, in the process that fits:
    a 0 or a negative entry would otherwise reach the launch advice as "torchrun --nproc-per-node 0", and 1.5 would
    be cut to 1 without a word. (An Options, the kind of constraint scikit-learn's validation takes, with its own
    test.)"""

    def __init__(self):
        super().__init__(object, set())

    def is_satisfied_by(self, val: Any) -> bool:
        return (isinstance(val, tuple | list) and len(val) == 2
                and all(_PositiveInt().is_satisfied_by(d) for d in val))

    def __str__(self) -> str:
        return "a tuple of two positive ints (d0, d1), the tensor-parallel mesh of d0 * d1 processes,"


ESTIMATOR_PARAMETER_CONSTRAINTS: dict[str, list[Any]] = {
    "n_estimators": [_PositiveInt(), StrOptions({"auto"})],
    "checkpoint": [str, PurePath, None],
    "categorical_features": [StrOptions({"auto"}), list, tuple, np.ndarray],
    "max_context_rows": [_PositiveInt(), None],
    "batch_size": [_PositiveInt()],
    "device": [str, torch.device],  # the value is checked by resolve_device, with advice for "gpu" and "meta"
    "dtype": [StrOptions(set(DTYPES), deprecated={"bfloat16", "float16"}), Options(torch.dtype, set(DTYPES.values()))],
    "precision": [StrOptions(set(PRECISIONS))],
    "tensor_parallel": [_LayoutPair(), None],
    "sequence_parallel": ["boolean"],
    "random_state": [_PositiveInt(0), np.random.RandomState, np.random.Generator, None],  # resolve_seed
    "verbose": ["verbose"],
    "calibrate": ["boolean"],
    "n_jobs": [_PositiveInt(), Options(numbers.Integral, {-1}), None],
}
"""scikit-learn parameter constraints of TabFMClassifier / TabFMRegressor (a parameter an estimator lacks is
skipped, so one dict serves both): set as `_parameter_constraints` and call `self._validate_params()` in fit."""


def resolve_seed(random_state: int | np.random.RandomState | np.random.Generator | None) -> int | None:
    """The seed of one fit: an int as it is (numpy's default_rng takes non-negative ones), None for fresh entropy,
    or one drawn from a RandomState or Generator, which advances it, as scikit-learn's estimators do with theirs."""
    if isinstance(random_state, np.random.RandomState):
        return int(random_state.randint(np.iinfo(np.int32).max))
    if isinstance(random_state, np.random.Generator):
        return int(random_state.integers(np.iinfo(np.int32).max))
    return None if random_state is None else int(random_state)


def resolve_device(device: str | torch.device) -> torch.device:
    """The torch device to run on; "auto" picks CUDA when present. Refuses, with what to pass instead, names torch
    does not know ("gpu"), "meta" (it holds no data) and devices this machine lacks."""
    if isinstance(device, str) and device.strip().lower() == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hint = "use 'cpu', 'cuda' (or 'cuda:N'), or 'auto'"
    if isinstance(device, str) and device.strip().lower().startswith("gpu"):
        raise ValueError(f"device={device!r} is not a torch device name: use 'cuda' (or 'cuda:N') for an NVIDIA GPU, "
                         "or 'auto'")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device={device!r} is not a device torch knows: {hint}") from None
    if dev.type == "meta":
        raise ValueError(f"device={device!r} holds no data, so the model cannot run on it: {hint}")
    if dev.type not in DEVICE_TYPES:
        raise ValueError(f"device={device!r} is not supported (supported: {', '.join(DEVICE_TYPES)}): {hint}")
    if dev.type != "cpu":
        backend = torch.backends.mps if dev.type == "mps" else getattr(torch, dev.type)
        if not backend.is_available():
            raise ValueError(f"device={device!r} but this machine has no {dev.type} device; use device='cpu' or "
                             "'auto' (tabfm predict: --device cpu or auto)")
        count = getattr(backend, "device_count", lambda: 1)()
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"device={device!r} but this machine has {count} {dev.type} device(s), numbered from 0")
    return dev


def _label_kind(v: Any) -> str:
    """The kind of one label: labels of different kinds have no common order (np.unique) or equality (True == 1)."""
    if isinstance(v, str | np.str_):
        return "str"
    if isinstance(v, bytes):  # numpy would turn b"a" beside "b" into the text "a"
        return "bytes"
    if isinstance(v, bool | np.bool_):
        return "bool"
    if isinstance(v, numbers.Number):
        return "number"
    return type(v).__name__


def check_class_labels(y: Any) -> np.ndarray:
    """y as a 1-D array of class labels, refused with one clear line when a label is missing (None, NaN, pd.NA,
    NaT), infinite, or of another kind than the rest (strings mixed with numbers or booleans), or when y is
    continuous."""
    y = _nullable_as_numpy(unmask(y))  # masked labels become missing ones, refused below
    given = np.asarray(y, dtype=object).ravel() if isinstance(y, list | tuple) else None  # numpy would stringify
    check_real_targets(y)                                                                    # ["a", 1] silently
    y = column_or_1d(y, warn=True)
    missing = bad = np.zeros(len(y), bool)
    if y.dtype.kind in "fc":
        missing, bad = np.isnan(y), np.isinf(y)
    elif y.dtype.kind in "Mm":
        missing = np.isnat(y)
    elif y.dtype.kind == "O":
        missing = np.array([is_missing(v) for v in y], dtype=bool).reshape(len(y))
    if missing.any():
        raise ValueError(f"y holds missing labels (None/NaN/pd.NA) in {int(missing.sum())} rows: drop those rows or "
                         "give them a class")
    if bad.any():
        raise ValueError(f"y holds inf in {int(bad.sum())} rows: drop those rows or give them a class")
    if (y.dtype.kind == "O" or given is not None) and len(y):
        examples: dict[str, Any] = {}
        for v in (y if given is None else given):
            examples.setdefault(_label_kind(v), v)
        if len(examples) > 1:
            kinds = " and ".join(f"{k} (e.g. {v!r})" for k, v in examples.items())
            raise ValueError(f"y mixes label types: {kinds}; give every label one type, e.g. y.astype(str)")
        (kind, example), = examples.items()
        if kind not in ("str", "number", "bool"):  # scikit-learn would call them continuous values
            raise ValueError(f"y holds labels of type {kind} (e.g. {example!r}); a classifier takes strings, "
                             "numbers or booleans: convert them, e.g. y.astype(str)")
        if y.dtype.kind == "O" and kind != "str":  # e.g. a pandas object column of ints:
            y = np.array(y.tolist())  # scikit-learn calls its type "unknown"; read as the numbers they are
            if y.dtype.kind == "O":
                raise ValueError(f"y holds numbers numpy cannot store as one array type (e.g. {example!r}; integers "
                                 "beyond int64 and Decimals are such): convert them, e.g. y.astype(str)")
    check_classification_targets(y)
    return y


def _nullable_as_numpy(y: Any) -> Any:
    """A pandas Series, array (pd.array) or one-column DataFrame of nullable integers or booleans (Int64, UInt8,
    boolean) with no missing value as numpy integers or booleans of the same shape; anything else as it is.
    column_or_1d reads them as float64, so labels True/False came back from predict as 1.0/0.0 and 1/2 as 1.0/2.0.
    With a missing value they stay as they are and are refused as missing labels."""
    if not hasattr(y, "isna"):
        return y
    if getattr(y, "ndim", 1) == 1:
        dtype = getattr(y, "dtype", None)
    else:
        dtypes = getattr(y, "dtypes", None)
        dtype = dtypes.iloc[0] if dtypes is not None and len(dtypes) == 1 else None
    numpy_dtype = getattr(dtype, "numpy_dtype", None)
    if numpy_dtype is None or np.dtype(numpy_dtype).kind not in "iub" or np.asarray(y.isna()).any():
        return y
    return y.to_numpy(dtype=numpy_dtype)


def check_real_targets(y: Any) -> None:
    """Refuse complex targets in one line (scikit-learn's message prints the whole array), and a polars LazyFrame
    (column_or_1d called it an array of shape ()). Read from y's dtype, or a list's: array-likes that are neither
    are left to column_or_1d."""
    refuse_lazy_frame(y, "y")
    dtype = np.asarray(y).dtype if isinstance(y, list | tuple) else getattr(y, "dtype", None)
    if getattr(dtype, "kind", None) == "c":
        raise ValueError("y holds complex numbers; targets must be real: pass the real part (np.real) or the "
                         "magnitude (np.abs)")


def n_threads(n_jobs: int | None) -> int | None:
    """The thread count n_jobs asks for: None (leave it), -1 (every core this process may use) or k >= 1."""
    if n_jobs is None:
        return None
    if isinstance(n_jobs, numbers.Integral) and not isinstance(n_jobs, bool | np.bool_):
        if n_jobs == -1:
            return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        if n_jobs >= 1:
            return int(n_jobs)
    # scikit-learn's error for a bad parameter (a ValueError and a TypeError): the estimators set their threads
    # before fit validates its parameters, so this is the check a bad n_jobs meets first
    raise InvalidParameterError(f"n_jobs must be a positive number of threads, -1 (all cores) or None, got "
                                f"{n_jobs!r}")


@contextlib.contextmanager
def torch_threads(n_jobs: int | None) -> Iterator[int]:
    """Run a block with torch's intra-op threads (and numpy's BLAS threads) set by n_jobs, restoring both after,
    even on an error. On a busy machine fewer threads than torch's default (every core) avoid oversubscription.
    Yields the thread count in force."""
    threads = n_threads(n_jobs)
    if threads is None:
        yield torch.get_num_threads()
        return
    from tabfm.native_threads import shared_limit

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with shared_limit(threads, "blas"):  # the process's count: shared with other threads' calls
            yield threads
    finally:
        torch.set_num_threads(before)
