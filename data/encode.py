"""Tables -> one padded batch of tensors. Reads only each DataFrame and its TableMeta (never the prior),
so tables read back from Parquet encode to exactly the same tensors as the ones just drawn.

Shapes (B tables, R rows = most rows in the batch, C feature columns = most columns in the batch):
    values      [B, R, C] float32  numeric cell values, raw (the model normalises with train rows only);
                                   0 where missing, categorical or padding
    missing     [B, R, C] bool     True where a real cell is missing (null)
    cat_codes   [B, R, C] int64    per-column category codes 0..n-1 (categories sorted as strings);
                                   -1 for numeric columns, missing cells and padding
    is_cat      [B, C]    bool     True for categorical columns
    n_cats      [B, C]    int64    categories of each column (0 for numeric columns and padding)
    labels      [B, R]    int64    class ids (classification; -100 on padding rows, cross_entropy's ignore_index)
                          float32  or regression targets (0 on padding rows)
    n_train     [B]       int64    rows 0..n_train-1 of a table are train rows, then its test rows
    n_classes   [B]       int64    classes of each table (0 for regression)
    row_pad     [B, R]    bool     True on padding rows (torch key_padding_mask convention)
    col_pad     [B, C]    bool     True on padding columns
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import numpy as np
import polars as pl
import torch

from tabfm.data.tables import TARGET, Table

IGNORE_LABEL = -100
"""Class label on padding rows: torch.nn.functional.cross_entropy ignores it by default."""


@dataclass
class Batch:
    """One step's tables as padded tensors; see the module docstring for shapes."""

    values: torch.Tensor
    missing: torch.Tensor
    cat_codes: torch.Tensor
    is_cat: torch.Tensor
    n_cats: torch.Tensor
    labels: torch.Tensor
    n_train: torch.Tensor
    n_classes: torch.Tensor
    row_pad: torch.Tensor
    col_pad: torch.Tensor
    task: str
    """"classification" or "regression": one task per batch, so labels have one dtype."""
    step: int = -1
    """The step the batch was drawn for (-1 when not drawn for a step)."""
    train_bounds: tuple[int, int] | None = None
    """(fewest, most) train rows of a table: n_train's range as Python ints, read once when the batch is built, so
    the model's forward reads no tensor into Python (torch.compile then traces it without a graph break). None
    where n_train holds no values (the meta device, an empty batch)."""
    most_classes: int | None = None
    """n_classes.max() as a Python int, read likewise (None where n_classes holds no values)."""

    def __post_init__(self) -> None:
        """Read the Python-int summaries. On the CPU they are always re-read (cheap), so a batch rebuilt from another
        one's fields never carries stale ones; on an accelerator those given (by `to`) are kept, avoiding a sync."""
        if self.train_bounds is None or self.n_train.device.type == "cpu":
            self.train_bounds = _int_range(self.n_train)
        if self.most_classes is None or self.n_classes.device.type == "cpu":
            span = _int_range(self.n_classes)
            self.most_classes = None if span is None else span[1]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensor fields by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return replace(self, **{k: v.to(device, non_blocking=non_blocking) for k, v in self.tensors().items()})

    def pin_memory(self) -> Batch:
        """Called by DataLoader(pin_memory=True)."""
        return replace(self, **{k: v.pin_memory() for k, v in self.tensors().items()})


def encode_tables(tables: Sequence[Table], step: int = -1) -> Batch:
    """Pad and stack tables of one task into a Batch."""
    if not tables:
        raise ValueError("encode_tables needs at least one table")
    tasks = {t.meta.task for t in tables}
    if len(tasks) != 1:
        raise ValueError(f"a batch holds one task, got {sorted(tasks)}; group tables by meta.task first")
    task = tasks.pop()
    B = len(tables)
    R = max(t.df.height for t in tables)
    C = max(len(t.meta.columns) for t in tables)

    values = np.zeros((B, R, C), np.float32)
    missing = np.zeros((B, R, C), bool)
    cat_codes = np.full((B, R, C), -1, np.int64)
    is_cat = np.zeros((B, C), bool)
    n_cats = np.zeros((B, C), np.int64)
    classification = task == "classification"
    labels = np.full((B, R), IGNORE_LABEL, np.int64) if classification else np.zeros((B, R), np.float32)
    row_pad = np.ones((B, R), bool)
    col_pad = np.ones((B, C), bool)
    for b, t in enumerate(tables):
        n = t.df.height
        row_pad[b, :n] = False
        col_pad[b, : len(t.meta.columns)] = False
        for j, info in enumerate(t.meta.columns):
            s = t.df.get_column(info.name)
            if info.kind == "categorical":
                codes, k = _category_codes(s)
                cat_codes[b, :n, j], n_cats[b, j], is_cat[b, j] = codes, k, True
                missing[b, :n, j] = codes < 0
            else:
                if s.dtype == pl.String:
                    raise ValueError(f"column {info.name} is {info.kind} in the metadata but holds strings")
                v = s.cast(pl.Float64).to_numpy()
                m = np.isnan(v)
                values[b, :n, j], missing[b, :n, j] = np.where(m, 0.0, v), m
        y = t.df.get_column(TARGET).to_numpy()
        labels[b, :n] = y
    return Batch(
        values=torch.from_numpy(values),
        missing=torch.from_numpy(missing),
        cat_codes=torch.from_numpy(cat_codes),
        is_cat=torch.from_numpy(is_cat),
        n_cats=torch.from_numpy(n_cats),
        labels=torch.from_numpy(labels),
        n_train=torch.tensor([t.meta.n_train for t in tables], dtype=torch.int64),
        n_classes=torch.tensor([t.meta.n_classes for t in tables], dtype=torch.int64),
        row_pad=torch.from_numpy(row_pad),
        col_pad=torch.from_numpy(col_pad),
        task=task,
        step=step,
    )


def _int_range(t: torch.Tensor) -> tuple[int, int] | None:
    """(min, max) of an integer tensor as Python ints; None when it holds no values (meta device or empty)."""
    if t.is_meta or t.numel() == 0:
        return None
    lo, hi = torch.stack(torch.aminmax(t)).tolist()  # one read (one sync on an accelerator)
    return lo, hi


def category_codes(s: pl.Series, categories: pl.Series | None = None) -> tuple[np.ndarray, pl.Series]:
    """(codes [n] int64, categories): the one category encoder of the project (synthetic tables, evaluation and
    the estimators' preprocessing). Categories are the train values' distinct strings sorted (by code point),
    numbered from 0; a null, or a value not among `categories` when they are given (a category first seen at
    predict), is -1."""
    s = s.cast(pl.String)
    cats = s.drop_nulls().unique().sort() if categories is None else categories.cast(pl.String)
    codes = s.replace_strict(cats, pl.int_range(cats.len(), eager=True), default=-1, return_dtype=pl.Int64)
    return codes.to_numpy(), cats


def _category_codes(s: pl.Series) -> tuple[np.ndarray, int]:
    """(codes [n] int64 with -1 for null, number of categories) of a table's own categories."""
    codes, cats = category_codes(s)
    return codes, cats.len()
