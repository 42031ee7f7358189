"""`tabfm predict`: CSV and Parquet in and out, probabilities, task inference, clear errors, and a torchrun run on
2 processes that writes the one-process predictions."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import polars as pl
import pytest
from test_estimator import mixed_frame

from tabfm.cli import main


@pytest.fixture
def tables(tmp_path):
    df, y = mixed_frame(120, seed=3)
    frame = pl.from_pandas(df).with_columns(pl.Series("label", y), pl.Series("amount", df["x"] * 3.7 + 0.25))
    frame[:90].write_csv(tmp_path / "train.csv")
    frame[90:].drop("label").write_csv(tmp_path / "test.csv")  # keeps "amount": a feature when the target is label
    frame[90:].write_parquet(tmp_path / "test.parquet")
    return tmp_path


def test_predict_classes_to_csv(tables, capsys):
    out = tables / "pred.csv"
    rc = main(["predict", "--train", str(tables / "train.csv"), "--target", "label", "--test",
               str(tables / "test.csv"), "-o", str(out), "--n-estimators", "2"])
    assert rc == 0
    pred = pl.read_csv(out)
    assert pred.columns == ["label"] and pred.height == 30
    assert set(pred["label"].to_list()) <= {"yes", "no"}
    assert "wrote 30 predictions (classification)" in capsys.readouterr().err


def test_predict_proba_parquet_and_stdout(tables, capsys):
    # The test table may keep its target column: it is ignored. The other target column is a feature here.
    rc = main(["predict", "--train", str(tables / "train.csv"), "--target", "label", "--test",
               str(tables / "test.parquet"), "--proba", "--n-estimators", "2"])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "proba_no,proba_yes" and len(lines) == 31
    proba = np.array([[float(v) for v in line.split(",")] for line in lines[1:]])
    assert np.allclose(proba.sum(1), 1)


def test_predict_regression_is_inferred(tables):
    out = tables / "amount.parquet"
    rc = main(["predict", "--train", str(tables / "train.csv"), "--target", "amount", "--test",
               str(tables / "test.parquet"), "-o", str(out), "--n-estimators", "1"])
    assert rc == 0
    pred = pl.read_parquet(out)["amount"].to_numpy()
    assert pred.dtype.kind == "f" and len(pred) == 30 and np.isfinite(pred).all()


@pytest.mark.parametrize("args, message", [
    (["--target", "nope"], "has no column 'nope'"),
    (["--target", "amount", "--proba", "--test", "test.parquet"], "--proba is for classification"),
    (["--target", "label", "--test", "missing.csv"], "no such file"),
])
def test_predict_errors(tables, capsys, args, message):
    base = {"--train": str(tables / "train.csv"), "--test": str(tables / "test.csv")}
    argv = ["predict"]
    for flag, value in base.items():
        if flag not in args:
            argv += [flag, value]
    argv += [str(tables / a) if a.endswith((".csv", ".parquet")) else a for a in args]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_predict_sharded_under_torchrun_equals_one_process(tables):
    common = ["--train", str(tables / "train.csv"), "--target", "label", "--test", str(tables / "test.csv"),
              "--proba", "--dtype", "float64", "--n-estimators", "2"]
    assert main(["predict", *common, "-o", str(tables / "one.csv")]) == 0
    run = subprocess.run([sys.executable, "-m", "tabfm.cli", "predict", *common, "--nproc", "2", "--layout", "1x2",
                          "-o", str(tables / "two.csv")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    one, two = pl.read_csv(tables / "one.csv").to_numpy(), pl.read_csv(tables / "two.csv").to_numpy()
    np.testing.assert_allclose(two, one, rtol=0, atol=1e-10)
