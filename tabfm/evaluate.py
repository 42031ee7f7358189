"""Periodic evaluation of the model being pretrained on a few real classification tables (benchmarks/datasets).

For each table (Parquet + JSON sidecar: feature_columns, categorical_columns, target, classes, fold_ids) the rows
of fold 0 are test rows and all other rows are train (context) rows, subsampled deterministically to at most
`max_train_rows`. The table becomes the model's Batch through tabfm.data.encode, like a table of the prior:

    numeric columns      raw values (the model normalises with train rows), nulls / NaN -> missing
    categorical columns  codes of the train rows' categories sorted as strings; a category no train row has
                         (and a null) is a missing cell
    labels               class ids: positions in the sidecar's `classes`

`evaluate(model, tables, mesh)` runs one forward per table. The model may be tensor-parallel: every rank of the
mesh must call it together (data-parallel replicas other than the first skip the forward); only global rank 0
computes the metrics (ROC-AUC, one-vs-rest macro for multiclass; log-loss; accuracy, from the probabilities of the
table's classes) and gets them back, other ranks get None. Nothing here touches the training RNG streams or the
batches: the forward runs under no_grad in eval mode inside a forked RNG state.

These tables are for evaluation only: never pretrain on them.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import torch
import torch.distributed as dist

from tabfm.data.encode import Batch, encode_tables
from tabfm.data.tables import TARGET, ColumnInfo, Table, TableMeta
from tabfm.model import ModelConfig, TabFM
from tabfm.parallel.mesh import TPMesh

DATASETS_DIR = Path(__file__).resolve().parent.parent / "benchmarks" / "datasets"
DEFAULT_TABLES = ("skl_iris", "skl_breast_cancer", "penguins_species", "mass_crabs_species", "skl_wine")
"""Small classification tables (a few hundred rows, up to 30 features, 2-3 classes): a forward each is cheap."""

TEST_FOLD = 0


@dataclass(frozen=True)
class EvalTable:
    """One real table ready for the model: a Batch of one table (train rows first) and the test labels."""

    name: str
    batch: Batch
    y_test: np.ndarray
    """[n_test] class ids of the test rows."""
    n_classes: int
    n_train: int


def _read(name: str, datasets_dir: Path) -> tuple[pl.DataFrame, dict[str, Any]]:
    meta_path, data_path = datasets_dir / f"{name}.json", datasets_dir / f"{name}.parquet"
    if not meta_path.is_file() or not data_path.is_file():
        raise FileNotFoundError(f"no table {name!r} in {datasets_dir} (need {name}.json and {name}.parquet)")
    return pl.read_parquet(data_path), json.loads(meta_path.read_text())


def load_table(name: str, max_train_rows: int = 512, datasets_dir: str | Path = DATASETS_DIR,
               model_cfg: ModelConfig | None = None) -> EvalTable | str:
    """The table as an EvalTable, or a note (a string) saying why it is skipped."""
    try:
        df, meta = _read(name, Path(datasets_dir))
    except FileNotFoundError as e:
        return str(e)
    if meta["task"] not in ("binary", "multiclass"):
        return f"{name}: task {meta['task']!r}; evaluation covers classification only"
    classes = [str(c) for c in meta["classes"]]
    features = list(meta["feature_columns"])
    if model_cfg is not None and len(classes) > model_cfg.max_classes:
        return f"{name}: {len(classes)} classes > model.max_classes={model_cfg.max_classes}"
    if model_cfg is not None and len(features) > model_cfg.max_columns:
        return f"{name}: {len(features)} features > model.max_columns={model_cfg.max_columns}"

    folds = np.asarray(meta["fold_ids"])
    y_raw = df.get_column(meta["target"]).cast(pl.String)
    class_id = {c: i for i, c in enumerate(classes)}
    labels = np.array([class_id.get(v, -1) if v is not None else -1 for v in y_raw.to_list()], np.int64)
    keep = labels >= 0                                              # rows whose label is one of the classes
    train_idx = np.flatnonzero(keep & (folds != TEST_FOLD))
    test_idx = np.flatnonzero(keep & (folds == TEST_FOLD))
    if len(train_idx) > max_train_rows:                             # deterministic per table name
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        train_idx = np.sort(rng.choice(train_idx, size=max_train_rows, replace=False))
    if len(train_idx) == 0 or len(test_idx) == 0:
        return f"{name}: no train or no test rows"
    order = np.concatenate([train_idx, test_idx])
    n_train = len(train_idx)

    categorical = set(meta.get("categorical_columns", []))
    columns, infos = [], []
    for c in features:
        s = df.get_column(c)[order]
        if c in categorical:
            values = s.cast(pl.String).to_list()
            seen = {v for v in values[:n_train] if v is not None}
            # Categories of the train rows only: a test-row category they lack becomes a missing cell, so the
            # codes encode_tables gives (categories sorted as strings) are those of the train rows.
            s = pl.Series(c, [v if v in seen else None for v in values], dtype=pl.String)
            kind = "categorical"
        else:
            s = s.cast(pl.Float64)
            kind = "numeric"
        columns.append(s.alias(c))
        infos.append(ColumnInfo(c, kind, "signal", "none"))
    y = labels[order]
    table_df = pl.DataFrame([*columns, pl.Series(TARGET, y, dtype=pl.Int64)])
    tmeta = TableMeta(prior="real:" + name, hparams={}, task="classification", n_classes=len(classes),
                      label_mode="real", n_train=n_train, columns=tuple(infos))
    batch = encode_tables([Table(table_df, tmeta)])
    return EvalTable(name=name, batch=batch, y_test=y[n_train:], n_classes=len(classes), n_train=n_train)


def load_tables(names: Sequence[str], max_train_rows: int = 512, datasets_dir: str | Path = DATASETS_DIR,
                model_cfg: ModelConfig | None = None) -> tuple[list[EvalTable], list[str]]:
    """(tables that can be evaluated, notes on the ones skipped)."""
    tables, notes = [], []
    for name in names:
        t = load_table(name, max_train_rows, datasets_dir, model_cfg)
        (notes if isinstance(t, str) else tables).append(t)
    return tables, notes


def table_metrics(y: np.ndarray, proba: np.ndarray) -> dict[str, float]:
    """ROC-AUC (one-vs-rest macro when multiclass), log-loss and accuracy of class probabilities [n, k]."""
    from sklearn.metrics import accuracy_score, log_loss, roc_auc_score  # seconds to import: only when evaluating

    k = proba.shape[1]
    labels = list(range(k))
    try:
        if k == 2:
            auc = roc_auc_score(y, proba[:, 1])
        else:
            auc = roc_auc_score(y, proba, multi_class="ovr", average="macro", labels=labels)
    except ValueError:  # a class missing from the test rows
        auc = math.nan
    return {"roc_auc": float(auc), "log_loss": float(log_loss(y, proba, labels=labels)),
            "accuracy": float(accuracy_score(y, proba.argmax(1)))}


@torch.no_grad()
def evaluate(model: TabFM, tables: Sequence[EvalTable], mesh: TPMesh | None = None) -> dict[str, Any] | None:
    """Metrics per table and their means (global rank 0), None elsewhere. Call on every rank of the mesh."""
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if mesh is not None and mesh.dp_axis.index != 0:
        return None  # the first replica's mesh holds the same weights; the others have nothing to add
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    per_table: dict[str, dict[str, float]] = {}
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for t in tables:
                logits = model(t.batch.to(device))[0, t.n_train:t.n_train + len(t.y_test), :t.n_classes]
                if rank0:
                    proba = logits.double().softmax(-1).cpu().numpy()
                    per_table[t.name] = table_metrics(t.y_test, proba)
    finally:
        model.train(was_training)
    if not rank0:
        return None
    out: dict[str, Any] = {}
    for key in ("roc_auc", "log_loss", "accuracy"):
        vals = [m[key] for m in per_table.values()]
        out[f"mean_{key}"] = float(np.mean(vals)) if vals else math.nan
    out["tables"] = per_table
    return out
