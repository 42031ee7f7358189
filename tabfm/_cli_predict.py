"""`tabfm predict`: fit on a train table, predict a test table (CSV, TSV or Parquet), optionally sharded over
processes.

    tabfm predict --train train.csv --target y --test test.csv [-o preds.csv [--overwrite]] [--proba]
    tabfm predict ... --nproc 4 --layout 2x2     # torchrun: one context split over 4 processes
    tabfm predict ... --data-parallel 4          # torchrun: the test rows split over 4 processes

The train table is read whole; the test table is read --batch-rows rows at a time, its columns given the train
table's types (tabfm.table_io.TableScan), predicted in chunks of --batch-size rows (tabfm.predict_stream: the
same chunks, and so the same answers, whatever --batch-rows) and written as it goes (tabfm.table_write.TableWriter:
a temporary file renamed into place on success), so memory is bounded by a batch, not by the test table.

With --nproc > 1 or --data-parallel > 1 the command relaunches itself under torchrun. --nproc: every rank runs
the estimator with tensor_parallel=(d0, d1) (rows by sequence parallelism, heads by tensor parallelism) on every
test row. --data-parallel: every rank fits the whole estimator and predicts every N-th chunk of test rows, gathered
on rank 0. Either way rank 0 writes the predictions, which equal the one-process ones.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

from tabfm._cli_demo import parse_layout
from tabfm.table_io import NA_VALUES

TASKS = ("auto", "classification", "regression")
MAX_AUTO_CLASSES = 20
"""--task auto: a numeric target with more distinct values than this is regression (prices, counts), one with at
most this many is classification (0/1, ratings 1..5, class codes)."""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "predict", help="fit on a train table and predict a test table (CSV, TSV or Parquet)",
        description="Fit the pretrained model on --train (in context) and predict --test. Cells that are empty or "
        "hold a usual missing token (NA, N/A, NaN, null, None, ?, - ...) are read as missing; see --na-values.")
    _add_arguments(p)
    p.set_defaults(run=_predict)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--train", required=True, help="train table with the target column (.csv, .tsv or .parquet)")
    p.add_argument("--target", required=True, help="name of the target column")
    p.add_argument("--test", required=True,
                   help="table to predict (.csv, .tsv or .parquet); a target column there is ignored")
    p.add_argument("-o", "--output", help="where to write the predictions: .csv, .tsv or .parquet; - or no -o: CSV "
                   "on stdout. Never one of the input tables; an existing file only with --overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing -o file (written whole first, then moved over it)")
    p.add_argument("--proba", action="store_true",
                   help="class probabilities, one proba_CLASS column per class after the predicted label (6 "
                   "significant digits in CSV/TSV)")
    p.add_argument("--task", choices=TASKS, default="auto",
                   help=f"auto (default): regression for a numeric target with more than {MAX_AUTO_CLASSES} distinct "
                   "values (whole numbers or not), classification otherwise (text, booleans, a few numeric labels "
                   "such as 0/1 or 1..5); the choice is printed")
    p.add_argument("--checkpoint", help="merged .safetensors or checkpoint folder (default: the shipped model)")
    p.add_argument("--n-estimators", type=_members, default="auto",
                   help="ensemble members: a count, or auto (default: 4, up to 16 on tables of fewer than 1,024 "
                   "train rows, and more with over 10 classes)")
    p.add_argument("--local-context-rows", type=int, default=256, metavar="N",
                   help="with more train rows than N, each member reads local contexts of N nearest train rows "
                   "(0: one context of all train rows)")
    p.add_argument("--categorical", default="", help="comma-separated columns to treat as categorical")
    p.add_argument("--na-values", default="", metavar="A,B,...",
                   help="comma-separated extra cell values that mean missing, added to the defaults: "
                   + " ".join(repr(v) if v else "'' (empty)" for v in NA_VALUES))
    p.add_argument("--no-default-na", action="store_true",
                   help="read only empty cells and the --na-values as missing (e.g. when 'NA' or '-' is a category)")
    p.add_argument("--separator", type=parse_separator, default=None, metavar="SEP",
                   help="field separator of the .csv/.tsv tables, e.g. ';' or tab (default: ',' for .csv, tab for "
                   ".tsv)")
    p.add_argument("--decimal-comma", action="store_true",
                   help="numbers in the .csv/.tsv tables are written with a decimal comma (1,5), as in "
                   "semicolon-separated exports")
    p.add_argument("--quiet", action="store_true", help="no progress bar or progress lines (warnings still show)")
    p.add_argument("--batch-size", type=int, default=1024, help="test rows per forward")
    p.add_argument("--batch-rows", type=int, default=20_000,
                   help="test rows read (and held) at a time: memory is bounded by this, not by the test table "
                        "(polars' reading of a CSV peaked at 0.67 GiB with 100,000, 0.45 GiB with 20,000)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"],
                   help="the weights' dtype (default: float32; bfloat16 compute is --precision bf16)")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"],
                   help="bf16: bfloat16 autocast over float32 weights; auto (default): bf16 on CUDA, fp32 elsewhere")
    p.add_argument("--n-jobs", type=int, default=None, metavar="N",
                   help="CPU threads of the model and the work between its forwards (the estimators' n_jobs; -1: "
                   "every core; default: torch's count); under --nproc / --data-parallel, each process's")
    p.add_argument("--nproc", type=int, default=1, help="processes (torchrun) to shard the model over")
    p.add_argument("--layout", type=parse_layout, default=None,
                   help="tensor-parallel mesh d0xd1 for --nproc (default: nproc x 1)")
    p.add_argument("--no-sequence-parallel", action="store_true", help="keep rows whole on every rank")
    p.add_argument("--data-parallel", type=int, default=1, metavar="N",
                   help="processes (torchrun) that each fit the whole model and predict every N-th batch of test "
                   "rows (instead of --nproc, which splits the model)")


def _members(text: str) -> int | str:
    """--n-estimators: a whole number (_predict checks it is at least 1), or auto."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a member count: give a whole number, or auto") from None


def parse_separator(text: str) -> str:
    """--separator: one character, or 'tab' (a tab is awkward to type in a shell)."""
    separator = "\t" if text.lower() in ("tab", "\\t") else text
    if len(separator) != 1 or not separator.isascii() or separator in "\"\r\n":
        raise argparse.ArgumentTypeError(f"{text!r} is not a separator: give one character such as ';' or '|', or tab")
    return separator


def infer_task(y) -> tuple[str, str]:
    """(task, why) for --task auto: the number of distinct values decides, not whether they are whole, so integer
    prices and counts are regression while 0/1 or 1..5 labels stay classification; and a target with fractional
    values where most values are distinct (fewer than two rows per value, e.g. 18 measurements on 18 rows) is
    regression however few rows there are: classes of one row each are no classes."""
    if not y.dtype.is_numeric():
        return "classification", f"the target {y.name!r} is not numeric ({y.dtype})"
    values = y.drop_nulls()
    distinct, limit = values.n_unique(), MAX_AUTO_CLASSES
    if distinct > limit:
        return "regression", f"the target {y.name!r} is numeric with {distinct} distinct values (over {limit})"
    if y.dtype.is_float() and distinct > 2 and 2 * distinct > len(values) and (values != values.round(0)).any():
        return "regression", (f"the target {y.name!r} has fractional values, {distinct} distinct in {len(values)} "
                              "rows (fewer than two rows per value)")
    return "classification", f"the target {y.name!r} has only {distinct} distinct values (at most {limit})"


def _is_rank0() -> bool:
    """True unless this is a torchrun worker other than rank 0 (torch.distributed is looked up, never imported:
    the one-process path reads and checks the tables before paying for torch)."""
    dist = sys.modules.get("torch.distributed")
    return dist is None or not dist.is_initialized() or dist.get_rank() == 0


def _say(args: argparse.Namespace, message: str, *, warning: bool = False) -> None:
    """A progress line (not with --quiet) or a warning (always) on stderr, from rank 0 only."""
    if _is_rank0() and (warning or not args.quiet):
        print(f"tabfm predict: {'warning: ' if warning else ''}{message}", file=sys.stderr)


def load_train(args: argparse.Namespace):
    """(X, y, task, why) from --train: rows without a target dropped (with a warning), a warning for each text
    column that is mostly numbers; `why` is the line saying how --task auto chose ("" for a given --task). Raises
    ValueError on bad input."""
    import polars as pl

    from tabfm import table_io, text_columns

    # the target also as the text its cells hold, for a classifier's labels (_labels_as_written)
    train, target_text = table_io.read_table_and_text(args.train, args.target, _na(args), args.separator,
                                                      args.decimal_comma)
    _say_short_rows(args, args.train, table_io.short_rows(args.train, args.separator,
                                                          train.get_column(train.columns[-1]).null_count()))
    mostly = (("numbers", "If they mean missing, pass --na-values",
               text_columns.mostly_numeric_text(train, args.decimal_comma)),
              ("dates", "Fix them, or pass --na-values if they mean missing", text_columns.mostly_temporal_text(train)))
    for kind, remedy, found in mostly:
        for column, k, n, others in found:
            shown = ", ".join(repr(v) for v in others)
            _say(args, f"{args.train}: column {column!r} is read as text (categories) although {k} of its {n} "
                 f"values are {kind}; the others: {shown}. {remedy}", warning=True)
    for column, example in [] if args.decimal_comma else text_columns.thousands_text(train):
        _say(args, f"{args.train}: column {column!r} is read as text (categories) although its values are numbers "
             f"if {example!r} is {example.replace(',', '')} (thousands separators) or "
             f"{example.replace(',', '.', 1) if example.count(',') == 1 else 'a decimal comma'}: remove the "
             "separators if they group thousands, or pass --decimal-comma if the comma is the decimal point",
             warning=True)
    for column, example in [] if args.decimal_comma else text_columns.decimal_comma_text(train):
        _say(args, f"{args.train}: column {column!r} is read as text (categories) although its values are numbers "
             f"with a decimal comma (e.g. {example!r}); pass --decimal-comma", warning=True)
    if args.target not in train.columns:
        raise ValueError(f"{args.train} has no column {args.target!r}; columns: {', '.join(map(repr, train.columns))}")
    table_io.check_finite(train, str(args.train))  # before rows are left out: its row numbers are the file's
    target = train.get_column(args.target)
    if target.dtype.is_nested() or target.dtype in (pl.Binary, pl.Object):  # a Parquet list or struct column
        raise ValueError(f"{args.train}: the target {args.target!r} has the polars type {target.dtype}; a target "
                         "holds one number, text or boolean per row: flatten or convert that column")
    labelled = target.is_not_null()
    if target.dtype.is_float():  # a Parquet file's NaN is a missing target too, as a CSV's "NaN" cell is null
        labelled = labelled & ~target.is_nan().fill_null(False)
    # polars reads a CSV's blank line (e.g. one at its end) as a row with every cell missing, where pandas skips
    # it: no row, so not counted as one without a target. Such rows (a line of only missing-value tokens too) are
    # left out with the unlabelled ones without a word: they hold nothing to fit.
    rows = train.height - int(train.select(pl.all_horizontal(pl.all().is_null())).to_series().sum())
    if rows == 0:
        raise ValueError(f"{args.train}: has a header ({train.width} columns) but no rows (only blank lines or "
                         "missing cells)")
    unlabelled = rows - int(labelled.sum())
    if unlabelled == rows:
        raise ValueError(f"{args.train}: the target column {args.target!r} is empty (every cell is missing)")
    if unlabelled:
        _say(args, f"{args.train}: {unlabelled} of {rows} rows have no {args.target!r} value; they are left "
             "out", warning=True)
    if not labelled.all():
        train = train.filter(labelled)
    y = train.get_column(args.target)
    X = train.drop(args.target)
    if not X.columns:
        raise ValueError(f"{args.train} has no feature columns besides the target {args.target!r}")
    if args.target in _categorical_columns(args):
        raise ValueError(f"--categorical names the target {args.target!r}; it lists feature columns only (a "
                         "classification target is read as classes anyway: --task classification)")
    unknown = [c for c in _categorical_columns(args) if c not in X.columns]
    if unknown:  # else the estimator's fit refused it, as "categorical_features names ...", a name never typed
        shown = ", ".join(map(repr, X.columns[:10])) + (f", ... ({len(X.columns)} in all)" if len(X.columns) > 10
                                                        else "")  # one line, also for a table of 3,000 columns
        raise ValueError(f"--categorical names {unknown[0]!r}, which is not a column of {args.train}; its feature "
                         f"columns: {shown}")
    task, why = _task(args, y)
    if task == "classification":
        y = _labels_as_written(y, target_text, None if labelled.all() else labelled)
    if args.proba and task == "regression":
        raise ValueError("--proba is for classification; this target is treated as regression (use --task)")
    if task == "regression" and not (y.dtype.is_numeric() or y.dtype == pl.Boolean):
        example = y.drop_nulls()[0]
        raise ValueError(f"{args.train}: the target {args.target!r} holds text (e.g. {example!r}), and a regression "
                         "needs numbers: use --task classification, or fix the column")
    if args.proba and args.target in {f"proba_{c}" for c in y.cast(str).unique().to_list()}:
        raise ValueError(f"--proba writes a proba_CLASS column per class, and the target {args.target!r} is also one "
                         "of them: rename the target column")
    return X, y, task, why


def _labels_as_written(y, text, labelled):
    """A classifier's target y as the train file spells it (`text`, its cells as text; None for Parquet), where
    reading it as numbers or booleans changed the spelling: '01' read as 1 (written back as 1), '007' and '7' read
    as one class, TRUE as true. y as it is otherwise (integer labels stay integers, in their numeric order).
    labelled: the rows kept, or None for all."""
    import polars as pl

    if y.dtype == pl.String or text is None:
        return y
    text = text if labelled is None else text.filter(labelled)
    return text if (text != y.cast(pl.String)).any() else y


def _categorical_columns(args: argparse.Namespace) -> list[str]:
    """The columns --categorical names (comma-separated; empty: none)."""
    return [c for c in args.categorical.split(",") if c]


def _task(args: argparse.Namespace, y) -> tuple[str, str]:
    """(--task, ""), or the inferred task and a line saying why (an integer target may be meant either way)."""
    if args.task != "auto":
        return args.task, ""
    task, why = infer_task(y)
    other = "classification" if task == "regression" else "regression"
    return task, f"task: {task}, as {why}; pass --task {other} if that is wrong"


def _numeric_classes(task: str, y) -> bool:
    """A numeric target read as classes: the one --task auto choice that may well be wrong (a count, a score), so
    it is said as a warning, which --quiet does not hide."""
    return task == "classification" and y.dtype.is_numeric()


def _na(args: argparse.Namespace) -> list[str]:
    from tabfm import table_io

    return table_io.na_tokens(args.na_values, defaults=not args.no_default_na)


def _say_short_rows(args: argparse.Namespace, path: str, found: tuple[int, int] | None) -> None:
    """A warning line for rows with fewer fields than the header (table_io.short_rows), read as missing cells."""
    if found:
        count, line = found
        _say(args, f"{path}: {count} row(s) have fewer fields than the header (the first on line {line}); their "
             "absent last cells are read as missing: check the file is complete", warning=True)


def open_test(args: argparse.Namespace, X):
    """--test opened for reading in batches (tabfm.table_io.TableScan), checked to hold X's columns; its other
    columns (the target aside) are named in a progress line and not read."""
    from tabfm import table_io

    test = table_io.TableScan(args.test, _na(args), args.batch_rows, args.separator, args.decimal_comma)
    missing_cols = [c for c in X.columns if c not in test.columns]
    if missing_cols:
        raise ValueError(f"{args.test} lacks the train table's feature columns {missing_cols}")
    _say_short_rows(args, args.test, test.short_rows())
    unused = [c for c in test.columns if c not in X.columns and c != args.target]
    if unused:  # e.g. an id column, or a feature the train table lacks: said rather than dropped unseen
        _say(args, f"{args.test}: ignoring {len(unused)} column(s) the train table's features do not include: "
                   f"{', '.join(map(repr, unused[:5]))}{', ...' if len(unused) > 5 else ''}")
    return test


def run_prediction(args: argparse.Namespace) -> int:
    """Read, fit, predict and write batch by batch (only rank 0 writes). Runs in every process under torchrun."""
    from tabfm import table_write

    output = table_write.check_output(args.output, (args.train, args.test), args.overwrite)
    X, y, task, why = load_train(args)
    test = open_test(args, X)  # its header and rows checked before the fit
    if why:  # after the checks, so that bad input still gives one line
        _say(args, why, warning=_numeric_classes(task, y))
    _say(args, f"{task}: fitting on {X.height} rows x {X.width} features, predicting {test.n_rows} rows")
    est = fit(args, X, y, task)
    empty = [0]
    outputs = _predictions(args, est, _counting_empty_rows(test.batches(X.schema, args.batch_rows), empty))
    if not _is_rank0():
        for _ in outputs:  # the other ranks' share of the work (and of the collectives)
            pass
        return 0
    from tqdm.auto import tqdm

    with _exit_on_sigterm(), _warnings_as_lines(args), \
            table_write.TableWriter(output, float_digits=6 if args.proba else None) as out, \
            tqdm(total=test.n_rows, desc="predict", unit="row", disable=args.quiet) as bar:
        for chunk in outputs:
            frame = prediction_frame(args, est, chunk, y.dtype)
            out.write(frame)
            bar.update(frame.height)
    if output is not None:
        _say(args, f"wrote {out.rows} {'probability rows' if args.proba else 'predictions'} ({task}) to {output}")
    if empty[0]:
        _say(args, f"{args.test}: {empty[0]} of {test.n_rows} rows have every cell missing (blank lines, or only "
             "missing-value tokens); each got a prediction as a row with every feature missing, in its place. If "
             "some are blank lines and not rows, remove them: pandas' read_csv skips blank lines, so its rows would "
             "not line up with these", warning=True)
    return 0


def _counting_empty_rows(batches, count: list[int]):
    """The batches as they are, adding to count[0] the rows whose every cell is missing (a blank line of a CSV
    reads as one)."""
    import polars as pl

    for batch in batches:
        count[0] += batch.select(pl.all_horizontal(pl.all().is_null())).to_series().sum()
        yield batch


@contextlib.contextmanager
def _warnings_as_lines(args: argparse.Namespace):
    """Python warnings raised while fitting or predicting (e.g. an id column left out, categories never seen at
    fit) as the CLI's own warning lines, not as a source path, a line number and the line of tabfm that warned."""
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        warnings.showwarning = lambda message, *rest, **kw: _say(args, str(message), warning=True)
        yield


@contextlib.contextmanager
def _exit_on_sigterm():
    """SIGTERM (kill, or torchrun stopping its ranks) exits through Python, so the output's temporary file is
    removed as on any error (the default action would leave it behind)."""
    def leave(signum, frame):
        sys.exit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, leave)
    except ValueError:  # not the main thread: leave the handler alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _predictions(args: argparse.Namespace, est, batches):
    """The outputs [rows, K] of each chunk of --batch-size test rows, in order (tabfm.predict_stream), split over
    the ranks with --data-parallel."""
    import torch.distributed as dist

    from tabfm.predict_stream import predict_chunks, rechunk

    group = dist.group.WORLD if args.data_parallel > 1 and dist.is_initialized() else None
    return predict_chunks(est, rechunk(batches, args.batch_size), group)


def fit(args: argparse.Namespace, X, y, task: str):
    """The fitted estimator: sharded with tensor_parallel under torchrun --nproc, whole on every rank with
    --data-parallel."""
    import polars as pl
    import torch.distributed as dist

    from tabfm.estimator import TabFMClassifier, TabFMRegressor
    from tabfm.preprocess import NumericTextWarning

    world = dist.get_world_size() if dist.is_initialized() else 1
    tp = (args.layout or (world, 1)) if world > 1 and args.data_parallel == 1 else None
    kwargs = dict(n_estimators=args.n_estimators, local_context_rows=args.local_context_rows or None,
                  checkpoint=args.checkpoint, batch_size=args.batch_size, n_jobs=args.n_jobs,
                  device=args.device, dtype=args.dtype, precision=args.precision, tensor_parallel=tp,
                  sequence_parallel=not args.no_sequence_parallel,
                  categorical_features=_categorical_columns(args) or "auto",
                  verbose=not args.quiet and _is_rank0())  # a bar over the fit's contexts
    est = (TabFMRegressor if task == "regression" else TabFMClassifier)(**kwargs)
    # classes keep a numeric target's order (proba_2 before proba_10, as est.classes_ in Python), others as text;
    # fractional classes (ratings of 3.5 and 4.5) as text too, which scikit-learn's classifiers take (as floats they
    # are a "continuous" target they refuse), written back as numbers (prediction_frame)
    numeric = y.dtype.is_numeric() and not (y.dtype.is_float() and (y != y.round(0)).any())
    y_values = y.to_numpy() if task == "regression" or numeric else y.cast(pl.String).to_numpy()
    with _warnings_as_lines(args):  # e.g. an id column left out: a warning line, not a source path
        warnings.simplefilter("ignore", NumericTextWarning)  # read_tables said it already, with the CLI's remedy
        return est.fit(X, y_values).set_params(verbose=False)  # predict's bar is the CLI's own, over rows


def prediction_frame(args: argparse.Namespace, est, outputs, target_dtype=None):
    """The predictions of one chunk (outputs as tabfm.predict_stream.outputs_of gives them) as a DataFrame: the
    target column (a classifier's label is its most probable class, in the train target's type when that is
    numeric: an integer target's labels are written as integers, not text), then proba_CLASS columns with --proba."""
    import polars as pl

    if not hasattr(est, "classes_"):
        return pl.DataFrame({args.target: outputs[:, 0]})
    labels = pl.Series(args.target, est.classes_[outputs.argmax(1)])
    if target_dtype is not None and target_dtype.is_numeric():
        labels = labels.cast(target_dtype)
    if not args.proba:
        return pl.DataFrame([labels])
    return pl.DataFrame([labels, *(pl.Series(f"proba_{c}", outputs[:, i]) for i, c in enumerate(est.classes_))])


def _fail(message: str) -> int:
    print(f"tabfm predict: error: {message}", file=sys.stderr)
    return 2


def _predict(args: argparse.Namespace) -> int:
    from tabfm import table_write
    from tabfm.launch import run_torchrun, worker_argv

    members = 1 if args.n_estimators == "auto" else args.n_estimators
    for flag, value in (("--nproc", args.nproc), ("--n-estimators", members),
                        ("--batch-size", args.batch_size), ("--batch-rows", args.batch_rows),
                        ("--data-parallel", args.data_parallel)):
        if value < 1:
            return _fail(f"{flag} must be at least 1, got {value}")
    if args.local_context_rows < 0 or args.local_context_rows == 1:
        return _fail(f"--local-context-rows must be 0 (one context) or at least 2, got {args.local_context_rows}")
    if args.n_jobs is not None and args.n_jobs < 1 and args.n_jobs != -1:
        return _fail(f"--n-jobs must be at least 1, or -1 for every core, got {args.n_jobs}")
    if args.nproc > 1 and args.data_parallel > 1:
        return _fail(f"--nproc {args.nproc} splits the model, --data-parallel {args.data_parallel} the test rows; "
                     "choose one")
    if args.layout is not None and args.layout[0] * args.layout[1] != args.nproc:
        return _fail(f"--layout {args.layout[0]}x{args.layout[1]} needs --nproc {args.layout[0] * args.layout[1]}")
    if args.checkpoint is not None and not Path(args.checkpoint).exists():  # else found after reading and fitting
        return _fail(f"--checkpoint {args.checkpoint} does not exist; give a merged .safetensors file or a checkpoint "
                     "folder (`tabfm ckpt merge RUN_DIR -o model.safetensors`), or leave --checkpoint out for the "
                     "shipped model")
    try:  # before any work, and before torchrun starts processes
        table_write.check_output(args.output, (args.train, args.test), args.overwrite)
        if args.nproc == 1 and args.data_parallel == 1:
            return run_prediction(args)
    except (ValueError, TypeError, MemoryError) as e:  # MemoryError: tabfm.cache_memory's refusal of a fit
        return _fail(str(e))
    # --nproc stays with the launcher (each rank takes its share from torchrun's environment); --data-parallel
    # goes to the ranks too: it tells them to split the rows rather than the model.
    nproc = max(args.nproc, args.data_parallel)
    return run_torchrun(__name__, worker_argv(worker_parser(), args, skip=("nproc",)), nproc)


def worker_parser() -> argparse.ArgumentParser:
    """The parser each torchrun rank reads its arguments with: the same options as `tabfm predict`."""
    parser = argparse.ArgumentParser(prog="tabfm predict (worker)")
    _add_arguments(parser)
    return parser


def worker_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of each torchrun process: join the process group, predict, leave."""
    import torch.distributed as dist

    from tabfm.parallel.process_group import process_group

    args = worker_parser().parse_args(argv)
    with process_group(args.device):
        try:
            return run_prediction(args)
        except (ValueError, TypeError) as e:
            if not dist.is_initialized() or dist.get_rank() == 0:
                _fail(str(e))
            return 2


if __name__ == "__main__":
    try:
        sys.exit(worker_main())
    except KeyboardInterrupt:  # a rank under torchrun on Ctrl-C: the launcher says it once, no traceback per rank
        sys.exit(130)
