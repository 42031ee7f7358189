"""`tabfm gen`: write synthetic tables from the prior as Parquet shards with a JSON sidecar each."""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import replace
from pathlib import Path

from tabfm.data.config import DataConfig, TableConfig, check_tables_fit_memory
from tabfm.data.priors.mix import PRIOR_NAMES, PriorConfig
from tabfm.out_paths import file_in_the_way


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `gen` on the `tabfm` command."""
    p = subparsers.add_parser(
        "gen",
        help="write synthetic tables (Parquet + JSON sidecars)",
        description="Draw tables from the synthetic prior and write table_NNNNNN.parquet + .json per table, "
        "plus manifest.json. Table i depends only on (seed, i).",
    )
    p.add_argument("--prior", choices=PRIOR_NAMES, default="mix", help="prior family (default: mix)")
    p.add_argument("--n-tables", type=int, default=1000, help="tables to write (default: 1000)")
    p.add_argument("--out", required=True, help="output folder (created if missing; must be empty unless --overwrite)")
    p.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty folder: an earlier run's table_*.parquet/.json and manifest.json "
                   "there are deleted first, other files are left alone")
    p.add_argument("--seed", type=int, default=0, help="root seed (default: 0)")
    p.add_argument("--task", choices=("any", "classification", "regression"), default="any",
                   help="force every table's task (default: drawn per table)")  # fmt: skip
    d = TableConfig()
    for flag, what in (
        ("min_rows", "fewest rows per table"),
        ("max_rows", "most rows per table"),
        ("min_features", "fewest feature columns"),
        ("max_features", "most feature columns"),
        ("max_classes", "most classes, 2..10"),
    ):
        default = getattr(d, flag)
        p.add_argument("--" + flag.replace("_", "-"), type=int, default=default, help=f"{what} (default: {default})")
    p.add_argument("--workers", type=int, default=0, help="processes drawing tables (default: 0, this one)")
    p.add_argument("--quiet", action="store_true", help="no progress bar (errors still show)")
    p.set_defaults(run=run)


GEN_FILES = ("table_*.parquet", "table_*.json", "manifest.json")
"""What `tabfm gen` writes into --out, and so what --overwrite deletes there (nothing else)."""


def prepare_out(out: str, overwrite: bool) -> None:
    """Refuse an --out that is a file, or a non-empty folder without --overwrite (tables of two runs would mix
    silently); with --overwrite, delete an earlier run's files first."""
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    blocker = file_in_the_way(folder)
    if blocker is not None:
        raise ValueError(f"--out {out}: {blocker} is a file, not a folder")
    if not folder.is_dir() or not any(folder.iterdir()):
        return
    if not overwrite:
        raise ValueError(f"--out {out} is not empty; choose an empty or new folder, or pass --overwrite to replace "
                         "an earlier run's tables there")
    for pattern in GEN_FILES:
        for old in folder.glob(pattern):
            old.unlink()


_FLAG_NAMES = re.compile(r"\b(?:table\.|data\.)?(min_rows|max_rows|min_features|max_features|max_classes|seed)\b")


def data_config(args: argparse.Namespace) -> DataConfig:
    """The prior's config from gen's options; its ValueError in gen's own words (--max-rows, not table.max_rows: a
    key of a config file that gen has none of)."""
    try:
        table = replace(
            TableConfig(),
            min_rows=args.min_rows,
            max_rows=args.max_rows,
            min_features=args.min_features,
            max_features=args.max_features,
            max_classes=args.max_classes,
        )
        return DataConfig(seed=args.seed, prior=PriorConfig(name=args.prior), table=table)
    except ValueError as e:
        raise ValueError(_FLAG_NAMES.sub(lambda m: "--" + m.group(1).replace("_", "-"), str(e))) from None


def run(args: argparse.Namespace) -> int:
    """Write the tables; 0 on success, 2 on a bad option (with what to change)."""
    from tqdm import tqdm

    from tabfm.data.dump import check_fits_disk, write_tables

    try:
        cfg = data_config(args)
        check_tables_fit_memory(args.max_rows, args.max_features, 1, f"--max-rows {args.max_rows}")
        if args.workers < 0:
            raise ValueError(f"--workers={args.workers} must be >= 0")
        if args.n_tables < 1:
            raise ValueError(f"--n-tables={args.n_tables} must be >= 1")
        check_fits_disk(Path(args.out), args.n_tables)
        prepare_out(args.out, args.overwrite)
        with tqdm(total=args.n_tables, unit="table", desc=f"gen {args.prior}", disable=args.quiet) as bar:
            out = write_tables(
                cfg,
                args.out,
                args.n_tables,
                task=None if args.task == "any" else args.task,
                workers=args.workers,
                progress=bar.update,
            )
    except (ValueError, OSError) as e:
        print(f"tabfm gen: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.n_tables} tables to {out}")
    return 0
