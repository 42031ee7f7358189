"""Evaluation on real tables (tabfm.evaluate): encoding (fold 0 = test rows, train-row categories, subsampling),
metrics of an untrained model in range, skipped tables, and a 2x2 tensor-parallel mesh giving the metrics of one
process (float64). The metrics line in metrics.jsonl is checked by tests/test_pretrain.py (resume with eval on)."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import polars as pl
import pytest
import torch
from dist_harness import get_mesh

from tabfm.evaluate import DEFAULT_TABLES, evaluate, load_table, load_tables, table_metrics
from tabfm.model import ModelConfig, build_model
from tabfm.parallel_model import model_mesh, parallelize_model

TINY = ModelConfig.load("tiny")


def _write(tmp_path, name: str, df: pl.DataFrame, meta: dict) -> None:
    df.write_parquet(tmp_path / f"{name}.parquet")
    (tmp_path / f"{name}.json").write_text(json.dumps(meta))


def test_table_encoding_uses_fold_0_as_test_and_train_row_categories(tmp_path):
    df = pl.DataFrame({"x": [1.0, None, 3.0, 4.0, 5.0, 6.0], "c": ["b", "a", None, "b", "z", "a"],
                       "n": [10, 20, 30, 40, 50, 60], "y": ["no", "yes", "no", "yes", "yes", "no"]})
    meta = {"task": "binary", "classes": ["no", "yes"], "target": "y", "feature_columns": ["x", "c", "n"],
            "categorical_columns": ["c", "n"], "fold_ids": [1, 0, 2, 0, 0, 1]}
    _write(tmp_path, "toy", df, meta)
    t = load_table("toy", datasets_dir=tmp_path)
    b = t.batch
    # Train rows (folds 1, 2) first: 0, 2, 5; then the test rows 1, 3, 4.
    assert t.n_train == 3 and b.n_train.tolist() == [3] and t.y_test.tolist() == [1, 1, 1]
    assert b.labels[0].tolist() == [0, 0, 0, 1, 1, 1] and b.n_classes.tolist() == [2]
    assert b.values[0, :, 0].tolist() == [1.0, 3.0, 6.0, 0.0, 4.0, 5.0]
    assert b.missing[0, :, 0].tolist() == [False, False, False, True, False, False]
    # "c": train categories {a, b} (codes in string order); test "z" was never seen -> missing, like the null.
    assert b.is_cat[0].tolist() == [False, True, True] and b.n_cats[0].tolist() == [0, 2, 3]
    assert b.cat_codes[0, :, 1].tolist() == [1, -1, 0, 0, 1, -1]
    assert b.missing[0, :, 1].tolist() == [False, True, False, False, False, True]
    # "n": integer categories sorted as strings: "10" < "30" < "60"; 20, 40, 50 are unseen.
    assert b.cat_codes[0, :, 2].tolist() == [0, 1, 2, -1, -1, -1]


def test_train_rows_are_subsampled_deterministically():
    a, b = load_table("skl_breast_cancer", max_train_rows=64), load_table("skl_breast_cancer", max_train_rows=64)
    assert a.n_train == 64 and len(a.y_test) == 114
    assert torch.equal(a.batch.values, b.batch.values)


def test_tables_the_model_cannot_take_are_skipped_with_a_note():
    small = dataclasses.replace(TINY, max_classes=2, max_columns=8)
    tables, notes = load_tables(["skl_iris", "skl_breast_cancer", "skl_diabetes", "mass_crabs_species", "nope"],
                                model_cfg=small)
    assert [t.name for t in tables] == ["mass_crabs_species"]
    assert len(notes) == 4
    assert "3 classes > model.max_classes=2" in notes[0] and "30 features > model.max_columns=8" in notes[1]
    assert "classification only" in notes[2] and "no table 'nope'" in notes[3]


def test_metrics_match_definitions():
    y = np.array([0, 1, 1, 0])
    p = np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.3, 0.7]])
    m = table_metrics(y, p)
    assert m["roc_auc"] == 0.75 and m["accuracy"] == 0.5
    assert m["log_loss"] == pytest.approx(-np.mean(np.log([0.9, 0.8, 0.4, 0.3])))


def _model(dtype=torch.float64):
    return build_model(TINY, seed=0).to(dtype)


def test_untrained_model_gives_finite_metrics_in_range():
    tables, notes = load_tables(DEFAULT_TABLES, model_cfg=TINY)
    assert notes == [] and [t.name for t in tables] == list(DEFAULT_TABLES)
    model = _model(torch.float32)
    model.train()
    rng_before = torch.get_rng_state()
    out = evaluate(model, tables)
    assert model.training and torch.equal(torch.get_rng_state(), rng_before)
    assert set(out["tables"]) == set(DEFAULT_TABLES)
    for name, m in out["tables"].items():
        assert 0 <= m["roc_auc"] <= 1 and 0 <= m["accuracy"] <= 1, (name, m)
        assert 0 < m["log_loss"] < 20 and math.isfinite(m["log_loss"]), (name, m)
    for key in ("roc_auc", "log_loss", "accuracy"):
        assert out[f"mean_{key}"] == pytest.approx(np.mean([m[key] for m in out["tables"].values()]))


def _evaluate_on_mesh(d0: int, d1: int, sp: bool):
    tables, _ = load_tables(DEFAULT_TABLES, model_cfg=TINY)
    model = parallelize_model(_model(), get_mesh(d0, d1), sequence_parallel=sp)
    return evaluate(model, tables, model_mesh(model))


def test_tensor_parallel_evaluation_equals_one_process(ranks):
    ref = _evaluate_on_mesh(1, 1, False)
    results = ranks(4).run(_evaluate_on_mesh, 2, 2, True)
    assert all(r is None for r in results[1:])  # only rank 0 computes metrics
    got = results[0]
    for name, m in ref["tables"].items():
        for key, value in m.items():
            assert got["tables"][name][key] == pytest.approx(value, rel=1e-9, abs=1e-12), (name, key)
