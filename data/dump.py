"""Write tables as Parquet shards with a JSON sidecar each, and read them back as a fixed dataset.

Layout of a dump folder:
    manifest.json            format version, table count, seed, the config that drew them
    table_000000.parquet     the cells (feature columns, then `target`; train rows first)
    table_000000.json        the TableMeta (prior, hyperparameters, task, n_classes, columns, n_train)
    ...
Table i is drawn from SeedSequence([seed, i]) alone, so a dump is the same whatever the worker count, and any
table can be regenerated on its own.
"""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import asdict
from multiprocessing import get_context
from pathlib import Path
from typing import overload

import numpy as np
import polars as pl

from tabfm.data.config import DataConfig
from tabfm.data.priors.mix import make_prior
from tabfm.data.tables import Table, TableMeta, draw_table

FORMAT_VERSION = 1


def table_at(cfg: DataConfig, index: int, task: str | None = None) -> Table:
    """Table `index` of the dump drawn with cfg (sizes from cfg.table's full ranges; no curriculum)."""
    rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, index]))
    return draw_table(rng, make_prior(cfg.prior), cfg.table, cfg.table.max_rows, cfg.table.max_features, task)


def write_table(table: Table, out: Path, index: int) -> None:
    """One table as table_{index}.parquet + table_{index}.json."""
    stem = out / f"table_{index:06d}"
    table.df.write_parquet(stem.with_suffix(".parquet"))
    stem.with_suffix(".json").write_text(json.dumps(table.meta.to_dict(), indent=1))


def read_table(out: Path, index: int) -> Table:
    stem = Path(out) / f"table_{index:06d}"
    meta = TableMeta.from_dict(json.loads(stem.with_suffix(".json").read_text()))
    return Table(df=pl.read_parquet(stem.with_suffix(".parquet")), meta=meta)


def _write_range(cfg: DataConfig, out: Path, start: int, stop: int, task: str | None) -> int:
    for i in range(start, stop):
        write_table(table_at(cfg, i, task), out, i)
    return stop - start


MIN_TABLE_BYTES = 1024
"""A floor on what one written table takes on disk (its Parquet file and JSON sidecar: a 4 x 1 table takes
about 1.3 KB), for refusing a count the disk cannot hold before writing any."""

def check_fits_disk(out: Path, n_tables: int) -> None:
    """Refuse (ValueError) more tables than the disk under `out` could hold at MIN_TABLE_BYTES each: found before
    any folder or table is written, not when the disk is full."""
    existing = next(p for p in (out, *out.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    if n_tables * MIN_TABLE_BYTES > free:
        raise ValueError(f"{n_tables:,} tables need at least {n_tables * MIN_TABLE_BYTES / 2**30:,.0f} GiB and "
                         f"{existing} has {free / 2**30:,.0f} GiB free: write fewer tables")

def write_tables(
    cfg: DataConfig,
    out: str | Path,
    n_tables: int,
    task: str | None = None,
    workers: int = 0,
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Draw tables 0..n_tables-1 with cfg (task forced when given) and write them under `out`.

    `progress(k)` is called as k more tables are written; `workers` > 0 draws in that many processes.
    """
    if n_tables < 1:
        raise ValueError(f"n_tables={n_tables} must be >= 1")
    out = Path(out)
    check_fits_disk(out, n_tables)
    out.mkdir(parents=True, exist_ok=True)
    chunk = 16
    ranges = ((s, min(s + chunk, n_tables)) for s in range(0, n_tables, chunk))  # lazily: n_tables may be large
    if workers > 0:
        with ProcessPoolExecutor(workers, mp_context=get_context(cfg.mp_context)) as pool:
            pending: set = set()
            for s, e in itertools.chain(ranges, [(None, None)]):  # a bounded number in flight; the end drains it
                if pending and (s is None or len(pending) >= 4 * workers):
                    finished, pending = wait(pending, return_when=ALL_COMPLETED if s is None else FIRST_COMPLETED)
                    for f in finished:
                        if progress:
                            progress(f.result())
                        else:
                            f.result()
                if s is not None:
                    pending.add(pool.submit(_write_range, cfg, out, s, e, task))
    else:
        for i in range(n_tables):
            write_table(table_at(cfg, i, task), out, i)
            if progress:
                progress(1)
    manifest = {
        "format_version": FORMAT_VERSION,
        "n_tables": n_tables,
        "seed": cfg.seed,
        "task": task,
        "config": asdict(cfg),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, default=str))
    return out


class ParquetTables(Sequence[Table]):
    """A dump folder as a read-only sequence of tables, read lazily (the JSON sidecars are read on demand)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        manifest = self.folder / "manifest.json"
        if not manifest.exists():
            raise ValueError(f"{self.folder} has no manifest.json; write it with `tabfm gen --out {self.folder}`")
        m = json.loads(manifest.read_text())
        if m.get("format_version") != FORMAT_VERSION:
            version = m.get("format_version")
            raise ValueError(f"{manifest} has format_version {version}; this reader knows {FORMAT_VERSION}")
        self.n_tables = int(m["n_tables"])

    def __len__(self) -> int:
        return self.n_tables

    @overload
    def __getitem__(self, i: int) -> Table: ...
    @overload
    def __getitem__(self, i: slice) -> list[Table]: ...
    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(f"table {i} out of range for {len(self)} tables")
        return read_table(self.folder, i % len(self))

    def __iter__(self) -> Iterator[Table]:
        return (self[i] for i in range(len(self)))

    def metas(self) -> list[TableMeta]:
        """All tables' metadata, without reading the cells."""
        return [
            TableMeta.from_dict(json.loads((self.folder / f"table_{i:06d}.json").read_text())) for i in range(len(self))
        ]
