"""How many forwards the estimators cut a set of tables into: balanced over the table threads, and on a CPU small
enough that no activation outgrows glibc's malloc heap.

glibc's malloc serves a block of up to its mmap threshold (32 MiB at most on 64-bit Linux) from its heap, where a
freed block is reused; a larger block is mmap-ed fresh and unmapped again on free, so every op that writes a tensor
that large page-faults each of its 4 KiB pages in anew. On the 2-core VM a 60 MiB clone takes 38 ms, 3.9 ms when
the same bytes come from the heap (GLIBC_TUNABLES raising the threshold), and encoding 10,000 train rows in
forwards of 2^20 cells spent about 30% of its time so. The threshold is the process's, and a library has no
business changing it, so on a CPU the estimators size their forwards instead: each forward's widest activation
(`forward_bytes`) stays within HEAP_BLOCK_BYTES. Smaller forwards cost nothing measurable: each still
runs tens of thousands of cells per op, and under another allocator (macOS, jemalloc) the bound is harmless.
Accelerators have their own caching allocator: there only the cell budget (memory) bounds a forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tabfm.model import ModelConfig

__all__ = ["CONTEXT_CELL_BUDGET", "HEAP_BLOCK_BYTES", "ForwardSizes", "cache_bytes", "context_cache_bytes",
           "context_groups", "forward_bytes", "forward_count"]

CONTEXT_CELL_BUDGET = 1 << 20
"""Most train cells (rows x columns x contexts) kept as one Context at fit (a group, encoded in forwards sized
here). Off a CPU a group is one forward, whose activations are about a dozen [cells, embed_dim] tensors: 2^20 cells
keep them near 1.5 GiB; 2^22 (before local contexts, which make hundreds of small contexts) peaked at 7.8 GiB for
100,000 train rows. One context is always encoded whole (tabfm.chunked bounds a long one)."""

HEAP_BLOCK_BYTES = 8 << 20
"""Widest activation of one CPU forward. At most glibc's largest mmap threshold on 64-bit, 32 MiB
(DEFAULT_MMAP_THRESHOLD_MAX: blocks up to the dynamic threshold are reused from the heap, and the first large free
raises it); 8 MiB measured as fast or faster than 32 (the default classifier at 1,000 / 10,000 / 50,000 train rows:
1.73 vs 1.84 s, 15.6 vs 15.7 s, 10.0 vs 10.7-12.2 s) at a lower peak (1,000 rows fit + predict 0.96 vs 1.37 GiB;
50,000 rows 3.0 vs 3.3 GiB): two threads' forwards then live in less memory and more of it stays in cache."""


def forward_bytes(config: ModelConfig, tables: int, rows: int, columns: int, element_size: int,
                  encoding: bool) -> int:
    """Bytes of the widest activation of one forward of `tables` tables of `rows` rows showing `columns` feature
    columns: the fused q|k|v (or the MLP's hidden layer, if wider) of the cells and CLS tokens in the axial and
    compression blocks (when `encoding` train rows with inducing column attention, each column's M summaries
    too), or of the row vectors in the in-context blocks. tests/test_forward_sizes.py checks it bounds every
    tensor a forward allocates and is met."""
    cell = max(3, config.axial_mlp_ratio) * config.embed_dim
    row = max(3, config.icl_mlp_ratio) * config.icl_dim
    tokens = rows * (columns + config.row_num_cls)
    if encoding and config.column_attention == "inducing":
        tokens = max(tokens, (rows + config.num_inducing) * columns)
    return element_size * tables * max(tokens * cell, rows * row)


def cache_bytes(config: ModelConfig, train_rows: int, columns: int, element_size: int) -> int:
    """Bytes of the largest cached keys (or values) tensor one table of a Context holds: what selecting some of a
    context's tables for one forward (tabfm.model.Context.select) allocates per table."""
    column_keys = config.num_inducing if config.column_attention == "inducing" else train_rows
    return element_size * max(columns * column_keys * config.embed_dim, train_rows * config.icl_dim)


def context_cache_bytes(config: ModelConfig, train_rows: int, columns: int, element_size: int) -> int:
    """Bytes of every cached key and value one table of a Context holds once encoded (Context.nbytes): per axial
    block the column attention's keys and values (of the train rows, or of the inducing summaries), per in-context
    block those of the train rows. tests/test_forward_sizes.py checks it against encoded contexts."""
    column_keys = config.num_inducing if config.column_attention == "inducing" else train_rows
    axial = config.axial_num_blocks * 2 * columns * column_keys * config.embed_dim
    icl = config.icl_num_blocks * 2 * train_rows * config.icl_dim
    return element_size * (axial + icl)


def forward_count(tables: int, table_bytes: int, workers: int, byte_limit: int | None) -> int:
    """Forwards that `tables` tables of one shape are cut into (np.array_split): each with at most `byte_limit`
    bytes of widest activation (table_bytes per table; None: no limit) where a single table allows, and a multiple
    of `workers` where there are that many tables, so the threads get equal shares."""
    if tables <= 0:
        return 0
    per = tables if byte_limit is None else max(1, byte_limit // max(table_bytes, 1))
    count = math.ceil(tables / per)
    return min(tables, math.ceil(count / max(workers, 1)) * max(workers, 1))


def context_groups(widths: np.ndarray, rows: int) -> list[tuple[np.ndarray, int]]:
    """(contexts, columns shown) of each group of contexts kept as one Context: contexts (positions in `widths`,
    the columns each shows; all of `rows` train rows) of one width, at most CONTEXT_CELL_BUDGET train cells."""
    groups = []
    for width in np.unique(widths):
        same = np.flatnonzero(widths == width)
        size = max(1, CONTEXT_CELL_BUDGET // max(rows * int(width), 1))
        groups += [(units, int(width)) for units in np.array_split(same, math.ceil(len(same) / size))]
    return groups


@dataclass(frozen=True)
class ForwardSizes:
    """How one estimator cuts its forwards: its model's shape and dtype, the heap bound (None off a CPU) and the
    table threads (tabfm.table_threads) the forwards are spread over."""

    config: ModelConfig
    element_size: int
    heap: int | None
    workers: int

    def tables(self, count: int, rows: int, columns: int, encoding: bool = False, cache_rows: int = 0) -> int:
        """Forwards that `count` tables of `rows` rows x `columns` columns are cut into; cache_rows: the tables'
        caches (of that many train rows) are copied for the forward (Context.select) and count too."""
        each = forward_bytes(self.config, 1, rows, columns, self.element_size, encoding)
        if cache_rows:
            each = max(each, cache_bytes(self.config, cache_rows, columns, self.element_size))
        return forward_count(count, each, self.workers, self.heap)

    def test_rows(self, count: int, tables: int, columns: int) -> int:
        """Forwards that `count` test rows, each read by all of `tables` tables (one global context per member),
        are cut into."""
        each = forward_bytes(self.config, tables, 1, columns, self.element_size, encoding=False)
        return forward_count(count, each, self.workers, self.heap)
