"""One category encoder (tabfm.data.encode.category_codes) for synthetic and evaluation tables and for the
estimators' inputs of any container: train categories sorted as strings, missing and unseen -1. (The estimators
order categories that are all numbers numerically, and a categorical dtype's in its own order:
tests/test_preprocess_inputs.py.)"""

import numpy as np
import polars as pl
import pytest

from tabfm.data.encode import _category_codes
from tabfm.preprocess import UNSEEN, TablePreprocessor


@pytest.mark.parametrize("values", [
    ["b", "a", None, "c", "a", "B", "10", "9", "é", "z"],
    ["x"] * 3 + [None] + ["y"],
    ["ünï", "Zed", "zed", "", "  ", None, "Zed"],
])
def test_prior_and_estimator_number_categories_alike(values):
    codes, k = _category_codes(pl.Series(values, dtype=pl.String))
    pre = TablePreprocessor(categorical_features=[0]).fit(np.array(values, dtype=object).reshape(-1, 1))
    cells = pre.transform(np.array(values, dtype=object).reshape(-1, 1))
    assert k == cells.n_cats[0]
    np.testing.assert_array_equal(codes, cells.codes[:, 0])


def test_unseen_categories_at_predict_are_missing():
    """A category first seen at predict gets a negative code of its own (missing to every reader of codes but the
    target encodings), a missing cell -1."""
    train = np.array(["b", "a", "c"], dtype=object).reshape(-1, 1)
    pre = TablePreprocessor().fit(train)
    cells = pre.transform(np.array(["c", "zz", None, "a"], dtype=object).reshape(-1, 1))
    np.testing.assert_array_equal(cells.codes[:, 0], [2, UNSEEN, -1, 0])
