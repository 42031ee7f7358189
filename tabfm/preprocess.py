"""A user's feature table (numpy, pandas or polars) -> the model's cells, fitted on the train rows only.

    columns      numeric (any real dtype; dates, times and durations as seconds, time zones in UTC, whether of a
                 datetime64 / arrow / polars dtype or Python / pandas objects: date at midnight UTC, time since
                 midnight, pd.Period at its start), or categorical (strings, booleans, pandas/polars categoricals,
                 or the columns named in `categorical_features`); an object column that mixes strings and numbers
                 is an error, never a guess, and so are complex numbers, nested (list / struct) columns and
                 duplicate column names; a text column that is mostly numbers is read as categories, with a warning
    names        a DataFrame at predict must name its columns as at fit (as strings, in order); arrays by position
    missing      None, NaN, NaT, null and pd.NA are missing cells; inf is an error; a column with no value in a
                 predict batch reads as missing cells of its fit-time kind
    constant     a column with one value and no missing cell, or with no value at all, carries nothing and is
                 dropped at fit (at predict it is still expected, and not read); so is, with a warning, a
                 categorical column with a different value in each of at least ID_ROWS train rows (an id)
    categories   the train rows' categories are codes 0..n-1 in the order of their dtype (a pandas categorical's
                 categories, a polars Enum's), else numeric when every category is a number ("2" < "10"), else
                 sorted as strings; the fitted list defines the codes at predict. A category first seen at predict
                 reads as a missing cell (code UNSEEN, which every reader of codes takes as missing, except the
                 target encodings: tabfm.category_encoding), with a warning when most of a column's cells are such
    scaling      numeric columns are transformed per ensemble member: "none" (only standardised with the train
                 rows' mean and deviation, in float64: the model standardises each column that way anyway), "robust" (median / interquartile range, then
                 a soft clip at +-4 so an outlier cannot dominate the model's train-row mean and deviation),
                 "quantile" (train-row quantiles mapped to a standard normal) or "power" (standardised, then
                 Yeo-Johnson towards a normal shape, tabfm.yeo_johnson), the others from scikit-learn

Reading X into named columns of one kind each is tabfm.raw_columns'; `TablePreprocessor.fit(X)` learns the
columns; `transform(X)` gives `Cells` with raw numeric values (NaN where missing) and category codes;
`scale(values, kind)` applies a scaling fitted at fit.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from tabfm.data.encode import category_codes
from tabfm.numeric_bounds import NumericBounds
from tabfm.raw_columns import (category_string, check_table_shape, dtype_categories, has_categorical_dtype, has_names,
                               non_numeric_words, raw_column, string_series)

NUMERIC_TRANSFORMS = ("none", "robust", "quantile", "power")
SCALINGS = NUMERIC_TRANSFORMS
SOFT_CLIP = 4.0
UNSEEN_SHOWN = 5
"""Columns named in the warning about unseen categories at predict (the rest are counted)."""
NEW_EXPECTED = 0.25
"""A categorical column whose train cells were at least this share categories seen once (Column.new_share) is not
named when a predict batch's cells are mostly categories not seen at fit: new values are what such a column brings
(Good-Turing), not a sign of values given in another form than at fit."""
FAR_PEAKS = 10.0
"""A predict batch's numeric column whose present cells are mostly larger in magnitude than this many times the
largest of its train rows gets a warning naming it: such values are squeezed next to the train rows' extremes, so
a column given in other units than at fit (millimetres for metres) would be read as its largest train values
without a word. Measured against the largest train magnitude, not the train rows' deviation: a column of nearly
equal values (100.0-100.2) or mostly zeros has a tiny deviation that real test values exceed a thousandfold (one
row of two of the 465 folds of the suites did, in a first try)."""
FAR_CLIP = 1e6
"""Numeric values past this many times their column's largest train magnitude are read as that many: the model
reads them as its train rows' extremes anyway (numeric_bounds squeezes them), and 1e308 in a column whose train rows
reached 0.5 overflowed to inf in the division and failed the scaler ("Input X contains infinity")."""
UNSEEN = -2
"""The code of a category first seen at predict (Cells.codes): missing to the model, the linear models and the
trees, the overall mean to a target encoding (where a missing cell has the missing train cells' mean)."""
ID_ROWS = 30
"""A categorical column with a different value in every one of at least this many train rows (an id, a name, a
free-text note) is left out at fit, with a warning: no other row can share one of its values, so every test row's
would read as missing, while the trees could split the train rows on its arbitrary order."""
POWER_FIT_ROWS = 500
"""Train rows (a fixed random subset) that the Yeo-Johnson exponents are fitted on: 500 rows pin an exponent down
well, and the search's cost grows with the rows (tabfm.yeo_johnson)."""


@contextlib.contextmanager
def array_output():
    """Within it, scikit-learn transformers return numpy arrays whatever the user set with
    sklearn.set_config(transform_output="pandas" or "polars"), which would otherwise reach the indexing here (and
    does for estimators saved before this existed, whose transformers never had set_output called)."""
    from sklearn import config_context

    with config_context(transform_output="default"):
        yield


@dataclass(frozen=True)
class Column:
    """One kept column: its name (str; "x{i}" for arrays), position in the input, kind and train categories."""

    name: str
    index: int
    kind: str
    categories: tuple[str, ...] = ()
    values: str | None = None
    """A numeric column's values (RawColumn.values: numbers, dates, durations...), by its type or, in an object
    column, its cells; None in estimators saved before it was kept."""
    new_share: float = 0.0
    """A categorical column's share of train cells whose category occurs once among them: Good-Turing's estimate of
    how often a new row brings a category not seen at fit (0 in estimators saved before it was kept)."""


@dataclass
class Cells:
    """The kept columns of n rows: numeric values (NaN where missing or categorical) and category codes."""

    values: np.ndarray
    """[n, C] float64."""
    codes: np.ndarray
    """[n, C] int64: 0..n_cats-1, -1 for numeric columns and missing cells, UNSEEN (-2) for a category first seen
    at predict: a negative code reads as missing everywhere but in the target encodings."""
    is_cat: np.ndarray
    """[C] bool."""
    n_cats: np.ndarray
    """[C] int64."""
    encoded: np.ndarray | None = None
    """[n, E] float64 target encodings of the categorical columns of many levels (tabfm.category_encoding), which
    the linear models and the trees read as numeric columns after the C; None where no column is encoded."""

    def take(self, rows: np.ndarray | slice) -> Cells:
        """The given rows."""
        return Cells(self.values[rows], self.codes[rows], self.is_cat, self.n_cats,
                     None if self.encoded is None else self.encoded[rows])

    def numeric(self) -> tuple[np.ndarray, np.ndarray]:
        """([n, C + E] the values with the target encodings appended, [C + E] which of those columns are numeric):
        the columns as the linear models read them."""
        if self.encoded is None:
            return self.values, ~self.is_cat
        return (np.concatenate([self.values, self.encoded], 1),
                np.r_[~self.is_cat, np.ones(self.encoded.shape[1], bool)])


def _fit_categories(raw: np.ndarray, order: list[str] | None) -> tuple[str, ...]:
    """The train rows' categories in code order: the dtype's order when it declares one, else numeric order when
    every category is a number (so "2" < "10": the ordinal view feeds codes to the model as numbers), else sorted
    as strings."""
    seen = category_codes(string_series(raw))[1]  # distinct, sorted as strings
    if order is not None:
        present = set(seen.to_list())
        return tuple(dict.fromkeys(c for c in order if c in present))  # the dtype holds every value
    numbers = seen.cast(pl.Float64, strict=False)
    if seen.len() and not numbers.null_count():
        return tuple(seen.gather(np.argsort(numbers.to_numpy(), kind="stable")).to_list())
    return tuple(seen.to_list())


def _numbers_with_others(raw: np.ndarray) -> list[str] | None:
    """Up to 3 of the other values of a text column whose non-missing cells are mostly numbers, or None where they
    are not: the rule `tabfm predict` warns by (tabfm.text_columns.mostly_numeric_text), so the API and the command
    agree on which columns they name."""
    from tabfm.text_columns import mostly_numeric_text

    found = mostly_numeric_text(pl.DataFrame({"column": string_series(raw)}))
    return found[0][3] if found else None


def _new_share(raw: np.ndarray) -> float:
    """The share of the non-missing cells of a categorical column (category strings, None where missing) whose
    value occurs once among them (Column.new_share)."""
    present = [v for v in raw if v is not None]
    if not present:
        return 0.0
    counts = np.unique(np.asarray(present, dtype=object).astype(str), return_counts=True)[1]
    return float((counts == 1).sum() / len(present))


def _short(value: object, limit: int = 40) -> str:
    """repr(value), cut to `limit` characters: a free-text cell in a warning is an example, not the message."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


class NumericTextWarning(UserWarning):
    """fit read text columns that are mostly numbers as categories (a category of its own, so that callers that
    say it their own way, such as `tabfm predict`, can silence this one alone)."""


def _numeric_text_warning(columns: list[tuple[str, list[str]]]) -> str:
    """The warning for text columns that are mostly numbers: (name, up to 3 of its other values) each."""
    shown = ", ".join(f"{name!r} (other values: {', '.join(_short(v, 20) for v in others)})" if others
                      else repr(name) for name, others in columns)
    return (f"column(s) {shown} hold text that is mostly numbers and are read as categories: to read them as numbers "
            "convert them (pandas: pd.to_numeric(X[c], errors='coerce'); polars: pl.col(c).cast(pl.Float64, "
            "strict=False)), which makes any other value a missing cell (map such values to numbers first where "
            "they mean one, such as '>3'), or name them in categorical_features to keep them as categories")


def _unseen_note(c: Column, raw: np.ndarray, codes: np.ndarray, present: np.ndarray) -> str | None:
    """A note naming a categorical column whose predict cells (`present`: those not missing) are mostly
    categories not seen at fit (e.g. fitted on booleans, given 0/1), or None; None also where fit's own cells
    expected that (Column.new_share of at least NEW_EXPECTED: a county or a product name, whose new rows bring new
    values, mostly missing to the model and target-encoded where the column has many levels). It names no counts:
    predicting batch after batch (tabfm predict) repeats the same text, which Python's default warning filter then
    shows once."""
    unseen = codes == UNSEEN
    if 2 * int(unseen.sum()) <= int(present.sum()) or getattr(c, "new_share", 0.0) >= NEW_EXPECTED:
        return None
    example = raw[np.flatnonzero(unseen)[0]]
    at_fit = ", ".join(_short(v) for v in c.categories[:3])
    return f"column {c.name!r} (e.g. {_short(example)}; at fit e.g. [{at_fit}])"


class TablePreprocessor:
    """Learns the columns of the train rows; see the module docstring for the rules."""

    def __init__(self, categorical_features: str | Sequence[int | str] = "auto", max_columns: int | None = None,
                 transforms: Sequence[str] = NUMERIC_TRANSFORMS):
        self.categorical_features = categorical_features
        self.max_columns = max_columns
        self.transforms = tuple(transforms)

    def _forced(self, names: list[str]) -> set[int]:
        if isinstance(self.categorical_features, str):
            if self.categorical_features != "auto":
                raise ValueError(f"categorical_features must be 'auto' or a list of column indices or names, "
                                 f"got {self.categorical_features!r}")
            return set()
        flags = list(self.categorical_features)
        if flags and all(isinstance(c, bool | np.bool_) for c in flags):  # a mask, as scikit-learn's estimators take
            if len(flags) != len(names):
                raise ValueError(f"categorical_features is a mask of {len(flags)} booleans for {len(names)} columns: "
                                 "give one per column of X")
            return {i for i, flag in enumerate(flags) if flag}
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
        self.named_ = has_names(X)
        forced = self._forced(names)
        columns: list[Column] = []
        raw_numeric = []
        numeric_text, ids = [], []
        for i, (name, col) in enumerate(zip(names, cols, strict=True)):
            kind, raw, values = raw_column(col, name)
            if kind == "numeric" and np.isinf(raw).any():
                raise ValueError(f"column {name!r} holds inf at fit; replace it with a finite value or NaN (missing)")
            if i in forced and kind == "numeric":
                raw = np.array([None if math.isnan(v) else category_string(v) for v in raw], dtype=object)
                kind = "categorical"
            if kind == "numeric":
                seen = raw[~np.isnan(raw)]
                if len(np.unique(seen)) <= 1 and len(seen) in (0, n):
                    continue  # constant, or no value at all
                columns.append(Column(name, i, "numeric", values=values))
                raw_numeric.append(raw)
            else:
                cats = _fit_categories(raw, dtype_categories(col))
                if not cats or (len(cats) == 1 and all(v is not None for v in raw)):
                    continue  # constant, or no value at all
                others = None if i in forced or has_categorical_dtype(col) else _numbers_with_others(raw)
                new_share = _new_share(raw)
                if others is None and len(cats) >= ID_ROWS and new_share == 1.0:  # every present value once
                    ids.append(name)  # (numbers read as text get the advice to convert them instead)
                    continue
                columns.append(Column(name, i, "categorical", cats, new_share=new_share))
                if others is not None:
                    numeric_text.append((name, others))
        if numeric_text:
            warnings.warn(_numeric_text_warning(numeric_text), NumericTextWarning, stacklevel=2)
        if ids:
            shown = ", ".join(repr(n) for n in ids)
            warnings.warn(f"column(s) {shown} hold a different value in every train row that has one (ids?) and are "
                          "left out: no new row can share one of their values; drop them from the table to silence "
                          "this", UserWarning, stacklevel=2)
        self.columns_ = columns
        numeric = np.stack(raw_numeric, 1) if raw_numeric else np.zeros((n, 0))
        # each column divided by its largest train magnitude first: every transform below is scale-free, and
        # values near float64's limits (1e308) no longer overflow a variance or a float32 cast
        peak = np.nanmax(np.abs(numeric), axis=0, initial=0.0) if numeric.size else np.zeros(numeric.shape[1])
        self.peak_ = np.where(np.isfinite(peak) & (peak > 0), peak, 1.0)
        self.magnitude_ = peak  # the largest train magnitude as it is (0 for a column of zeros and missing cells)
        unit = numeric / self.peak_
        self.bounds_ = NumericBounds.fit(unit)
        bounded = self.bounds_.apply(unit)
        with array_output():
            self.scalers_ = {kind: self._fit_scaler(kind, bounded) for kind in self.transforms}
        return self

    @staticmethod
    def _fit_scaler(kind: str, numeric: np.ndarray) -> Any:
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import QuantileTransformer, RobustScaler, StandardScaler

        from tabfm.yeo_johnson import YeoJohnson, row_subset

        if kind not in NUMERIC_TRANSFORMS:
            raise ValueError(f"unknown numeric transform {kind!r}; choose from {NUMERIC_TRANSFORMS}")
        if numeric.shape[1] == 0:
            return None
        if kind == "none":  # what the model does to every column anyway, done here in float64 (no lost digits)
            return StandardScaler().fit(numeric)
        if kind == "robust":
            return RobustScaler(unit_variance=False).fit(numeric)
        if kind == "power":  # standardised first: Yeo-Johnson's lambda search overflows on large raw values
            with warnings.catch_warnings():  # the scaler too is fitted on the subset
                warnings.simplefilter("ignore", RuntimeWarning)
                return make_pipeline(StandardScaler(), YeoJohnson()).fit(row_subset(numeric, POWER_FIT_ROWS))
        return QuantileTransformer(output_distribution="normal", n_quantiles=max(2, min(1000, len(numeric))),
                                   subsample=None, random_state=0).fit(numeric)

    def transform(self, X: Any) -> Cells:
        names, cols = check_table_shape(X)
        if len(names) != len(self.names_):
            raise ValueError(f"X has {len(names)} features, but the estimator was fitted with {len(self.names_)}")
        self._check_names(X, names)
        n = len(cols[0])
        C = max(len(self.columns_), 1)  # all columns constant: one empty column, so the model still has a token
        values = np.full((n, C), np.nan)
        codes = np.full((n, C), -1, np.int64)
        is_cat = np.zeros(C, bool)
        n_cats = np.zeros(C, np.int64)
        unseen: list[str | None] = []
        far: list[str] = []
        numeric_index = 0  # the column's position among the numeric ones (peak_, bounds_)
        for j, c in enumerate(self.columns_):
            kind, raw, now = raw_column(cols[c.index], c.name)
            if c.kind == "numeric":
                if kind != "numeric" and all(v is None for v in raw):  # an all-missing batch (None, polars Null)
                    kind, raw = "numeric", np.full(n, np.nan)
                if kind != "numeric":
                    example = next((v for v in raw if v is not None), None)
                    raise ValueError(f"column {c.name!r} held {c.values or 'numbers'} at fit but holds "
                                     f"{non_numeric_words(cols[c.index])} now (e.g. {example!r}); pass "
                                     f"{c.values or 'numbers'} as at fit")
                if np.isinf(raw).any():
                    raise ValueError(f"column {c.name!r} holds inf; replace it with a finite value or NaN (missing)")
                if c.values and now and now != c.values and not np.isnan(raw).all():
                    raise ValueError(f"column {c.name!r} held {c.values} at fit but {now} now; pass {c.values} as at "
                                     f"fit (both reach the model as numbers, so these would be read as {c.values})")
                values[:, j] = raw
                note = self._far_note(c, numeric_index, raw)
                far += [note] if note else []
                numeric_index += 1
            else:
                if kind == "numeric":
                    raw = np.array([None if math.isnan(v) else category_string(v) for v in raw], dtype=object)
                texts = string_series(raw)
                codes[:, j] = category_codes(texts, string_series(c.categories))[0]
                present = texts.is_not_null().to_numpy()
                codes[present & (codes[:, j] < 0), j] = UNSEEN
                is_cat[j], n_cats[j] = True, len(c.categories)
                unseen.append(_unseen_note(c, raw, codes[:, j], present))
        if any(unseen):
            notes = [u for u in unseen if u]
            more = f"; and {len(notes) - UNSEEN_SHOWN} more columns" if len(notes) > UNSEEN_SHOWN else ""
            warnings.warn(f"categorical columns hold mostly values never seen at fit, which read as missing: "
                          f"{'; '.join(notes[:UNSEEN_SHOWN])}{more}. Pass the values as at fit (the same strings or "
                          "types, not codes of them)", UserWarning, stacklevel=2)
        if far:
            more = f"; and {len(far) - UNSEEN_SHOWN} more columns" if len(far) > UNSEEN_SHOWN else ""
            warnings.warn(f"numeric columns hold mostly values over {FAR_PEAKS:g} times larger than any of their "
                          f"train rows', which read as the train rows' extremes: "
                          f"{'; '.join(far[:UNSEEN_SHOWN])}{more}. Check their units against fit's", UserWarning,
                          stacklevel=2)
        return Cells(values, codes, is_cat, n_cats)

    def _far_note(self, c: Column, k: int, raw: np.ndarray) -> str | None:
        """A note naming numeric column c (the k-th numeric one) where most present cells of `raw` exceed FAR_PEAKS
        times its largest train magnitude, or None; never for dates, times or durations (dates after the train
        rows' are no error of units). Its words depend on the column only (no example of this batch), so that
        predicting batch after batch (tabfm predict) repeats the same text, which the default filter shows once."""
        present = raw[~np.isnan(raw)]
        if c.values not in (None, "numbers") or not len(present):
            return None
        largest = getattr(self, "magnitude_", self.peak_)[k]  # peak_ in estimators saved before magnitude_
        outside = np.abs(present) / FAR_PEAKS > largest  # divided: FAR_PEAKS x 1e308 would overflow
        if 2 * int(outside.sum()) <= len(present):
            return None
        return f"column {c.name!r} (at fit at most {largest:.6g} in magnitude)"

    def _check_names(self, X: Any, names: list[str]) -> None:
        """A table with column names must name its columns as at fit (as strings, in order): scikit-learn checks
        only all-string names, and a reordered table of int or tuple names would otherwise be read by position."""
        named = getattr(self, "named_", None)
        if named is None:  # fitted before named_ was kept: arrays were named x0, x1, ...
            named = self.names_ != [f"x{i}" for i in range(len(self.names_))]
        if not (named and has_names(X)) or names == self.names_:
            return
        diff = [i for i, (a, b) in enumerate(zip(names, self.names_, strict=True)) if a != b]
        raise ValueError(f"X's column names differ from those seen at fit (as strings, in order) at {len(diff)} of "
                         f"{len(names)} positions, first column {diff[0]}: {names[diff[0]]!r} where fit had "
                         f"{self.names_[diff[0]]!r}; pass X with the columns seen at fit, in their order")

    def scale(self, cells: Cells, kind: str) -> np.ndarray:
        """The numeric values [n, C] under one of the fitted transforms (NaN stays NaN; categorical columns stay
        NaN)."""
        if kind not in self.scalers_:
            raise ValueError(f"numeric transform {kind!r} was not fitted; fitted: {sorted(self.scalers_)}")
        values = cells.values
        numeric = [j for j, c in enumerate(self.columns_) if c.kind == "numeric"]
        if not numeric:
            return values.copy()
        every = len(numeric) == values.shape[1]  # then whole arrays, not a gather and a scatter of every cell
        with np.errstate(over="ignore"):  # a value past float64's range once divided (1e308 / 0.5) is the largest
            x = (values if every else values[:, numeric]) / self.peak_
        np.clip(x, -FAR_CLIP, FAR_CLIP, out=x)  # in place: the division's array is this call's own
        if getattr(self, "bounds_", None) is not None:  # absent in an estimator saved before the bounds existed
            x = self.bounds_.apply(x)
        if self.scalers_[kind] is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                with array_output():
                    x = self.scalers_[kind].transform(x)
            if kind == "robust":
                x = SOFT_CLIP * np.tanh(x / SOFT_CLIP)
        if every:
            return x
        out = values.copy()
        out[:, numeric] = x
        return out
