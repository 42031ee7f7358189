"""Bad input in, one clear ValueError / TypeError out (issue 16): parameters, class labels, threads, and the odd
columns the table reader must read right (NaT, nullable and categorical dtypes, time zones, all-missing batches)
or refuse by name (complex, nested, duplicate names)."""

from __future__ import annotations

import contextlib
import datetime
import decimal
import os
from pathlib import Path

import numpy as np
import pandas as pd
import polars as pl
import pytest
import torch
from sklearn.base import BaseEstimator
from sklearn.exceptions import DataConversionWarning
from sklearn.utils._param_validation import InvalidParameterError
from threadpoolctl import threadpool_info

from tabfm.estimator import TabFMClassifier, TabFMRegressor
from tabfm.preprocess import TablePreprocessor
from tabfm.raw_columns import raw_column
from tabfm.validation import (ESTIMATOR_PARAMETER_CONSTRAINTS, check_class_labels, resolve_device, resolve_seed,
                              torch_threads)

# -- parameters ---------------------------------------------------------------------------------------------

PARAMETERS = {"n_estimators": "auto", "checkpoint": None, "categorical_features": "auto", "max_context_rows": None,
              "batch_size": 1024, "device": "cpu", "dtype": "float32", "precision": "auto", "tensor_parallel": None,
              "sequence_parallel": True, "random_state": 0, "verbose": False, "calibrate": True, "n_jobs": None}


class Probe(BaseEstimator):
    """An estimator with the estimators' parameters, validated as the lead wires them into fit."""

    _parameter_constraints = ESTIMATOR_PARAMETER_CONSTRAINTS

    def __init__(self, **params):
        for k, v in {**PARAMETERS, **params}.items():
            setattr(self, k, v)

    def get_params(self, deep=True):
        return {k: getattr(self, k) for k in PARAMETERS}

    def fit(self):
        self._validate_params()
        return self


def test_constraints_cover_the_estimator_parameters():
    assert set(PARAMETERS) <= set(ESTIMATOR_PARAMETER_CONSTRAINTS)
    params = TabFMClassifier().get_params()
    assert {k: params[k] for k in PARAMETERS if k in params} == {k: v for k, v in PARAMETERS.items() if k in params}
    Probe().fit()  # the defaults pass


@pytest.mark.parametrize("name, value", [
    ("n_estimators", 3), ("n_estimators", np.int64(2)), ("n_estimators", "auto"), ("max_context_rows", 10), ("batch_size", 1),
    ("checkpoint", "model.safetensors"), ("checkpoint", Path("m")),
    ("categorical_features", [0, "colour"]), ("device", "cuda:1"), ("device", torch.device("cpu")),
    ("dtype", "bfloat16"), ("dtype", torch.float64), ("precision", "bf16"), ("tensor_parallel", (2, 1)), ("tensor_parallel", [1, np.int64(2)]),
    ("random_state", None),
    ("random_state", 2**40), ("random_state", np.random.RandomState(0)), ("random_state", np.random.default_rng(0)),
    ("verbose", 1), ("n_jobs", -1), ("n_jobs", 2),
])
def test_good_parameters_pass(name, value):
    Probe(**{name: value}).fit()


@pytest.mark.parametrize("name, value", [
    ("n_estimators", 0), ("n_estimators", True), ("n_estimators", "4"), ("n_estimators", 2.0), ("n_estimators", "AUTO"),
    ("batch_size", 0), ("max_context_rows", -5), ("random_state", -1), ("random_state", "0"),
    ("dtype", torch.int64), ("dtype", "int8"), ("precision", "bfloat16"), ("device", 0), ("checkpoint", 3), ("tensor_parallel", 5),
    ("sequence_parallel", "yes"), ("calibrate", None), ("categorical_features", "all"), ("n_jobs", 0),
    ("n_jobs", -2), ("n_jobs", "2"), ("n_jobs", True),
    # each entry a positive int, two of them: (0, 2) once advised "torchrun --nproc-per-node 0", 1.5 became 1
    ("tensor_parallel", (0, 2)), ("tensor_parallel", (-1, -2)), ("tensor_parallel", (1.5, 2)),
    ("tensor_parallel", ("1", "1")), ("tensor_parallel", (1,)), ("tensor_parallel", (1, 1, 1)),
    ("tensor_parallel", (True, 1)),
])
def test_bad_parameters_are_named(name, value):
    with pytest.raises(InvalidParameterError, match=f"The '{name}' parameter of Probe must be .* Got .* instead"):
        Probe(**{name: value}).fit()
    assert issubclass(InvalidParameterError, ValueError) and issubclass(InvalidParameterError, TypeError)


@pytest.mark.parametrize("device, match", [
    ("gpu", "use 'cuda'"), ("GPU:0", "use 'cuda'"), ("meta", "holds no data"), ("tpu", "not a device torch knows"),
    ("xla", "not supported"), ("", "not a device torch knows"),
])
def test_resolve_device_says_what_to_pass(device, match):
    with pytest.raises(ValueError, match=match):
        resolve_device(device)


def test_resolve_device_accepts_cpu_and_auto():
    assert resolve_device("cpu") == resolve_device(torch.device("cpu")) == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"no cuda device; use device='cpu' or 'auto' \(tabfm predict: "
                                             r"--device cpu or auto\)"):
            resolve_device("cuda")


# -- class labels -------------------------------------------------------------------------------------------

MISSING_LABELS = {
    "None among strings": np.array(["a", "b", None, "a"], dtype=object),
    "NaN among strings": np.array(["a", "b", np.nan, "a"], dtype=object),
    "pd.NA among strings": pd.Series(["a", "b", pd.NA, "a"], dtype=object),
    "pandas string dtype": pd.Series(["a", "b", None, "a"], dtype="string"),
    "pandas categorical": pd.Series(["a", "b", None, "a"], dtype="category"),
    "pandas Int64": pd.Series([0, 1, None, 0], dtype="Int64"),
    "polars null": pl.Series(["a", "b", None, "a"]),
    "float NaN": np.array([0.0, 1.0, np.nan, 0.0]),
    "NaT": np.array(["2020-01-01", "2021-01-01", "NaT", "2020-01-01"], dtype="datetime64[D]"),
}


@pytest.mark.parametrize("y", MISSING_LABELS.values(), ids=MISSING_LABELS.keys())
def test_missing_labels_get_one_clear_error(y):
    with pytest.raises(ValueError, match=r"^y holds missing labels \(None/NaN/pd.NA\) in 1 rows: drop those rows "
                                         "or give them a class$"):
        check_class_labels(y)


@pytest.mark.parametrize("y, kinds", [
    (np.array(["a", 1, "a", 1], dtype=object), "str .* and number"),
    (np.array([True, 1, False, 0], dtype=object), "bool .* and number"),  # True == 1: np.unique would merge them
    (["yes", False, "no"], "str .* and bool"),
])
def test_mixed_label_types_are_refused(y, kinds):
    with pytest.raises(ValueError, match=f"y mixes label types: {kinds}.*give every label one type"):
        check_class_labels(y)


def test_other_bad_labels():
    with pytest.raises(ValueError, match="y holds inf in 1 rows"):
        check_class_labels([0.0, np.inf, 1.0])
    with pytest.raises(ValueError, match=r"y holds labels of type Interval \(e.g. Interval\(.*convert them, e.g. "
                                         r"y.astype\(str\)"):
        check_class_labels(pd.cut([0.1, 0.5, 0.9, 0.2], 2))
    with pytest.raises(ValueError, match=r"y holds numbers numpy cannot store as one array type \(e.g. Decimal"):
        check_class_labels(np.array([decimal.Decimal("1.5"), decimal.Decimal("2")], dtype=object))
    with pytest.raises(ValueError, match="y holds numbers numpy cannot store as one array type .*convert them"):
        check_class_labels(np.array([2**70, 1, 1], dtype=object))
    with pytest.raises(ValueError, match="y mixes label types: bytes .* and str"):
        check_class_labels([b"a", "b", "b"])
    with pytest.raises(ValueError, match=r"^y holds complex numbers; targets must be real"):
        check_class_labels(np.array([1 + 0j, 2 + 0j]))
    with pytest.raises(ValueError, match="continuous"):
        check_class_labels([0.5, 1.5, 2.25])


@pytest.mark.parametrize("y, expected", [
    (pd.Series([2, 1, 2, 1], dtype="Int64"), np.array([2, 1, 2, 1], np.int64)),
    (pd.Series([2, 1, 2, 1], dtype="UInt8"), np.array([2, 1, 2, 1], np.uint8)),
    (pd.Series([True, False, True, False], dtype="boolean"), np.array([True, False, True, False])),
    (pd.Series([2.0, 1.0, 2.0, 1.0], dtype="Float64"), np.array([2.0, 1.0, 2.0, 1.0])),  # floats stay floats
    (pd.array([True, False, True, False], dtype="boolean"), np.array([True, False, True, False])),  # arrays too
    (pd.array([2, 1, 2, 1], dtype="Int64"), np.array([2, 1, 2, 1], np.int64)),
    (pd.DataFrame({"y": pd.array([2, 1, 2, 1], dtype="Int16")}), np.array([2, 1, 2, 1], np.int16)),
])
def test_pandas_nullable_labels_keep_their_type(y, expected):
    """scikit-learn's column_or_1d reads nullable integers and booleans as float64: a classifier fitted on
    True/False would predict 1.0/0.0."""
    column = isinstance(y, pd.DataFrame)  # a one-column frame: scikit-learn's warning that y is a column vector
    with pytest.warns(DataConversionWarning) if column else contextlib.nullcontext():
        got = check_class_labels(y)
    assert got.dtype == expected.dtype and np.array_equal(got, expected)
    X = np.arange(8.0).reshape(4, 2)
    with pytest.warns(DataConversionWarning) if column else contextlib.nullcontext():
        est = TabFMClassifier(n_estimators=1, calibrate=False).fit(X, y)
    assert est.classes_.dtype == expected.dtype
    assert est.predict(X).dtype == expected.dtype


@pytest.mark.parametrize("y", [["b", "a", "b"], np.array([3, 1, 3]), [True, False, True], [1.0, 2.0, 1.0],
                               pd.Series(["x", "y", "x"], dtype="category"), pl.Series(["x", "y", "x"]),
                               np.array(["a", np.str_("b"), "a"], dtype=object)])
def test_good_labels_pass_unchanged(y):
    out = check_class_labels(y)
    assert out.ndim == 1 and list(out) == list(y)


@pytest.mark.parametrize("y, expected", [
    (np.array([0, 1, 0, 1], dtype=object), np.array([0, 1, 0, 1])),  # a pandas object column of ints
    (pd.Series([2, 7, 2], dtype=object), np.array([2, 7, 2])),
    (np.array([True, False, True], dtype=object), np.array([True, False, True])),
    (np.array([0.0, 1.0, 0.0], dtype=object), np.array([0.0, 1.0, 0.0])),
])
def test_object_arrays_of_one_number_kind_read_as_numbers(y, expected):
    out = check_class_labels(y)  # scikit-learn's type_of_target calls these "unknown"
    assert out.dtype == expected.dtype
    np.testing.assert_array_equal(out, expected)


def test_masked_labels_are_refused_and_an_empty_mask_is_ignored():
    for masked in (np.ma.array([0, 1, 0, 1], mask=[0, 1, 0, 0]), np.ma.array(["a", "b", "a"], mask=[0, 0, 1])):
        with pytest.raises(ValueError, match=r"^y holds missing labels \(None/NaN/pd.NA\) in 1 rows: drop those rows"):
            check_class_labels(masked)  # np.asarray would read the masked label
    np.testing.assert_array_equal(check_class_labels(np.ma.array([0, 1, 1], mask=False)), [0, 1, 1])


# -- threads ------------------------------------------------------------------------------------------------

def test_torch_threads_sets_and_restores():
    before = torch.get_num_threads()
    with torch_threads(1) as k:
        assert k == torch.get_num_threads() == 1
        assert all(lib["num_threads"] == 1 for lib in threadpool_info() if lib["user_api"] == "blas")
    assert torch.get_num_threads() == before
    with torch_threads(None) as k:
        assert k == torch.get_num_threads() == before
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    with torch_threads(-1) as k:
        assert k == torch.get_num_threads() == cores
    assert torch.get_num_threads() == before


def test_torch_threads_restores_after_an_error():
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="boom"), torch_threads(1):
        raise RuntimeError("boom")
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("n_jobs", [0, -2, 1.5, "2", True])
def test_torch_threads_refuses_bad_counts(n_jobs):
    before = torch.get_num_threads()
    with pytest.raises(InvalidParameterError, match="n_jobs must be a positive number of threads, -1 .* or None"):
        with torch_threads(n_jobs):
            pass
    assert torch.get_num_threads() == before


def test_a_bad_n_jobs_is_scikit_learns_invalid_parameter_error_at_fit():
    """The estimators set their threads before fit validates its parameters: n_jobs=-2 was a plain ValueError."""
    with pytest.raises(InvalidParameterError, match="got -2$"):
        TabFMClassifier(n_jobs=-2).fit(np.ones((4, 2)), [0, 1, 0, 1])


# -- columns the reader must read right -----------------------------------------------------------------------

JAN_1_2020 = 1577836800.0  # seconds since the epoch


@pytest.mark.parametrize("col", [
    pd.Series(pd.to_datetime(["2020-01-01", None])),
    pd.Series(pd.to_datetime(["2020-01-01", None])).astype("datetime64[ns]"),
    pd.Series(pd.to_datetime(["2020-01-01 01:00", None])).dt.tz_localize("Europe/Paris"),
    pd.Series(pd.to_datetime(["2020-01-01", None])).astype("timestamp[ms][pyarrow]"),
    pl.Series("d", [datetime.datetime(2020, 1, 1), None]),
    pl.Series("d", [datetime.datetime(2020, 1, 1), None]).cast(pl.Datetime("ns", "UTC")),
    pl.Series("d", [datetime.date(2020, 1, 1), None]),
    np.array(["2020-01-01", "NaT"], dtype="datetime64[D]"),
], ids=["pandas", "pandas-ns", "pandas-tz", "pandas-arrow", "polars", "polars-ns-utc", "polars-date", "numpy"])
def test_dates_read_as_seconds_and_nat_as_missing(col):
    kind, raw, values = raw_column(col, "d")
    assert kind == "numeric" and values.startswith("dates")
    assert raw[0] == pytest.approx(JAN_1_2020) and np.isnan(raw[1])  # NaT was -9.2e18


def test_durations_and_times_read_as_seconds():
    """Each reads as seconds, and its type says which kind of value it was (fit and predict compare these)."""
    assert raw_column(pd.Series(pd.to_timedelta([90, None], unit="s")), "t").values == "durations"
    assert raw_column(np.array([90, 30], dtype="timedelta64[s]"), "t").values == "durations"
    assert raw_column(pd.Series(pd.period_range("2020-01", periods=2, freq="M")), "t").values == "dates"
    assert raw_column(pl.Series("t", [1.5, None]), "t").values == "numbers"
    assert raw_column(np.array([1, 2], dtype=object), "t").values == "numbers"  # the cells decided
    assert raw_column(np.array([datetime.timedelta(1), None], dtype=object), "t").values == "durations"
    assert raw_column(np.array(["a", None], dtype=object), "t").values is None  # categorical
    assert raw_column(pd.Series(pd.to_timedelta([90, None], unit="s")), "t")[1][0] == 90
    assert raw_column(pl.Series("t", [datetime.timedelta(minutes=2), None]), "t")[1][0] == 120
    kind, raw, values = raw_column(pl.Series("t", [datetime.time(1), None]), "t")
    assert kind == "numeric" and raw[0] == 3600 and np.isnan(raw[1]) and values == "times of day"


def test_pandas_nullable_and_categorical_dtypes():
    df = pd.DataFrame({
        "Int64": pd.Series([1, None, 3, 4], dtype="Int64"),
        "Float64": pd.Series([1.5, None, 2.5, 0.0], dtype="Float64"),
        "boolean": pd.Series([True, None, False, True], dtype="boolean"),
        "category": pd.Series(["a", np.nan, "b", "a"], dtype="category"),
        "int_category": pd.Series([10, 20, None, 10], dtype="category"),  # a categorical dtype stays categorical
        "string": pd.Series(["x", pd.NA, "y", "x"], dtype="string"),
    })
    prep = TablePreprocessor().fit(df)
    assert {c.name: c.kind for c in prep.columns_} == {
        "Int64": "numeric", "Float64": "numeric", "boolean": "categorical", "category": "categorical",
        "int_category": "categorical", "string": "categorical"}
    assert prep.columns_[4].categories == ("10", "20")
    cells = prep.transform(df)
    np.testing.assert_array_equal(cells.values[:, 0], [1, np.nan, 3, 4])
    np.testing.assert_array_equal(cells.values[:, 1], [1.5, np.nan, 2.5, 0.0])
    np.testing.assert_array_equal(cells.codes[:, 2:], [[1, 0, 0, 0], [-1, -1, 1, -1], [0, 1, -1, 1], [1, 0, 0, 0]])


def test_fit_and_predict_agree_across_libraries_and_units():
    ns = pd.DataFrame({"d": pd.to_datetime(["2020-01-01", "2020-06-01", None]).astype("datetime64[ns]"),
                       "x": [1.0, 2.0, 3.0]})
    prep = TablePreprocessor().fit(ns)
    us = pl.from_pandas(ns).with_columns(pl.col("d").cast(pl.Datetime("us")))
    np.testing.assert_array_equal(prep.transform(us).values, prep.transform(ns).values)


@pytest.mark.parametrize("batch", [
    pd.DataFrame({"x": [None, None], "c": ["a", "b"]}, dtype=object),
    pd.DataFrame({"x": [pd.NA, pd.NA], "c": ["a", "b"]}, dtype=object),
    pl.DataFrame({"x": [None, None], "c": ["a", "b"]}),  # x is of polars' Null type
], ids=["object-None", "object-NA", "polars-Null"])
def test_an_all_missing_predict_column_reads_as_missing(batch):
    prep = TablePreprocessor().fit(pd.DataFrame({"x": [1.0, 2.0, 3.0], "c": ["a", "b", "a"]}))
    cells = prep.transform(batch)
    assert np.isnan(cells.values[:, 0]).all() and list(cells.codes[:, 1]) == [0, 1]
    # and in a column that was categorical at fit: missing categories
    prep = TablePreprocessor().fit(pd.DataFrame({"x": ["p", "q", "p"], "c": ["a", "b", "a"]}))
    assert list(prep.transform(batch).codes[:, 0]) == [-1, -1]


# -- columns the reader must refuse by name -------------------------------------------------------------------

@pytest.mark.parametrize("X, error, match", [
    (pd.DataFrame({"z": [1 + 2j, 3 + 0j], "x": [1.0, 2.0]}), ValueError, "column 'z' holds complex numbers.*np.real"),
    (pd.DataFrame([[1, 2], [3, 4]], columns=["a", "a"]), ValueError,
     "two columns named 'a' \\(positions 0 and 1\\): rename or drop one"),
    (pd.DataFrame([[1, 2], [3, 4]], columns=[1, "1"]), ValueError,
     "two columns 1 and '1', both read as the name '1' \\(positions 0 and 1\\)"),
    (pl.DataFrame({"l": [[1.0], [2.0, 3.0]], "x": [1.0, 2.0]}), TypeError,
     "column 'l' has the nested polars type List"),
    (pl.DataFrame({"s": [{"a": 1}, {"a": 2}], "x": [1.0, 2.0]}), TypeError, "column 's' .* Struct.*unnest"),
    (pl.DataFrame({"a": pl.Series([[1], [2]], dtype=pl.Array(pl.Int64, 1)), "x": [1.0, 2.0]}), TypeError,
     "column 'a' has the nested polars type Array"),
    (np.array([[np.array([1, 2]), 1.0], [np.array([3, 4]), 2.0]], dtype=object), TypeError,
     "column 'x0' holds a ndarray"),
    (np.array([[10**400, 1.0], [1, 2.0]], dtype=object), ValueError,
     "column 'x0' holds a 401-digit number, beyond float64"),
    ([[1.0, 2.0], [3.0]], ValueError, "rows have different lengths"),
])
def test_unreadable_columns_are_refused_by_name(X, error, match):
    with pytest.raises(error, match=match):
        TablePreprocessor().fit(X)


# -- through the estimator (its fit reads X before anything else) ---------------------------------------------

def _frame(n: int = 24) -> tuple[pd.DataFrame, np.ndarray]:
    rng = np.random.default_rng(0)
    df = pd.DataFrame({"x": rng.normal(size=n), "when": pd.date_range("2020-01-01", periods=n, freq="D"),
                       "colour": rng.choice(["red", "blue"], size=n)})
    return df, (df["x"] > 0).to_numpy().astype(int)


def test_estimator_reads_nat_and_all_missing_batches():
    df, y = _frame()
    df.loc[3, "when"] = pd.NaT
    clf = TabFMClassifier(n_estimators=1, calibrate=False).fit(df, y)
    batch = df[:4].astype({"x": object, "when": object})
    batch["x"], batch["when"] = None, None
    proba = clf.predict_proba(batch)
    assert np.isfinite(proba).all() and np.allclose(proba.sum(1), 1)
    assert np.isfinite(clf.predict_proba(pl.from_pandas(df[:4]).with_columns(pl.lit(None).alias("x")))).all()


def test_estimator_refuses_duplicate_names_and_complex_by_name():
    df, y = _frame()
    with pytest.raises(ValueError, match="two columns named 'x'"):
        TabFMClassifier(n_estimators=1).fit(df.rename(columns={"colour": "x"}), y)
    with pytest.raises(ValueError, match="column 'x' holds complex"):
        TabFMClassifier(n_estimators=1).fit(df.assign(x=df["x"] + 1j), y)


def test_estimator_missing_labels_wired():
    df, y = _frame()
    with pytest.raises(ValueError, match="y holds missing labels"):
        TabFMClassifier(n_estimators=1).fit(df, np.where(y == 1, "yes", None))


@pytest.mark.parametrize("Est", [TabFMClassifier, TabFMRegressor])
def test_a_lazy_y_is_told_to_be_collected(Est):
    """An audit's finding: y as a polars LazyFrame (as X is refused) was 'a 1d array, got an array of shape ()'."""
    X = np.random.default_rng(0).normal(size=(20, 2))
    est = Est(n_estimators=1)
    with pytest.raises(TypeError) as e:
        est.fit(X, pl.DataFrame({"y": np.arange(20) % 2}).lazy())
    assert str(e.value) == "y is a polars LazyFrame: collect() it first"
    assert not hasattr(est, "classes_") and not hasattr(est, "preprocessor_")  # nothing fitted


@pytest.mark.parametrize("params", [{"device": "gpu"}, {"n_estimators": True}, {"random_state": -1},
                                    {"average": "mean"}, {"max_features": 0}, {"numeric_transforms": 3}])
def test_estimator_parameters_wired(params):
    df, y = _frame()
    with pytest.raises(ValueError, match=r"use 'cuda'|The '\w+' parameter of TabFMClassifier"):
        TabFMClassifier(**params).fit(df, y)


def test_estimator_n_jobs_sets_threads_only_during_fit_and_predict(monkeypatch):
    import torch

    df, y = _frame()
    seen = []
    real = TabFMClassifier._fit_common

    def spy(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(TabFMClassifier, "_fit_common", spy)
    before = torch.get_num_threads()
    clf = TabFMClassifier(n_estimators=1, calibrate=False, n_jobs=1).fit(df, y)
    assert seen == [1] and torch.get_num_threads() == before
    clf.predict_proba(df)
    assert torch.get_num_threads() == before


def test_a_random_state_object_seeds_each_fit_from_itself():
    """scikit-learn's convention (a fuzzer found it refused): a RandomState or Generator gives one seed per fit,
    drawn from it, so equal objects give equal fits and one object gives a new seed at each fit."""
    assert resolve_seed(7) == 7 and resolve_seed(None) is None
    a, b = np.random.RandomState(3), np.random.RandomState(3)
    assert resolve_seed(a) == resolve_seed(b) != resolve_seed(a)
    g = np.random.default_rng(3)
    assert resolve_seed(g) == resolve_seed(np.random.default_rng(3)) != resolve_seed(g)
    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(60, 3)), np.arange(60) % 2
    fits = [TabFMClassifier(n_estimators=2, random_state=np.random.RandomState(5)).fit(X, y) for _ in range(2)]
    assert fits[0].seed_ == fits[1].seed_
    np.testing.assert_array_equal(fits[0].predict_proba(X[:5]), fits[1].predict_proba(X[:5]))
