"""Pretraining batches, deterministic per (seed, step, data-parallel rank).

Shapes of one Batch (encode.py has the full legend): B tables, R rows (train rows first), C feature columns.
    values [B, R, C] f32   missing [B, R, C] bool   cat_codes [B, R, C] i64   is_cat, n_cats, col_pad [B, C]
    labels [B, R] i64 (classification) or f32 (regression)   row_pad [B, R] bool   n_train, n_classes [B] i64

A step's generator is numpy's SeedSequence([seed, step, dp_rank]), and nothing else feeds it: every rank of a
tensor-parallel mesh (same dp_rank) gets the same batch, data-parallel replicas get different ones, a run resumed
at step k gets exactly the batches it would have had, and the worker count never changes a batch. Workers each
produce whole steps: worker w of W makes steps start+w, start+w+W, ..., and torch's DataLoader asks its workers
round-robin and returns results in request order, so steps come out in order.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from tabfm.data.config import DataConfig
from tabfm.data.encode import Batch, encode_tables
from tabfm.data.priors.mix import make_prior
from tabfm.data.tables import Table, draw_table
from tabfm.data.targets import draw_task


def step_seed(seed: int, step: int, dp_rank: int) -> np.random.SeedSequence:
    """The only source of randomness of one step's batch."""
    if min(seed, step, dp_rank) < 0:
        raise ValueError(f"seed, step and dp_rank must be >= 0, got {seed}, {step}, {dp_rank}")
    return np.random.SeedSequence([seed, step, dp_rank])


class Source(Protocol):
    """Where a step's tables come from."""

    def tables(self, step: int, dp_rank: int) -> list[Table]: ...


class PriorSource:
    """Draws each step's tables fresh from the prior: one task per step, sizes capped by the curriculum."""

    def __init__(self, cfg: DataConfig) -> None:
        self.cfg = cfg
        self.prior = make_prior(cfg.prior)

    def tables(self, step: int, dp_rank: int) -> list[Table]:
        ss = step_seed(self.cfg.seed, step, dp_rank)
        task = draw_task(np.random.default_rng(ss), self.cfg.table)
        max_rows, max_features = self.cfg.curriculum.limits(step, self.cfg.table)
        return [
            draw_table(np.random.default_rng(child), self.prior, self.cfg.table, max_rows, max_features, task)
            for child in ss.spawn(self.cfg.batch_size)
        ]


class FixedSource:
    """Draws each step's tables from a fixed collection (e.g. Parquet shards read back), with replacement.

    A step picks one table at random, then the rest of the batch among tables of the same task.
    """

    def __init__(self, tables: Sequence[Table], batch_size: int, seed: int = 0) -> None:
        if len(tables) == 0:
            raise ValueError("FixedSource needs at least one table")
        self.tables_, self.batch_size, self.seed = tables, batch_size, seed
        self._by_task: dict[str, np.ndarray] | None = None

    def _groups(self) -> dict[str, np.ndarray]:
        if self._by_task is None:
            metas = getattr(self.tables_, "metas", None)
            tasks = [m.task for m in metas()] if metas else [t.meta.task for t in self.tables_]
            self._by_task = {k: np.flatnonzero(np.array(tasks) == k) for k in sorted(set(tasks))}
        return self._by_task

    def tables(self, step: int, dp_rank: int) -> list[Table]:
        rng = np.random.default_rng(step_seed(self.seed, step, dp_rank))
        groups = self._groups()
        first = int(rng.integers(len(self.tables_)))
        pool = next(g for g in groups.values() if first in g)
        rest = rng.choice(pool, size=self.batch_size - 1, replace=True)
        return [self.tables_[int(i)] for i in (first, *rest)]


def batch_at(source: Source, step: int, dp_rank: int = 0) -> Batch:
    """The batch of `step` on data-parallel rank `dp_rank`."""
    return encode_tables(source.tables(step, dp_rank), step=step)


class StepDataset(IterableDataset):
    """Batches of steps start_step, start_step+1, ... (forever, or num_steps of them); one item is one step.

    Under a DataLoader with W workers, worker w makes steps start_step + w + k*W, so each worker produces whole
    steps and the output order is exact.
    """

    def __init__(self, source: Source, dp_rank: int = 0, start_step: int = 0, num_steps: int | None = None) -> None:
        if start_step < 0 or dp_rank < 0 or (num_steps is not None and num_steps < 0):
            raise ValueError("start_step, dp_rank and num_steps must be >= 0")
        self.source, self.dp_rank, self.start_step, self.num_steps = source, dp_rank, start_step, num_steps

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        worker, n_workers = (0, 1) if info is None else (info.id, info.num_workers)
        stop = None if self.num_steps is None else self.start_step + self.num_steps
        step = self.start_step + worker
        while stop is None or step < stop:
            yield batch_at(self.source, step, self.dp_rank)
            step += n_workers


WORKER_THREAD_ENV = ("POLARS_MAX_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
"""Thread-pool sizes a worker process reads when its libraries load: one thread each."""


class StepLoader(DataLoader):
    """A DataLoader whose worker processes start with one polars and one BLAS thread each.

    Torch already gives each worker one thread for its own ops, but polars and numpy's BLAS size their pools to
    every core: 12 workers on 16 cores would run 12 x 16 threads for small frames and matrices. The workers are the
    parallelism. The pools are sized when a spawned worker imports its libraries, before any worker_init_fn runs,
    so the variables are set around the spawn and restored at once (this process's own pools are already sized).
    """

    def __iter__(self):
        if self.num_workers == 0:
            return super().__iter__()
        saved = {name: os.environ.get(name) for name in WORKER_THREAD_ENV}
        os.environ.update(dict.fromkeys(WORKER_THREAD_ENV, "1"))
        try:
            return super().__iter__()  # starts the workers
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def make_loader(
    cfg: DataConfig,
    source: Source | None = None,
    dp_rank: int = 0,
    start_step: int = 0,
    num_steps: int | None = None,
    pin_memory: bool = False,
) -> StepLoader:
    """A DataLoader yielding one Batch per step from `start_step` (the prior unless `source` is given).

    With cfg.num_workers > 0, background processes produce whole steps; the batches are the same as with 0.
    """
    dataset = StepDataset(source or PriorSource(cfg), dp_rank=dp_rank, start_step=start_step, num_steps=num_steps)
    workers = cfg.num_workers
    return StepLoader(
        dataset,
        batch_size=None,  # an item is already a whole step
        num_workers=workers,
        prefetch_factor=cfg.prefetch_factor if workers else None,
        multiprocessing_context=cfg.mp_context if workers else None,
        persistent_workers=False,
        pin_memory=pin_memory and torch.cuda.is_available(),
    )
