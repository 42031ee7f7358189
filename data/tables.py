"""A prior's sample -> a polars DataFrame with mixed column types and missing cells, plus its metadata.

The DataFrame holds the feature columns in order, then the label column `target`; rows are train rows first,
then test rows. Everything the loader needs besides the cells is in `TableMeta`, which is JSON-able, so a table
written to Parquet + JSON and read back encodes to the very same tensors.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import polars as pl

from tabfm.data import columns as col
from tabfm.data.config import TableConfig
from tabfm.data.priors.base import Prior
from tabfm.data.targets import draw_label_plan, draw_task, make_labels, split_order

TARGET = "target"
"""Name of the label column, always last."""


@dataclass(frozen=True)
class ColumnInfo:
    """What one feature column is (see columns.KINDS, ROLES, MISSING)."""

    name: str
    kind: str
    """"numeric", "skewed", "heavy_tailed", "integer" or "categorical"; the loader encodes only the last as codes."""
    role: str
    """"signal", "irrelevant", "constant" or "duplicate"."""
    missing: str
    """"none", "mcar" or "value"."""


@dataclass(frozen=True)
class TableMeta:
    """Per-table metadata: where the table came from and how to read it."""

    prior: str
    """Prior family that drew the latent table ("scm", "mlp", "trees")."""
    hparams: dict[str, Any]
    """The prior's hyperparameters drawn for this table."""
    task: str
    """"classification" or "regression"."""
    n_classes: int
    """Classes present (labels are 0..n_classes-1); 0 for regression."""
    label_mode: str
    """How labels came from the latent targets: "threshold", "argmax", "linear" or "skewed"."""
    n_train: int
    """Rows 0..n_train-1 are train (context) rows, the rest test rows."""
    columns: tuple[ColumnInfo, ...]
    """The feature columns, in DataFrame order."""

    @property
    def task_kind(self) -> str:
        """"binary", "multiclass" or "regression"."""
        if self.task == "regression":
            return "regression"
        return "binary" if self.n_classes == 2 else "multiclass"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TableMeta:
        return cls(**{**d, "columns": tuple(ColumnInfo(**c) for c in d["columns"])})


@dataclass(frozen=True)
class Table:
    """One synthetic table: the cells and the metadata."""

    df: pl.DataFrame
    meta: TableMeta


def draw_table(
    rng: np.random.Generator, prior: Prior, cfg: TableConfig, max_rows: int, max_features: int, task: str | None = None
) -> Table:
    """A table whose size is drawn within the config's ranges capped at (max_rows, max_features)."""
    n_rows = int(rng.integers(cfg.min_rows, max(cfg.min_rows, max_rows) + 1))
    n_features = int(rng.integers(cfg.min_features, max(cfg.min_features, max_features) + 1))
    return sample_table(rng, prior, cfg, n_rows, n_features, task or draw_task(rng, cfg))


def sample_table(
    rng: np.random.Generator, prior: Prior, cfg: TableConfig, n_rows: int, n_features: int, task: str
) -> Table:
    """A table of exactly n_rows x n_features (+ target) for `task`, drawn from `prior` and made messy."""
    roles = [col.draw_role(rng, cfg) for _ in range(n_features)]
    if "signal" not in roles:
        roles[int(rng.integers(n_features))] = "signal"
    n_signal = roles.count("signal")
    n_classes, label_mode, n_targets = draw_label_plan(rng, cfg, task)
    sample = prior.sample(rng, n_rows, n_signal, n_targets)
    labels, n_classes = make_labels(rng, sample.y, n_classes, label_mode, cfg)
    order, n_train = split_order(rng, labels, n_classes, cfg)
    x, labels = sample.x[order], labels[order]

    has_missing = rng.random() < cfg.missing_table_prob
    series: list[pl.Series | None] = [None] * n_features
    infos: list[ColumnInfo | None] = [None] * n_features
    signal = iter(range(n_signal))
    for j, role in enumerate(roles):
        if role == "duplicate":
            continue
        name, kind = f"f{j}", col.draw_kind(rng, cfg)
        if role == "constant":
            values, how, z = col.constant_values(rng, n_rows, kind), "none", None
        else:
            z = x[:, next(signal)] if role == "signal" else col.noise_latent(rng, n_rows)
            values, how = col.render(rng, z, kind, cfg.max_categories), col.draw_missing(rng, cfg, has_missing)
        mask = col.missing_mask(rng, z, how, cfg.max_missing_rate) if z is not None else np.zeros(n_rows, bool)
        series[j], infos[j] = col.to_series(name, values, kind, mask), ColumnInfo(name, kind, role, how)
    sources = [j for j, role in enumerate(roles) if role != "duplicate"]
    for j, role in enumerate(roles):
        if role == "duplicate":
            src = sources[int(rng.integers(len(sources)))]
            series[j] = series[src].alias(f"f{j}")
            infos[j] = replace(infos[src], name=f"f{j}", role="duplicate")

    target = pl.Series(TARGET, labels, dtype=pl.Float64 if task == "regression" else pl.Int64)
    meta = TableMeta(
        prior=sample.prior,
        hparams=_jsonable(sample.hparams),
        task=task,
        n_classes=n_classes,
        label_mode=label_mode,
        n_train=n_train,
        columns=tuple(infos),
    )
    return Table(df=pl.DataFrame([*series, target]), meta=meta)


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    """The dict as it reads back from JSON (tuples become lists, numpy scalars Python ones)."""
    return json.loads(json.dumps(d, default=lambda o: o.item() if hasattr(o, "item") else str(o)))
