"""The report of benchmarks/accuracy.py: summary tables, targets, per-table rows and notes, and its accuracy.csv
written and read back (--reuse-baselines, --report-only, benchmarks/gpu_state.py's comparisons).

Kept apart from accuracy.py (loading tables, fitting the models, the command line) so that the report can be read,
changed and rerun (`accuracy.py --report-only CSV`) without touching the fitting; it imports nothing of the models.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from scipy.stats import rankdata

if TYPE_CHECKING:  # the tables are read (duck-typed) here, loaded in accuracy.py
    from accuracy import RealTable

REG_REFERENCE = {"dev": "ridge", "suite2": "hgb"}
"""The regression baseline each suite's R^2 target is judged against (the issue's targets)."""
MANY_CLASSES = 5
"""Tables with at least this many classes are also summarised on their own (many_class_lines)."""

MODELS = ("tabfm", "logreg", "ridge", "rf", "hgb", "knn")
CLASSIFIERS = ("tabfm", "logreg", "rf", "hgb", "knn")
REGRESSORS = ("tabfm", "ridge", "rf", "hgb", "knn")
CLS_METRICS = ("roc_auc", "accuracy", "log_loss")
REG_METRICS = ("r2", "rmse", "cover80")


@dataclass
class Result:
    """One model on one table: metrics per fold, seconds, the first error and warnings seen."""

    metrics: dict[str, list[float]] = field(default_factory=dict)
    seconds: float = 0.0
    error: str | None = None
    n_failed_folds: int = 0
    warnings: set[str] = field(default_factory=set)

    def mean(self, key: str) -> float:
        """The mean over the folds that scored (a failed fold's NaN is left out, counted in n_failed_folds)."""
        vals = [v for v in self.metrics.get(key, []) if not math.isnan(v)]
        return float(np.mean(vals)) if vals else math.nan


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
    """The mean over tables of a model's fold means, and on how many tables it scored (the summary shows both,
    so a model that failed somewhere is not silently averaged over fewer tables)."""
    vals = [r[model].mean(key) for r in per_table.values()]
    vals = [v for v in vals if not math.isnan(v)]
    return (float(np.mean(vals)) if vals else math.nan), len(vals)


def _f(v: float, digits: int = 4) -> str:
    """A metric as the report prints it ("n/a" for a model that did not score; accuracy.py's curve uses it too)."""
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
            means[f"{m}/r2"] = r2
            secs = sum(r[m].seconds for r in reg.values())
            lines.append(f"| {m} | {_f(r2)} | {_f(rmse, 3)} | {_f(rank[m], 2)} | {n}/{len(reg)} | {secs:.1f} |")
        cover, n_cover = _mean_over_tables({k: v for k, v in reg.items() if "tabfm" in v}, "tabfm", "cover80")
        if n_cover:
            lines += ["", f"tabfm's 80% predictive interval (quantiles 0.1 and 0.9) holds {cover:.1%} of the test "
                      f"targets (mean over {n_cover} tables; nominal 80%)"]
        lines.append("")
    return lines, means


def per_table_lines(tables: dict[str, RealTable], per_table: dict[str, dict[str, Result]],
                    models: list[str]) -> list[str]:
    """One row per table and metric (ROC-AUC and log-loss, or R^2 and RMSE), one column per model, with the
    table's profile (rows, features, categorical / missing share, classes, target skew) and ours minus the best
    baseline on the first metric."""
    lines = ["| table | suite | task | rows | feats | cat | miss | K | skew | metric | " + " | ".join(models)
             + " | ours - best |", "|---" * (11 + len(models)) + "|"]
    for name, results in per_table.items():
        t = tables[name]
        pr = t.profile()
        keys = ("roc_auc", "log_loss") if t.is_classification else ("r2", "rmse")
        for key in keys:
            cells = [_f(results[m].mean(key), 4 if key != "rmse" else 3) if m in results else "" for m in models]
            gap = ""
            if key in ("roc_auc", "r2") and "tabfm" in results:
                others = [results[m].mean(key) for m in models if m != "tabfm" and m in results]
                others = [v for v in others if not math.isnan(v)]
                if others:
                    gap = f"{results['tabfm'].mean(key) - max(others):+.4f}"
            lines.append(f"| {name} | {t.suite} | {t.task} | {pr['rows']} | {pr['features']} | {pr['cat_share']:.2f} | "
                         f"{pr['missing']:.2f} | {pr['classes'] or ''} | {pr['skew']:.2f} | {key} | "
                         + " | ".join(cells) + f" | {gap} |")
    return lines


def target_lines(means: dict[str, float], cls_models: list[str], reg_models: list[str],
                 reg_reference: str) -> list[str]:
    """The three targets, judged honestly ("met" / "missed"; "n/a" when a model needed is not in the run)."""
    if "tabfm" not in cls_models + reg_models:
        return ["targets: n/a (tabfm not in --models)"]
    out = []
    ours_auc, ours_ll = means.get("tabfm/roc_auc", math.nan), means.get("tabfm/log_loss", math.nan)
    baselines = [m for m in cls_models if m != "tabfm" and not math.isnan(means.get(f"{m}/roc_auc", math.nan))]
    if baselines and not math.isnan(ours_auc):
        best = max(baselines, key=lambda m: means[f"{m}/roc_auc"])
        b = means[f"{best}/roc_auc"]
        verdict = "met" if ours_auc >= b else "missed"
        out.append(f"target 1, mean ROC-AUC >= best baseline's: tabfm {_f(ours_auc)} vs {best} {_f(b)} "
                   f"({ours_auc - b:+.4f}): {verdict}")
    else:
        out.append("target 1, mean ROC-AUC >= best baseline's: n/a (no classification baseline in the run)")
    if not math.isnan(means.get("logreg/log_loss", math.nan)) and not math.isnan(ours_ll):
        lr = means["logreg/log_loss"]
        verdict = "met" if ours_ll <= lr else "missed"
        out.append(f"target 2, mean log-loss <= logistic regression's: tabfm {_f(ours_ll)} vs logreg {_f(lr)} "
                   f"({ours_ll - lr:+.4f}): {verdict}")
    else:
        out.append("target 2, mean log-loss <= logistic regression's: n/a (logreg not in the run)")
    ours_r2, ref_r2 = means.get("tabfm/r2", math.nan), means.get(f"{reg_reference}/r2", math.nan)
    if not math.isnan(ours_r2) and not math.isnan(ref_r2):
        verdict = "met" if ours_r2 >= ref_r2 else "missed"
        out.append(f"target 3, mean R^2 >= {reg_reference}'s: tabfm {_f(ours_r2)} vs {reg_reference} {_f(ref_r2)} "
                   f"({ours_r2 - ref_r2:+.4f}): {verdict}")
    else:
        out.append(f"target 3, mean R^2 >= {reg_reference}'s: n/a (a model needed is not in the run)")
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
        w.writerow(["dataset", "suite", "task", "model", "n_rows", "n_features", "n_classes", "n_folds",
                    "roc_auc_mean", "accuracy_mean", "log_loss_mean", "r2_mean", "rmse_mean", "cover80_mean",
                    "seconds", "failed_folds", "error"])
        for name, results in per_table.items():
            t = tables[name]
            for m, r in results.items():
                vals = [r.mean(k) if k in r.metrics else math.nan for k in (*CLS_METRICS, *REG_METRICS)]
                w.writerow([name, t.suite, t.task, m, len(t.y), t.X.width, len(t.classes) or "", n_folds,
                            *("" if math.isnan(v) else f"{v:.5f}" for v in vals), f"{r.seconds:.2f}",
                            r.n_failed_folds, r.error or ""])


def read_baselines(paths: list[Path], names: list[str], n_folds: int,
                   with_tabfm: bool = False) -> dict[str, dict[str, Result]]:
    """The baselines' per-table means from earlier runs' accuracy.csv files or the suites' stored
    baselines.csv (5 folds; tabfm's rows are skipped unless with_tabfm), as Results of one value per metric;
    refused when a file scored other folds than this run."""
    out: dict[str, dict[str, Result]] = {}
    for path in paths:
        with path.open() as fh:
            for row in csv.DictReader(fh):
                if (row["model"] == "tabfm" and not with_tabfm) or row["dataset"] not in names:
                    continue
                folds = int(row.get("n_folds") or 5)
                if folds != n_folds:
                    raise SystemExit(f"{path}: {row['dataset']} was scored on {folds} folds, this run on {n_folds}; "
                                     f"refit the baselines or pass --folds {folds}")
                seconds = float(row.get("seconds") or 0.0) or float(row.get("fit_predict_s_mean") or 0.0) * folds
                res = Result(seconds=seconds, error=row.get("error") or None,
                             n_failed_folds=int(row.get("failed_folds") or 0))
                for key in (*CLS_METRICS, *REG_METRICS):
                    if row.get(f"{key}_mean"):
                        res.metrics[key] = [float(row[f"{key}_mean"])]
                out.setdefault(row["dataset"], {})[row["model"]] = res
    return out


def report(tables: dict[str, RealTable], per_table: dict[str, dict[str, Result]], models: list[str],
           suites: list[str]) -> list[str]:
    """Summary and targets per suite, then for all suites together when there are several."""
    lines: list[str] = []
    groups = [(s, [n for n in per_table if tables[n].suite == s]) for s in suites]
    if len(suites) > 1:
        groups.append(("+".join(suites), list(per_table)))
    for label, names in groups:
        if not names:
            continue
        cls = {n: per_table[n] for n in names if tables[n].is_classification}
        reg = {n: per_table[n] for n in names if not tables[n].is_classification}
        cls_models = [m for m in CLASSIFIERS if m in models]
        reg_models = [m for m in REGRESSORS if m in models]
        summary, means = summary_tables(cls, reg, cls_models, reg_models)
        reference = REG_REFERENCE.get(label, "hgb")
        lines += [f"## Suite {label} ({len(names)} tables)", "", *summary,
                  *target_lines(means, cls_models, reg_models, reference), ""]
    many = {n: r for n, r in per_table.items() if len(tables[n].classes) >= MANY_CLASSES}
    if many:
        lines += many_class_lines(many, tables, [m for m in CLASSIFIERS if m in models])
    return lines


def many_class_lines(many: dict[str, dict[str, Result]], tables: dict[str, RealTable],
                     models: list[str]) -> list[str]:
    """Tables of MANY_CLASSES or more classes on their own (over all suites): where the model was weakest against
    logistic regression's log-loss (issue 13), each table's log-loss and the means of log-loss and ROC-AUC."""
    lines = [f"## Tables of {MANY_CLASSES} or more classes ({len(many)}, all suites): log-loss", "",
             "| table | K | rows | " + " | ".join(models) + " |", "|---|---|---|" + "---|" * len(models)]
    for name, results in sorted(many.items(), key=lambda kv: len(tables[kv[0]].classes)):
        vals = [_f(results[m].mean("log_loss"), 3) if m in results else "n/a" for m in models]
        lines.append(f"| {name} | {len(tables[name].classes)} | {len(tables[name].y)} | " + " | ".join(vals) + " |")
    for key, label in (("log_loss", "mean log-loss"), ("roc_auc", "mean ROC-AUC")):
        vals = [_f(_mean_over_tables({n: r for n, r in many.items() if m in r}, m, key)[0]) for m in models]
        lines.append(f"| {label} | | | " + " | ".join(vals) + " |")
    return [*lines, ""]
