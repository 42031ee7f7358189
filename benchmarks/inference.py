"""In-context inference speed and memory of TabFMClassifier (shipped model, CPU, float32) on this machine.

    python benchmarks/inference.py [--estimators 1,4] [--repeats 3] [--sizes 1000,5000,10000,25000]
                                   [--with-100k] [--txt benchmarks/results/inference.txt]
                                   [--png benchmarks/results/inference_memory.png]
    python benchmarks/inference.py --long-contexts 10000,25000   [--txt benchmarks/results/inference_long.txt]

Speed: fit + predict_proba of 1,000 train x 1,000 test rows x 20 numeric features (make_classification,
seed 0), best of --repeats after one warm-up per setting, for each n_estimators of --estimators and the
default, and the default with one global context per member (local_context_rows=None, the default before local
contexts) as the reference, with the ratio. Target: the default estimator's fit + predict under 1 s. Reference
("no cache"): per context, its train rows followed by the test rows it predicts as one table, run through one full
model forward, i.e. what every prediction would cost without the cached keys/values; its probabilities are
checked against predict_proba.

Memory: for each context size (train rows x 20 features, n_estimators=1), fit + predict_proba of 100 test rows in
a fresh process (`--one-size ROWS`), reporting the peak resident memory (VmHWM), the baseline before the fit
(after a small warm-up fit that loads the model), the keys/values cache size, and the fit / predict times.
Targets: a 100,000-row context within 8 GiB (issue 7) and fit under 10 minutes (issue 15). With local contexts
(the default) fit grows linearly in the rows (100,000 rows: about a minute on 2 cores); the 100,000-row point
runs with --with-100k, otherwise its memory and time are extrapolated (least squares over the sizes >= 5,000
rows) and labelled as such.

Long contexts (--long-contexts 10000,25000,100000): for each size, the fit time and peak resident memory of
TabFMClassifier(n_estimators=1, calibrate=False, n_jobs=2) on that many train rows x 20 features (then predict_proba
of --test-rows rows), each in a fresh process: with local contexts (the default, tabfm.local_context), and up to
GLOBAL_LIMIT rows with one global context (local_context_rows=None) encoded in one pass (--row-chunk 0, the code
before tabfm.chunked) and in chunks of tabfm.chunked.ROW_CHUNK rows; only this section runs when it is given.
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
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import make_classification

import tabfm.chunked
from tabfm.data.encode import IGNORE_LABEL
from tabfm.estimator import TabFMClassifier

GIB = 1 << 30
FEATURES = 20
TARGET_SECONDS = 1.0
TARGET_BYTES = 8 * GIB
TARGET_ROWS = 100_000
TARGET_FIT_SECONDS = 600.0


class Log:
    """print() that also keeps the lines, to write them to the results file."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)


def make_data(n_train: int, n_test: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(X_train, y_train, X_test, y_test): a binary make_classification task with FEATURES numeric columns."""
    X, y = make_classification(n_samples=n_train + n_test, n_features=FEATURES, n_informative=10, n_redundant=5,
                               random_state=seed)
    return X[:n_train], y[:n_train], X[n_train:], y[n_train:]


# -- speed -----------------------------------------------------------------------------------------------------

@dataclass
class Speed:
    fit_s: float
    predict_s: float
    accuracy: float

    @property
    def total_s(self) -> float:
        return self.fit_s + self.predict_s


def time_estimator(n_estimators: int, data: tuple, repeats: int, calibrate: bool,
                   local: bool = True) -> tuple[Speed, TabFMClassifier]:
    """Fit + predict_proba, best total of `repeats` after one warm-up; the fitted estimator of the last run.
    local=False: one context of all train rows per member (local_context_rows=None)."""
    X_train, y_train, X_test, y_test = data
    extra = {} if local else {"local_context_rows": None}
    est = TabFMClassifier(n_estimators=n_estimators, calibrate=calibrate, **extra)
    est.fit(X_train, y_train).predict_proba(X_test)  # warm-up: loads the model, first-call kernel setup
    best: Speed | None = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        est.fit(X_train, y_train)
        t1 = time.perf_counter()
        proba = est.predict_proba(X_test)
        t2 = time.perf_counter()
        run = Speed(t1 - t0, t2 - t1, float((est.classes_[proba.argmax(1)] == y_test).mean()))
        if best is None or run.total_s < best.total_s:
            best = run
    return best, est


@torch.no_grad()
def full_forward_proba(est: TabFMClassifier, X_test: np.ndarray) -> np.ndarray:
    """predict_proba without the cache: per context, one forward of its train rows followed by the test rows it
    predicts (all of them, or with local contexts those routed to it; n_train = the context's rows),
    preprocessed exactly as the fitted estimator does it."""
    model = est._model()
    test = est.preprocessor_.transform(X_test)
    n_train, n_test = est.context_rows_.shape[1], len(test.values)
    route = None if est.local_ is None else est.local_.route(test)
    logp = np.empty((est.n_members_, n_test, est.n_groups_))
    for u, m in enumerate(est.context_members_):
        rows = np.arange(n_test) if route is None else np.flatnonzero(route[m] == u)
        if not len(rows):
            continue
        train = est._unit_values(est.train_cells_, np.array([u]), est.context_rows_[[u]])
        tested = est._unit_values(test, np.array([u]), rows[None])
        parts = {k: torch.cat([train[k], tested[k]], 1) if k in ("values", "missing", "cat_codes") else train[k]
                 for k in train}
        labels = torch.from_numpy(est._member_labels(m, est.y_train_[est.context_rows_[u]]))[None]
        labels = torch.cat([labels, torch.full((1, len(rows)), IGNORE_LABEL)], 1)
        logits = model(est._batch(parts, labels, n_train, est.n_groups_))[0, n_train:].double()
        logp[m, rows] = logits[..., :est.n_groups_].log_softmax(-1).numpy()
    return est._blend(est._combine(logp, est.temperature_), test)  # the same decoding, temperature and blend


def time_full_forward(est: TabFMClassifier, X_test: np.ndarray, repeats: int) -> tuple[float, float]:
    """(best seconds of full_forward_proba after one warm-up, max |difference| to the cached predict_proba)."""
    diff = float(np.abs(full_forward_proba(est, X_test) - est.predict_proba(X_test)).max())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        full_forward_proba(est, X_test)
        times.append(time.perf_counter() - t0)
    return min(times), diff


def speed_section(log: Log, estimators: list[int], repeats: int) -> None:
    default = TabFMClassifier().n_estimators
    data = make_data(1000, 1000)
    log(f"speed: 1,000 train x 1,000 test rows x {FEATURES} numeric features, batch_size "
        f"{TabFMClassifier().batch_size}; best of {repeats} after a warm-up (default n_estimators = {default})")
    log(f"{'n_est':>5} {'cal':>3} {'context':>7} {'fit s':>7} {'predict s':>9} {'total s':>8} {'acc':>6} | "
        f"{'no-cache fwd s':>14} {'/predict':>8} {'/total':>7} {'max|dp|':>8}")
    totals: dict[tuple[int, bool, bool], float] = {}
    settings = [(n, c, True) for n in sorted(set(estimators) | {default}) for c in (True, False)]
    settings += [(default, c, False) for c in (True, False)]  # the reference: one global context per member
    for n, calibrate, local in settings:
        speed, est = time_estimator(n, data, repeats, calibrate, local)
        full_s, diff = time_full_forward(est, data[2], repeats)
        totals[n, calibrate, local] = speed.total_s
        mark = " (default)" if n == default and calibrate and local else ""
        log(f"{n:>5} {'yes' if calibrate else 'no':>3} {'local' if local else 'global':>7} {speed.fit_s:>7.3f} "
            f"{speed.predict_s:>9.3f} {speed.total_s:>8.3f} {speed.accuracy:>6.3f} | {full_s:>14.3f} "
            f"{full_s / speed.predict_s:>7.2f}x {full_s / speed.total_s:>6.2f}x {diff:>8.1e}{mark}")
    log("no-cache fwd = one full forward per context of its train rows then the test rows it predicts (with local")
    log("contexts, those routed to it) incl. the test rows' preprocessing; /predict = what each predict call saves with the cache,")
    log("/total = against fit + predict (one predict per fit: the cache pays off from the second predict on);")
    log("max|dp| = largest difference between its probabilities and predict_proba's; cal = calibrate (the")
    log("classifier's temperature fitted on held-out train rows at fit: about one more context encoding).")
    for calibrate in (True, False):
        ratio = totals[default, calibrate, False] / totals[default, calibrate, True]
        log(f"default n_estimators, calibrate={calibrate}: global contexts / local contexts = {ratio:.2f}x the time")
    for calibrate in (True, False):
        total = totals[default, calibrate, True]
        log(f"target: 1,000-row case (default n_estimators={default}, calibrate={calibrate}) under "
            f"{TARGET_SECONDS:g} s on this machine: {'MET' if total < TARGET_SECONDS else 'MISSED'} ({total:.3f} s)")


# -- memory ----------------------------------------------------------------------------------------------------

def peak_rss() -> int:
    """Peak resident bytes of this process: VmHWM of /proc/self/status on Linux. Not getrusage's ru_maxrss there:
    it survives fork + exec, so a child started by a 1 GiB parent reports at least 1 GiB (measured)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, kilobytes elsewhere
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def one_size(rows: int, test_rows: int, **params) -> dict:
    """Run in a fresh process: fit on `rows` train rows + predict `test_rows` with TabFMClassifier(n_estimators=1,
    **params); memory and times as a dict."""
    warm = make_data(200, 50, seed=1)
    TabFMClassifier(n_estimators=1, **params).fit(warm[0], warm[1]).predict_proba(warm[2])  # loads the model
    X_train, y_train, X_test, _ = make_data(rows, test_rows)
    base = peak_rss()
    est = TabFMClassifier(n_estimators=1, **params)
    t0 = time.perf_counter()
    est.fit(X_train, y_train)
    t1 = time.perf_counter()
    est.predict_proba(X_test)
    t2 = time.perf_counter()
    cache = sum(context.nbytes() for _, context in est.contexts_)
    peak = peak_rss()
    return {"rows": rows, "fit_s": t1 - t0, "predict_s": t2 - t1, "base": base, "peak": peak, "cache": cache}


def measure_size(rows: int, test_rows: int, *extra: str) -> dict:
    cmd = [sys.executable, __file__, "--one-size", str(rows), "--test-rows", str(test_rows), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def fit_poly(x: np.ndarray, y: np.ndarray, powers: tuple[int, ...]) -> np.ndarray:
    """Least-squares coefficients of y = sum_p c_p x^p."""
    return np.linalg.lstsq(np.stack([x ** p for p in powers], 1), y, rcond=None)[0]


def eval_poly(c: np.ndarray, x: np.ndarray | float, powers: tuple[int, ...]) -> np.ndarray:
    return sum(cp * np.asarray(x, float) ** p for cp, p in zip(c, powers, strict=True))


MEM_POWERS, TIME_POWERS = (0, 1), (0, 1)  # local contexts: memory and time linear in the rows


def memory_section(log: Log, sizes: list[int], test_rows: int, png: Path) -> None:
    log(f"memory: context rows x {FEATURES} features, n_estimators=1, fit + predict_proba of {test_rows} test rows, "
        "each size in a fresh process")
    log(f"{'rows':>7} {'fit s':>8} {'predict s':>9} {'base GiB':>8} {'peak GiB':>8} {'peak-base':>9} "
        f"{'kv cache GiB':>12} {'MiB/1k rows':>11}")
    points = []
    for rows in sizes:
        p = measure_size(rows, test_rows)
        points.append(p)
        extra = p["peak"] - p["base"]
        log(f"{rows:>7} {p['fit_s']:>8.2f} {p['predict_s']:>9.3f} {p['base'] / GIB:>8.3f} {p['peak'] / GIB:>8.3f} "
            f"{extra / GIB:>9.3f} {p['cache'] / GIB:>12.3f} {extra / (1 << 20) / (rows / 1000):>11.1f}")
    x = np.array([p["rows"] for p in points], float)
    peak = np.array([p["peak"] for p in points], float)
    total = np.array([p["fit_s"] + p["predict_s"] for p in points], float)
    fitted = x >= min(5000, x.max())  # small sizes are dominated by fixed costs
    mem_c = fit_poly(x[fitted], peak[fitted], MEM_POWERS) if fitted.sum() >= 2 else None
    time_c = fit_poly(x[fitted], total[fitted], TIME_POWERS) if fitted.sum() >= 2 else None
    if mem_c is not None:
        log(f"peak memory ~ {mem_c[0] / GIB:.3f} GiB + {mem_c[1] * 1000 / (1 << 20):.1f} MiB per 1,000 rows "
            f"(least squares over {int(fitted.sum())} sizes >= {int(x[fitted].min())} rows)")
        log(f"time ~ {time_c[0]:.3g} s + {time_c[1] * 1000:.3g} s per 1,000 rows")
    if TARGET_ROWS in x:
        measured = peak[x == TARGET_ROWS][0]
        log(f"target: {TARGET_ROWS:,}-row context within {TARGET_BYTES / GIB:g} GiB: "
            f"{'MET' if measured <= TARGET_BYTES else 'MISSED'} (measured peak {measured / GIB:.2f} GiB)")
        fit_s = points[int(np.flatnonzero(x == TARGET_ROWS)[0])]["fit_s"]
        log(f"target: {TARGET_ROWS:,}-row context fitted within {TARGET_FIT_SECONDS / 60:g} min: "
            f"{'MET' if fit_s <= TARGET_FIT_SECONDS else 'MISSED'} (measured {fit_s:.0f} s)")
    elif mem_c is not None:
        est_peak, est_time = float(eval_poly(mem_c, TARGET_ROWS, MEM_POWERS)), float(eval_poly(time_c, TARGET_ROWS,
                                                                                                TIME_POWERS))
        verdict = "likely met" if est_peak <= TARGET_BYTES else "likely missed"
        log(f"target: {TARGET_ROWS:,}-row context within {TARGET_BYTES / GIB:g} GiB: NOT MEASURED (--with-100k); "
            f"extrapolated peak {est_peak / GIB:.2f} GiB -> {verdict}; extrapolated time {est_time / 60:.0f} min")
    plot(png, x, peak, total, mem_c, time_c)
    log(f"\nplot written to {png}")


# -- long contexts ---------------------------------------------------------------------------------------------

LONG_PARAMS = {"calibrate": False, "n_jobs": 2}
"""TabFMClassifier(n_estimators=1, **LONG_PARAMS) in the long-context runs (issue 15: one context encoding)."""
GLOBAL_LIMIT = 25_000
"""The long-context runs encode one global context only up to this many rows (quadratic: 100,000 took 36 min)."""


def long_context_section(log: Log, sizes: list[int], test_rows: int) -> None:
    """Fit time and peak memory per context size, one pass against row chunks, each run in a fresh process."""
    chunk = tabfm.chunked.ROW_CHUNK
    log(f"long contexts: rows x {FEATURES} features, TabFMClassifier(n_estimators=1, calibrate=False, n_jobs=2), fit "
        f"+ predict_proba of {test_rows} test rows, each run in a fresh process: local contexts (the default), and "
        f"up to {GLOBAL_LIMIT:,} rows one global context encoded in one pass or in chunks of {chunk} rows "
        f"(tabfm.chunked.ROW_CHUNK)")
    log(f"{'rows':>7} {'encoding':>12} {'fit s':>8} {'predict s':>9} {'base GiB':>8} {'peak GiB':>8} "
        f"{'peak-base':>9} {'kv cache GiB':>12}")
    local_rows = TabFMClassifier().local_context_rows
    for rows in sizes:
        runs = [(f"local {local_rows}", ["--long"])]
        if rows <= GLOBAL_LIMIT:
            runs += [(label, ["--long", "--global-context", "--row-chunk", str(row_chunk)])
                     for label, row_chunk in (("one pass", 0), (f"chunks {chunk}", chunk))]
        for label, flags in runs:
            p = measure_size(rows, test_rows, *flags)
            log(f"{rows:>7} {label:>12} {p['fit_s']:>8.2f} {p['predict_s']:>9.3f} {p['base'] / GIB:>8.3f} "
                f"{p['peak'] / GIB:>8.3f} {(p['peak'] - p['base']) / GIB:>9.3f} {p['cache'] / GIB:>12.3f}")


def plot(png: Path, x: np.ndarray, peak: np.ndarray, total: np.ndarray, mem_c: np.ndarray | None,
         time_c: np.ndarray | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_m, ax_t) = plt.subplots(1, 2, figsize=(11, 4.2))
    grid = np.linspace(0, max(TARGET_ROWS, x.max()), 200)
    ax_m.plot(x, peak / GIB, "o-", label="measured peak RSS")
    ax_t.plot(x, total, "o-", label="measured fit + predict")
    if mem_c is not None and x.max() < TARGET_ROWS:
        ax_m.plot(grid, eval_poly(mem_c, grid, MEM_POWERS) / GIB, "--", color="gray", label="linear extrapolation")
        ax_t.plot(grid, eval_poly(time_c, grid, TIME_POWERS), "--", color="gray", label="linear extrapolation")
    ax_m.axhline(TARGET_BYTES / GIB, color="red", lw=1, label="8 GiB target")
    ax_m.set(xlabel="context (train) rows", ylabel="peak resident memory (GiB)", ylim=(0, None),
             title=f"memory: {FEATURES} features, n_estimators=1")
    ax_t.set(xlabel="context (train) rows", ylabel="seconds", title="time: fit + predict of the test rows")
    for ax in (ax_m, ax_t):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--estimators", default="1,4", help="n_estimators to time (the default is always added)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per speed setting (best is kept)")
    p.add_argument("--sizes", default="1000,5000,10000,25000", help="context rows for the memory runs")
    p.add_argument("--with-100k", action="store_true", help="also run the 100,000-row context (about a minute)")
    p.add_argument("--test-rows", type=int, default=100, help="test rows predicted in each memory run")
    p.add_argument("--skip-speed", action="store_true", help="only the memory runs")
    p.add_argument("--skip-memory", action="store_true", help="only the speed runs")
    p.add_argument("--txt", type=Path, default=None,
                   help="results text (default benchmarks/results/inference.txt; inference_long.txt with "
                        "--long-contexts)")
    p.add_argument("--png", type=Path, default=Path("benchmarks/results/inference_memory.png"), help="memory plot")
    p.add_argument("--long-contexts", default=None, metavar="ROWS,ROWS",
                   help="only the long-context runs at these context sizes, e.g. 10000,25000 (one pass and chunked)")
    p.add_argument("--one-size", type=int, default=None, help=argparse.SUPPRESS)  # internal: one memory point
    p.add_argument("--long", action="store_true", help=argparse.SUPPRESS)  # internal: with LONG_PARAMS
    p.add_argument("--row-chunk", type=int, default=None, help=argparse.SUPPRESS)  # internal: 0 = one pass
    p.add_argument("--global-context", action="store_true", help=argparse.SUPPRESS)  # internal: no local contexts
    args = p.parse_args()

    if args.one_size is not None:
        if args.row_chunk is not None:
            tabfm.chunked.ROW_CHUNK = args.row_chunk or sys.maxsize
        params = {**(LONG_PARAMS if args.long else {}), **({"local_context_rows": None} if args.global_context else {})}
        print(json.dumps(one_size(args.one_size, args.test_rows, **params)))
        return
    try:
        long_sizes = [int(s) for s in args.long_contexts.split(",")] if args.long_contexts else []
    except ValueError:
        p.error(f"--long-contexts takes comma-separated row counts such as 10000,25000, got {args.long_contexts!r}")
    args.txt = args.txt or Path(f"benchmarks/results/inference{'_long' if long_sizes else ''}.txt")
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.with_100k and TARGET_ROWS not in sizes:
        sizes.append(TARGET_ROWS)
    log = Log()
    start = time.perf_counter()
    machine = platform.processor() or platform.machine()
    log(f"# benchmarks/inference.py: {machine}, {os.cpu_count()} CPU cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), float32, shipped model")
    log(f"# load average at start {' '.join(f'{v:.2f}' for v in os.getloadavg())} "
        "(shared machine: absolute numbers move with the load)\n")
    if long_sizes:
        long_context_section(log, long_sizes, args.test_rows)
        args.skip_speed = args.skip_memory = True
    if not args.skip_speed:
        speed_section(log, [int(n) for n in args.estimators.split(",")], args.repeats)
        log()
    if not args.skip_memory:
        memory_section(log, sizes, args.test_rows, args.png)
    log(f"\n# total wall time {time.perf_counter() - start:.0f} s; load average at end "
        f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    args.txt.parent.mkdir(parents=True, exist_ok=True)
    args.txt.write_text("\n".join(log.lines) + "\n")


if __name__ == "__main__":
    main()
