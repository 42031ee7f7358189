"""`tabfm predict`: CSV and Parquet in and out, probabilities, task inference, NA tokens, clear errors for bad
input (one line, nothing written, inputs untouched), the test table streamed in batches (the same bytes as read
whole; a bad row half-way leaves no output), and runs on 2 processes (the model split under torchrun, the test rows
split on 2 gloo ranks) that write the one-process predictions."""

from __future__ import annotations

import csv
import io
import re
import subprocess
import sys
import warnings
from datetime import date

import numpy as np
import polars as pl
import pytest
from builders import mixed_frame

from tabfm.cli import main
from tabfm.preprocess import NumericTextWarning


@pytest.fixture
def tables(tmp_path):
    df, y = mixed_frame(120, seed=3)
    frame = pl.from_pandas(df).with_columns(pl.Series("label", y), pl.Series("amount", df["x"] * 3.7 + 0.25))
    frame[:90].write_csv(tmp_path / "train.csv")
    frame[90:].drop("label").write_csv(tmp_path / "test.csv")  # keeps "amount": a feature when the target is label
    frame[90:].write_parquet(tmp_path / "test.parquet")
    frame[:90].drop("label").with_columns(pl.Series("proba_b", ["a", "b"] * 45)).write_csv(tmp_path / "clash.csv")
    return tmp_path


def test_predict_classes_to_csv(tables, capsys):
    out = tables / "pred.csv"
    rc = main(["predict", "--train", str(tables / "train.csv"), "--target", "label", "--test",
               str(tables / "test.csv"), "-o", str(out), "--n-estimators", "2"])
    assert rc == 0
    pred = pl.read_csv(out)
    assert pred.columns == ["label"] and pred.height == 30
    assert set(pred["label"].to_list()) <= {"yes", "no"}
    err = capsys.readouterr().err
    assert "wrote 30 predictions (classification)" in err
    assert "fit: encode contexts: 100%" in err  # the fit's progress, shown without --quiet
    argv = ["predict", "--train", str(tables / "train.csv"), "--target", "amount", "--test",
            str(tables / "test.parquet"), "-o", str(out), "--n-estimators", "1"]
    assert main(argv) == 2  # an earlier run's predictions are not replaced silently
    assert f"{out}: already exists; choose another output file, or replace it with --overwrite" in \
        capsys.readouterr().err
    assert pl.read_csv(out).columns == ["label"]
    assert main([*argv, "--overwrite"]) == 0
    assert pl.read_csv(out).columns == ["amount"] and pl.read_csv(out).height == 30


def test_predict_proba_parquet_and_stdout(tables, capsys):
    # The test table may keep its target column: it is ignored. The other target column is a feature here.
    rc = main(["predict", "--train", str(tables / "train.csv"), "--target", "label", "--test",
               str(tables / "test.parquet"), "--proba", "--n-estimators", "2"])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "label,proba_no,proba_yes" and len(lines) == 31
    labels = [line.split(",")[0] for line in lines[1:]]
    proba = np.array([[float(v) for v in line.split(",")[1:]] for line in lines[1:]])
    assert np.allclose(proba.sum(1), 1, atol=1e-5)
    assert labels == [("no", "yes")[i] for i in proba.argmax(1)]


def test_integer_classes_keep_their_numeric_order(tables, capsys):
    """Found by a hunt: the classes were read as text, so --proba wrote proba_1, proba_10, proba_2, not the order
    of est.classes_ in Python."""
    train = pl.read_csv(tables / "train.csv")
    grade = pl.Series("grade", [(1, 2, 10)[i % 3] for i in range(train.height)])
    train.drop("label").with_columns(grade).write_csv(tables / "grades.csv")
    rc = main(["predict", "--train", str(tables / "grades.csv"), "--target", "grade", "--test",
               str(tables / "test.csv"), "--task", "classification", "--proba", "--n-estimators", "1", "--quiet"])
    assert rc == 0
    pred = pl.read_csv(io.StringIO(capsys.readouterr().out))
    assert pred.columns == ["grade", "proba_1", "proba_2", "proba_10"]
    assert pred["grade"].dtype == pl.Int64
    assert pred["grade"].to_list() == [(1, 2, 10)[i] for i in pred.drop("grade").to_numpy().argmax(1)]


def test_test_columns_the_train_table_lacks_are_named_and_change_nothing(tables, capsys):
    test = pl.read_csv(tables / "test.csv")
    test.with_columns(pl.Series("row_id", range(test.height)), pl.lit(1.0).alias("extra")).write_csv(
        tables / "with_id.csv")
    outputs = []
    for name in ("test.csv", "with_id.csv", "test.parquet"):  # test.parquet keeps the target column "label"
        out = tables / f"pred_{name}.csv"
        assert main(["predict", "--train", str(tables / "train.csv"), "--target", "label", "--test",
                     str(tables / name), "-o", str(out), "--n-estimators", "1", "--proba"]) == 0
        outputs.append(out.read_bytes())
        err = capsys.readouterr().err
        assert ("ignoring 2 column(s) the train table's features do not include: 'row_id', 'extra'" in err) == \
            (name == "with_id.csv"), err
    assert outputs[0] == outputs[1] == outputs[2]


@pytest.mark.parametrize("labels, classes", [
    (["01", "02"], ["01", "02"]),                    # read as 1 and 2, they were written back as 1 and 2
    (["007", "7", "07"], ["007", "07", "7"]),        # read as one class 7
    (["TRUE", "FALSE"], ["FALSE", "TRUE"]),          # read as booleans, written back as true / false
    (["1", "10", "2"], ["1", "2", "10"]),            # spelled as read: integers, in their numeric order
    (["3.5", "4.5"], ["3.5", "4.5"]),                # fractional classes: scikit-learn's "continuous" refusal
])
def test_class_labels_are_written_as_the_train_file_spells_them(tmp_path, capsys, labels, classes):
    rng = np.random.default_rng(0)
    k = rng.integers(len(labels), size=60)
    x = k + rng.normal(scale=0.1, size=60)
    rows = [f"{x[i]:.3f},{labels[k[i]]}" for i in range(60)]
    (tmp_path / "tr.csv").write_text("a,y\n" + "\n".join(rows + ["0.5,"]) + "\n")  # a row with no label
    (tmp_path / "te.csv").write_text("a\n" + "\n".join(f"{v:.3f}" for v in x[:20]) + "\n")
    assert main(["predict", "--train", str(tmp_path / "tr.csv"), "--target", "y", "--test", str(tmp_path / "te.csv"),
                 "--n-estimators", "1", "--quiet", "--proba", "-o", str(tmp_path / "p.csv")]) == 0
    text = (tmp_path / "p.csv").read_text().splitlines()
    assert text[0] == "y," + ",".join(f"proba_{c}" for c in classes)
    predicted = [line.split(",")[0] for line in text[1:]]
    assert predicted == [labels[i] for i in k[:20]]  # separable: every label right, and spelled as written


def test_the_train_file_is_read_once_for_labels_as_written(tmp_path, capsys, monkeypatch):
    """Labels read as numbers ('01' as 1) are written as the train file spells them; their text was read in a
    second pass over the train file, now from the one read."""
    reads = []
    read_csv = pl.read_csv

    def counting(source, *args, **kwargs):
        reads.append(source)
        return read_csv(source, *args, **kwargs)

    monkeypatch.setattr(pl, "read_csv", counting)
    a = np.arange(40) % 2
    (tmp_path / "tr.csv").write_text("a,y\n" + "\n".join(f"{v + 0.01 * i:.2f},0{v + 1}" for i, v in enumerate(a)))
    (tmp_path / "te.csv").write_text("a\n0.1\n1.1\n")
    assert main(["predict", "--train", str(tmp_path / "tr.csv"), "--target", "y", "--test", str(tmp_path / "te.csv"),
                 "--n-estimators", "1", "--quiet", "-o", str(tmp_path / "p.csv")]) == 0
    assert (tmp_path / "p.csv").read_text().splitlines() == ["y", "01", "02"]
    assert [r for r in reads if str(r).endswith("tr.csv")] == [tmp_path / "tr.csv"]


@pytest.mark.parametrize("table, cell", [("train", "-inf"), ("test", "1e400"), ("test", "inf")])
def test_an_infinite_cell_is_named_with_its_file_and_row(tmp_path, capsys, table, cell):
    rows = {"train": ["a,y"] + [f"{i % 5},{'xy'[i % 2]}" for i in range(30)], "test": ["a"] + ["1"] * 30}
    rows[table][12] = f"{cell},x" if table == "train" else cell                  # data row 12
    for name, lines in rows.items():
        (tmp_path / f"{name}.csv").write_text("\n".join(lines) + "\n")
    out = tmp_path / "p.csv"
    assert main(["predict", "--train", str(tmp_path / "train.csv"), "--target", "y", "--test",
                 str(tmp_path / "test.csv"), "--n-estimators", "1", "--batch-rows", "7", "-o", str(out)]) == 2
    assert f"{tmp_path / table}.csv: column 'a' holds {'-inf' if cell == '-inf' else 'inf'} (row 12); the model " \
        "takes finite numbers" in capsys.readouterr().err
    assert not out.exists()


def test_predict_regression_is_inferred(tables):
    out = tables / "amount.parquet"
    rc = main(["predict", "--train", str(tables / "train.csv"), "--target", "amount", "--test",
               str(tables / "test.parquet"), "-o", str(out), "--n-estimators", "1"])
    assert rc == 0
    pred = pl.read_parquet(out)["amount"].to_numpy()
    assert pred.dtype.kind == "f" and len(pred) == 30 and np.isfinite(pred).all()


def _price_tables(folder) -> None:
    """The fuzzer's table: a whole-number price that is linear in the features (200 train rows, 40 test rows)."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(240, 3))
    price = np.round(200000 + 50000 * X[:, 0] + 20000 * X[:, 1]).astype(int)
    df = pl.DataFrame({"f1": X[:, 0].round(4), "f2": X[:, 1].round(4), "f3": X[:, 2].round(4), "price": price})
    df[:200].write_csv(folder / "train.csv")
    df[200:].write_csv(folder / "test.csv")


def test_a_whole_number_price_is_regression_and_the_choice_is_said(tmp_path, capsys):
    _price_tables(tmp_path)
    argv = ["predict", "--train", str(tmp_path / "train.csv"), "--target", "price", "--test",
            str(tmp_path / "test.csv"), "--n-estimators", "1", "-o", str(tmp_path / "auto.csv")]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "tabfm predict: task: regression, as the target 'price' is numeric with 200 distinct values (over 20); " \
        "pass --task classification if that is wrong" in err
    pred = pl.read_csv(tmp_path / "auto.csv")["price"].to_numpy()
    truth = pl.read_csv(tmp_path / "test.csv")["price"].to_numpy()
    assert pred.dtype.kind == "f" and np.abs(pred - truth).mean() < 2000  # as 200 classes: 20,638
    assert main([*argv[:-2], "-o", str(tmp_path / "quiet.csv"), "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_a_small_fractional_target_is_regression_and_numeric_classes_are_said_even_when_quiet(tmp_path, capsys):
    """18 measurements on 18 rows were read as 18 classes, the predictions snapped to train values, and --quiet
    hid the line that said so."""
    rng = np.random.default_rng(2)
    a = rng.normal(size=18)
    pl.DataFrame({"a": a, "y": np.round(a * 3 + rng.normal(size=18) * 0.1, 3)}).write_csv(tmp_path / "small.csv")
    pl.DataFrame({"a": [0.0, 1.0, 2.0]}).write_csv(tmp_path / "t.csv")
    argv = ["predict", "--train", str(tmp_path / "small.csv"), "--target", "y", "--test", str(tmp_path / "t.csv"),
            "--n-estimators", "1", "--quiet"]
    assert main([*argv, "-o", str(tmp_path / "reg.csv")]) == 0
    assert capsys.readouterr().err == ""
    pred = pl.read_csv(tmp_path / "reg.csv")["y"].to_numpy()
    assert not set(pred.tolist()) & set(np.round(a * 3, 3).tolist()) and pred[0] < pred[1] < pred[2]
    pl.DataFrame({"a": a, "y": (a > 0).astype(int)}).write_csv(tmp_path / "codes.csv")
    assert main([*argv[:2], str(tmp_path / "codes.csv"), *argv[3:], "-o", str(tmp_path / "cls.csv")]) == 0
    assert "tabfm predict: warning: task: classification, as the target 'y' has only 2 distinct values" in \
        capsys.readouterr().err


@pytest.mark.parametrize("values, task", [
    (list(range(200_000, 200_200)), "regression"),  # whole-number prices
    ([i % 23 for i in range(100)], "regression"),  # a count with 23 distinct values
    ([i % 21 * 0.5 for i in range(100)], "regression"),
    ([i % 2 for i in range(100)], "classification"),  # 0/1
    ([1 + i % 5 for i in range(100)], "classification"),  # ratings 1..5
    ([i % 20 for i in range(100)], "classification"),  # MAX_AUTO_CLASSES codes
    ([0.5, 1.5, 2.5] * 10, "classification"),
    ([0.5, 1.5, 2.5, 3.25], "regression"),  # fractional, one row per value: no classes
    ([0.0, 1.0, 2.0, 3.0], "classification"),  # whole numbers: codes, however few rows
    ([f"c{i}" for i in range(100)], "classification"),  # text, however many values
    ([True, False] * 10, "classification"),
])
def test_infer_task_counts_distinct_values_whole_or_not(values, task):
    from tabfm._cli_predict import MAX_AUTO_CLASSES, infer_task

    assert MAX_AUTO_CLASSES == 20
    inferred, why = infer_task(pl.Series("y", [*values, None]))
    assert inferred == task and "'y'" in why


@pytest.mark.parametrize("args, message", [
    (["--target", "nope"], "has no column 'nope'; columns: 'x', 'noise', "),  # quoted: a fuzzer's ' a ' hid its spaces
    (["--target", "amount", "--proba", "--test", "test.parquet"], "--proba is for classification"),
    (["--target", "label", "--test", "missing.csv"], "no such file"),
    (["--target", "label", "--local-context-rows", "1"], "--local-context-rows must be 0 (one context) or at least 2"),
    (["--target", "proba_b", "--proba", "--train", "clash.csv"], "the target 'proba_b' is also one of them"),
    (["--target", "label", "--task", "regression"], "the target 'label' holds text (e.g. 'yes'), and a regression "
     "needs numbers: use --task classification"),
    (["--target", "label", "--categorical", "c,label"], "--categorical names the target 'label'"),
    (["--target", "label", "--n-jobs", "0"], "--n-jobs must be at least 1, or -1 for every core, got 0"),
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


@pytest.mark.parametrize("args, message", [
    (["--categorical", "flag,color"], "--categorical names 'color', which is not a column of {train}; its feature "
     "columns: 'x', 'noise', 'colour', 'flag', 'const', 'gappy', 'amount'"),
    (["--checkpoint", "runs/tiny/model.safetensors"], "--checkpoint runs/tiny/model.safetensors does not exist; give "
     "a merged .safetensors file or a checkpoint folder (`tabfm ckpt merge RUN_DIR -o model.safetensors`), or leave "
     "--checkpoint out for the shipped model"),
])
def test_predict_names_its_own_flags_before_fitting(tables, capsys, args, message):
    """Found by a hunt: a mistyped --categorical column or --checkpoint path was refused only by the estimator,
    after reading the tables and (for the column) fitting, as `categorical_features names 'color' ... of X` or
    `... or checkpoint=None for the shipped model`: Python names the command line never had."""
    out = tables / "pred.csv"
    assert main(["predict", "--train", str(tables / "train.csv"), "--target", "label", "--test",
                 str(tables / "test.csv"), "-o", str(out), "--quiet", *args]) == 2
    assert capsys.readouterr().err == f"tabfm predict: error: {message.format(train=tables / 'train.csv')}\n"
    assert not out.exists()


def test_a_mistyped_categorical_column_of_a_wide_table_names_ten_columns(tmp_path, capsys):
    """The message stays one short line on a wide table: ten column names, then how many there are."""
    header = ",".join([f"c{i}" for i in range(12)] + ["label"])
    rows = "\n".join(",".join([str(r + i) for i in range(12)] + [str(r % 2)]) for r in range(6))
    (tmp_path / "train.csv").write_text(header + "\n" + rows + "\n")
    out = tmp_path / "pred.csv"
    assert main(["predict", "--train", str(tmp_path / "train.csv"), "--target", "label", "--test",
                 str(tmp_path / "train.csv"), "-o", str(out), "--quiet", "--categorical", "c99"]) == 2
    shown = ", ".join(f"'c{i}'" for i in range(10))
    assert capsys.readouterr().err == (f"tabfm predict: error: --categorical names 'c99', which is not a column of "
                                       f"{tmp_path / 'train.csv'}; its feature columns: {shown}, ... (12 in all)\n")
    assert not out.exists()


def test_precision_bf16_is_close_to_fp32_and_bfloat16_weights_are_gone(tables, capsys):
    argv = ["predict", "--train", str(tables / "train.csv"), "--target", "label", "--test", str(tables / "test.csv"),
            "--proba", "--n-estimators", "1"]
    assert main([*argv, "-o", str(tables / "fp32.csv"), "--precision", "fp32"]) == 0
    assert main([*argv, "-o", str(tables / "bf16.csv"), "--precision", "bf16"]) == 0
    fp32, bf16 = (pl.read_csv(tables / f"{p}.csv").select(pl.selectors.starts_with("proba_")).to_numpy()
                  for p in ("fp32", "bf16"))
    assert np.abs(fp32 - bf16).max() <= 2.0 ** -6  # tests/test_inference_precision.py: why this tolerance
    with pytest.raises(SystemExit):
        main([*argv, "--dtype", "bfloat16"])
    assert "invalid choice: 'bfloat16'" in capsys.readouterr().err


@pytest.mark.slow
def test_predict_sharded_under_torchrun_equals_one_process(tables):
    common = ["--train", str(tables / "train.csv"), "--target", "label", "--test", str(tables / "test.csv"),
              "--proba", "--dtype", "float64", "--n-estimators", "2"]
    assert main(["predict", *common, "-o", str(tables / "one.csv")]) == 0
    run = subprocess.run([sys.executable, "-m", "tabfm.cli", "predict", *common, "--nproc", "2", "--layout", "1x2",
                          "-o", str(tables / "two.csv")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    one, two = pl.read_csv(tables / "one.csv"), pl.read_csv(tables / "two.csv")
    assert one["label"].to_list() == two["label"].to_list()
    np.testing.assert_allclose(two.drop("label").to_numpy(), one.drop("label").to_numpy(), rtol=0, atol=1e-10)


def _with_tokens(frame: pl.DataFrame, path, tokens: list[str]) -> None:
    """`frame` as CSV with its missing cells written as the given tokens in turn (as a hand-made file has them)."""
    rows = frame.select(pl.all().cast(pl.String)).rows()
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(frame.columns)
        w.writerows([tokens[(i + j) % len(tokens)] if v is None else v for j, v in enumerate(row)]
                    for i, row in enumerate(rows))


def test_na_tokens_read_as_missing_give_the_predictions_of_empty_cells(tables, capsys):
    train = pl.read_csv(tables / "train.csv")
    train = train.with_columns(pl.when(pl.int_range(pl.len()) % 7 == 0).then(None).otherwise(pl.col("x")).alias("x"))
    train.write_csv(tables / "empty_cells.csv")
    _with_tokens(train, tables / "tokens.csv", ["NA", "?", "N/A", "-", "null", " NA"])
    assert "?" in (tables / "tokens.csv").read_text()
    common = ["predict", "--target", "label", "--test", str(tables / "test.csv"), "--proba", "--n-estimators", "1",
              "--batch-size", "16"]
    assert main([*common, "--train", str(tables / "empty_cells.csv"), "-o", str(tables / "a.csv")]) == 0
    err = capsys.readouterr().err
    assert "tabfm predict: classification: fitting on 90 rows x 7 features, predicting 30 rows" in err
    assert "predict: 100%" in err and "30/30" in err  # the progress bar over the test rows
    assert "wrote 30 probability rows (classification)" in err
    assert main([*common, "--train", str(tables / "tokens.csv"), "-o", str(tables / "b.csv"), "--quiet"]) == 0
    assert capsys.readouterr().err == ""
    assert (tables / "a.csv").read_text() == (tables / "b.csv").read_text()  # before: 'x' became a category
    pred = pl.read_csv(tables / "a.csv")
    assert pred.columns == ["label", "proba_no", "proba_yes"]
    assert pred["label"].to_list() == [("no", "yes")[i] for i in pred.drop("label").to_numpy().argmax(1)]
    digits = {len(re.sub(r"e-?\d+$|^0\.0*|\.", "", v)) for line in (tables / "a.csv").read_text().splitlines()[1:]
              for v in line.split(",")[1:]}
    assert max(digits) <= 6 and max(digits) >= 5


def _mostly_numbers(tables):
    """train.csv with every tenth 'x' cell 'n.a.': a column of numbers read as text."""
    train = pl.read_csv(tables / "train.csv")
    train.with_columns(pl.when(pl.int_range(pl.len()) % 10 == 0).then(pl.lit("n.a."))
                       .otherwise(pl.col("x").cast(pl.String)).alias("x")).write_csv(tables / "bad.csv")
    return "bad.csv"


def _mostly_dates(tables):
    """A column of dates with one impossible date, which made it categories without a word (later dates all unseen
    categories)."""
    days = [f"2020-01-{1 + i % 28:02d}" for i in range(59)] + ["2020-02-30"]
    (tables / "days.csv").write_text("x,day,y\n" + "\n".join(f"{i % 7},{d},{'ab'[i % 2]}" for i, d in enumerate(days)))
    return "days.csv"


@pytest.mark.parametrize("write, token, message", [
    (_mostly_numbers, "n.a.", "column 'x' is read as text (categories) although 81 of its 90 values are numbers; the "
     "others: 'n.a.'. If they mean missing, pass --na-values"),
    (_mostly_dates, "2020-02-30", "column 'day' is read as text (categories) although 59 of its 60 values are dates; "
     "the others: '2020-02-30'. Fix them, or pass --na-values if they mean missing"),
])
def test_a_text_column_of_mostly_numbers_or_dates_is_warned_about(tables, capsys, write, token, message):
    name = write(tables)
    # The warning comes as the tables are read, before anything else: a wrong target stops the run right after.
    argv = ["predict", "--train", str(tables / name), "--test", str(tables / "test.csv"), "--target", "nope"]
    assert main(argv) == 2
    warning, error = capsys.readouterr().err.strip().splitlines()
    assert warning == f"tabfm predict: warning: {tables / name}: {message}"
    assert error.startswith("tabfm predict: error: ") and "has no column 'nope'" in error
    assert main([*argv, "--na-values", token]) == 2
    assert "warning" not in capsys.readouterr().err


def test_a_mostly_numeric_text_column_is_warned_about_once(tables, capsys):
    _mostly_numbers(tables)
    test = pl.read_csv(tables / "test.csv").with_columns(pl.col("x").cast(pl.String))
    test.write_csv(tables / "bad_test.csv")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rc = main(["predict", "--train", str(tables / "bad.csv"), "--test", str(tables / "bad_test.csv"), "--target",
                   "label", "-o", str(tables / "out.csv"), "--n-estimators", "1", "--quiet"])
    assert rc == 0
    assert capsys.readouterr().err.count("column 'x' is read as text") == 1  # the command's own line
    assert not [w for w in caught if issubclass(w.category, NumericTextWarning)]  # not the estimator's as well


def _snapshot(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


@pytest.mark.parametrize("files, args, message", [
    ({"train.csv": b""}, [], "{train}: the file is empty"),
    ({"test.csv": b"x,noise\n"}, [], "{test}: has a header (2 columns) but no rows"),
    ({"train.csv": b"x,label\n1,yes\n2,no,3\n"}, [], "{train}: line 3 has 3 fields but the header has 2"),
    ({"test.csv": "x,colour\n1,caf\xe9\n".encode("latin-1")}, [], "{test}: not UTF-8 text (byte 0xe9 on line 2)"),
    ({"fake.parquet": b"x,colour\n1,red\n"}, ["--test", "{tmp}/fake.parquet"], "{tmp}/fake.parquet: not a Parquet"),
    ({}, ["-o", "{tmp}/preds.xlsx"], "{tmp}/preds.xlsx: cannot write a table with extension '.xlsx'"),
    ({}, ["-o", "{tmp}/nowhere/preds.csv"], "folder {tmp}/nowhere does not exist; create it first"),
    ({}, ["-o", "{train}"], "{train}: is the input table {train}"),
    ({}, ["-o", "{tmp}/../{tmp.name}/test.csv"], "is the input table {test}"),
    ({"train.csv": b"x,label\n1,NA\n2,?\n"}, [], "{train}: the target column 'label' is empty"),
    ({}, ["--n-estimators", "0"], "--n-estimators must be at least 1, got 0"),
])
def test_bad_input_gives_one_line_and_writes_nothing(tables, capsys, files, args, message):
    for name, data in files.items():
        (tables / name).write_bytes(data)
    names = {"tmp": tables, "train": tables / "train.csv", "test": tables / "test.csv"}
    before = _snapshot(tables)
    argv = ["predict", "--train", str(tables / "train.csv"), "--target", "label", "--test", str(tables / "test.csv")]
    assert main([*argv, *(a.format(**names) for a in args)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tabfm predict: error: "), err
    assert message.format(**names) in err
    assert _snapshot(tables) == before


@pytest.mark.parametrize("labels, dtype", [([[0], [1]], "List(Int64)"), ([{"k": 0}, {"k": 1}], "Struct")])
def test_a_nested_target_gives_one_line(tables, capsys, labels, dtype):
    """A Parquet target of lists was a traceback (polars cannot cast List to String), one of structs became
    labels such as {1} without a word."""
    pl.DataFrame({"x": np.arange(40) / 10, "y": labels * 20}).write_parquet(tables / "nested.parquet")
    before = _snapshot(tables)
    assert main(["predict", "--train", str(tables / "nested.parquet"), "--target", "y", "--test",
                 str(tables / "test.csv"), "-o", str(tables / "out.csv")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"nested.parquet: the target 'y' has the polars type {dtype}" in err, err
    assert _snapshot(tables) == before


def test_output_is_checked_before_torchrun_starts(tables, capsys):
    argv = ["predict", "--train", str(tables / "train.csv"), "--target", "label", "--test", str(tables / "test.csv"),
            "--nproc", "2", "-o", str(tables / "train.csv")]
    assert main(argv) == 2
    assert "is the input table" in capsys.readouterr().err


def test_rows_without_a_target_are_left_out_with_a_warning(tables, capsys):
    text = (tables / "train.csv").read_text().splitlines()
    header, rows = text[0], text[1:]
    col = header.split(",").index("label")
    rows = [",".join("NA" if j == col and i < 4 else v for j, v in enumerate(r.split(","))) for i, r in enumerate(rows)]
    (tables / "gaps.csv").write_text("\n".join([header, *rows]) + "\n")
    # found by a hunt: a Parquet target's NaN (as polars and pyarrow write a float gap) stopped the run as bad y,
    # while the same rows in a CSV were left out
    pl.read_csv(tables / "train.csv").with_columns(
        pl.when(pl.int_range(pl.len()) < 3).then(float("nan")).otherwise(pl.col("amount")).alias("amount")
    ).write_parquet(tables / "nan.parquet")
    for name, target, gaps in (("gaps.csv", "label", 4), ("nan.parquet", "amount", 3)):
        # The tables are read and checked first: --proba with --task regression then stops the run before fitting.
        argv = ["predict", "--train", str(tables / name), "--target", target, "--test", str(tables / "test.csv"),
                "--task", "regression", "--proba"]
        assert main(argv) == 2
        warning, error = capsys.readouterr().err.strip().splitlines()
        assert warning == f"tabfm predict: warning: {tables / name}: {gaps} of 90 rows have no {target!r} value; " \
            "they are left out"
        assert error == "tabfm predict: error: --proba is for classification; this target is treated as " \
            "regression (use --task)"


@pytest.mark.parametrize("target, test, suffix, extra", [
    ("label", "test.csv", ".csv", ["--proba"]),
    ("amount", "test.parquet", ".parquet", []),
])
def test_the_test_table_read_in_batches_of_7_rows_gives_the_same_bytes(tables, target, test, suffix, extra):
    # the first 7 test rows have no 'x': read alone, that batch's column would be all missing
    no_x = pl.when(pl.int_range(pl.len()) < 7).then(None).otherwise(pl.col("x")).alias("x")
    pl.read_csv(tables / "test.csv").with_columns(no_x).write_csv(tables / "test.csv")
    pl.read_parquet(tables / "test.parquet").with_columns(no_x).write_parquet(tables / "test.parquet")
    common = ["predict", "--train", str(tables / "train.csv"), "--target", target, "--test", str(tables / test),
              "--n-estimators", "1", "--batch-size", "8", "--quiet", *extra]
    assert main([*common, "-o", str(tables / f"whole{suffix}")]) == 0
    assert main([*common, "-o", str(tables / f"seven{suffix}"), "--batch-rows", "7"]) == 0
    whole = (tables / f"whole{suffix}").read_bytes()
    assert (tables / f"seven{suffix}").read_bytes() == whole
    pred = pl.read_csv(whole) if suffix == ".csv" else pl.read_parquet(whole)
    assert pred.height == 30 and pred.columns[0] == target
    assert not [p.name for p in tables.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("local", [256, 30], ids=["one context", "local contexts"])  # the table has 90 train rows
def test_the_stream_gives_what_the_estimator_gives_on_the_whole_table(tables, local):
    from tabfm.estimator import TabFMRegressor
    from tabfm.table_io import read_table

    out = tables / "amount.csv"
    assert main(["predict", "--train", str(tables / "train.csv"), "--target", "amount", "--test",
                 str(tables / "test.parquet"), "--n-estimators", "1", "--batch-size", "8", "--batch-rows", "7",
                 "--local-context-rows", str(local), "--quiet", "-o", str(out)]) == 0
    train, test = read_table(tables / "train.csv"), read_table(tables / "test.parquet")
    reg = TabFMRegressor(n_estimators=1, batch_size=8, local_context_rows=local).fit(train.drop("amount"),
                                                                                   train["amount"].to_numpy())
    assert (reg.local_ is not None) == (local < 90)
    expected = reg.predict(test.select(train.drop("amount").columns))
    assert out.read_text() == pl.DataFrame({"amount": expected}).write_csv()


@pytest.mark.parametrize("spoil, message", [
    (lambda fields: ["oops", *fields[1:]],
     "{test}: column 'x' holds 'oops' (row 20) where the train table has numbers"),
    (lambda fields: [*fields, "1", "2", "3"], "{test}: line 21 has 10 fields but the header has 7"),
], ids=["bad cell", "ragged line"])  # polars reads text in blocks: this small file's ragged line is met up front
def test_a_bad_row_half_way_leaves_no_output(tables, capsys, spoil, message):
    lines = (tables / "test.csv").read_text().splitlines()
    lines[20] = ",".join(spoil(lines[20].split(",")))  # data row 20, in the third batch of 7 rows
    (tables / "test.csv").write_text("\n".join(lines) + "\n")
    out = tables / "pred.csv"
    out.write_text("an earlier run\n")
    before = _snapshot(tables)
    argv = ["predict", "--train", str(tables / "train.csv"), "--target", "label", "--test", str(tables / "test.csv"),
            "--n-estimators", "1", "--batch-size", "8", "--batch-rows", "7", "-o", str(out), "--overwrite"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("tabfm predict: error: ") and message.format(test=tables / "test.csv") in err, err
    assert _snapshot(tables) == before  # the earlier output untouched, no temporary file left
    assert main(argv[:-3]) == 2  # to stdout: the first batches' predictions are not printed either
    captured = capsys.readouterr()
    assert captured.out == "" and message.format(test=tables / "test.csv") in captured.err


def test_a_date_column_reads_alike_from_csv_and_parquet(tmp_path, capsys):
    rng = np.random.default_rng(1)
    days = pl.date_range(date(2020, 1, 1), date(2020, 5, 29), eager=True).sample(120, seed=1)
    frame = pl.DataFrame({"d": days, "x": rng.normal(size=120).round(3),
                          "late": np.where((days > date(2020, 3, 15)).to_numpy(), "yes", "no")})
    for name, rows in (("train", frame[:90]), ("test", frame[90:])):
        rows.write_parquet(tmp_path / f"{name}.parquet")
        rows.write_csv(tmp_path / f"{name}.csv")  # d as 2020-03-15 text
    outputs = []
    for train, test in (("parquet", "parquet"), ("csv", "csv"), ("parquet", "csv")):
        out = tmp_path / f"{train}_{test}.csv"
        assert main(["predict", "--train", str(tmp_path / f"train.{train}"), "--target", "late", "--test",
                     str(tmp_path / f"test.{test}"), "--proba", "--n-estimators", "1", "--quiet", "-o", str(out)]) == 0
        outputs.append(out.read_text())
    assert capsys.readouterr().err == ""  # before: "column 'd' was numeric at fit but holds strings now"
    assert outputs[1] == outputs[0] and outputs[2] == outputs[0]  # before: d a category of 90 days from CSV


def test_a_semicolon_export_with_decimal_commas_reads_as_the_csv(tables, capsys):
    def european(name: str) -> str:
        text = (tables / name).read_text()  # the table's text cells hold no comma
        return text.replace(",", ";").replace(".", ",")

    (tables / "train_semi.csv").write_text(european("train.csv"))
    (tables / "test_semi.csv").write_text(european("test.csv"))
    common = ["predict", "--target", "label", "--proba", "--n-estimators", "1", "--quiet"]
    assert main([*common, "--train", str(tables / "train.csv"), "--test", str(tables / "test.csv"),
                 "-o", str(tables / "comma.csv")]) == 0
    semi = [*common, "--train", str(tables / "train_semi.csv"), "--test", str(tables / "test_semi.csv")]
    assert main(semi) == 2  # before: "line 2 has 2 fields but the header has 1"
    assert capsys.readouterr().err == f"tabfm predict: error: {tables / 'train_semi.csv'}: the header " \
        f"'{(tables / 'train_semi.csv').read_text().splitlines()[0][:60]}' is one column holding ';': the file " \
        "looks semicolon-separated; pass --separator ';' (and --decimal-comma if its numbers are written 1,5), " \
        "or save it as comma-separated CSV\n"
    assert main([*semi, "--separator", ";", "-o", str(tables / "categories.csv")]) == 0  # numbers as categories
    warnings = capsys.readouterr().err.splitlines()
    example = str(pl.read_csv(tables / "train.csv")["x"][0]).replace(".", ",")
    assert warnings[0] == f"tabfm predict: warning: {tables / 'train_semi.csv'}: column 'x' is read as text " \
        f"(categories) although its values are numbers with a decimal comma (e.g. '{example}'); pass --decimal-comma"
    assert main([*semi, "--separator", ";", "--decimal-comma", "-o", str(tables / "semi.csv")]) == 0
    assert (tables / "semi.csv").read_text() == (tables / "comma.csv").read_text()


@pytest.mark.parametrize("text, separator", [(";", ";"), ("tab", "\t"), ("\\t", "\t"), ("\t", "\t"), ("|", "|")])
def test_separator_option_reaches_the_ranks(text, separator):
    from tabfm._cli_predict import worker_parser
    from tabfm.launch import worker_argv

    args = worker_parser().parse_args(["--train", "a.csv", "--target", "y", "--test", "b.csv", "--separator", text,
                                       "--decimal-comma"])
    assert args.separator == separator
    assert worker_parser().parse_args(worker_argv(worker_parser(), args)) == args
    with pytest.raises(SystemExit):
        worker_parser().parse_args(["--train", "a.csv", "--target", "y", "--test", "b.csv", "--separator", ";;"])


@pytest.mark.parametrize("text, members", [("auto", "auto"), ("3", 3)])
def test_n_estimators_option_takes_a_count_or_auto_and_reaches_the_ranks(text, members, capsys):
    from tabfm._cli_predict import worker_parser
    from tabfm.launch import worker_argv

    base = ["--train", "a.csv", "--target", "y", "--test", "b.csv"]
    args = worker_parser().parse_args([*base, "--n-estimators", text])
    assert args.n_estimators == members
    assert worker_parser().parse_args(worker_argv(worker_parser(), args)) == args
    assert worker_parser().parse_args(base).n_estimators == "auto"
    with pytest.raises(SystemExit):
        worker_parser().parse_args([*base, "--n-estimators", "many"])
    assert "'many' is not a member count: give a whole number, or auto" in capsys.readouterr().err


def test_short_rows_are_named_in_a_warning_line(tables, capsys):
    lines = (tables / "train.csv").read_text().splitlines()
    lines[3] = ",".join(lines[3].split(",")[:2])  # line 4 loses its last fields, the label among them
    (tables / "train.csv").write_text("\n".join(lines) + "\n")
    (tables / "test.csv").write_text((tables / "test.csv").read_text() + "1.5\n")
    out = tables / "pred.csv"
    assert main(["predict", "--train", str(tables / "train.csv"), "--target", "label", "--test",
                 str(tables / "test.csv"), "-o", str(out), "--n-estimators", "1", "--quiet"]) == 0
    err = capsys.readouterr().err
    for name, line in (("train.csv", 4), ("test.csv", 32)):
        assert (f"tabfm predict: warning: {tables / name}: 1 row(s) have fewer fields than the header (the first "
                f"on line {line}); their absent last cells are read as missing: check the file is complete") in err
    assert pl.read_csv(out).height == 31


def _predict_worker(argv: list[str]) -> int:
    from tabfm._cli_predict import worker_main

    return worker_main(argv)


def test_predict_data_parallel_on_two_ranks_equals_one_process(tables, ranks, monkeypatch):
    """--data-parallel 2: the launcher's worker command line run by each of 2 gloo ranks (torchrun itself is
    the sharded test's: starting it again costs two more interpreters and adds no check)."""
    from tabfm import launch

    launched = []

    def run_on_ranks(module, argv, nproc, max_restarts=0):
        launched.append((module, nproc))
        codes = ranks(nproc).run(_predict_worker, list(argv))
        assert codes == [0] * nproc, codes
        return 0

    monkeypatch.setattr(launch, "run_torchrun", run_on_ranks)
    common = ["--train", str(tables / "train.csv"), "--target", "label", "--test", str(tables / "test.csv"),
              "--proba", "--dtype", "float64", "--n-estimators", "1", "--batch-size", "8", "--batch-rows", "7"]
    assert main(["predict", *common, "-o", str(tables / "one.parquet")]) == 0
    assert main(["predict", *common, "--data-parallel", "2", "-o", str(tables / "two.parquet")]) == 0
    assert launched == [("tabfm._cli_predict", 2)]
    one, two = pl.read_parquet(tables / "one.parquet"), pl.read_parquet(tables / "two.parquet")
    assert one["label"].to_list() == two["label"].to_list()
    np.testing.assert_allclose(two.drop("label").to_numpy(), one.drop("label").to_numpy(), rtol=0, atol=1e-10)


def test_data_parallel_and_model_split_are_alternatives(tables, capsys):
    argv = ["predict", "--train", str(tables / "train.csv"), "--target", "label", "--test", str(tables / "test.csv"),
            "--nproc", "2", "--data-parallel", "2"]
    assert main(argv) == 2
    assert "--nproc 2 splits the model, --data-parallel 2 the test rows; choose one" in capsys.readouterr().err


def test_sigterm_while_writing_removes_the_temporary_file(tmp_path):
    import os
    import signal

    from tabfm._cli_predict import _exit_on_sigterm
    from tabfm.table_write import TableWriter

    out = tmp_path / "pred.csv"
    with pytest.raises(SystemExit) as stop:
        with _exit_on_sigterm(), TableWriter(out) as writer:
            writer.write(pl.DataFrame({"y": [1, 2]}))
            os.kill(os.getpid(), signal.SIGTERM)
    assert stop.value.code == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_blank_lines_in_the_test_file_are_predicted_in_place_and_said(tmp_path, capsys):
    """A test CSV with 3 rows and 3 blank lines gave 6 predictions without a word (pandas reads 3 rows)."""
    rng = np.random.default_rng(0)
    a = rng.normal(size=40)
    pl.DataFrame({"a": a, "b": np.where(a > 0, "u", "v"), "y": (a > 0).astype(int)}).write_csv(tmp_path / "tr.csv")
    (tmp_path / "te.csv").write_text("a,b\n1.0,u\n\n-1.0,v\n\n\n0.5,w\n")
    argv = ["predict", "--train", str(tmp_path / "tr.csv"), "--target", "y", "--test", str(tmp_path / "te.csv"),
            "--n-estimators", "1", "--quiet", "-o", str(tmp_path / "p.csv")]
    assert main(argv) == 0
    assert "te.csv: 3 of 6 rows have every cell missing (blank lines, or only missing-value tokens)" in \
        capsys.readouterr().err
    assert pl.read_csv(tmp_path / "p.csv").height == 6
    (tmp_path / "te.csv").write_text("a,b\n1.0,u\n-1.0,v\n")
    assert main([*argv, "--overwrite"]) == 0 and "blank lines" not in capsys.readouterr().err


def test_blank_lines_in_the_train_file_are_no_rows_without_a_target(tmp_path, capsys):
    """A train CSV ending in blank lines (as polars reads them: rows with every cell missing) was said to have that
    many rows without a target; pandas reads no row there. A real row without its target is still said."""
    rng = np.random.default_rng(0)
    a = rng.normal(size=40)
    rows = [f"{v:.3f},{'u' if v > 0 else 'v'},{int(v > 0)}" for v in a]
    (tmp_path / "te.csv").write_text("a,b\n1.0,u\n-1.0,v\n")
    argv = ["predict", "--train", str(tmp_path / "tr.csv"), "--target", "y", "--test", str(tmp_path / "te.csv"),
            "--n-estimators", "1", "-o", str(tmp_path / "p.csv"), "--overwrite"]
    (tmp_path / "tr.csv").write_text("\r\n".join(["a,b,y", *rows[:20], "", *rows[20:], "0.5,u,", "", "", ""]))
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "tr.csv: 1 of 41 rows have no 'y' value; they are left out" in err
    assert "classification: fitting on 40 rows x 2 features, predicting 2 rows" in err
    for end in ("\n\n", "\n\n\n\n"):  # stopped after the train table is read: --proba is refused for regression
        (tmp_path / "tr.csv").write_text("\n".join(["a,b,y", *rows]) + end)
        assert main([*argv, "--task", "regression", "--proba"]) == 2
        assert capsys.readouterr().err.strip().splitlines() == ["tabfm predict: error: --proba is for classification; "
                                                                 "this target is treated as regression (use --task)"]
    (tmp_path / "tr.csv").write_text("a,b,y\n\n\n")
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == f"tabfm predict: error: {tmp_path / 'tr.csv'}: has a header (3 " \
        "columns) but no rows (only blank lines or missing cells)"


def test_integer_labels_stay_integers_and_predict_warnings_are_the_cli_s_lines(tmp_path, capsys):
    """An integer target's labels were written as text (Parquet str), and a warning raised while predicting came out
    as Python's, with tabfm's source path and line."""
    rng = np.random.default_rng(1)
    a = rng.normal(size=40)
    pl.DataFrame({"a": a, "c": np.where(a > 0, "up", "down"), "y": (a > 0).astype(np.int64) * 7}).write_csv(
        tmp_path / "tr.csv")
    pl.DataFrame({"a": [1.0, -1.0, 0.5], "c": ["sideways", "sideways", "sideways"]}).write_csv(tmp_path / "te.csv")
    argv = ["predict", "--train", str(tmp_path / "tr.csv"), "--target", "y", "--test", str(tmp_path / "te.csv"),
            "--n-estimators", "1", "--quiet", "-o", str(tmp_path / "p.parquet")]
    assert main(argv) == 0
    out = pl.read_parquet(tmp_path / "p.parquet")
    assert out.schema == pl.Schema({"y": pl.Int64}) and set(out["y"].to_list()) <= {0, 7}
    err = capsys.readouterr().err
    assert "tabfm predict: warning: categorical columns hold mostly values never seen at fit" in err
    assert "UserWarning" not in err and ".py:" not in err


def test_a_warning_raised_while_fitting_is_a_cli_line(tmp_path, capsys):
    """An id column left out at fit warned as Python's warning, with tabfm's source path and line (only predicting
    was wrapped)."""
    rng = np.random.default_rng(2)
    a = rng.normal(size=40)
    pl.DataFrame({"a": a, "name": [f"n{i}" for i in range(40)], "y": (a > 0).astype(np.int64)}).write_csv(
        tmp_path / "tr.csv")
    pl.DataFrame({"a": [1.0, -1.0], "name": ["z1", "z2"]}).write_csv(tmp_path / "te.csv")
    argv = ["predict", "--train", str(tmp_path / "tr.csv"), "--target", "y", "--test", str(tmp_path / "te.csv"),
            "--n-estimators", "1", "--quiet", "-o", str(tmp_path / "p.csv")]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "tabfm predict: warning: column(s) 'name' hold a different value in every train row" in err
    assert "UserWarning" not in err and ".py:" not in err and "never seen at fit" not in err


def test_n_jobs_reaches_the_estimator(tables, monkeypatch):
    """--n-jobs is the estimators' n_jobs: the threads of a shared machine's share (a fuzzer found no way to set
    them but OMP_NUM_THREADS)."""
    from tabfm.estimator import TabFMClassifier

    seen = []
    real = TabFMClassifier.fit

    def spy(self, X, y):
        seen.append(self.n_jobs)
        return real(self, X, y)

    monkeypatch.setattr(TabFMClassifier, "fit", spy)
    argv = ["predict", "--train", str(tables / "train.csv"), "--target", "label", "--test", str(tables / "test.csv"),
            "--n-estimators", "1", "--n-jobs", "1", "-o", str(tables / "jobs.csv")]
    assert main(argv) == 0 and seen == [1]
