"""The real tables of benchmarks/accuracy.py's suites read as their sidecars say: the bytes the sidecar was written
for, one fold id per row, five non-empty folds, every class in fold 0's train rows, only finite targets."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from builders import benchmark_module

ROOT = Path(__file__).resolve().parent.parent
accuracy = benchmark_module("accuracy")

TABLES = [(suite, name) for suite in accuracy.SUITES for name in accuracy.suite_tables(suite)]


def test_every_suite_has_its_tables():
    counts = {suite: len(accuracy.suite_tables(suite)) for suite in accuracy.SUITES}
    assert counts == {"dev": 16, "suite2": 40, "large": 15, "holdout": 22, "highcard": 12,
                      "highcard_holdout": 12, "wide": 12, "wide_holdout": 7}


@pytest.mark.parametrize("suite,name", TABLES, ids=[n for _, n in TABLES])
def test_table_reads_as_its_sidecar_says(suite, name):
    folder = accuracy.SUITES[suite]
    meta = json.loads((folder / f"{name}.json").read_text())
    assert len(meta["fold_ids"]) == meta["n_rows"] and sorted(set(meta["fold_ids"])) == [0, 1, 2, 3, 4]
    if suite in accuracy.BUILT_SUITES and not (folder / f"{name}.parquet").is_file():
        pytest.skip(f"the {suite} suite's tables are built, not kept: {accuracy.BUILT_SUITES[suite]}")
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


def test_a_suite_not_yet_built_is_refused_with_the_command_that_builds_it(monkeypatch, tmp_path, capsys):
    wide = accuracy.SUITES["wide"]
    for item in wide.glob("*.json"):  # the sidecars alone, as a fresh clone has them
        (tmp_path / item.name).write_bytes(item.read_bytes())
    monkeypatch.setitem(accuracy.SUITES, "wide", tmp_path)
    monkeypatch.setattr(sys, "argv", ["accuracy.py", "--suites", "wide", "--models", "logreg", "--folds", "1"])
    with pytest.raises(SystemExit):
        accuracy.main()
    assert "the wide suite's tables are built, not kept in the repository: run " + accuracy.BUILT_SUITES["wide"] in (
        capsys.readouterr().err)


def test_report_only_reads_every_score_and_says_so(monkeypatch, capsys):
    """--report-only fits nothing, so its header names the CSV, not parameters or a machine it cannot know."""
    csv = ROOT / "benchmarks" / "results" / "accuracy_linear_maps.csv"
    monkeypatch.setattr(sys, "argv", ["accuracy.py", "--report-only", str(csv), "--folds", "5",
                                      "--tables", "skl_iris,skl_diabetes"])
    accuracy.main()
    out = capsys.readouterr().out
    assert f"every model's scores read from {csv}" in out
    assert "fitted in this run" not in out and "\ntabfm: " not in out and "\nmachine: " not in out
    iris = [line for line in out.splitlines() if line.startswith("| skl_iris |") and "| roc_auc |" in line]
    assert len(iris) == 1 and "| 0.9980 |" in iris[0]  # tabfm's 5-fold ROC-AUC as the CSV holds it (0.99800)


def test_run_header_shows_each_estimators_own_default():
    """The classifier mixes contexts by default and the regressor does not: the header of a run that fits both must
    say so, not print the regressor's value for both (which it did)."""
    params = accuracy._estimator_params({})
    assert params["mix_contexts"] == "True (classifier) / False (regressor)"
    assert params["local_context_rows"] == 256 and params["linear_base"] is True  # shared, and regressor-only


@pytest.mark.parametrize("flag,csv,message", [
    ("--report-only", "missing.csv", "--report-only {csv}: no such file; give an accuracy.csv written by "
     "benchmarks/accuracy.py"),
    ("--report-only", "benchmarks/results/accuracy.txt", "--report-only {csv}: not an accuracy.csv of "
     "benchmarks/accuracy.py (no dataset, model and metric columns)"),
    ("--reuse-baselines", "benchmarks/results/accuracy_large_suite.csv", "--reuse-baselines {csv}: no logreg score "
     "of skl_iris there (a run of other tables or models); pass one that scored them, or leave them out with "
     "--tables / --models"),
])
def test_an_earlier_csv_that_cannot_be_reported_is_refused_in_one_line(monkeypatch, tmp_path, flag, csv, message):
    """A missing file, a file that is no accuracy.csv, or one of another suite had been a traceback (the last after
    fitting tabfm): now one line before anything is fitted, nothing written."""
    path = tmp_path / csv if csv == "missing.csv" else ROOT / csv
    monkeypatch.setattr(sys, "argv", ["accuracy.py", "--tables", "skl_iris", "--folds", "5", "--models", "logreg",
                                      flag, str(path), "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit) as e:
        accuracy.main()
    assert str(e.value) == message.format(csv=path)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("out", ["afile", "afile/sub"])
def test_an_out_folder_a_file_blocks_is_refused_before_fitting(monkeypatch, tmp_path, capsys, out):
    """--out onto a file (or below one) had been a FileExistsError / NotADirectoryError after every fold was fitted."""
    (tmp_path / "afile").write_text("x")
    monkeypatch.setattr(accuracy, "run_fold", lambda *a: pytest.fail("fitted before --out was checked"))
    monkeypatch.setattr(sys, "argv", ["accuracy.py", "--tables", "skl_iris", "--folds", "1", "--models", "logreg",
                                      "--out", str(tmp_path / out)])
    with pytest.raises(SystemExit):
        accuracy.main()
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"accuracy.py: error: --out {tmp_path / out}: {tmp_path / 'afile'} is a file, not a folder; give a folder for "
        "accuracy.txt and accuracy.csv")
    assert [p.name for p in tmp_path.iterdir()] == ["afile"] and (tmp_path / "afile").read_text() == "x"


@pytest.mark.parametrize("folds", ["0", "6", "-1"])
def test_a_fold_count_outside_the_stored_five_is_refused_before_any_work(monkeypatch, tmp_path, capsys, folds):
    """--folds 0 had been refused with "skl_iris has 5 folds", which does not say what to give."""
    monkeypatch.setattr(accuracy, "_warm_up", lambda *a: pytest.fail("warmed up before --folds was checked"))
    monkeypatch.setattr(sys, "argv", ["accuracy.py", "--tables", "skl_iris", "--folds", folds, "--models", "tabfm",
                                      "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit):
        accuracy.main()
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"accuracy.py: error: --folds {folds}: give 1 to 5 (folds 0..N-1 of each table's 5 stored folds are scored)")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags,message", [
    (["--set", "n_estimatros=4"], "--set n_estimatros: no parameter of TabFMClassifier or TabFMRegressor; choose from "
     "average, batch_size, "),
    (["--set", "n_estimators=abc"], "--set n_estimators=abc: The 'n_estimators' parameter of TabFMClassifier must be "
     "an int in the range [1, inf) or a str among {'auto'}. Got 'abc' instead."),
    (["--n-estimators", "0"], "--n-estimators 0: The 'n_estimators' parameter of TabFMClassifier must be an int in the "
     "range [1, inf) or a str among {'auto'}. Got 0 instead."),
    (["--checkpoint", "/no/such/weights"], "--checkpoint /no/such/weights: no such file or folder; give a merged "
     ".safetensors file or a checkpoint folder, or leave it out for the shipped model"),
    (["--set", "device=gpux"], "tabfm with device=gpux: device='gpux' is not a torch device name: use 'cuda' (or "
     "'cuda:N') for an NVIDIA GPU, or 'auto'"),
])
def test_a_tabfm_parameter_the_estimators_refuse_is_named_before_any_work(monkeypatch, tmp_path, capsys, flags,
                                                                          message):
    """A mistyped --set name had been dropped silently (the run scored the defaults under the change's name), and a
    bad value or a missing --checkpoint was a traceback from the warm-up fit: now one line naming the flag (or the
    values, for what only fit checks), nothing fitted or written."""
    monkeypatch.setattr(accuracy, "run_fold", lambda *a: pytest.fail("fitted a run with a refused parameter"))
    monkeypatch.setattr(sys, "argv", ["accuracy.py", "--tables", "skl_iris", "--folds", "1", "--models", "tabfm",
                                      *flags, "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit):
        accuracy.main()
    line = capsys.readouterr().err.splitlines()[-1]
    if message.endswith(", "):  # the list of parameters goes on
        assert line.startswith(f"accuracy.py: error: {message}") and line.endswith(", verbose")
    else:
        assert line == f"accuracy.py: error: {message}"
    assert not (tmp_path / "out").exists()


def test_a_table_of_a_suite_not_named_says_which_suite_to_add(monkeypatch, tmp_path, capsys):
    """A large table named without --suites large was 'no table' in dev and suite2, as if mistyped."""
    monkeypatch.setattr(sys, "argv", ["accuracy.py", "--tables", "skl_iris,aer_cps1988_wage", "--folds", "1",
                                      "--models", "logreg", "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit):
        accuracy.main()
    assert capsys.readouterr().err.splitlines()[-1] == ("accuracy.py: error: no table ['aer_cps1988_wage'] in the "
                                                        "suites ['dev', 'suite2']; add large to --suites")
    assert not (tmp_path / "out").exists()
