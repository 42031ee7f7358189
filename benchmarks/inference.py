"""In-context inference speed and memory of TabFMClassifier (shipped model, CPU, float32) on this machine, and its
precision: fp32 against bf16 autocast, on CPU and on a GPU.

    python benchmarks/inference.py [--estimators 1,4] [--repeats 3] [--sizes 1000,5000,10000,25000]
                                   [--with-100k] [--txt runs/benchmarks/inference.txt]
                                   [--png runs/benchmarks/inference_memory.png]
    python benchmarks/inference.py --long-contexts 10000,25000   [--txt runs/benchmarks/inference_long.txt]
    python benchmarks/inference.py --precision-compare [--device cpu] [--repeats 1]
    python benchmarks/inference.py --gpu-table [--device cuda] [--budget-s 90] [--txt ...]   (benchmarks/gpu_recipe.sh)

Speed: fit + predict_proba of 1,000 train x 1,000 test rows x 20 numeric features (make_classification,
seed 0), best of --repeats after one warm-up per setting, for each n_estimators of --estimators and the
default, the default without the classifier's second-context mixture (mix_contexts=False) and without its trees
(tree_blend=False), and the default with
one global context per member (local_context_rows=None, the default before local contexts) as the reference, with
the ratios. Target: the default estimator's fit + predict under 1 s. Reference
("no cache"): per context, its train rows followed by the test rows it predicts (first or, mixed, second) as one
table, run through one full model forward, i.e. what every prediction would cost without the cached keys/values;
its probabilities are checked against predict_proba. Then the default's first fit + predict in a fresh process
(what a script that fits once pays: the model's load included) and the process's start-up. Then the default (n_jobs=1) saved and loaded: the load's
seconds and one row's predict (target: under 50 ms).

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

Precision (--precision-compare; only this section runs): the default TabFMClassifier and TabFMRegressor at 1,000 x
1,000 x 20, precision="fp32" beside precision="bf16" (torch.autocast to bfloat16, float32 weights;
tabfm.inference_precision) in one run: fit and predict times, accuracy / R^2, the keys/values cache, and the
largest and mean difference of the probabilities (classifier) or predictions over std(y) (regressor).

GPU table (--gpu-table; only this section runs): the default classifier's fit + predict_proba at 1k x 1k x 20,
10k x 10k x 100 and 50k x 1k x 100 on --device (cuda), fp32 and bf16, each size in a fresh process (--gpu-one) so
an out-of-memory error or a crash costs one row; with peak device memory, the bf16 probabilities' difference to
fp32 and, for the first size, the attention kernels a bf16 predict ran (torch.profiler). Rows are printed as they
come; no size starts after --budget-s.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import make_classification, make_regression

import tabfm.chunked
from tabfm.data.encode import IGNORE_LABEL
from tabfm.ensemble import auto_members
from tabfm.estimator import TabFMClassifier
from tabfm.out_paths import benchmark_output, check_png, check_text_output

if str(Path(__file__).resolve().parent) not in sys.path:  # run as a script, or loaded by a test from its path
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402

GIB = 1 << 30
FEATURES = 20
TARGET_SECONDS = 1.0
TARGET_BYTES = 8 * GIB
TARGET_ROWS = 100_000
TARGET_FIT_SECONDS = 600.0
ONE_ROW_TARGET_S = 0.05


class Log:
    """print() that also keeps the lines, to write them to the results file."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)


def make_data(n_train: int, n_test: int, seed: int = 0, features: int = FEATURES,
              task: str = "classification") -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(X_train, y_train, X_test, y_test): a binary make_classification task with `features` numeric columns (10
    informative, 5 redundant), or with task="regression" a make_regression one (10 informative, noise 10)."""
    informative = min(10, features)
    if task == "regression":
        X, y = make_regression(n_samples=n_train + n_test, n_features=features, n_informative=informative, noise=10.0,
                               random_state=seed)
    else:
        X, y = make_classification(n_samples=n_train + n_test, n_features=features, n_informative=informative,
                                   n_redundant=min(5, features - informative), random_state=seed)
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


CONTEXTS = {"local": {}, "unmixed": {"mix_contexts": False}, "notrees": {"tree_blend": False},
            "global": {"local_context_rows": None}}
"""The speed table's settings: local contexts (the default: a row near an edge mixed from two), local with
one context per row (mix_contexts=False), the default without the trees (tree_blend=False), one context of all
train rows per member (the reference)."""


def time_estimator(n_estimators: int, data: tuple, repeats: int, calibrate: bool,
                   context: str = "local") -> tuple[Speed, TabFMClassifier]:
    """Fit + predict_proba, best total of `repeats` after one warm-up; the fitted estimator of the last run.
    context: a key of CONTEXTS."""
    X_train, y_train, X_test, y_test = data
    extra = CONTEXTS[context]
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
    predicts (all of them, or with local contexts those routed to it, first or second; n_train = the context's
    rows), preprocessed exactly as the fitted estimator does it, the two contexts of a row mixed as it mixes them."""
    model = est._model()
    test = est.preprocessor_.transform(X_test)
    n_train, n_test = est.context_rows_.shape[1], len(test.values)
    routes = [None] if est.local_ is None else est.local_.routes(test)
    outputs = []
    passes = routes[:2] if est._mixes_contexts() else routes[:1]
    for i, route in enumerate(passes):
        logp = np.zeros((est.n_members_, n_test, est.n_groups_))
        for u, m in enumerate(est.context_members_):
            wanted = True if i == 0 else routes[2][m] > 0  # the second pass: only the rows the estimator mixes
            rows = np.arange(n_test) if route is None else np.flatnonzero((route[m] == u) & wanted)
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
        outputs.append(logp)
    logp = outputs[0] if len(outputs) == 1 else est._mix_contexts(*outputs, routes[2], routes[0], routes[1])[0]
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
    data = make_data(1000, 1000)
    default = auto_members(len(data[0]))  # what n_estimators="auto" (the default) gives these train rows
    log(f"speed: 1,000 train x 1,000 test rows x {FEATURES} numeric features, batch_size "
        f"{TabFMClassifier().batch_size}; best of {repeats} after a warm-up (default n_estimators = {default})")
    log(f"{'n_est':>5} {'cal':>3} {'context':>7} {'fit s':>7} {'predict s':>9} {'total s':>8} {'acc':>6} | "
        f"{'no-cache fwd s':>14} {'/predict':>8} {'/total':>7} {'max|dp|':>8}")
    totals: dict[tuple[int, bool, str], float] = {}
    settings = [(n, c, "local") for n in sorted(set(estimators) | {default}) for c in (True, False)]
    settings += [(default, True, "unmixed"), (default, True, "notrees")]
    settings += [(default, c, "global") for c in (True, False)]  # the reference: one global context per member
    for n, calibrate, context in settings:
        speed, est = time_estimator(n, data, repeats, calibrate, context)
        full_s, diff = time_full_forward(est, data[2], repeats)
        totals[n, calibrate, context] = speed.total_s
        mark = " (default)" if n == default and calibrate and context == "local" else ""
        log(f"{n:>5} {'yes' if calibrate else 'no':>3} {context:>7} {speed.fit_s:>7.3f} "
            f"{speed.predict_s:>9.3f} {speed.total_s:>8.3f} {speed.accuracy:>6.3f} | {full_s:>14.3f} "
            f"{full_s / speed.predict_s:>7.2f}x {full_s / speed.total_s:>6.2f}x {diff:>8.1e}{mark}")
    log("no-cache fwd = one full forward per context of its train rows then the test rows it predicts (with local")
    log("contexts, those routed to it) incl. the test rows' preprocessing; /predict = what each predict call saves with the cache,")
    log("/total = against fit + predict (one predict per fit: the cache pays off from the second predict on);")
    log("max|dp| = largest difference between its probabilities and predict_proba's; cal = calibrate (the")
    log("classifier's temperature fitted on held-out train rows at fit: about half of one more context encoding);")
    log("unmixed = local contexts with mix_contexts=False (each row predicted from one context per member, not a")
    log("row near an edge from two); notrees = tree_blend=False (no gradient-boosted trees fitted and weighed in).")
    ratio = totals[default, True, "local"] / totals[default, True, "unmixed"]
    log(f"default n_estimators, calibrate=True: the default / mix_contexts=False = {ratio:.2f}x the time")
    ratio = totals[default, True, "local"] / totals[default, True, "notrees"]
    log(f"default n_estimators, calibrate=True: the default / tree_blend=False = {ratio:.2f}x the time")
    for calibrate in (True, False):
        ratio = totals[default, calibrate, "global"] / totals[default, calibrate, "local"]
        log(f"default n_estimators, calibrate={calibrate}: global contexts / local contexts = {ratio:.2f}x the time")
    for calibrate in (True, False):
        total = totals[default, calibrate, "local"]
        log(f"target: 1,000-row case (default n_estimators={default}, calibrate={calibrate}) under "
            f"{TARGET_SECONDS:g} s on this machine: {'MET' if total < TARGET_SECONDS else 'MISSED'} ({total:.3f} s)")
    first_call_line(log, totals[default, True, "local"])
    one_row_after_load(log, data, totals[default, True, "local"])


def one_row_after_load(log: Log, data: tuple, fit_predict_s: float, repeats: int = 20) -> None:
    """The default estimator (n_jobs=1, as a server answering single rows would run it) fitted on the speed
    table's train rows, saved and loaded: the load's seconds, then the median of `repeats` one-row predictions
    after a warm-up, against the default's fit + predict (fit_predict_s)."""
    import tempfile

    X_train, y_train, X_test, _ = data
    est = TabFMClassifier(n_jobs=1).fit(X_train, y_train)
    with tempfile.TemporaryDirectory() as folder:
        est.save(Path(folder) / "est")
        t0 = time.perf_counter()
        loaded = TabFMClassifier.load(Path(folder) / "est")
        load_s = time.perf_counter() - t0
    loaded.predict_proba(X_test[:1])
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        loaded.predict_proba(X_test[i + 1:i + 2])
        times.append(time.perf_counter() - t0)
    one_s = float(np.median(times))
    refit = " (the trees read from trees.skops)" if loaded.tree_model_ is not None else ""
    log(f"after save and load (n_jobs=1): load {load_s:.3f} s{refit}, one row predicted in "
        f"{1e3 * one_s:.1f} ms (median of {repeats}), {fit_predict_s / one_s:.0f}x faster than the default's fit + "
        f"predict")
    log(f"target: one row predicted by a loaded estimator under {1e3 * ONE_ROW_TARGET_S:g} ms: "
        f"{'MET' if one_s < ONE_ROW_TARGET_S else 'MISSED'} ({1e3 * one_s:.1f} ms)")


def first_call() -> dict:
    """Run in a fresh process (--first-call): the default estimator's first fit and predict_proba on the speed
    table's data, the seconds a script that fits once pays (the model's load and first-call setup included)."""
    X_train, y_train, X_test, _ = make_data(1000, 1000)
    t0 = time.perf_counter()
    est = TabFMClassifier().fit(X_train, y_train)
    t1 = time.perf_counter()
    est.predict_proba(X_test)
    return {"fit_s": t1 - t0, "predict_s": time.perf_counter() - t1}


def first_call_line(log: Log, warm_s: float) -> None:
    """The default's first fit + predict in a fresh process, and the process's start-up (interpreter and imports:
    the wall time less the fit and predict), against the warm fit + predict (warm_s)."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--first-call"], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"--first-call failed ({done.returncode}):\n{done.stderr[-3000:]}")
    first = json.loads(done.stdout.strip().splitlines()[-1])
    log(f"first call in a fresh process (the default): fit {first['fit_s']:.3f} s + predict {first['predict_s']:.3f} s "
        f"= {first['fit_s'] + first['predict_s']:.3f} s ({(first['fit_s'] + first['predict_s']) / warm_s:.2f}x the "
        f"warm {warm_s:.3f} s); start-up (interpreter, imports) {wall - first['fit_s'] - first['predict_s']:.2f} s")


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


# -- precision: fp32 against bf16 autocast, and the GPU table ------------------------------------------------

GPU_SIZES = ((1000, 1000, 20), (50_000, 1000, 100), (10_000, 10_000, 100))
"""(train rows, test rows, features) of --gpu-table (issue 15), 50k before 10k: a lease's budget ran out before
the 50k row (the one with a target: under 10 s) once, when it came last."""
PRECISIONS = ("fp32", "bf16")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_precision(task: str, data: tuple, precision: str, device: torch.device, repeats: int) -> dict:
    """Fit + predict of the default estimator (TabFMClassifier, or TabFMRegressor for task="regression") at one
    precision after a small warm-up fit: best total of `repeats`; its outputs (probabilities or predictions), its
    score (accuracy or R^2), the keys/values cache and, on CUDA, the peak device memory."""
    from tabfm.regressor import TabFMRegressor

    Est = TabFMRegressor if task == "regression" else TabFMClassifier
    X_train, y_train, X_test, y_test = data
    warm = make_data(200, 50, seed=1, features=X_train.shape[1], task=task)
    Est(device=str(device), precision=precision).fit(warm[0], warm[1]).predict(warm[2])  # load, first kernels
    best = None
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        est = Est(device=str(device), precision=precision)
        t0 = time.perf_counter()
        est.fit(X_train, y_train)
        sync(device)
        t1 = time.perf_counter()
        out = est.predict(X_test) if task == "regression" else est.predict_proba(X_test)
        t2 = time.perf_counter()
        if best is None or t2 - t0 < best["fit_s"] + best["predict_s"]:
            if task == "regression":
                score = 1 - ((out - y_test) ** 2).sum() / ((y_test - y_test.mean()) ** 2).sum()
            else:
                score = (est.classes_[out.argmax(1)] == y_test).mean()
            best = {"fit_s": t1 - t0, "predict_s": t2 - t1, "out": out, "score": float(score),
                    "cache": sum(c.nbytes() for _, c in est.contexts_),
                    "peak": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}
    return best


def precision_rows(log: Log, task: str, data: tuple, device: torch.device, repeats: int) -> dict:
    """fp32 and bf16 side by side for one table: a row each, then their difference; the runs by precision."""
    runs = {p: run_precision(task, data, p, device, repeats) for p in PRECISIONS}
    scale = 1.0 if task == "classification" else float(np.std(data[3]))
    diff = np.abs(runs["fp32"]["out"] - runs["bf16"]["out"]) / scale
    for p, r in runs.items():
        peak = "" if r["peak"] is None else f" {r['peak'] / GIB:>8.2f}"
        log(f"{task[:5]:>5} {p:>5} {r['fit_s']:>8.3f} {r['predict_s']:>9.3f} {r['fit_s'] + r['predict_s']:>8.3f} "
            f"{r['score']:>7.4f} {r['cache'] / (1 << 20):>9.1f}{peak}")
    total = {p: r["fit_s"] + r["predict_s"] for p, r in runs.items()}
    if task == "classification":
        same = np.mean(runs["fp32"]["out"].argmax(1) == runs["bf16"]["out"].argmax(1))
        what, extra = "|dp|", f"; same predicted class {same:.4f}"
    else:
        what, extra = "|d pred| / std(y)", ""
    log(f"{'':>5} bf16 against fp32: max {what} {diff.max():.2e}, mean {diff.mean():.2e}{extra}; "
        f"time fp32 / bf16 = {total['fp32'] / total['bf16']:.2f}x")
    return runs


def precision_header(log: Log, device: torch.device) -> None:
    peak = f" {'peak GiB':>8}" if device.type == "cuda" else ""
    log(f"{'task':>5} {'prec':>5} {'fit s':>8} {'predict s':>9} {'total s':>8} {'score':>7} {'kv MiB':>9}{peak}")


def precision_section(log: Log, device: torch.device, repeats: int) -> None:
    """--precision-compare: the default classifier and regressor at 1,000 x 1,000 x 20, fp32 against bf16."""
    log(f"precision: default TabFMClassifier / TabFMRegressor on {device}, 1,000 train x 1,000 test rows x "
        f"{FEATURES} features (make_classification / make_regression, seed 0), fp32 and precision='bf16' "
        f"(torch.autocast, float32 weights); best of {repeats} after a warm-up; score = accuracy / R^2")
    precision_header(log, device)
    for task in ("classification", "regression"):
        precision_rows(log, task, make_data(1000, 1000, task=task), device, repeats)


def attention_kernels(device: torch.device) -> str:
    """The CUDA kernels of one bf16 predict whose names say attention (flash / memory-efficient / math)."""
    from torch.profiler import ProfilerActivity, profile

    X, y, X_test, _ = make_data(300, 100)
    est = TabFMClassifier(n_estimators=1, device=str(device), precision="bf16").fit(X, y)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        est.predict_proba(X_test)
    names = {e.key for e in prof.key_averages() if any(w in e.key.lower() for w in ("flash", "fmha", "attention",
                                                                                     "efficient"))}
    return ", ".join(sorted(names)[:4]) or "none named attention"


def gpu_one(n_train: int, n_test: int, features: int, device: torch.device) -> dict:
    """Run in a fresh process (--gpu-one): the default classifier's fit + predict at fp32 and bf16 on `device`;
    an out-of-memory run is reported as such and the other still runs."""
    data = make_data(n_train, n_test, features=features)
    out: dict = {"size": [n_train, n_test, features],
                 "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)}
    probs = {}
    for p in PRECISIONS:
        try:
            r = run_precision("classification", data, p, device, repeats=2 if n_train <= 1000 else 1)
        except torch.cuda.OutOfMemoryError as e:
            out[p] = {"error": f"out of memory ({str(e).splitlines()[0][:80]})"}
            continue
        probs[p] = r.pop("out")
        out[p] = r
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if len(probs) == 2:
        d = np.abs(probs["fp32"] - probs["bf16"])
        out["max_dp"], out["mean_dp"] = float(d.max()), float(d.mean())
        out["same_argmax"] = float(np.mean(probs["fp32"].argmax(1) == probs["bf16"].argmax(1)))
    if n_train <= 1000 and device.type == "cuda":
        try:
            out["kernels"] = attention_kernels(device)
        except Exception as e:  # the profiler is a nicety: never lose the table for it
            out["kernels"] = f"profiler failed: {type(e).__name__}"
    return out


def gpu_table_section(log: Log, device: str, budget_s: float, sizes: tuple = GPU_SIZES) -> None:
    """--gpu-table: each (train, test, features) of `sizes` in a fresh process (an OOM or a crash costs one row);
    no size starts after budget_s, and a running one is stopped there."""
    log(f"GPU table: default TabFMClassifier (n_estimators=4, calibrated, local contexts) on {device}, fit + "
        "predict_proba, fp32 (IEEE float32 matmuls) and precision='bf16' (autocast, float32 weights); each size in "
        "a fresh process after a warm-up fit; 1,000-row case best of 2")
    log(f"{'train':>7} {'test':>6} {'feat':>4} {'prec':>5} {'fit s':>8} {'predict s':>9} {'total s':>8} {'acc':>6} "
        f"{'kv GiB':>7} {'peak GiB':>8} {'max|dp|':>8} {'mean|dp|':>8}")
    end, named = time.perf_counter() + budget_s, set()
    for n_train, n_test, features in sizes:
        left = end - time.perf_counter()
        head = f"{n_train:>7} {n_test:>6} {features:>4}"
        if left < 5:
            log(f"{head}  skipped: the {budget_s:g} s budget is spent")
            continue
        cmd = [sys.executable, __file__, "--gpu-one", f"{n_train},{n_test},{features}", "--device", device]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired:
            log(f"{head}  stopped after {left:.0f} s (the budget's end)")
            continue
        if done.returncode != 0:
            log(f"{head}  failed (exit {done.returncode}): {(done.stderr.strip().splitlines() or ['?'])[-1][:100]}")
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        if r.get("device_name") not in named:
            named.add(r.get("device_name"))
            log(f"{'':>7} device: {r.get('device_name')}")
        for p in PRECISIONS:
            x = r[p]
            if "error" in x:
                log(f"{head} {p:>5}  {x['error']}")
                continue
            dp = f" {r['max_dp']:>8.1e} {r['mean_dp']:>8.1e}" if p == "bf16" and "max_dp" in r else ""
            peak = x["peak"] / GIB if x["peak"] is not None else float("nan")
            log(f"{head} {p:>5} {x['fit_s']:>8.3f} {x['predict_s']:>9.3f} {x['fit_s'] + x['predict_s']:>8.3f} "
                f"{x['score']:>6.3f} {x['cache'] / GIB:>7.3f} {peak:>8.2f}{dp}")
        if "kernels" in r:
            log(f"{'':>7} bf16 attention kernels: {r['kernels']}")


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


def _parser() -> argparse.ArgumentParser:
    """The command line (apart from main so that main reads as the run, under the project's function length)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--estimators", default="1,4", help="n_estimators to time (the default is always added)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per speed setting (best is kept)")
    p.add_argument("--sizes", default="1000,5000,10000,25000", help="context rows for the memory runs")
    p.add_argument("--with-100k", action="store_true", help="also run the 100,000-row context (about a minute)")
    p.add_argument("--test-rows", type=int, default=100, help="test rows predicted in each memory run")
    p.add_argument("--skip-speed", action="store_true", help="only the memory runs")
    p.add_argument("--skip-memory", action="store_true", help="only the speed runs")
    p.add_argument("--txt", type=Path, default=None,
                   help=f"results text (default {benchmark_output('inference.txt')}; inference_long.txt with "
                        "--long-contexts, inference_precision.txt with --precision-compare, inference_gpu.txt with "
                        "--gpu-table)")
    p.add_argument("--png", type=Path, default=benchmark_output("inference_memory.png"), help="memory plot")
    p.add_argument("--long-contexts", default=None, metavar="ROWS,ROWS",
                   help="only the long-context runs at these context sizes, e.g. 10000,25000 (one pass and chunked)")
    p.add_argument("--precision-compare", action="store_true",
                   help="only fp32 against precision='bf16' (autocast) at 1,000 x 1,000 x 20, classifier and regressor")
    p.add_argument("--gpu-table", action="store_true",
                   help="only the GPU table: fit + predict at 1k x 1k x 20, 10k x 10k x 100, 50k x 1k x 100, fp32 and "
                   "bf16, each size in a fresh process (prints as it goes; --txt is written at the end)")
    p.add_argument("--device", default=None, help="device of --precision-compare (cpu) and --gpu-table (cuda)")
    p.add_argument("--budget-s", type=float, default=540.0, help="--gpu-table stops starting sizes after this")
    p.add_argument("--gpu-sizes", default=None, metavar="TRAINxTESTxFEATURES,...",
                   help="the --gpu-table sizes (default 1000x1000x20,10000x10000x100,50000x1000x100)")
    p.add_argument("--gpu-one", default=None, help=argparse.SUPPRESS)  # internal: one size of the GPU table
    p.add_argument("--first-call", action="store_true", help=argparse.SUPPRESS)  # internal: a fresh process
    p.add_argument("--one-size", type=int, default=None, help=argparse.SUPPRESS)  # internal: one memory point
    p.add_argument("--long", action="store_true", help=argparse.SUPPRESS)  # internal: with LONG_PARAMS
    p.add_argument("--row-chunk", type=int, default=None, help=argparse.SUPPRESS)  # internal: 0 = one pass
    p.add_argument("--global-context", action="store_true", help=argparse.SUPPRESS)  # internal: no local contexts
    return p


def _counts(p: argparse.ArgumentParser, flag: str, text: str, what: str, example: str) -> list[int]:
    """A flag's comma-separated counts of 1 or more, or one line naming it (int() had been a traceback)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        p.error(f"{flag} takes comma-separated {what} of 1 or more such as {example}, got {text!r}")
    return values


def _check_outputs(p: argparse.ArgumentParser, args: argparse.Namespace, memory: bool) -> None:
    """--repeats, --test-rows and where --txt (and --png, when the memory runs draw it) are written, checked before
    the minutes of timing that had gone before a traceback on them."""
    for flag, value in (("--repeats", args.repeats), ("--test-rows", args.test_rows)):
        if value < 1:
            p.error(f"{flag} {value}: give 1 or more")
    try:
        check_text_output(args.txt, "--txt", "the results text")
        if memory:
            check_png(args.png, "--png")
    except ValueError as e:
        p.error(str(e))


def main() -> None:
    """One fresh-process point (--gpu-one, --one-size) as JSON, or the sections asked for, logged to --txt."""
    p = _parser()
    args = p.parse_args()

    if args.gpu_one is not None:
        n_train, n_test, features = (int(v) for v in args.gpu_one.split(","))
        print(json.dumps(gpu_one(n_train, n_test, features, torch.device(args.device or "cuda"))))
        return
    if args.first_call:
        print(json.dumps(first_call()))
        return
    if args.one_size is not None:
        if args.row_chunk is not None:
            tabfm.chunked.ROW_CHUNK = args.row_chunk or sys.maxsize
        params = {**(LONG_PARAMS if args.long else {}), **({"local_context_rows": None} if args.global_context else {})}
        print(json.dumps(one_size(args.one_size, args.test_rows, **params)))
        return
    long_sizes = (_counts(p, "--long-contexts", args.long_contexts, "row counts", "10000,25000")
                  if args.long_contexts else [])
    mode = "_long" if long_sizes else "_precision" if args.precision_compare else "_gpu" if args.gpu_table else ""
    args.txt = args.txt or benchmark_output(f"inference{mode}.txt")
    sizes = _counts(p, "--sizes", args.sizes, "row counts", "1000,5000")
    estimators = _counts(p, "--estimators", args.estimators, "n_estimators", "1,4")
    _check_outputs(p, args, memory=not (mode or args.skip_memory))
    if args.with_100k and TARGET_ROWS not in sizes:
        sizes.append(TARGET_ROWS)
    log = Log()
    start = time.perf_counter()
    log(f"# benchmarks/inference.py: {machine.describe()}, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), float32, shipped model")
    log(f"# load average at start {' '.join(f'{v:.2f}' for v in os.getloadavg())} "
        "(shared machine: absolute numbers move with the load)\n")
    if long_sizes:
        long_context_section(log, long_sizes, args.test_rows)
        args.skip_speed = args.skip_memory = True
    if args.precision_compare:
        precision_section(log, torch.device(args.device or "cpu"), args.repeats)
        args.skip_speed = args.skip_memory = True
    if args.gpu_table:
        sizes = tuple(tuple(int(v) for v in size.split("x")) if re.fullmatch(r"\d+x\d+x\d+", size) else ()
                      for size in args.gpu_sizes.split(",")) if args.gpu_sizes else GPU_SIZES
        if not all(sizes):
            p.error(f"--gpu-sizes takes sizes such as 1000x1000x20,50000x1000x100, got {args.gpu_sizes!r}")
        gpu_table_section(log, args.device or "cuda", args.budget_s, sizes)
        args.skip_speed = args.skip_memory = True
    if not args.skip_speed:
        speed_section(log, estimators, args.repeats)
        log()
    if not args.skip_memory:
        memory_section(log, sizes, args.test_rows, args.png)
    log(f"\n# total wall time {time.perf_counter() - start:.0f} s; load average at end "
        f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    args.txt.parent.mkdir(parents=True, exist_ok=True)
    args.txt.write_text("\n".join(log.lines) + "\n")


if __name__ == "__main__":
    main()
