"""How fast one loader worker makes pretraining tables, and what they look like.

    python benchmarks/prior.py [--sizes 64x8,256x16,1024x32,4096x64] [--consumption-rate TABLES_PER_S]
                               [--png runs/benchmarks/prior_tables.png]

Each measurement is the whole per-step path a worker runs (draw tables from the prior, make them messy polars
DataFrames, encode to padded tensors) in this one process, so the rates are per worker. The PNG shows a grid of
classification tables: two numeric feature columns against each other, coloured by class.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import time
from pathlib import Path


from tabfm.data.config import DataConfig, TableConfig
from tabfm.data.loader import PriorSource, batch_at
from tabfm.data.priors.mix import PRIOR_NAMES, PriorConfig
from tabfm.data.tables import TARGET, Table
from tabfm.out_paths import benchmark_output, check_png


def measure(prior: str, rows: int, cols: int, batch_size: int, min_seconds: float) -> tuple[float, float]:
    """(tables/s, cells/s) of one process drawing steps of `batch_size` tables of exactly rows x cols."""
    table = TableConfig(min_rows=rows, max_rows=rows, min_features=cols, max_features=cols)
    src = PriorSource(DataConfig(seed=0, batch_size=batch_size, prior=PriorConfig(name=prior), table=table))
    batch_at(src, 0)  # warm-up
    steps, start = 0, time.perf_counter()
    while steps < 2 or time.perf_counter() - start < min_seconds:
        batch_at(src, 1 + steps)
        steps += 1
    tables_per_s = steps * batch_size / (time.perf_counter() - start)
    return tables_per_s, tables_per_s * rows * (cols + 1)


def draw_grid(path: Path, n_panels: int = 12, seed: int = 0) -> None:
    """A grid of classification tables from the mix prior: two numeric columns per panel, coloured by class."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = TableConfig(
        min_rows=200, max_rows=400, min_features=4, max_features=8, regression_prob=0.0, categorical_prob=0.1
    )
    src = PriorSource(DataConfig(seed=seed, batch_size=1, table=table))
    picked: list[tuple[Table, list[str]]] = []
    step = 0
    while len(picked) < n_panels:
        t = src.tables(step, 0)[0]
        step += 1
        numeric = [c for c in t.meta.columns if c.kind != "categorical" and c.role == "signal"]
        if len(numeric) >= 2:
            picked.append((t, numeric[:2]))
    n_cols = 4
    n_rows = math.ceil(n_panels / n_cols)
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(4 * n_cols, 3.4 * n_rows))
    for ax, (t, (a, b)) in zip(axes.flat, picked):
        d = t.df.select(a.name, b.name, TARGET).drop_nulls()
        ax.scatter(d[a.name], d[b.name], c=d[TARGET], cmap="tab10", vmin=0, vmax=9, s=7, alpha=0.8)
        ax.set_xlabel(f"{a.name} ({a.kind})", fontsize=8)
        ax.set_ylabel(f"{b.name} ({b.kind})", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.set_title(f"{t.meta.prior}, {t.meta.n_classes} classes, {t.df.height} rows", fontsize=9)
    for ax in list(axes.flat)[len(picked):]:
        ax.axis("off")
    fig.suptitle("tabfm synthetic prior (mix): two numeric features per table, coloured by class", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def _checked(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[tuple[int, int]]:
    """The sizes, each flag checked before any timing (a bad prior, size or --png had been a traceback, naming the
    prior's config keys or after every measurement), refused in one line naming the flag."""
    for prior in args.priors.split(","):
        if prior not in PRIOR_NAMES:
            p.error(f"--priors {prior}: no such prior; choose from {','.join(PRIOR_NAMES)}")
    if args.batch_size < 1:
        p.error(f"--batch-size {args.batch_size}: give 1 or more tables per step")
    sizes = []
    for size in args.sizes.split(","):
        rows, _, cols = size.partition("x")
        if not (rows.isdigit() and cols.isdigit()):
            p.error(f"--sizes {size}: give ROWSxCOLS sizes such as 64x8,256x16")
        try:
            TableConfig(min_rows=int(rows), max_rows=int(rows), min_features=int(cols), max_features=int(cols))
        except ValueError as e:
            p.error(f"--sizes {size}: the prior makes no table of {rows} rows x {cols} columns ({e}); give larger "
                    "sizes such as 64x8")
        sizes.append((int(rows), int(cols)))
    try:
        check_png(args.png, "--png")
    except ValueError as e:
        p.error(str(e))
    return sizes


def _parser() -> argparse.ArgumentParser:
    """The command line (apart from main, so that its defaults can be read without timing anything)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="64x8,256x16,1024x32,4096x64", help="ROWSxCOLS table sizes, comma-separated")
    p.add_argument("--priors", default=",".join(PRIOR_NAMES), help="priors to time, comma-separated")
    p.add_argument("--batch-size", type=int, default=8, help="tables per step")
    p.add_argument("--seconds", type=float, default=1.5, help="minimum time per measurement")
    p.add_argument("--consumption-rate", type=float, default=None,
                   help="tables/s the training step consumes; prints how many workers keep up")  # fmt: skip
    p.add_argument("--png", type=Path, default=benchmark_output("prior_tables.png"), help="where to draw tables")
    return p


def main() -> None:
    p = _parser()
    args = p.parse_args()

    sizes = _checked(p, args)
    machine = platform.processor() or platform.machine()
    print(f"machine: {machine}, {os.cpu_count()} CPU cores; one process = one worker")
    print(f"steps of {args.batch_size} tables, generation + mess + tensor encoding, >= {args.seconds}s per row\n")
    print(f"{'prior':<6} {'rows':>6} {'cols':>5} {'tables/s':>10} {'cells/s':>12} {'ms/table':>9}")
    mix_rates: dict[tuple[int, int], float] = {}
    for prior in args.priors.split(","):
        for rows, cols in sizes:
            tps, cps = measure(prior, rows, cols, args.batch_size, args.seconds)
            if prior == "mix":
                mix_rates[(rows, cols)] = tps
            print(f"{prior:<6} {rows:>6} {cols:>5} {tps:>10.1f} {cps:>12.3g} {1000 / tps:>9.2f}")

    print()
    if args.consumption_rate is None:
        print("no --consumption-rate given, so no producer/consumer ratio is printed; rerun with --consumption-rate")
        print("<tables/s a training step consumes: tables per step / step time, which benchmarks/pretrain.py and")
        print("gpu_pretrain.py time> to get the workers needed per size.")
    else:
        print(f"consumption rate {args.consumption_rate:g} tables/s (mix prior):")
        for (rows, cols), tps in mix_rates.items():
            ratio = tps / args.consumption_rate
            print(f"  {rows}x{cols}: one worker makes {ratio:.2f}x what training eats -> "
                  f"{math.ceil(1 / ratio)} worker(s) needed")  # fmt: skip
    draw_grid(args.png)
    print(f"\ntable grid written to {args.png}")


if __name__ == "__main__":
    main()
