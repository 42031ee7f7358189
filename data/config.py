"""Typed config sections of the data pipeline, one docstring per field; bad values raise ValueError at once.

`DataConfig` is the `data:` section of a run: the loader gets all of it, tables.py only `table`, the priors only
`prior`, so each component sees its own section.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from tabfm.data.priors.mix import PriorConfig

MAX_CLASSES = 10
"""Classes the model's classification head has; tables never have more."""


def _check_range(section: str, lo_name: str, lo: float, hi_name: str, hi: float, floor: float) -> None:
    if lo < floor:
        raise ValueError(f"{section}.{lo_name}={lo} must be >= {floor}")
    if lo > hi:
        raise ValueError(f"{section}.{lo_name}={lo} > {section}.{hi_name}={hi}; make {lo_name} <= {hi_name}")


def _check_prob(section: str, name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{section}.{name}={value} is a probability; set it within [0, 1]")


@dataclass
class TableConfig:
    """Sizes, task and mess of the tables: everything about a table except how its numbers were drawn."""

    min_rows: int = 64
    """Fewest rows (train + test) of a table."""
    max_rows: int = 1024
    """Most rows of a table (the curriculum may cap it lower early in training)."""
    min_features: int = 2
    """Fewest feature columns (the target column is not counted)."""
    max_features: int = 32
    """Most feature columns (the curriculum may cap it lower early in training)."""
    min_train_fraction: float = 0.5
    """Smallest share of a table's rows that are labelled context (train) rows."""
    max_train_fraction: float = 0.9
    """Largest share of train rows; at least one row is always left for test."""
    regression_prob: float = 0.2
    """Chance that a step's tables (or a dumped table) are regression rather than classification."""
    min_classes: int = 2
    """Fewest classes of a classification table (2..10)."""
    max_classes: int = 10
    """Most classes of a classification table (2..10: the model's head size)."""
    binary_prob: float = 0.5
    """Chance that a classification table is binary; otherwise its class count is uniform over the rest."""
    argmax_class_prob: float = 0.5
    """Chance that multiclass labels are the argmax of several latent scores (nominal classes) rather than
    thresholds on one latent (ordered classes, then shuffled)."""
    min_imbalance_alpha: float = 0.5
    """Lower end of the Dirichlet concentration of class proportions (small: strongly imbalanced)."""
    max_imbalance_alpha: float = 20.0
    """Upper end of that concentration (large: nearly balanced)."""
    categorical_prob: float = 0.2
    """Chance that a feature column is categorical (a quantised latent, as strings)."""
    max_categories: int = 50
    """Most categories of a categorical column (at least 2)."""
    skewed_prob: float = 0.15
    """Chance that a numeric column is right-skewed (log-normal-like)."""
    heavy_tailed_prob: float = 0.1
    """Chance that a numeric column is heavy-tailed (sinh-stretched)."""
    integer_prob: float = 0.15
    """Chance that a numeric column holds integers (counts or ordinal levels)."""
    irrelevant_prob: float = 0.1
    """Chance that a column is noise unrelated to everything else."""
    constant_prob: float = 0.03
    """Chance that a column holds one value in every row."""
    duplicate_prob: float = 0.03
    """Chance that a column is an exact copy of another column of the table."""
    missing_table_prob: float = 0.5
    """Chance that a table has missing cells at all."""
    missing_column_prob: float = 0.4
    """In such a table, chance that a column has missing cells."""
    max_missing_rate: float = 0.4
    """Largest share of missing cells in a column (the rate is uniform in (0, this])."""
    value_missing_prob: float = 0.5
    """Chance that a column's missing cells depend on their own value (else missing completely at random)."""

    def __post_init__(self) -> None:
        s = "table"
        _check_range(s, "min_rows", self.min_rows, "max_rows", self.max_rows, floor=4)
        _check_range(s, "min_features", self.min_features, "max_features", self.max_features, floor=1)
        lo, hi = self.min_train_fraction, self.max_train_fraction
        _check_range(s, "min_train_fraction", lo, "max_train_fraction", hi, floor=0.0)
        if self.max_train_fraction >= 1.0 or self.min_train_fraction <= 0.0:
            raise ValueError(f"{s}.min/max_train_fraction must lie in (0, 1): a table needs train and test rows")
        for name in ("min_classes", "max_classes"):
            value = getattr(self, name)
            if not 2 <= value <= MAX_CLASSES:
                raise ValueError(f"{s}.{name}={value} is out of 2..{MAX_CLASSES} (the head's classes); set it within")
        _check_range(s, "min_classes", self.min_classes, "max_classes", self.max_classes, floor=2)
        if self.min_rows < 2 * self.max_classes:
            raise ValueError(
                f"{s}.min_rows={self.min_rows} is too few for {self.max_classes} classes; "
                f"raise min_rows to >= {2 * self.max_classes} or lower max_classes"
            )
        lo, hi = self.min_imbalance_alpha, self.max_imbalance_alpha
        _check_range(s, "min_imbalance_alpha", lo, "max_imbalance_alpha", hi, floor=1e-3)
        if not 2 <= self.max_categories <= 1000:
            raise ValueError(f"{s}.max_categories={self.max_categories} must be within 2..1000")
        for name in (
            "regression_prob", "binary_prob", "argmax_class_prob", "categorical_prob", "skewed_prob",
            "heavy_tailed_prob", "integer_prob", "irrelevant_prob", "constant_prob", "duplicate_prob",
            "missing_table_prob", "missing_column_prob", "max_missing_rate", "value_missing_prob",
        ):  # fmt: skip
            _check_prob(s, name, getattr(self, name))
        if self.skewed_prob + self.heavy_tailed_prob + self.integer_prob > 1.0:
            raise ValueError(
                f"{s}.skewed_prob + heavy_tailed_prob + integer_prob must be <= 1 (shares of numeric columns)"
            )
        if self.irrelevant_prob + self.constant_prob + self.duplicate_prob > 0.9:
            raise ValueError(f"{s}.irrelevant_prob + constant_prob + duplicate_prob must be <= 0.9 to keep signal")
        if self.max_missing_rate > 0.9:
            raise ValueError(f"{s}.max_missing_rate={self.max_missing_rate} leaves too few cells; set it <= 0.9")


@dataclass
class CurriculumConfig:
    """Table sizes growing with the step: small cheap tables first, the full range after `ramp_steps`."""

    start_max_rows: int = 128
    """Cap on rows at step 0 (clipped into [table.min_rows, table.max_rows])."""
    start_max_features: int = 8
    """Cap on feature columns at step 0 (clipped into [table.min_features, table.max_features])."""
    ramp_steps: int = 0
    """Steps over which the caps grow geometrically to table.max_rows / max_features; 0 turns the curriculum off."""

    def __post_init__(self) -> None:
        if self.ramp_steps < 0:
            raise ValueError(f"curriculum.ramp_steps={self.ramp_steps} must be >= 0 (0 turns the curriculum off)")
        if self.start_max_rows < 1 or self.start_max_features < 1:
            raise ValueError("curriculum.start_max_rows and start_max_features must be >= 1")

    def limits(self, step: int, table: TableConfig) -> tuple[int, int]:
        """(max rows, max feature columns) allowed at `step`."""
        return (
            self._grow(step, self.start_max_rows, table.min_rows, table.max_rows),
            self._grow(step, self.start_max_features, table.min_features, table.max_features),
        )

    def _grow(self, step: int, start: int, lo: int, hi: int) -> int:
        start = min(max(start, lo), hi)
        if self.ramp_steps == 0 or step >= self.ramp_steps:
            return hi
        t = max(step, 0) / self.ramp_steps
        return int(min(hi, max(lo, round(math.exp((1 - t) * math.log(start) + t * math.log(hi))))))


@dataclass
class DataConfig:
    """The `data:` section of a run: what the prior draws, how tables look, and how batches are served."""

    seed: int = 0
    """Root seed; a batch depends only on (seed, step, data-parallel rank)."""
    batch_size: int = 8
    """Tables per step on each data-parallel rank."""
    num_workers: int = 0
    """Background processes producing whole steps (0: produce them in the training process)."""
    prefetch_factor: int = 2
    """Steps each worker prepares ahead."""
    mp_context: str = "spawn"
    """How workers start: "spawn" (default; safe with polars' thread pool) or "forkserver" ("fork" can deadlock)."""
    prior: PriorConfig = field(default_factory=PriorConfig)
    """Which prior draws the latent tables."""
    table: TableConfig = field(default_factory=TableConfig)
    """Sizes, task and mess of the tables."""
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    """Growth of table sizes with the step."""

    def __post_init__(self) -> None:
        if self.seed < 0:
            raise ValueError(f"data.seed={self.seed} must be >= 0 (it seeds numpy's SeedSequence)")
        if self.batch_size < 1:
            raise ValueError(f"data.batch_size={self.batch_size} must be >= 1")
        if self.num_workers < 0:
            raise ValueError(f"data.num_workers={self.num_workers} must be >= 0")
        if self.prefetch_factor < 1:
            raise ValueError(f"data.prefetch_factor={self.prefetch_factor} must be >= 1")
        if self.mp_context not in ("spawn", "forkserver", "fork"):
            raise ValueError(f"data.mp_context={self.mp_context!r} must be 'spawn', 'forkserver' or 'fork'")

    @classmethod
    def tiny(cls, seed: int = 0, **overrides) -> DataConfig:
        """Tests and smoke runs: batches of 8 tables x 64 rows x 8 feature columns."""
        table = TableConfig(min_rows=64, max_rows=64, min_features=8, max_features=8)
        return cls(**{"seed": seed, "batch_size": 8, "table": table, **overrides})


BYTES_PER_CELL = 16
"""A floor on what one cell of a prior table costs before the model sees it (a float64 value, its missing flag and
category code): what one batch of the largest tables needs at the least."""


def physical_memory() -> int | None:
    """This machine's memory in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_tables_fit_memory(rows: int, features: int, tables: int, what: str) -> None:
    """Refuse (ValueError) tables whose raw cells alone pass this machine's memory: found at the first batch, after
    the run has started, as a MemoryError traceback."""
    need, have = tables * rows * (features + 1) * BYTES_PER_CELL, physical_memory()
    if have is not None and need > have:
        raise ValueError(f"{what}: {tables} table(s) of up to {rows:,} rows x {features} features need at least "
                         f"{need / 2**30:,.0f} GiB for their raw cells alone, and this machine has "
                         f"{have / 2**30:,.0f} GiB: lower the rows")
