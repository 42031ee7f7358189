"""`tabfm predict`: fit on a train table, predict a test table (CSV or Parquet), optionally sharded over processes.

    tabfm predict --train train.csv --target y --test test.csv [-o preds.csv] [--proba]
    tabfm predict ... --nproc 4 --layout 2x2     # torchrun: one context split over 4 processes

With --nproc > 1 the command relaunches itself under torchrun; every rank reads the tables and runs the estimator
with tensor_parallel=(d0, d1) (rows by sequence parallelism, heads by tensor parallelism), and rank 0 writes the
predictions, which equal the one-process ones.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from tabfm._cli_demo import parse_layout

TASKS = ("auto", "classification", "regression")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("predict", help="fit on a train table and predict a test table (CSV or Parquet)")
    _add_arguments(p)
    p.set_defaults(run=_predict)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--train", required=True, help="train table with the target column (.csv or .parquet)")
    p.add_argument("--target", required=True, help="name of the target column")
    p.add_argument("--test", required=True, help="table to predict (.csv or .parquet); a target column is ignored")
    p.add_argument("-o", "--output", help="where to write the predictions (.csv or .parquet; default: stdout)")
    p.add_argument("--proba", action="store_true", help="class probabilities, one column per class")
    p.add_argument("--task", choices=TASKS, default="auto",
                   help="auto: regression for a numeric target with more than 20 distinct non-integer values")
    p.add_argument("--checkpoint", help="merged .safetensors or checkpoint folder (default: the shipped model)")
    p.add_argument("--n-estimators", type=int, default=4, help="ensemble members")
    p.add_argument("--categorical", default="", help="comma-separated columns to treat as categorical")
    p.add_argument("--batch-size", type=int, default=1024, help="test rows per forward")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    p.add_argument("--nproc", type=int, default=1, help="processes (torchrun) to shard the model over")
    p.add_argument("--layout", type=parse_layout, default=None,
                   help="tensor-parallel mesh d0xd1 for --nproc (default: nproc x 1)")
    p.add_argument("--no-sequence-parallel", action="store_true", help="keep rows whole on every rank")


def read_table(path: str):
    """A polars DataFrame from a .csv or .parquet file, with a clear error for anything else."""
    import polars as pl

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{path}: no such file")
    if p.suffix.lower() == ".parquet":
        return pl.read_parquet(p)
    if p.suffix.lower() in (".csv", ".tsv", ".txt"):
        return pl.read_csv(p, separator="\t" if p.suffix.lower() == ".tsv" else ",", infer_schema_length=10_000)
    raise ValueError(f"{path}: unknown table format {p.suffix!r}; use .csv, .tsv or .parquet")


def infer_task(y) -> str:
    """Regression for a numeric target with many distinct non-integer values; classification otherwise."""
    import numpy as np

    if not y.dtype.is_numeric():
        return "classification"
    values = y.drop_nulls().to_numpy().astype(float)
    distinct = np.unique(values)
    return "regression" if len(distinct) > 20 and not np.all(distinct == np.round(distinct)) else "classification"


def run_prediction(args: argparse.Namespace) -> int:
    """Read, fit, predict, write (only rank 0 writes). Runs in every process when sharded."""
    import polars as pl
    import torch.distributed as dist

    from tabfm.estimator import TabFMClassifier, TabFMRegressor

    train, test = read_table(args.train), read_table(args.test)
    if args.target not in train.columns:
        raise ValueError(f"{args.train} has no column {args.target!r}; columns: {', '.join(train.columns)}")
    y = train.get_column(args.target)
    X = train.drop(args.target)
    X_test = test.drop(args.target) if args.target in test.columns else test
    missing_cols = [c for c in X.columns if c not in X_test.columns]
    if missing_cols:
        raise ValueError(f"{args.test} lacks the train table's feature columns {missing_cols}")
    X_test = X_test.select(X.columns)
    task = infer_task(y) if args.task == "auto" else args.task
    if args.proba and task == "regression":
        raise ValueError("--proba is for classification; this target is treated as regression (use --task)")
    tp = None
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        tp = args.layout or (world, 1)
    kwargs = dict(n_estimators=args.n_estimators, checkpoint=args.checkpoint, batch_size=args.batch_size,
                  device=args.device, dtype=args.dtype, tensor_parallel=tp,
                  sequence_parallel=not args.no_sequence_parallel,
                  categorical_features=[c for c in args.categorical.split(",") if c] or "auto", verbose=True)
    est = (TabFMRegressor if task == "regression" else TabFMClassifier)(**kwargs)
    y_values = y.to_numpy() if task == "regression" else y.cast(pl.String).to_numpy()
    est.fit(X, y_values)
    if args.proba:
        proba = est.predict_proba(X_test)
        out = pl.DataFrame({f"proba_{c}": proba[:, i] for i, c in enumerate(est.classes_)})
    else:
        out = pl.DataFrame({args.target: est.predict(X_test)})
    if dist.is_initialized() and dist.get_rank() != 0:
        return 0
    if args.output is None:
        sys.stdout.write(out.write_csv())
    elif Path(args.output).suffix.lower() == ".parquet":
        out.write_parquet(args.output)
    else:
        out.write_csv(args.output)
    if args.output is not None:
        print(f"wrote {out.height} {'probability rows' if args.proba else 'predictions'} ({task}) to {args.output}",
              file=sys.stderr)
    return 0


def _predict(args: argparse.Namespace) -> int:
    if args.nproc < 1:
        print("error: --nproc must be at least 1", file=sys.stderr)
        return 2
    if args.layout is not None and args.layout[0] * args.layout[1] != args.nproc:
        print(f"error: --layout {args.layout[0]}x{args.layout[1]} needs --nproc {args.layout[0] * args.layout[1]}",
              file=sys.stderr)
        return 2
    if args.nproc == 1:
        try:
            return run_prediction(args)
        except (ValueError, TypeError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc), "-m",
           "tabfm._cli_predict", *sys_argv_tail(args)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.call(cmd, env=env)


def sys_argv_tail(args: argparse.Namespace) -> list[str]:
    """The arguments again, for the torchrun workers."""
    out = ["--train", args.train, "--target", args.target, "--test", args.test, "--task", args.task,
           "--n-estimators", str(args.n_estimators), "--batch-size", str(args.batch_size), "--device", args.device,
           "--dtype", args.dtype]  # no --nproc: torchrun would take it for its own --nproc-per-node
    for flag, value in (("--output", args.output), ("--checkpoint", args.checkpoint)):
        if value:
            out += [flag, value]
    if args.categorical:
        out += ["--categorical", args.categorical]
    if args.layout is not None:
        out += ["--layout", f"{args.layout[0]}x{args.layout[1]}"]
    if args.proba:
        out.append("--proba")
    if args.no_sequence_parallel:
        out.append("--no-sequence-parallel")
    return out


def worker_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of each torchrun process: join the process group, predict, leave."""
    import torch
    import torch.distributed as dist

    parser = argparse.ArgumentParser(prog="tabfm predict (worker)")
    _add_arguments(parser)
    args = parser.parse_args(argv)
    backend = "nccl" if args.device != "cpu" and torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    try:
        return run_prediction(args)
    except (ValueError, TypeError) as e:
        if dist.get_rank() == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(worker_main())
