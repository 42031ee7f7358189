"""Table threads (tabfm.table_threads) against the same forwards in sequence with torch's intra-op threads, side by
side in one run: fit and predict times of the default estimators on this machine's CPU, and how far the
predictions moved (float rounding of batched matmuls only).

    python benchmarks/table_threads.py [--sizes 1000x1000,5000x1000] [--repeats 3] [--n-jobs N]
                                       [--txt FILE]

Each row: one estimator setting at TRAIN x TEST rows x 20 numeric features (make_classification /
make_regression, seed 0, as benchmarks/inference.py), best total of --repeats after one warm-up, sequential
(`sequential_tables()`) and threaded alternating so a drift of the machine's speed hits both alike.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from inference import Log, make_data  # noqa: E402

from tabfm import TabFMClassifier, TabFMRegressor  # noqa: E402
from tabfm.table_threads import sequential_tables  # noqa: E402

SETTINGS = {
    "classifier": (TabFMClassifier, {}),
    "classifier-1-member": (TabFMClassifier, {"n_estimators": 1}),
    "classifier-global-contexts": (TabFMClassifier, {"local_context_rows": None}),
    "regressor": (TabFMRegressor, {}),
}


def run_once(Estimator, params: dict, data: tuple) -> tuple[float, float, np.ndarray]:
    """(fit s, predict s, outputs) of one fit + predict."""
    X_train, y_train, X_test, _ = data
    t0 = time.perf_counter()
    est = Estimator(**params).fit(X_train, y_train)
    t1 = time.perf_counter()
    out = est.predict_proba(X_test) if Estimator is TabFMClassifier else est.predict(X_test)
    return t1 - t0, time.perf_counter() - t1, out


def compare(Estimator, params: dict, data: tuple, repeats: int,
            reference: Callable[[], contextlib.AbstractContextManager] = sequential_tables) -> dict:
    """Best (fit, predict) of the reference setting (entered through `reference`) and of the default, alternating
    sides each repeat, and the largest difference of their outputs."""
    best = {"reference": (float("inf"), 0.0), "ours": (float("inf"), 0.0)}
    outs = {}
    with reference():
        run_once(Estimator, params, data)  # warm-up: the model's load and first-call setup
    for _ in range(repeats):
        for side in best:
            with reference() if side == "reference" else contextlib.nullcontext():
                fit_s, pred_s, outs[side] = run_once(Estimator, params, data)
            if fit_s + pred_s < sum(best[side]):
                best[side] = (fit_s, pred_s)
    scale = 1.0 if Estimator is TabFMClassifier else float(np.std(data[1]))
    return {**best, "diff": float(np.abs(outs["ours"] - outs["reference"]).max() / scale)}


def side_by_side(log: Log, args: argparse.Namespace, reference: Callable[[], contextlib.AbstractContextManager],
                 sides: tuple[str, str]) -> None:
    """One row per size and setting of args: the reference's and the default's fit, predict and total, their
    ratio and the largest output difference; `sides` names the two in the header."""
    ref, ours = sides
    log(f"{'setting':30s} {'rows':>11s} | {ref + ' fit':>7s} {'predict':>7s} {'total':>6s} | {ours + ' fit':>7s} "
        f"{'predict':>7s} {'total':>6s} | {'speed-up':>8s}  max |d|")
    for size in args.sizes.split(","):
        n_train, n_test = (int(v) for v in size.split("x"))
        for name in args.settings.split(","):
            Estimator, extra = SETTINGS[name]
            task = "classification" if Estimator is TabFMClassifier else "regression"
            data = make_data(n_train, n_test, task=task)
            r = compare(Estimator, {**extra, "n_jobs": args.n_jobs}, data, args.repeats, reference)
            (rf, rp), (of, op) = r["reference"], r["ours"]
            log(f"{name:30s} {size:>11s} | {rf:7.2f} {rp:7.2f} {rf + rp:6.2f} | {of:7.2f} {op:7.2f} {of + op:6.2f} | "
                f"{(rf + rp) / (of + op):7.2f}x  {r['diff']:.1e}")


def side_by_side_main(argv: list[str] | None, doc: str, sizes: str, repeats: int,
                      title: Callable[[argparse.Namespace], str], reference: Callable[[], contextlib.AbstractContextManager], sides: tuple[str, str]) -> None:
    """The command line of a side-by-side benchmark (this one's, benchmarks/forward_sizes.py's): parse argv,
    print the title line and the table, write it to --txt."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=sizes, help="TRAINxTEST rows, comma separated")
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--n-jobs", type=int, default=None, help="the estimators' n_jobs (default: torch's threads)")
    p.add_argument("--settings", default=",".join(SETTINGS), help="which rows, by name, comma separated")
    p.add_argument("--txt", type=Path, default=None, help="also write the table here")
    args = p.parse_args(argv)
    log = Log()
    log(f"# {title(args)}; torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} CPUs, load average "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}; best of {args.repeats}")
    side_by_side(log, args, reference, sides)
    log("max |d|: classifier probabilities; regressor predictions over std(y)")
    if args.txt:
        args.txt.write_text("\n".join(log.lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    def title(args: argparse.Namespace) -> str:
        threads = args.n_jobs or torch.get_num_threads()
        return (f"table threads: {threads} threads of one intra-op thread vs sequential forwards on {threads} "
                f"intra-op threads")

    side_by_side_main(argv, __doc__, "1000x1000,5000x1000", 3, title, sequential_tables, ("seq", "thr"))


if __name__ == "__main__":
    main()
