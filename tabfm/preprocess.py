"""A user's feature table (numpy, pandas or polars) -> the model's cells, fitted on the train rows only.

    columns      numeric (any real dtype), or categorical (strings, booleans, pandas/polars categoricals, or the
                 columns named in `categorical_features`); an object column that mixes strings and numbers is an
                 error, never a guess
    missing      None, NaN, null and pd.NA are missing cells; inf is an error
    constant     a column with one value and no missing cell carries nothing and is dropped at fit
    categories   the train rows' categories, sorted as strings, are codes 0..n-1; a category first seen at
                 predict is a missing cell
    scaling      numeric columns are rescaled per ensemble member, "robust" (median / interquartile range, then a
                 soft clip at +-4 so an outlier cannot dominate the model's train-row mean and deviation) or
                 "quantile" (train-row quantiles mapped to a standard normal), both from scikit-learn

`TablePreprocessor.fit(X)` learns the columns; `transform(X)` gives `Cells` with raw numeric values (NaN where
missing) and category codes; `scale(values, kind)` applies a scaling fitted at fit.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

SCALINGS = ("robust", "quantile")
SOFT_CLIP = 4.0


@dataclass(frozen=True)
class Column:
    """One kept column: its name (str; "x{i}" for arrays), position in the input, kind and train categories."""

    name: str
    index: int
    kind: str
    categories: tuple[str, ...] = ()


@dataclass
class Cells:
    """The kept columns of n rows: numeric values (NaN where missing or categorical) and category codes."""

    values: np.ndarray
    """[n, C] float64."""
    codes: np.ndarray
    """[n, C] int64: 0..n_cats-1, -1 for numeric columns and missing / unseen categories."""
    is_cat: np.ndarray
    """[C] bool."""
    n_cats: np.ndarray
    """[C] int64."""

    def take(self, rows: np.ndarray | slice) -> Cells:
        """The given rows."""
        return Cells(self.values[rows], self.codes[rows], self.is_cat, self.n_cats)


def _is_missing(v: Any) -> bool:
    if v is None:
        return True
    try:
        return bool(v != v)  # NaN, pd.NA (raises TypeError: ambiguous)
    except TypeError:
        return True


def category_string(v: Any) -> str:
    """The canonical string of a category value, so 1, 1.0 and "1" read the same at fit and predict."""
    if isinstance(v, bool | np.bool_):
        return str(bool(v))
    if isinstance(v, numbers.Integral):
        return str(int(v))
    if isinstance(v, numbers.Real):
        f = float(v)
        return str(int(f)) if f.is_integer() else repr(f)
    return str(v)


def _columns_of(X: Any) -> tuple[list[str], list[Any]]:
    """(names, column objects)."""
    try:
        import polars as pl

        if isinstance(X, pl.DataFrame):
            return [str(c) for c in X.columns], X.get_columns()
        if isinstance(X, pl.LazyFrame):
            raise TypeError("X is a polars LazyFrame: collect() it first")
    except ImportError:  # polars is a dependency; keep numpy-only use working without it
        pass
    if hasattr(X, "toarray") or type(X).__module__.startswith("scipy.sparse"):
        raise TypeError("Sparse data is not supported: a sparse matrix was passed, but dense data is required; "
                        "use X.toarray() to convert it to a dense numpy array")
    if hasattr(X, "iloc") and hasattr(X, "columns"):  # pandas
        return [str(c) for c in X.columns], [X.iloc[:, i] for i in range(X.shape[1])]
    arr = np.asarray(X)
    if arr.dtype.kind == "c":
        raise ValueError("Complex data not supported: X must hold real numbers or categories")
    if arr.ndim == 1:
        raise ValueError(f"X must be 2-D (rows x features); got a 1-D array of {arr.shape[0]} values. Reshape your "
                         "data: X.reshape(-1, 1) for one feature or X.reshape(1, -1) for one row")
    if arr.ndim != 2:
        raise ValueError(f"X must be 2-D (rows x features); got shape {arr.shape}")
    return [f"x{i}" for i in range(arr.shape[1])], [arr[:, i] for i in range(arr.shape[1])]


def _raw_column(col: Any, name: str) -> tuple[str, np.ndarray]:
    """("numeric", float64 array with NaN) or ("categorical", object array of str / None)."""
    dtype = getattr(col, "dtype", None)
    module = type(col).__module__
    if module.startswith("polars"):
        if dtype.is_numeric():
            return "numeric", col.cast(float).fill_null(float("nan")).to_numpy().astype(np.float64)
        if dtype.is_temporal():
            return "numeric", col.cast(int).cast(float).fill_null(float("nan")).to_numpy().astype(np.float64)
        col = col.to_list()
    elif module.startswith("pandas"):
        import pandas as pd

        if pd.api.types.is_numeric_dtype(dtype) and not pd.api.types.is_bool_dtype(dtype):
            return "numeric", col.astype("float64").to_numpy(dtype=np.float64, na_value=np.nan)
        if pd.api.types.is_datetime64_any_dtype(dtype):
            return "numeric", col.astype("int64").astype("float64").to_numpy()
        col = col.astype(object).to_numpy()
    arr = np.asarray(col)
    if arr.dtype.kind in "biuf":
        if arr.dtype.kind == "b":
            return "categorical", np.array([str(bool(v)) for v in arr], dtype=object)
        return "numeric", arr.astype(np.float64)
    if arr.dtype.kind in "US":
        return "categorical", arr.astype(str).astype(object)
    if arr.dtype.kind == "c":
        raise ValueError("Complex data not supported: X must hold real numbers or categories")
    # object: decide from the values
    kinds = set()
    out = np.empty(len(arr), dtype=object)
    for i, v in enumerate(arr):
        if _is_missing(v):
            out[i] = None
        elif isinstance(v, str | bool | np.bool_ | np.str_):
            kinds.add("str")
            out[i] = category_string(v)
        elif isinstance(v, numbers.Real):
            kinds.add("num")
            out[i] = float(v)
        else:
            raise TypeError(f"column {name!r} holds a {type(v).__name__} ({v!r}); X cells must be numbers, strings, "
                            "booleans or missing (None / NaN)")
    if kinds == {"str", "num"}:
        example = next(v for v in out if isinstance(v, str))
        raise ValueError(f"column {name!r} mixes numbers and strings (e.g. {example!r}): fix the bad cells, or "
                         f"convert the whole column to strings to treat it as categorical")
    if kinds == {"num"}:
        return "numeric", np.array([np.nan if v is None else v for v in out], dtype=np.float64)
    return "categorical", out


def check_table_shape(X: Any) -> tuple[list[str], list[Any]]:
    """(column names, columns) of a table with at least one row and one column; a clear error otherwise."""
    names, cols = _columns_of(X)
    n = len(cols[0]) if cols else len(X)
    if not names:
        raise ValueError(f"Found array with 0 feature(s) (shape=({n}, 0)) while a minimum of 1 is required: "
                         "X needs at least one column")
    if n == 0:
        raise ValueError(f"Found array with 0 sample(s) (shape=(0, {len(names)})) while a minimum of 1 is "
                         "required: X needs at least one row")
    return names, cols


class TablePreprocessor:
    """Learns the columns of the train rows; see the module docstring for the rules."""

    def __init__(self, categorical_features: str | Sequence[int | str] = "auto", max_columns: int | None = None):
        self.categorical_features = categorical_features
        self.max_columns = max_columns

    def _forced(self, names: list[str]) -> set[int]:
        if isinstance(self.categorical_features, str):
            if self.categorical_features != "auto":
                raise ValueError(f"categorical_features must be 'auto' or a list of column indices or names, "
                                 f"got {self.categorical_features!r}")
            return set()
        out = set()
        for c in self.categorical_features:
            if isinstance(c, numbers.Integral) and not isinstance(c, bool):
                if not 0 <= int(c) < len(names):
                    raise ValueError(f"categorical_features index {c} is out of range for {len(names)} columns")
                out.add(int(c))
            elif str(c) in names:
                out.add(names.index(str(c)))
            else:
                raise ValueError(f"categorical_features names {c!r}, which is not a column of X; columns: {names}")
        return out

    def fit(self, X: Any) -> TablePreprocessor:
        names, cols = check_table_shape(X)
        n = len(cols[0])
        self.names_ = names
        forced = self._forced(names)
        columns: list[Column] = []
        raw_numeric = []
        for i, (name, col) in enumerate(zip(names, cols, strict=True)):
            kind, raw = _raw_column(col, name)
            if kind == "numeric" and np.isinf(raw).any():
                raise ValueError(f"column {name!r} holds inf at fit; replace it with a finite value or NaN (missing)")
            if i in forced and kind == "numeric":
                raw = np.array([None if math.isnan(v) else category_string(v) for v in raw], dtype=object)
                kind = "categorical"
            if kind == "numeric":
                seen = raw[~np.isnan(raw)]
                if len(np.unique(seen)) <= 1 and len(seen) == n:
                    continue  # constant
                columns.append(Column(name, i, "numeric"))
                raw_numeric.append(raw)
            else:
                cats = tuple(sorted({v for v in raw if v is not None}))
                if len(cats) <= 1 and all(v is not None for v in raw):
                    continue  # constant
                columns.append(Column(name, i, "categorical", cats))
        if self.max_columns is not None and len(columns) > self.max_columns:
            raise ValueError(f"X has {len(columns)} informative features but the model takes at most "
                             f"{self.max_columns}: select features first (e.g. sklearn.feature_selection."
                             "SelectKBest) or use a model with a larger max_columns")
        self.columns_ = columns
        numeric = np.stack(raw_numeric, 1) if raw_numeric else np.zeros((n, 0))
        self.scalers_ = {kind: self._fit_scaler(kind, numeric) for kind in SCALINGS}
        return self

    @staticmethod
    def _fit_scaler(kind: str, numeric: np.ndarray) -> Any:
        from sklearn.preprocessing import QuantileTransformer, RobustScaler

        if numeric.shape[1] == 0:
            return None
        if kind == "robust":
            return RobustScaler(unit_variance=False).fit(numeric)
        return QuantileTransformer(output_distribution="normal", n_quantiles=max(2, min(1000, len(numeric))),
                                   subsample=None, random_state=0).fit(numeric)

    def transform(self, X: Any) -> Cells:
        names, cols = check_table_shape(X)
        if len(names) != len(self.names_):
            raise ValueError(f"X has {len(names)} features, but the estimator was fitted with {len(self.names_)}")
        n = len(cols[0])
        C = max(len(self.columns_), 1)  # all columns constant: one empty column, so the model still has a token
        values = np.full((n, C), np.nan)
        codes = np.full((n, C), -1, np.int64)
        is_cat = np.zeros(C, bool)
        n_cats = np.zeros(C, np.int64)
        for j, c in enumerate(self.columns_):
            kind, raw = _raw_column(cols[c.index], c.name)
            if c.kind == "numeric":
                if kind != "numeric":
                    example = next((v for v in raw if v is not None), None)
                    raise ValueError(f"column {c.name!r} was numeric at fit but holds strings now (e.g. {example!r}); "
                                     "pass the same kind of data as at fit")
                if np.isinf(raw).any():
                    raise ValueError(f"column {c.name!r} holds inf; replace it with a finite value or NaN (missing)")
                values[:, j] = raw
            else:
                if kind == "numeric":
                    raw = np.array([None if math.isnan(v) else category_string(v) for v in raw], dtype=object)
                lookup = {cat: k for k, cat in enumerate(c.categories)}
                codes[:, j] = [lookup.get(v, -1) for v in raw]
                is_cat[j], n_cats[j] = True, len(c.categories)
        return Cells(values, codes, is_cat, n_cats)

    def scale(self, cells: Cells, kind: str) -> np.ndarray:
        """The numeric values [n, C] under one of SCALINGS (NaN stays NaN; categorical columns stay NaN)."""
        if kind not in SCALINGS:
            raise ValueError(f"unknown scaling {kind!r}; choose from {SCALINGS}")
        out = cells.values.copy()
        numeric = [j for j, c in enumerate(self.columns_) if c.kind == "numeric"]
        if numeric:
            scaled = self.scalers_[kind].transform(cells.values[:, numeric])
            if kind == "robust":
                scaled = SOFT_CLIP * np.tanh(scaled / SOFT_CLIP)
            out[:, numeric] = scaled
        return out
