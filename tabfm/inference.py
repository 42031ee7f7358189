"""In-context inference with the train rows encoded once: a Context caches what test rows need from them.

Test rows never influence train rows (tabfm.model), so everything a test row reads from the context is fixed
once the train rows are known:

    cell statistics      mean / deviation of each numeric column over the train rows      [B, 1, C]
    target statistics    mean / deviation of the regression target (regression only)     [B, 1]
    keys / values        of the train rows, at every attention over rows (ColumnAttention of each axial block
                         and every in-context block): dense.KVCache, this rank's heads when tensor-parallel

`encode_context(model, batch)` runs the train rows once, recording those; `predict_logits(model, context,
batch)` runs a batch of test rows only, attending to the cached keys/values. Cost per test batch:
O(test rows x (train rows + columns)) instead of a forward of the whole context. On a tensor-parallel model
every rank of the mesh calls both together, and the result is the one-process result (tests/test_inference.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from tabfm.data.encode import Batch
from tabfm.model import KeyRows, TabFM, TargetStats
from tabfm.parallel.dense import KVCache


def row_attention_layers(model: TabFM) -> list[nn.Module]:
    """The attention layers whose keys are rows, in forward order (plain or tensor-parallel modules)."""
    layers = [block.column.block.attn for block in model.axial]
    return layers + [block.attn for block in model.icl.blocks.blocks]


@contextmanager
def _attached(model: TabFM, caches: list[KVCache]) -> Iterator[None]:
    """The caches plugged into the model's attentions over rows for the duration of the block only."""
    layers = row_attention_layers(model)
    try:
        for layer, cache in zip(layers, caches, strict=True):
            layer.kv_cache = cache
        yield
    finally:
        for layer in layers:
            layer.kv_cache = None


@dataclass
class Context:
    """Train rows of B tables, encoded: all a batch of their test rows needs (see the module docstring)."""

    task: str
    n_train: int
    num_columns: int
    n_classes: torch.Tensor
    """[B] classes of each table (0 for regression)."""
    cell_stats: tuple[torch.Tensor, torch.Tensor]
    target_stats: TargetStats | None
    caches: list[KVCache]

    @property
    def key_rows(self) -> KeyRows:
        """Every table of a context has all n_train rows: attention needs no mask."""
        return KeyRows(self.n_train, None)

    @property
    def num_tables(self) -> int:
        return int(self.n_classes.shape[0])

    def nbytes(self) -> int:
        """Memory held by the cached keys/values (this rank's share)."""
        return sum(c.nbytes() for c in self.caches)


def _check_context_batch(batch: Batch) -> int:
    n_train = batch.n_train
    R = batch.values.shape[1]
    if bool(batch.row_pad.any()) or int(n_train.min()) != R or int(n_train.max()) != R:
        raise ValueError("encode_context takes a batch of train rows only: every table with the same number of "
                         "rows, all of them train rows (n_train == rows, no row padding)")
    return R


@torch.no_grad()
def encode_context(model: TabFM, batch: Batch) -> Context:
    """Encode the train rows of `batch` (tables of equal size, all rows train rows) once."""
    n_train = _check_context_batch(batch)
    caches = [KVCache() for _ in row_attention_layers(model)]
    with _attached(model, caches):
        model(batch)
    for cache in caches:
        cache.recording = False
    target = model.target_stats(batch) if batch.task == "regression" else None
    return Context(task=batch.task, n_train=n_train, num_columns=batch.values.shape[2],
                   n_classes=batch.n_classes.clone(),
                   cell_stats=model.cells.stats(batch.values, batch.missing, batch.n_train),
                   target_stats=target, caches=caches)


@torch.no_grad()
def predict_logits(model: TabFM, context: Context, batch: Batch) -> torch.Tensor:
    """Logits [B, R, Y] of a batch whose rows are all test rows of the context's B tables."""
    B, _, C = batch.values.shape
    if B != context.num_tables or C != context.num_columns:
        raise ValueError(f"the test batch has {B} tables x {C} columns but the context was encoded from "
                         f"{context.num_tables} tables x {context.num_columns} columns")
    if batch.task != context.task:
        raise ValueError(f"a {batch.task} batch cannot be predicted from a {context.task} context")
    with _attached(model, context.caches):
        return model(batch, context=context)
