"""Heap-sized CPU forwards (tabfm.forward_sizes) against forwards bounded by the cell budget alone (as before),
side by side in one run: fit and predict times of the default estimators on this machine's CPU, and how far the
predictions moved (float rounding of batched matmuls only).

    python benchmarks/forward_sizes.py [--sizes 1000x1000,5000x1000,10000x1000] [--repeats 2] [--n-jobs N]
                                       [--txt FILE]

Each row: one estimator setting at TRAIN x TEST rows x 20 numeric features (make_classification /
make_regression, seed 0, as benchmarks/inference.py), best total of --repeats after one warm-up, the two sides
alternating so a drift of the machine's speed hits both alike (benchmarks/table_threads.compare). The reference
sets tabfm.forward_sizes.HEAP_BLOCK_BYTES to None: forwards of up to tabfm.forward_sizes.CONTEXT_CELL_BUDGET cells.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from table_threads import side_by_side_main  # noqa: E402

import tabfm.forward_sizes  # noqa: E402


@contextlib.contextmanager
def cell_budget_only() -> Iterator[None]:
    """The reference: no heap bound on a CPU forward."""
    before = tabfm.forward_sizes.HEAP_BLOCK_BYTES
    tabfm.forward_sizes.HEAP_BLOCK_BYTES = None
    try:
        yield
    finally:
        tabfm.forward_sizes.HEAP_BLOCK_BYTES = before


def main(argv: list[str] | None = None) -> None:
    def title(args: argparse.Namespace) -> str:
        return (f"forwards within {tabfm.forward_sizes.HEAP_BLOCK_BYTES >> 20} MiB of widest activation vs the cell "
                f"budget alone; n_jobs={args.n_jobs}")

    side_by_side_main(argv, __doc__, "1000x1000,5000x1000,10000x1000", 2, title, cell_budget_only, ("ref", "new"))


if __name__ == "__main__":
    main()
