"""Accuracy of the pretrained model's scikit-learn estimators against scikit-learn baselines on real tables.

    python benchmarks/accuracy.py [--tables skl_iris,skl_diabetes] [--folds 5] [--n-estimators N]
                                  [--max-context-rows N] [--models tabfm,logreg,ridge,rf,hgb,knn]
                                  [--device cpu] [--out benchmarks/results]

Every table of benchmarks/datasets (Parquet + JSON sidecar) is scored by 5-fold cross-validation on the folds
stored in its sidecar (`fold_ids`: train on the other folds, test on fold k), so every model sees exactly the
same splits. Rows whose target is null are dropped. Models, all fitted on the same rows in this one process
(the scikit-learn baselines with one OpenMP / BLAS thread, tabfm with torch's default threads):

    tabfm    TabFMClassifier / TabFMRegressor (shipped weights, the estimator's defaults unless flags say
             otherwise); it gets the table as it is: string categoricals, nulls
    logreg   LogisticRegression(max_iter=1000): median / most-frequent imputation, StandardScaler, one-hot
    ridge    Ridge (regression), same preprocessing as logreg
    rf       RandomForest (500 trees, random_state 0): imputation, ordinal-encoded categoricals
    hgb      HistGradientBoosting (random_state 0), native categorical support, native missing values
    knn      kNN (k=15), same preprocessing as logreg

Measured per table (mean over the folds): classification ROC-AUC (binary: probability of the second class;
multiclass: one-vs-rest macro over all the sidecar's classes), accuracy and log-loss (labels = all classes);
regression R^2 and RMSE; and fit + predict seconds. Then per model the mean over tables of each metric and the
mean rank (rank of ROC-AUC, or of R^2 for regression, among the models on each table; 1 = best, ties share
the mean rank, a model that failed on a table ranks last there). A baseline that fails on a table is reported,
not fatal. The targets, checked on the last line: tabfm's mean ROC-AUC >= the best baseline's, and tabfm's
mean log-loss <= logistic regression's.

Writes the printed text to OUT/accuracy.txt and per-table, per-model results to OUT/accuracy.csv.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import platform
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
from scipy.stats import rankdata
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

MODELS = ("tabfm", "logreg", "ridge", "rf", "hgb", "knn")
CLASSIFIERS = ("tabfm", "logreg", "rf", "hgb", "knn")
REGRESSORS = ("tabfm", "ridge", "rf", "hgb", "knn")
CLS_METRICS = ("roc_auc", "accuracy", "log_loss")
REG_METRICS = ("r2", "rmse")


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

    @property
    def is_classification(self) -> bool:
        return self.task != "regression"


@dataclass
class Result:
    """One model on one table: metrics per fold, seconds, the first error and warnings seen."""

    metrics: dict[str, list[float]] = field(default_factory=dict)
    seconds: float = 0.0
    error: str | None = None
    n_failed_folds: int = 0
    warnings: set[str] = field(default_factory=set)

    def mean(self, key: str) -> float:
        vals = [v for v in self.metrics.get(key, []) if not math.isnan(v)]
        return float(np.mean(vals)) if vals else math.nan


def load_real_table(name: str) -> RealTable:
    """The table of benchmarks/datasets with its sidecar folds, null targets dropped (the same reading as
    tabfm.evaluate: classes are positions in the sidecar's `classes`)."""
    df, meta = _read(name, DATASETS_DIR)
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
                     folds=folds[keep], classes=classes, n_dropped=int((~keep).sum()))


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


def make_model(model: str, t: RealTable, ours: dict[str, Any]) -> BaseEstimator:
    """A fresh unfitted model for the table's task."""
    n_num, n_cat = t.n_numeric, t.X_np.shape[1] - t.n_numeric
    cat_mask = [False] * n_num + [True] * n_cat
    if model == "tabfm":
        return (TabFMClassifier if t.is_classification else TabFMRegressor)(**ours)
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
                pred = fit_predict(make_model(model, t, ours), model, t, train, test)
            res.warnings.update(f"{w.category.__name__}: {str(w.message).splitlines()[0][:100]}" for w in caught)
            metrics = fold_metrics(t, t.y[test], pred)
        except Exception as e:  # noqa: BLE001 -- a failing model is reported, not fatal
            res.error = res.error or f"fold {k}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            res.n_failed_folds += 1
            metrics = {m: math.nan for m in (CLS_METRICS if t.is_classification else REG_METRICS)}
        res.seconds += time.perf_counter() - start
        for key, v in metrics.items():
            res.metrics.setdefault(key, []).append(v)


def ranks(per_table: dict[str, dict[str, Result]], models: list[str], key: str) -> dict[str, float]:
    """Mean over tables of each model's rank by `key` (higher is better; 1 = best, ties averaged, NaN last)."""
    out: dict[str, list[float]] = {m: [] for m in models}
    for results in per_table.values():
        vals = np.array([results[m].mean(key) for m in models])
        vals = np.where(np.isnan(vals), -np.inf, vals)
        for m, r in zip(models, rankdata(-vals, method="average")):
            out[m].append(float(r))
    return {m: float(np.mean(v)) if v else math.nan for m, v in out.items()}


def _mean_over_tables(per_table: dict[str, dict[str, Result]], model: str, key: str) -> tuple[float, int]:
    vals = [r[model].mean(key) for r in per_table.values()]
    vals = [v for v in vals if not math.isnan(v)]
    return (float(np.mean(vals)) if vals else math.nan), len(vals)


def _f(v: float, digits: int = 4) -> str:
    return "n/a" if math.isnan(v) else f"{v:.{digits}f}"


def summary_tables(cls: dict[str, dict[str, Result]], reg: dict[str, dict[str, Result]], cls_models: list[str],
                   reg_models: list[str]) -> tuple[list[str], dict[str, float]]:
    """The markdown summary tables (lines) and the means the targets are judged on."""
    lines: list[str] = []
    means: dict[str, float] = {}
    if cls:
        rank = ranks(cls, cls_models, "roc_auc")
        lines += [f"Classification ({len(cls)} tables; mean over tables of the per-table fold means)", "",
                  "| model | mean ROC-AUC | mean accuracy | mean log-loss | mean rank (ROC-AUC) | tables | seconds |",
                  "|---|---|---|---|---|---|---|"]
        for m in cls_models:
            auc, n = _mean_over_tables(cls, m, "roc_auc")
            acc, _ = _mean_over_tables(cls, m, "accuracy")
            ll, _ = _mean_over_tables(cls, m, "log_loss")
            means[f"{m}/roc_auc"], means[f"{m}/log_loss"] = auc, ll
            secs = sum(r[m].seconds for r in cls.values())
            lines.append(f"| {m} | {_f(auc)} | {_f(acc)} | {_f(ll)} | {_f(rank[m], 2)} | {n}/{len(cls)} | {secs:.1f} |")
        lines.append("")
    if reg:
        rank = ranks(reg, reg_models, "r2")
        lines += [f"Regression ({len(reg)} tables)", "",
                  "| model | mean R^2 | mean RMSE | mean rank (R^2) | tables | seconds |", "|---|---|---|---|---|---|"]
        for m in reg_models:
            r2, n = _mean_over_tables(reg, m, "r2")
            rmse, _ = _mean_over_tables(reg, m, "rmse")
            secs = sum(r[m].seconds for r in reg.values())
            lines.append(f"| {m} | {_f(r2)} | {_f(rmse, 3)} | {_f(rank[m], 2)} | {n}/{len(reg)} | {secs:.1f} |")
        lines.append("")
    return lines, means


def per_table_lines(tables: dict[str, RealTable], per_table: dict[str, dict[str, Result]],
                    models: list[str]) -> list[str]:
    """One row per table and metric (ROC-AUC and log-loss, or R^2 and RMSE), one column per model."""
    lines = ["| table | task | rows | metric | " + " | ".join(models) + " |", "|---" * (4 + len(models)) + "|"]
    for name, results in per_table.items():
        t = tables[name]
        keys = ("roc_auc", "log_loss") if t.is_classification else ("r2", "rmse")
        for key in keys:
            cells = [_f(results[m].mean(key), 4 if key != "rmse" else 3) if m in results else "" for m in models]
            lines.append(f"| {name} | {t.task} | {len(t.y)} | {key} | " + " | ".join(cells) + " |")
    return lines


def target_lines(means: dict[str, float], cls_models: list[str]) -> list[str]:
    """The two targets, judged honestly ("met" / "missed"; "n/a" when a model needed is not in the run)."""
    if "tabfm" not in cls_models:
        return ["targets: n/a (tabfm not in --models)"]
    out = []
    baselines = [m for m in cls_models if m != "tabfm" and not math.isnan(means.get(f"{m}/roc_auc", math.nan))]
    ours_auc, ours_ll = means["tabfm/roc_auc"], means["tabfm/log_loss"]
    if baselines:
        best = max(baselines, key=lambda m: means[f"{m}/roc_auc"])
        b = means[f"{best}/roc_auc"]
        verdict = "met" if ours_auc >= b else "missed"
        out.append(f"target 1, mean ROC-AUC >= best baseline's: tabfm {_f(ours_auc)} vs {best} {_f(b)} "
                   f"({ours_auc - b:+.4f}): {verdict}")
    else:
        out.append("target 1, mean ROC-AUC >= best baseline's: n/a (no baseline in the run)")
    if "logreg" in cls_models and not math.isnan(means.get("logreg/log_loss", math.nan)):
        lr = means["logreg/log_loss"]
        verdict = "met" if ours_ll <= lr else "missed"
        out.append(f"target 2, mean log-loss <= logistic regression's: tabfm {_f(ours_ll)} vs logreg {_f(lr)} "
                   f"({ours_ll - lr:+.4f}): {verdict}")
    else:
        out.append("target 2, mean log-loss <= logistic regression's: n/a (logreg not in the run)")
    return out


def notes_lines(per_table: dict[str, dict[str, Result]], tables: dict[str, RealTable]) -> list[str]:
    """Failures (always) and warnings (one line per model and table) the runs raised."""
    lines = []
    for name, results in per_table.items():
        if tables[name].n_dropped:
            lines.append(f"- {name}: {tables[name].n_dropped} rows dropped (null or unknown target)")
        for m, r in results.items():
            if r.error:
                lines.append(f"- FAILED {m} on {name} ({r.n_failed_folds} fold(s)): {r.error}")
            for w in sorted(r.warnings):
                lines.append(f"- warning, {m} on {name}: {w}")
    return lines


def write_csv(path: Path, tables: dict[str, RealTable], per_table: dict[str, dict[str, Result]], n_folds: int) -> None:
    """Per table, per model: the fold-mean metrics, seconds and the first error (columns like baselines.csv)."""
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["dataset", "task", "model", "n_rows", "n_features", "n_classes", "n_folds", "roc_auc_mean",
                    "accuracy_mean", "log_loss_mean", "r2_mean", "rmse_mean", "seconds", "failed_folds", "error"])
        for name, results in per_table.items():
            t = tables[name]
            for m, r in results.items():
                vals = [r.mean(k) if k in r.metrics else math.nan for k in (*CLS_METRICS, *REG_METRICS)]
                w.writerow([name, t.task, m, len(t.y), t.X.width, len(t.classes) or "", n_folds,
                            *("" if math.isnan(v) else f"{v:.5f}" for v in vals), f"{r.seconds:.2f}",
                            r.n_failed_folds, r.error or ""])


def _warm_up(ours: dict[str, Any]) -> None:
    """Load the model once before anything is timed (the estimators share the loaded weights)."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(16, 2))
    TabFMClassifier(**ours).fit(X, np.arange(16) % 2).predict_proba(X)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tables", default=None, help="table names, comma-separated (default: all in benchmarks/datasets)")
    p.add_argument("--folds", type=int, default=5, help="score folds 0..N-1 of the stored 5 folds")
    p.add_argument("--n-estimators", type=int, default=None, help="tabfm ensemble members (default: the estimator's)")
    p.add_argument("--max-context-rows", type=int, default=None,
                   help="tabfm train rows per member (default: the estimator's, all rows)")
    p.add_argument("--device", default=None, help="tabfm device: cpu, cuda, auto (default: the estimator's)")
    p.add_argument("--checkpoint", default=None, help="tabfm weights: merged .safetensors or checkpoint folder "
                   "(default: the shipped model)")
    p.add_argument("--models", default=",".join(MODELS), help=f"subset of {','.join(MODELS)}")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for accuracy.txt / .csv")
    args = p.parse_args()

    start_all = time.perf_counter()
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose from {list(MODELS)}")
    names = (args.tables.split(",") if args.tables else sorted(f.stem for f in DATASETS_DIR.glob("*.json")))
    ours = {k: v for k, v in (("n_estimators", args.n_estimators), ("max_context_rows", args.max_context_rows),
                              ("device", args.device), ("checkpoint", args.checkpoint)) if v is not None}
    if "tabfm" in models:
        _warm_up(ours)
    tables = {n: load_real_table(n) for n in names}
    for t in tables.values():
        if args.folds > len(np.unique(t.folds)) or args.folds < 1:
            p.error(f"--folds {args.folds}: {t.name} has {len(np.unique(t.folds))} folds")
    cls_models = [m for m in CLASSIFIERS if m in models]
    reg_models = [m for m in REGRESSORS if m in models]

    per_table: dict[str, dict[str, Result]] = {}
    jobs = [(n, k) for n in names for k in range(args.folds)]
    for name, k in tqdm(jobs, desc="table x fold", unit="fold", file=sys.stderr):
        t = tables[name]
        run_fold(t, k, cls_models if t.is_classification else reg_models, ours, per_table.setdefault(name, {}))
    elapsed = time.perf_counter() - start_all

    cls = {n: r for n, r in per_table.items() if tables[n].is_classification}
    reg = {n: r for n, r in per_table.items() if not tables[n].is_classification}
    summary, means = summary_tables(cls, reg, cls_models, reg_models)
    est_params = TabFMClassifier(**ours).get_params()
    lines = [
        f"command: python benchmarks/accuracy.py {' '.join(sys.argv[1:])}".rstrip(),
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores; "
        f"folds 0..{args.folds - 1} of the stored 5-fold split; seconds = fit + predict, summed over tables and folds",
        f"tabfm: n_estimators={est_params['n_estimators']}, max_context_rows={est_params['max_context_rows']}, "
        f"device={est_params['device']}, dtype={est_params['dtype']}, random_state={est_params['random_state']}, "
        f"checkpoint={est_params['checkpoint'] or 'shipped (tabfm/weights)'}",
        "", *summary, "Per table (mean over folds)", "",
        *per_table_lines(tables, per_table, [m for m in MODELS if m in models]), "",
        *target_lines(means, cls_models), "",
    ]
    notes = notes_lines(per_table, tables)
    if notes:
        lines += ["Notes", *notes, ""]
    lines.append(f"total runtime: {elapsed:.1f} s")
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "accuracy.txt").write_text(text + "\n")
    write_csv(args.out / "accuracy.csv", tables, per_table, args.folds)
    print(f"\nwritten: {args.out / 'accuracy.txt'}, {args.out / 'accuracy.csv'}")


if __name__ == "__main__":
    main()
