"""Predicting tables larger than memory, batch by batch, in one process or split over data-parallel ranks.

    batches read (any size) --rechunk--> chunks of batch_size rows --predict_chunks--> outputs [rows, K]

The model always sees the same chunks (rows 0..b-1, b..2b-1, ... of the whole table, b = the estimator's
batch_size) that `est.predict` on the whole table would give it, so the answers are the same to the bit whatever
the size of the batches read. Under torchrun with a process group of W ranks, chunk i is predicted by rank i % W
alone (every rank holds the whole fitted estimator) and the outputs are gathered on rank 0 in the table's order:
the one-process answer, with W times the throughput.

    rank r, round k     predicts chunk k*W + r -> all_gather(row counts) -> gather(outputs, padded) to rank 0
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import islice
from typing import Any

import numpy as np
import polars as pl


def rechunk(batches: Iterable[pl.DataFrame], rows: int) -> Iterator[pl.DataFrame]:
    """The rows of `batches` again, in frames of exactly `rows` rows (the last one may be shorter)."""
    pending: list[pl.DataFrame] = []
    held = 0
    for batch in batches:
        while batch.height:
            take = min(rows - held, batch.height)
            pending.append(batch.slice(0, take))
            batch, held = batch.slice(take), held + take
            if held == rows:
                yield pl.concat(pending)
                pending, held = [], 0
    if pending:
        yield pl.concat(pending)


def output_width(est: Any) -> int:
    """K, the width of outputs_of: the classes of a classifier, 1 for a regressor."""
    return len(est.classes_) if hasattr(est, "classes_") else 1


def outputs_of(est: Any, X: Any) -> np.ndarray:
    """[n, K] float64: a classifier's class probabilities (columns in classes_ order; predict is their argmax),
    or a regressor's predictions as one column."""
    if hasattr(est, "classes_"):
        return est.predict_proba(X)
    return np.asarray(est.predict(X), np.float64).reshape(-1, 1)


def predict_chunks(est: Any, chunks: Iterable[Any], group: Any = None) -> Iterator[np.ndarray | None]:
    """outputs_of(est, chunk) for each chunk, in order. With a process group of W > 1 ranks (every rank passing
    the same chunks), chunk i is predicted on rank i % W only and its outputs come out on the group's rank 0; the
    other ranks yield None for it. An input error (ValueError, TypeError) on any rank is raised on every rank,
    with that rank's message, so no rank waits for the others forever."""
    import torch.distributed as dist

    world = 1 if group is None else dist.get_world_size(group)
    if world == 1:
        for chunk in chunks:
            yield outputs_of(est, chunk)
        return
    rank, width = dist.get_rank(group), output_width(est)
    chunks = iter(chunks)
    while batch := list(islice(chunks, world)):  # one round: a chunk per rank (fewer at the end)
        out, error = None, None
        if rank < len(batch):
            try:
                out = outputs_of(est, batch[rank])
            except (ValueError, TypeError) as e:
                error = e
        gathered = _gather(out, error, width, group)
        yield from gathered[:len(batch)] if gathered is not None else [None] * len(batch)


def _gather(out: np.ndarray | None, error: Exception | None, width: int, group: Any) -> list[np.ndarray] | None:
    """Every rank's outputs of this round on rank 0 (None elsewhere): row counts first (-1: this rank failed),
    then the outputs padded to the longest."""
    import torch
    import torch.distributed as dist

    world, rank, device = dist.get_world_size(group), dist.get_rank(group), _device(group)
    count = torch.tensor([-1 if error is not None else 0 if out is None else len(out)], device=device)
    counts = [torch.empty_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    n = [int(c) for c in counts]
    if min(n) < 0:
        failed = n.index(-1)
        if rank == failed:
            _broadcast_text(str(error), failed, group)
            raise error
        raise ValueError(_broadcast_text("", failed, group))
    padded = torch.zeros(max(n), width, dtype=torch.float64, device=device)
    if out is not None:
        padded[:len(out)] = torch.from_numpy(out)
    parts = [torch.empty_like(padded) for _ in range(world)] if rank == 0 else None
    dist.gather(padded, parts, group=group, group_dst=0)
    return None if parts is None else [p[:k].cpu().numpy() for p, k in zip(parts, n, strict=True)]


def _device(group: Any):
    """Where the group's collectives take their tensors: this rank's GPU under NCCL, else the CPU."""
    import torch
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")


def _broadcast_text(text: str, src: int, group: Any) -> str:
    """`text` of group rank `src`, on every rank of the group."""
    import torch
    import torch.distributed as dist

    device = _device(group)
    data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)
    size = torch.tensor([len(data)], device=device)
    dist.broadcast(size, group=group, group_src=src)
    if dist.get_rank(group) != src:
        data = torch.empty(int(size), dtype=torch.uint8, device=device)
    if len(data):
        dist.broadcast(data, group=group, group_src=src)
    return bytes(data.tolist()).decode()


def predict_data_parallel(est: Any, X: Any, group: Any = None) -> np.ndarray | None:
    """outputs_of(est, X) (class probabilities, or predictions as one column) with the rows of X split over the
    ranks of `group` (default: every torchrun rank) in chunks of est.batch_size; every rank passes the same fitted
    estimator and X. Rank 0 gets the whole [n, K] answer, equal to one process's; the other ranks get None."""
    import torch.distributed as dist

    if group is None and dist.is_initialized():
        group = dist.group.WORLD
    n = len(X)
    chunks = (X[start:start + est.batch_size] for start in range(0, n, est.batch_size))
    outputs = list(predict_chunks(est, chunks, group))
    if outputs and outputs[0] is None:
        return None
    return np.concatenate(outputs) if outputs else np.empty((0, output_width(est)))
