"""Releasing the heap's free memory between forwards (tabfm.heap_release) against keeping it (as before), side by
side in one run: the resident memory of a fitted estimator predicting many rows in chunks, as `tabfm predict`
streams a large test table, and the time it takes.

    python benchmarks/heap_release.py [--train 1000] [--chunks 10] [--chunk-rows 10000] [--n-estimators 4]
                                      [--n-jobs 2] [--txt FILE]

Each side runs in a fresh process (peak resident memory is per process): fit the classifier on TRAIN rows x 20
numeric features (benchmarks/inference.make_data), then predict_proba CHUNKS chunks of CHUNK_ROWS rows, recording
the resident set after each chunk. The reference sets tabfm.heap_release.FREE_HEAP_LIMIT to None (never
release). The two sides' probabilities must agree exactly (releasing memory changes no arithmetic).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GIB = 1 << 30


def one_side(args: argparse.Namespace, release: bool) -> dict:
    """Run in the child process: fit, predict the chunks, report times and memory (and a digest of the outputs)."""
    import numpy as np

    sys.path.insert(0, str(HERE))
    from inference import make_data

    import tabfm.heap_release
    from tabfm import TabFMClassifier
    from tabfm.heap_release import resident_bytes

    if not release:
        tabfm.heap_release.FREE_HEAP_LIMIT = None
    n_test = args.chunks * args.chunk_rows
    X_train, y_train, X_test, _ = make_data(args.train, n_test)
    start = time.perf_counter()
    est = TabFMClassifier(n_estimators=args.n_estimators, n_jobs=args.n_jobs, random_state=0).fit(X_train, y_train)
    fit_s = time.perf_counter() - start
    after_fit = resident_bytes()
    start = time.perf_counter()
    resident, sums = [], []
    for i in range(args.chunks):
        proba = est.predict_proba(X_test[i * args.chunk_rows:(i + 1) * args.chunk_rows])
        resident.append(resident_bytes())
        sums.append(float(np.sum(proba * np.arange(1, proba.shape[1] + 1))))
    return {"fit_s": fit_s, "predict_s": time.perf_counter() - start, "after_fit": after_fit, "resident": resident,
            "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "digest": sums}


def run_side(args: argparse.Namespace, release: bool) -> dict:
    """One side in a fresh interpreter."""
    argv = [sys.executable, __file__, "--child", "release" if release else "keep", "--train", str(args.train),
            "--chunks", str(args.chunks), "--chunk-rows", str(args.chunk_rows), "--n-estimators",
            str(args.n_estimators), "--n-jobs", str(args.n_jobs)]
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def report(args: argparse.Namespace, keep: dict, release: dict) -> str:
    import tabfm.heap_release

    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    limit = tabfm.heap_release.FREE_HEAP_LIMIT >> 20
    lines = [f"# heap released past {limit} MiB of growth vs kept; TabFMClassifier(n_estimators={args.n_estimators}, "
             f"n_jobs={args.n_jobs}), {args.train} train rows, {args.chunks} x {args.chunk_rows} test rows x 20 "
             f"features; {platform.machine()}, {os.cpu_count()} CPUs, load average {load}",
             f"{'side':8s} {'fit s':>7s} {'predict s':>10s} {'after fit GiB':>14s} {'last GiB':>9s} {'peak GiB':>9s}"]
    for name, side in (("kept", keep), ("released", release)):
        lines.append(f"{name:8s} {side['fit_s']:7.2f} {side['predict_s']:10.2f} {side['after_fit'] / GIB:14.3f} "
                     f"{side['resident'][-1] / GIB:9.3f} {side['peak'] / GIB:9.3f}")
    lines.append("resident GiB after each chunk:")
    for name, side in (("kept", keep), ("released", release)):
        lines.append(f"  {name:8s} " + " ".join(f"{r / GIB:.2f}" for r in side["resident"]))
    same = keep["digest"] == release["digest"]
    lines.append(f"peak: released / kept = {release['peak'] / keep['peak']:.2f}x; predict time released / kept = "
                 f"{release['predict_s'] / keep['predict_s']:.2f}x; probabilities identical: {same}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", type=int, default=1000)
    p.add_argument("--chunks", type=int, default=10)
    p.add_argument("--chunk-rows", type=int, default=10_000)
    p.add_argument("--n-estimators", type=int, default=4)
    p.add_argument("--n-jobs", type=int, default=2)
    p.add_argument("--txt", type=Path, default=None, help="also write the table here")
    p.add_argument("--child", choices=["keep", "release"], default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        print(json.dumps(one_side(args, args.child == "release")))
        return
    keep, release = run_side(args, False), run_side(args, True)
    text = report(args, keep, release)
    print(text)
    if args.txt is not None:
        args.txt.parent.mkdir(parents=True, exist_ok=True)
        args.txt.write_text(text + "\n")


if __name__ == "__main__":
    main()
