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
                 dropped at fit (at predict it is still expected, and not read)
    categories   the train rows' categories are codes 0..n-1 in the order of their dtype (a pandas categorical's
                 categories, a polars Enum's), else numeric when every category is a number ("2" < "10"), else
                 sorted as strings; the fitted list defines the codes at predict. A category first seen at predict
                 is a missing cell, with a warning when most of a column's cells are such
    scaling      numeric columns are transformed per ensemble member: "none" (only standardised with the train
                 rows' mean and deviation, in float64: the model standardises each column that way anyway), "robust" (median / interquartile range, then
                 a soft clip at +-4 so an outlier cannot dominate the model's train-row mean and deviation),
                 "quantile" (train-row quantiles mapped to a standard normal) or "power" (standardised, then
                 Yeo-Johnson towards a normal shape, tabfm.yeo_johnson), the others from scikit-learn

`TablePreprocessor.fit(X)` learns the columns; `transform(X)` gives `Cells` with raw numeric values (NaN where
missing) and category codes; `scale(values, kind)` applies a scaling fitted at fit.
"""

from __future__ import annotations

import contextlib
import datetime
import decimal
import math
import numbers
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import polars as pl

from tabfm.data.encode import category_codes
from tabfm.numeric_bounds import NumericBounds

NUMERIC_TRANSFORMS = ("none", "robust", "quantile", "power")
SCALINGS = NUMERIC_TRANSFORMS
SOFT_CLIP = 4.0
UNSEEN_SHOWN = 5
"""Columns named in the warning about unseen categories at predict (the rest are counted)."""
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
    """None, NaN, NaT and pd.NA (the one value unequal to itself, or whose comparison has no truth value)."""
    if v is None:
        return True
    try:
        return bool(v != v)  # NaN, NaT; pd.NA raises TypeError (ambiguous)
    except TypeError:
        return True
    except ValueError:  # an array in a cell: not missing, and refused by the caller as a bad cell
        return False


def _strings(values: Sequence[str | None]) -> pl.Series:
    """A polars String series of category strings and None (from a list: an object array that starts with None
    would be read as polars' Object type)."""
    return pl.Series(list(values), dtype=pl.String)


def category_string(v: Any) -> str:
    """The canonical string of a category value, so 1, 1.0 and "1" read the same at fit and predict."""
    if isinstance(v, bool | np.bool_):
        return str(bool(v))
    if isinstance(v, numbers.Integral):
        return str(int(v))
    if isinstance(v, numbers.Real):
        f = float(v)
        if f.is_integer():
            return str(int(f))
        if abs(f) <= _FLOAT32_MAX and float(np.float32(f)) == f:
            # a float32 value (or one widened from float32) is written as float32's shortest decimal, so the 0.1
            # of a float32 column is the 0.1 of a float64 one (repr of the widened value: 0.10000000149011612)
            f = float(str(np.float32(f)))
        return repr(f)
    return str(v)


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def unmask(a: np.ndarray) -> np.ndarray:
    """A masked array's values with its masked cells missing (NaN for numbers, None otherwise), any other array as
    it is: np.asarray keeps the values under a mask, which would read them as data."""
    if not isinstance(a, np.ma.MaskedArray):
        return a
    if not np.ma.count_masked(a):
        return np.ma.getdata(a)
    if a.dtype.kind in "iuf":
        return a.astype(np.float64).filled(np.nan)
    out = np.ma.getdata(a).astype(object)
    out[np.ma.getmaskarray(a)] = None
    return out


def arrow_as_polars(X: Any) -> Any:
    """A pyarrow Table or RecordBatch as a polars DataFrame (zero-copy for most types), so that it is read by
    column name and each column's own type, like a DataFrame (numpy would make it one array of one type); anything
    else as it is."""
    if type(X).__module__.startswith("pyarrow") and hasattr(X, "column_names") and hasattr(X, "num_rows"):
        X = pl.from_arrow(X)
        return X.to_frame() if isinstance(X, pl.Series) else X  # a one-column batch comes back as a Series
    return X


def _columns_of(X: Any) -> tuple[list[str], list[Any]]:
    """(names, column objects)."""
    X = arrow_as_polars(X)
    if isinstance(X, pl.DataFrame):
        return [str(c) for c in X.columns], X.get_columns()
    if isinstance(X, pl.LazyFrame):
        raise TypeError("X is a polars LazyFrame: collect() it first")
    if hasattr(X, "toarray") or type(X).__module__.startswith("scipy.sparse"):
        raise TypeError("Sparse data is not supported: a sparse matrix was passed, but dense data is required; "
                        "use X.toarray() to convert it to a dense numpy array")
    if hasattr(X, "iloc") and hasattr(X, "columns"):  # pandas
        _check_unique(list(X.columns))
        names = [str(c) for c in X.columns]
        return names, [X.iloc[:, i] for i in range(X.shape[1])]
    try:
        arr = np.asarray(unmask(X))
        if arr.dtype.kind in "US" and isinstance(X, list | tuple):  # numpy turns 1.5 beside "red" into "1.5"
            arr = np.asarray(X, dtype=object)
    except ValueError:  # ragged rows
        raise ValueError("X's rows have different lengths: give every row one value per column (None where "
                         "missing)") from None
    if arr.dtype.kind == "c":
        raise ValueError("Complex data not supported: X must hold real numbers or categories")
    if arr.ndim == 1:
        raise ValueError(f"X must be 2-D (rows x features); got a 1-D array of {arr.shape[0]} values. Reshape your "
                         "data: X.reshape(-1, 1) for one feature or X.reshape(1, -1) for one row")
    if arr.ndim == 0:
        raise ValueError(f"X must be a table (an array, a list of rows, a DataFrame); got a {type(X).__name__}")
    if arr.ndim != 2:
        raise ValueError(f"X must be 2-D (rows x features); got shape {arr.shape}")
    return [f"x{i}" for i in range(arr.shape[1])], [arr[:, i] for i in range(arr.shape[1])]


def _check_unique(labels: list[Any]) -> None:
    """Column names are how fit's columns are found again at predict, as strings: a name used twice, or two labels
    with one string (0 and "0"), is ambiguous."""
    seen: dict[str, tuple[int, Any]] = {}
    for i, label in enumerate(labels):
        name = str(label)
        if name in seen:
            j, first = seen[name]
            named = (f"named {label!r}" if repr(first) == repr(label)
                     else f"{first!r} and {label!r}, both read as the name {name!r}")
            raise ValueError(f"X has two columns {named} (positions {j} and {i}): rename or drop one so that every "
                             "column name is unique")
        seen[name] = (i, label)


_UNIT_SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def _is_arrow_temporal(t: Any) -> bool:
    import pyarrow as pa

    return pa.types.is_timestamp(t) or pa.types.is_date(t) or pa.types.is_time(t) or pa.types.is_duration(t)


def _temporal_seconds(arr: Any) -> np.ndarray:
    """A pyarrow date / time / timestamp / duration array -> float64 seconds (since the epoch, since midnight, or
    long), NaN where null: every unit, time zone and library reads alike, so fit and predict agree."""
    import pyarrow as pa

    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    t = arr.type
    if pa.types.is_date32(t):
        scale = 86400.0
    elif pa.types.is_date64(t):
        scale = 1e-3
    else:
        scale = _UNIT_SECONDS[t.unit]
    ints = arr.view(pa.int32() if t.bit_width == 32 else pa.int64())
    out = ints.to_numpy(zero_copy_only=False).astype(np.float64) * scale
    out[arr.is_null().to_numpy(zero_copy_only=False)] = np.nan
    return out


def _numpy_temporal_seconds(arr: np.ndarray) -> np.ndarray:
    """datetime64 / timedelta64 (any unit, NaT missing) -> float64 seconds, as _temporal_seconds."""
    import pyarrow as pa

    if np.datetime_data(arr.dtype)[0] not in ("s", "ms", "us", "ns"):  # days, weeks, months...: arrow lacks them
        arr = arr.astype(f"{arr.dtype.name.split('[')[0]}[s]")
    return _temporal_seconds(pa.array(arr, from_pandas=True))


def _complex_error(name: str) -> ValueError:
    return ValueError(f"column {name!r} holds complex numbers; X cells must be real: pass the real part (np.real) "
                      "and the imaginary part (np.imag) as two columns, or the magnitude (np.abs)")


class RawColumn(NamedTuple):
    """A column as read: its kind, its cells, and for a numeric column what its type says the values are."""

    kind: str
    """"numeric" or "categorical"."""
    cells: np.ndarray
    """float64 with NaN (numeric; dates, times and durations in seconds) or an object array of str / None."""
    values: str | None = None
    """"numbers", "dates", "dates with a time zone", "times of day" or "durations": what the column's type says,
    or what the cells of a numeric object column are; None for categorical columns. All of them reach the model
    as float seconds, so only this tells dates from numbers between fit and predict."""


def _arrow_value_kind(t: Any) -> str:
    """The value kind of a pyarrow temporal type."""
    import pyarrow as pa

    if pa.types.is_timestamp(t):
        return "dates with a time zone" if t.tz else "dates"
    return "dates" if pa.types.is_date(t) else "times of day" if pa.types.is_time(t) else "durations"


def _pandas_column(col: Any, name: str) -> RawColumn | np.ndarray:
    """A pandas column read by its dtype, or its cells as an object array when the values must decide."""
    import pandas as pd

    dtype = col.dtype
    if isinstance(dtype, pd.CategoricalDtype):  # categorical whatever its categories (ints included)
        return RawColumn("categorical", np.array([None if _is_missing(v) else category_string(v)
                                                  for v in col.astype(object)], dtype=object))
    if isinstance(dtype, pd.PeriodDtype):  # a period reads as its start, a timestamp without a time zone
        col = col.dt.start_time
        dtype = col.dtype
    arrow = dtype.pyarrow_dtype if isinstance(dtype, pd.ArrowDtype) else None
    values = None
    if arrow is not None and _is_arrow_temporal(arrow):
        values = _arrow_value_kind(arrow)
    elif isinstance(dtype, pd.DatetimeTZDtype):
        values = "dates with a time zone"
    elif pd.api.types.is_datetime64_any_dtype(dtype):
        values = "dates"
    elif pd.api.types.is_timedelta64_dtype(dtype):
        values = "durations"
    if values is not None:
        import pyarrow as pa

        return RawColumn("numeric", _temporal_seconds(pa.array(col, from_pandas=True)), values)
    if pd.api.types.is_complex_dtype(dtype):
        raise _complex_error(name)
    if pd.api.types.is_numeric_dtype(dtype) and not pd.api.types.is_bool_dtype(dtype):
        return RawColumn("numeric", col.astype("float64").to_numpy(dtype=np.float64, na_value=np.nan), "numbers")
    return col.astype(object).to_numpy()


def _polars_column(col: Any, name: str) -> RawColumn | list:
    """A polars column read by its dtype, or its cells as a list when the values must decide."""
    dtype = col.dtype
    if dtype.is_nested():
        raise TypeError(f"column {name!r} has the nested polars type {dtype}; X cells must be numbers, strings, "
                        "booleans or missing: unnest or explode it into plain columns first")
    if dtype.is_numeric():
        return RawColumn("numeric", col.cast(float).fill_null(float("nan")).to_numpy().astype(np.float64), "numbers")
    if dtype.is_temporal():
        arrow = col.to_arrow()
        return RawColumn("numeric", _temporal_seconds(arrow), _arrow_value_kind(arrow.type))
    return col.to_list()


_NUMPY_VALUE_KINDS = {"i": "numbers", "u": "numbers", "f": "numbers", "M": "dates", "m": "durations"}


def _raw_column(col: Any, name: str) -> RawColumn:
    """The column read as ("numeric", float64 array with NaN) or ("categorical", object array of str / None), with
    what its type says its values are. Dates, times and durations are numeric, in seconds."""
    module = type(col).__module__
    if module.startswith(("polars", "pandas")):
        read = _polars_column(col, name) if module.startswith("polars") else _pandas_column(col, name)
        if isinstance(read, RawColumn):
            return read
        col = read
    arr = np.asarray(col)
    if arr.dtype.kind == "b":
        return RawColumn("categorical", np.array([str(bool(v)) for v in arr], dtype=object))
    if arr.dtype.kind in "iuf":
        return RawColumn("numeric", arr.astype(np.float64), "numbers")
    if arr.dtype.kind in "US":
        return RawColumn("categorical", arr.astype(str).astype(object))
    if arr.dtype.kind in "Mm":
        return RawColumn("numeric", _numpy_temporal_seconds(arr), _NUMPY_VALUE_KINDS[arr.dtype.kind])
    if arr.dtype.kind == "c":
        raise _complex_error(name)
    # object: decide from the values
    kinds = set()
    out = np.empty(len(arr), dtype=object)
    for i, v in enumerate(arr):
        if _is_missing(v):
            out[i] = None
        elif isinstance(v, str | bool | np.bool_ | np.str_):
            kinds.add("str")
            out[i] = category_string(v)
        elif isinstance(v, numbers.Real | decimal.Decimal):
            kinds.add("num")
            try:
                out[i] = float(v)
            except OverflowError:
                raise ValueError(f"column {name!r} holds a {len(str(abs(int(v))))}-digit number, beyond float64's "
                                 "range (about 1.8e308): rescale the column or mark the cell missing") from None
        elif (read := _temporal_cell(v)) is not None:
            kinds.add(read[0])
            out[i] = read[1]
        else:
            raise TypeError(f"column {name!r} holds a {type(v).__name__} ({v!r}); X cells must be numbers, strings, "
                            "booleans, dates, times or missing (None / NaN)")
    return _decide_object_column(kinds, out, name)


def _decide_object_column(kinds: set[str], out: np.ndarray, name: str) -> RawColumn:
    """An object column's kind from the kinds of its cells: one kind, or an error naming the mix (its order and
    meaning would be a guess). A numeric one records what its cells were (numbers, dates, ...), as a typed column
    does, so that predict can refuse another kind."""
    if "str" in kinds and len(kinds) > 1:
        example = next(v for v in out if isinstance(v, str))
        other = "numbers" if kinds - {"str"} == {"num"} else "dates or times"
        raise ValueError(f"column {name!r} mixes {other} and strings or booleans (e.g. {example!r}): fix the bad "
                         "cells, or convert the whole column to strings to treat it as categorical")
    if len(kinds) > 1:
        shown = " and ".join(sorted("numbers" if k == "num" else k for k in kinds))
        raise ValueError(f"column {name!r} mixes {shown}: give each column one kind of value (dates and datetimes "
                         "may share one)")
    if kinds and kinds != {"str"}:  # numbers, or dates / times / durations already in seconds
        (kind,) = kinds
        return RawColumn("numeric", np.array([np.nan if v is None else v for v in out], dtype=np.float64),
                         "numbers" if kind == "num" else kind)
    return RawColumn("categorical", out)


_EPOCH = datetime.datetime(1970, 1, 1)


def _temporal_cell(v: Any) -> tuple[str, float] | None:
    """(kind, seconds) of a Python / numpy / pandas date, time or duration object, as the equivalent datetime64,
    arrow or polars column reads (since the epoch, since midnight, or long; the unit's integer count times the
    unit, so the same float); None for anything else."""
    if hasattr(v, "start_time") and hasattr(v, "freqstr"):  # pd.Period: its start
        v = v.start_time
    if hasattr(v, "value") and hasattr(v, "asm8"):  # pd.Timestamp / pd.Timedelta: integers of its unit (UTC)
        unit = getattr(v, "unit", "ns")
        count = v.value // {"s": 10**9, "ms": 10**6, "us": 10**3, "ns": 1}[unit]
        return ("dates" if isinstance(v, datetime.datetime) else "durations"), count * _UNIT_SECONDS[unit]
    if isinstance(v, np.datetime64):
        return "dates", float(_numpy_temporal_seconds(np.array([v]))[0])
    if isinstance(v, datetime.datetime):
        if v.tzinfo is not None and v.utcoffset() is not None:
            v = v.astimezone(datetime.timezone.utc).replace(tzinfo=None)
        return "dates", ((v.replace(tzinfo=None) - _EPOCH) // datetime.timedelta(microseconds=1)) * 1e-6
    if isinstance(v, datetime.date):
        return "dates", (v - _EPOCH.date()).days * 86400.0
    if isinstance(v, datetime.time):
        return "times of day", (((v.hour * 60 + v.minute) * 60 + v.second) * 10**6 + v.microsecond) * 1e-6
    if isinstance(v, datetime.timedelta):
        return "durations", (v // datetime.timedelta(microseconds=1)) * 1e-6
    return None


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


def _has_names(X: Any) -> bool:
    """Whether X names its columns (a pandas or polars DataFrame); an array's columns are known by position."""
    return isinstance(X, pl.DataFrame) or (hasattr(X, "iloc") and hasattr(X, "columns"))


def _non_numeric_words(col: Any) -> str:
    """What a column read as categorical holds, in words for an error: categories, booleans or strings."""
    if _has_categorical_dtype(col):
        return "categories (a categorical dtype)"
    boolean = (col.dtype == pl.Boolean if isinstance(col, pl.Series) else
               str(getattr(col, "dtype", "")) in ("bool", "boolean", "bool[pyarrow]"))
    return "booleans" if boolean else "strings"


def _has_categorical_dtype(col: Any) -> bool:
    """A pandas categorical or polars Categorical / Enum column: its categories are declared, not guessed."""
    if isinstance(col, pl.Series):
        return isinstance(col.dtype, pl.Categorical | pl.Enum)
    if type(col).__module__.startswith("pandas"):
        import pandas as pd

        return isinstance(col.dtype, pd.CategoricalDtype)
    return False


def _dtype_categories(col: Any) -> list[str] | None:
    """The category order a column's dtype declares (a pandas categorical's categories, ordered or in the natural
    order pandas gave them; a polars Enum's), as category strings; None when the values must decide (a polars
    Categorical too: polars orders it as its strings)."""
    if isinstance(col, pl.Series):
        return [str(v) for v in col.dtype.categories] if isinstance(col.dtype, pl.Enum) else None
    if _has_categorical_dtype(col):
        return [category_string(v) for v in col.dtype.categories]
    return None


def _fit_categories(raw: np.ndarray, order: list[str] | None) -> tuple[str, ...]:
    """The train rows' categories in code order: the dtype's order when it declares one, else numeric order when
    every category is a number (so "2" < "10": the ordinal view feeds codes to the model as numbers), else sorted
    as strings."""
    seen = category_codes(_strings(raw))[1]  # distinct, sorted as strings
    if order is not None:
        present = set(seen.to_list())
        return tuple(dict.fromkeys(c for c in order if c in present))  # the dtype holds every value
    numbers = seen.cast(pl.Float64, strict=False)
    if seen.len() and not numbers.null_count():
        return tuple(seen.gather(np.argsort(numbers.to_numpy(), kind="stable")).to_list())
    return tuple(seen.to_list())


def _mostly_numbers(raw: np.ndarray) -> bool:
    """Whether most non-missing cells of a text column are numbers: the rule `tabfm predict` warns by
    (tabfm.table_io.mostly_numeric_text), so the API and the command agree on which columns they name."""
    from tabfm.table_io import mostly_numeric_text

    return bool(mostly_numeric_text(pl.DataFrame({"column": _strings(raw)})))


class NumericTextWarning(UserWarning):
    """fit read text columns that are mostly numbers as categories (a category of its own, so that callers that
    say it their own way, such as `tabfm predict`, can silence this one alone)."""


def _numeric_text_warning(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names)
    return (f"column(s) {shown} hold text that is mostly numbers and are read as categories: to read them as numbers "
            "convert them (pandas: pd.to_numeric(X[c], errors='coerce'); polars: pl.col(c).cast(pl.Float64, "
            "strict=False)), or name them in categorical_features to keep them as categories")


def _unseen_note(c: Column, raw: np.ndarray, codes: np.ndarray) -> str | None:
    """A note naming a categorical column whose predict cells are mostly categories not seen at fit (e.g. fitted
    on booleans, given 0/1), or None. It names no counts: predicting batch after batch (tabfm predict) repeats
    the same text, which Python's default warning filter then shows once."""
    present = _strings(raw).is_not_null().to_numpy()
    unseen = present & (codes < 0)
    if 2 * int(unseen.sum()) <= int(present.sum()):
        return None
    example = raw[np.flatnonzero(unseen)[0]]
    return f"column {c.name!r} (e.g. {example!r}; at fit e.g. {list(c.categories[:3])})"


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
        self.named_ = _has_names(X)
        forced = self._forced(names)
        columns: list[Column] = []
        raw_numeric = []
        numeric_text = []
        for i, (name, col) in enumerate(zip(names, cols, strict=True)):
            kind, raw, values = _raw_column(col, name)
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
                cats = _fit_categories(raw, _dtype_categories(col))
                if not cats or (len(cats) == 1 and all(v is not None for v in raw)):
                    continue  # constant, or no value at all
                columns.append(Column(name, i, "categorical", cats))
                if i not in forced and not _has_categorical_dtype(col) and _mostly_numbers(raw):
                    numeric_text.append(name)
        if numeric_text:
            warnings.warn(_numeric_text_warning(numeric_text), NumericTextWarning, stacklevel=2)
        self.columns_ = columns
        numeric = np.stack(raw_numeric, 1) if raw_numeric else np.zeros((n, 0))
        # each column divided by its largest train magnitude first: every transform below is scale-free, and
        # values near float64's limits (1e308) no longer overflow a variance or a float32 cast
        peak = np.nanmax(np.abs(numeric), axis=0, initial=0.0) if numeric.size else np.zeros(numeric.shape[1])
        self.peak_ = np.where(np.isfinite(peak) & (peak > 0), peak, 1.0)
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

        from tabfm.yeo_johnson import YeoJohnson

        if kind not in NUMERIC_TRANSFORMS:
            raise ValueError(f"unknown numeric transform {kind!r}; choose from {NUMERIC_TRANSFORMS}")
        if numeric.shape[1] == 0:
            return None
        if kind == "none":  # what the model does to every column anyway, done here in float64 (no lost digits)
            return StandardScaler().fit(numeric)
        if kind == "robust":
            return RobustScaler(unit_variance=False).fit(numeric)
        if kind == "power":  # standardised first: Yeo-Johnson's lambda search overflows on large raw values
            rows = numeric
            if len(rows) > POWER_FIT_ROWS:  # the lambda search costs ~1 ms per column per 1,000 rows
                some = rows[np.sort(np.random.default_rng(0).choice(len(rows), POWER_FIT_ROWS, replace=False))]
                if (~np.isnan(some)).any(axis=0).all():  # else a sparse column has no value there: all rows
                    rows = some
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                return make_pipeline(StandardScaler(), YeoJohnson()).fit(rows)
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
        for j, c in enumerate(self.columns_):
            kind, raw, now = _raw_column(cols[c.index], c.name)
            if c.kind == "numeric":
                if kind != "numeric" and all(v is None for v in raw):  # an all-missing batch (None, polars Null)
                    kind, raw = "numeric", np.full(n, np.nan)
                if kind != "numeric":
                    example = next((v for v in raw if v is not None), None)
                    raise ValueError(f"column {c.name!r} held {c.values or 'numbers'} at fit but holds "
                                     f"{_non_numeric_words(cols[c.index])} now (e.g. {example!r}); pass "
                                     f"{c.values or 'numbers'} as at fit")
                if np.isinf(raw).any():
                    raise ValueError(f"column {c.name!r} holds inf; replace it with a finite value or NaN (missing)")
                if c.values and now and now != c.values and not np.isnan(raw).all():
                    raise ValueError(f"column {c.name!r} held {c.values} at fit but {now} now; pass {c.values} as at "
                                     f"fit (both reach the model as numbers, so these would be read as {c.values})")
                values[:, j] = raw
            else:
                if kind == "numeric":
                    raw = np.array([None if math.isnan(v) else category_string(v) for v in raw], dtype=object)
                codes[:, j] = category_codes(_strings(raw), _strings(c.categories))[0]
                is_cat[j], n_cats[j] = True, len(c.categories)
                unseen.append(_unseen_note(c, raw, codes[:, j]))
        if any(unseen):
            notes = [u for u in unseen if u]
            more = f"; and {len(notes) - UNSEEN_SHOWN} more columns" if len(notes) > UNSEEN_SHOWN else ""
            warnings.warn(f"categorical columns hold mostly values never seen at fit, which read as missing: "
                          f"{'; '.join(notes[:UNSEEN_SHOWN])}{more}. Pass the values as at fit (the same strings or "
                          "types, not codes of them)", UserWarning, stacklevel=2)
        return Cells(values, codes, is_cat, n_cats)

    def _check_names(self, X: Any, names: list[str]) -> None:
        """A table with column names must name its columns as at fit (as strings, in order): scikit-learn checks
        only all-string names, and a reordered table of int or tuple names would otherwise be read by position."""
        named = getattr(self, "named_", None)
        if named is None:  # fitted before named_ was kept: arrays were named x0, x1, ...
            named = self.names_ != [f"x{i}" for i in range(len(self.names_))]
        if not (named and _has_names(X)) or names == self.names_:
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
        x = (values if every else values[:, numeric]) / self.peak_
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
