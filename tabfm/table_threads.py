"""Forwards over independent tables spread over CPU threads, one intra-op thread each.

The estimators' forwards on a CPU are many small ops (embeddings of 32, attention heads of 8): torch's intra-op
threads (one OpenMP team inside each op) spend much of each op starting and joining, so two cores give a forward
only ~1.2x. Tables never interact in a forward, so the estimators split their contexts into slices of tables and
run the slices on as many Python threads as torch would use intra-op threads, each thread with one intra-op thread:
the forwards ~1.5x faster on 2 cores, fit + predict 1.2-1.4x (`python benchmarks/table_threads.py`). torch releases
the GIL inside ops, and grad mode, autocast and the intra-op thread count are per thread in torch, so each slice
runs in the same modes whichever thread takes it, and its outputs are the ones one batch of all tables gives (up to
the float rounding of batched matmuls of another batch size).

Only for the CPU and a model without a mesh: a tensor-parallel forward runs collectives, which every rank must
issue in one order, and an accelerator runs one stream anyway.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

__all__ = ["host_work", "host_work_on_all_threads", "map_tables", "sequential_tables", "table_workers"]

T = TypeVar("T")
R = TypeVar("R")

_state = threading.local()


@contextlib.contextmanager
def _thread_flag(name: str) -> Iterator[None]:
    """The flag `name` of this thread set within the block, and back to what it was after."""
    before = getattr(_state, name, False)
    setattr(_state, name, True)
    try:
        yield
    finally:
        setattr(_state, name, before)


def sequential_tables() -> contextlib.AbstractContextManager:
    """Within the block (this thread), table slices run one after another with torch's intra-op threads, as
    before table threads existed: the benchmark's reference and the tests' comparison."""
    return _thread_flag("off")


def table_workers(device: torch.device | str, sharded: bool = False) -> int:
    """Threads for table slices: torch's intra-op thread count of the calling thread (the estimator's n_jobs sets
    it) on a CPU; 1 on an accelerator, under a tensor-parallel mesh (`sharded`) or in sequential_tables()."""
    if getattr(_state, "off", False) or sharded or torch.device(device).type != "cpu":
        return 1
    return max(1, torch.get_num_threads())


def map_tables(fn: Callable[[T], R], items: Sequence[T], workers: int,
               done: Callable[[T], object] | None = None) -> list[R]:
    """[fn(item) for item in items], run on up to `workers` threads of one intra-op thread each; results in the
    items' order. The first exception raised in a thread (or a KeyboardInterrupt here) is raised here once the
    running items end; the items not yet started are dropped, not run. done(item), where given, runs on the
    calling thread as each result is taken, in the items' order (a progress bar's step: no lock needed)."""
    pool = None
    if workers > 1 and len(items) > 1:
        pool = ThreadPoolExecutor(min(workers, len(items)), thread_name_prefix="tabfm-tables",
                                  initializer=torch.set_num_threads, initargs=(1,))
    try:
        out = []
        for item, result in zip(items, map(fn, items) if pool is None else pool.map(fn, items), strict=True):
            out.append(result)
            if done is not None:
                done(item)
        return out
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


HOST_WORK_ROWS = 10_000
"""Up to this many train rows the estimators' CPU work between forwards runs on one thread (host_work); above,
on the threads n_jobs gives, where the local contexts' k-means and searches grow large enough for a team: at
100,000 rows x 20 columns they took 7.7-8.9 s on 2 threads and 11.2-11.7 s on one (a quiet 2-core VM), at 10,000
rows 0.28-0.35 s against 0.36 s."""


@contextlib.contextmanager
def host_work(rows: int) -> Iterator[None]:
    """torch's intra-op threads and the BLAS threads at 1 within the block (this thread), restored after, for the
    estimators' CPU work between forwards (preprocessing, the local contexts' k-means and nearest-row searches, the
    linear models) on a table of `rows` train rows, up to HOST_WORK_ROWS. Its ops are small there (a thousand
    rows by tens of columns), too small to gain from a team of threads, and on a busy machine each op of a team
    waits for a thread that has no core: at 1,000 x 1,000 x 20 beside two busy processes fit + predict took
    4.25 s with the default threads and 3.57 s with this (benchmarks/host_threads.py)."""
    if getattr(_state, "host_all", False) or rows > HOST_WORK_ROWS:
        yield
        return
    from tabfm.validation import torch_threads

    with torch_threads(1):
        yield


def host_work_on_all_threads() -> contextlib.AbstractContextManager:
    """Within the block (this thread), host_work leaves the thread counts as they are, as before it existed: the
    benchmark's reference (benchmarks/host_threads.py)."""
    return _thread_flag("host_all")

