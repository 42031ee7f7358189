"""A user's feature table (numpy, pandas, polars or pyarrow) -> named raw columns, each of one kind: numbers (dates,
times and durations as seconds), or category values; and one clear error for what cannot be read (an object
column mixing strings and numbers, complex numbers, nested columns, duplicate names). tabfm.preprocess learns
and applies the columns' codes and scalings on top of these."""

from __future__ import annotations

import datetime
import decimal
import numbers
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import polars as pl


def is_missing(v: Any) -> bool:
    """None, NaN, NaT and pd.NA (the one value unequal to itself, or whose comparison has no truth value)."""
    if v is None:
        return True
    try:
        return bool(v != v)  # NaN, NaT; pd.NA raises TypeError (ambiguous)
    except TypeError:
        return True
    except ValueError:  # an array in a cell: not missing, and refused by the caller as a bad cell
        return False


def string_series(values: Sequence[str | None]) -> pl.Series:
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


def refuse_lazy_frame(data: Any, name: str) -> None:
    """A polars LazyFrame holds no rows until collected: one TypeError line naming `name` (X or y)."""
    if isinstance(data, pl.LazyFrame):
        raise TypeError(f"{name} is a polars LazyFrame: collect() it first")


def _columns_of(X: Any) -> tuple[list[str], list[Any]]:
    """(names, column objects)."""
    X = arrow_as_polars(X)
    if isinstance(X, pl.DataFrame):
        return [str(c) for c in X.columns], X.get_columns()
    refuse_lazy_frame(X, "X")
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
        return RawColumn("categorical", np.array([None if is_missing(v) else category_string(v)
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


def raw_column(col: Any, name: str) -> RawColumn:
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
        if is_missing(v):
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


def has_names(X: Any) -> bool:
    """Whether X names its columns (a pandas or polars DataFrame); an array's columns are known by position."""
    return isinstance(X, pl.DataFrame) or (hasattr(X, "iloc") and hasattr(X, "columns"))


def non_numeric_words(col: Any) -> str:
    """What a column read as categorical holds, in words for an error: categories, booleans or strings."""
    if has_categorical_dtype(col):
        return "categories (a categorical dtype)"
    boolean = (col.dtype == pl.Boolean if isinstance(col, pl.Series) else
               str(getattr(col, "dtype", "")) in ("bool", "boolean", "bool[pyarrow]"))
    return "booleans" if boolean else "strings"


def has_categorical_dtype(col: Any) -> bool:
    """A pandas categorical or polars Categorical / Enum column: its categories are declared, not guessed."""
    if isinstance(col, pl.Series):
        return isinstance(col.dtype, pl.Categorical | pl.Enum)
    if type(col).__module__.startswith("pandas"):
        import pandas as pd

        return isinstance(col.dtype, pd.CategoricalDtype)
    return False


def dtype_categories(col: Any) -> list[str] | None:
    """The category order a column's dtype declares (a pandas categorical's categories, ordered or in the natural
    order pandas gave them; a polars Enum's), as category strings; None when the values must decide (a polars
    Categorical too: polars orders it as its strings)."""
    if isinstance(col, pl.Series):
        return [str(v) for v in col.dtype.categories] if isinstance(col.dtype, pl.Enum) else None
    if has_categorical_dtype(col):
        return [category_string(v) for v in col.dtype.categories]
    return None
