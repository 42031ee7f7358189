"""Full vs inducing column attention (issue 12.3): the fit time of a freshly initialised model, side by side.

    python benchmarks/column_stage.py [--rows 1000 5000 20000] [--features 20] [--presets small small_inducing]
                                      [--repeats 1] [--column-max-rows 5000] [--txt runs/benchmarks/column_stage.txt]

One classification table of R train rows x F numeric features (random values, 2 classes, seed 0), float32, on the
CPU. For each preset and R: `fit`, tabfm.inference.encode_context of the train rows (what an estimator's fit runs
per context, in chunks of tabfm.chunked.ROW_CHUNK rows), and `column`, the column stages alone (every axial block's
column module on the cells [1, R, F, E]; up to --column-max-rows rows, since the full stage's own time at 20,000
rows is most of its fit anyway), best of --repeats after one untimed warm-up at the smallest size. The
ratio column is each preset's time over the first preset's. The in-context transformer attends over all train rows
whichever the column stage, so `fit` stays quadratic in R; `column` shows the stage this option changes.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import torch

from tabfm.data.encode import Batch
from tabfm.inference import encode_context
from tabfm.model import KeyRows, TabFM, build_model
from tabfm.out_paths import benchmark_output


def table(rows: int, features: int, seed: int = 0) -> Batch:
    """One table of `rows` train rows x `features` numeric features, binary labels."""
    g = torch.Generator().manual_seed(seed)
    shape = (1, rows, features)
    return Batch(values=torch.randn(shape, generator=g), missing=torch.zeros(shape, dtype=torch.bool),
                 cat_codes=torch.full(shape, -1), is_cat=torch.zeros(1, features, dtype=torch.bool),
                 n_cats=torch.zeros(1, features, dtype=torch.long), labels=torch.randint(0, 2, (1, rows), generator=g),
                 n_train=torch.tensor([rows]), n_classes=torch.tensor([2]),
                 row_pad=torch.zeros(1, rows, dtype=torch.bool), col_pad=torch.zeros(1, features, dtype=torch.bool),
                 task="classification")


def best_of(repeats: int, fn) -> float:
    """The fastest of `repeats` timed calls of fn(), in seconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


@torch.no_grad()
def measure(model: TabFM, batch: Batch, repeats: int, column: bool = True) -> tuple[float, float | None]:
    """(fit s, column-stage s or None when not `column`) of `model` on the train rows of `batch`."""
    fit = best_of(repeats, lambda: encode_context(model, batch))
    if not column:
        return fit, None
    x = model.cells(batch.values, batch.missing, batch.cat_codes, batch.is_cat,
                    model.cells.stats(batch.values, batch.missing, batch.n_train))
    kv = KeyRows(batch.values.shape[1], None)
    column = best_of(repeats, lambda: [block.column(x, kv) for block in model.axial])
    return fit, column


def _parser() -> argparse.ArgumentParser:
    """The command line (apart from main, so that its defaults can be read without timing anything)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1000, 5000, 20000])
    p.add_argument("--features", type=int, default=20)
    p.add_argument("--presets", nargs="+", default=["small", "small_inducing"])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--column-max-rows", type=int, default=5000, help="time the column stages alone up to this")
    p.add_argument("--txt", type=Path, default=benchmark_output("column_stage.txt"))
    return p


def main() -> None:
    args = _parser().parse_args()

    models = {name: build_model(name, seed=0).eval() for name in args.presets}
    measure(models[args.presets[0]], table(min(args.rows), args.features), 1)  # warm-up
    lines = [f"# column stage: fit (encode_context) and column-stage time, one table x {args.features} features, "
             f"float32, CPU",
             f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs "
             f"({platform.processor() or platform.machine()}), load average "
             f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}; best of {args.repeats}",
             "", "| rows | preset | fit s | fit ratio | column s | column ratio |", "|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for rows in args.rows:
        batch, first = table(rows, args.features), None
        for name, model in models.items():
            fit, column = measure(model, batch, args.repeats, rows <= args.column_max_rows)
            first = first or (fit, column)
            shown = "- | -" if column is None else f"{column:.3f} | {column / first[1]:.2f}x"
            line = f"| {rows} | {name} | {fit:.2f} | {fit / first[0]:.2f}x | {shown} |"
            print(line, flush=True)
            lines.append(line)
    args.txt.parent.mkdir(parents=True, exist_ok=True)
    args.txt.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.txt}")


if __name__ == "__main__":
    main()
