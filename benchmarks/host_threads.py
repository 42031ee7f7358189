"""The estimators' CPU work between forwards (tabfm.table_threads.host_work: preprocessing, the local contexts'
k-means and nearest-row searches, the linear models) on one torch and one BLAS thread, against the same work on
the default threads (as before host_work), side by side in one run, on a quiet machine and beside busy ones.

    python benchmarks/host_threads.py [--busy 0] [--sizes 1000x1000,5000x1000] [--repeats 3] [--n-jobs N]
                                      [--settings classifier,regressor] [--txt FILE]

--busy N starts N processes that spin on a core for the length of the run: a machine that something else is
using, as a laptop or a cross-validation running fits side by side is. Each row: one estimator setting at TRAIN x
TEST rows x 20 numeric features (benchmarks/inference.py's data), best total of --repeats after one warm-up, the
two sides alternating so that a drift of the machine's speed hits both; the forwards run on table threads on
both sides (tabfm.table_threads.map_tables), so only the work between them differs.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from table_threads import side_by_side_main  # noqa: E402

from tabfm.table_threads import host_work_on_all_threads  # noqa: E402


def _spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def busy_processes(count: int) -> Iterator[None]:
    """`count` processes spinning on a core each, stopped when the block ends (also on an error)."""
    procs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(count)]
    for proc in procs:
        proc.start()
    try:
        yield
    finally:
        for proc in procs:
            proc.terminate()
            proc.join()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--busy", type=int, default=0)
    known, rest = p.parse_known_args(argv)

    def title(args: argparse.Namespace) -> str:
        threads = args.n_jobs or torch.get_num_threads()
        return (f"host work on one thread vs on the default {threads} (forwards on {threads} table threads both); "
                f"{known.busy} busy process(es) beside")

    with busy_processes(known.busy):
        side_by_side_main(rest, __doc__, "1000x1000,5000x1000", 3, title, host_work_on_all_threads, ("all", "one"))


if __name__ == "__main__":
    main()
