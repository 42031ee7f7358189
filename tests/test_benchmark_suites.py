"""The real tables of benchmarks/accuracy.py's suites read as their sidecars say: the bytes the sidecar was written
for, one fold id per row, five non-empty folds, every class in fold 0's train rows, only finite targets."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from builders import benchmark_module

ROOT = Path(__file__).resolve().parent.parent
accuracy = benchmark_module("accuracy")

TABLES = [(suite, name) for suite in accuracy.SUITES for name in accuracy.suite_tables(suite)]


def test_every_suite_has_its_tables():
    counts = {suite: len(accuracy.suite_tables(suite)) for suite in accuracy.SUITES}
    assert counts == {"dev": 16, "suite2": 40, "large": 15}


@pytest.mark.parametrize("suite,name", TABLES, ids=[n for _, n in TABLES])
def test_table_reads_as_its_sidecar_says(suite, name):
    folder = accuracy.SUITES[suite]
    meta = json.loads((folder / f"{name}.json").read_text())
    assert hashlib.sha256((folder / f"{name}.parquet").read_bytes()).hexdigest() == meta["parquet_sha256"]
    table = accuracy.load_real_table(name, suite)
    assert table.X.columns == meta["feature_columns"] and meta["target"] not in table.X.columns
    assert len(table.y) == len(table.folds) == table.X.height == len(table.X_np) > 0
    assert sorted(np.unique(table.folds)) == [0, 1, 2, 3, 4]
    if table.is_classification:
        assert 0 <= table.y.min() and table.y.max() < len(table.classes)
        assert len(np.unique(table.y[table.folds != 0])) == len(np.unique(table.y))
    else:
        assert np.isfinite(table.y).all() and table.y.std() > 0
