"""The gradient-boosted trees' fits of one estimator fit, run in a thread beside the model's forwards.

Why: with tree_blend an estimator fits the trees once per calibration fold (on the rows the fold leaves out, to
score its rows) and once on every train row, and none of these fits needs the model: they need only the
preprocessed cells, the targets, the folds and a seed, all known before the first forward. Run one after another
on the calling thread they added 0.3 s to a 1.3 s fit at 1,000 x 20 on two cores, and seconds at 50,000 rows, where
on a GPU machine the host's cores sit idle while the device encodes. Started here before the forwards, they run
while those do, and the fit takes their results when it reaches them. The trees do not depend on the thread that
fits them nor on its thread count (scikit-learn's HistGradientBoosting is deterministic for a seed), so the fitted
estimator is the one a sequential fit gives, bit for bit.

The fit on every train row can start before the trees' weight is known (`ahead`), to be kept only where the weight
is above 0; where it is not kept, closing waits for it if it has started, so no fit outlives the estimator's `fit`.
The estimators start it ahead where the trees grow one tree per round (a regression, two classes): there a wasted
fit costs little. With K classes each round grows K trees: at 100 classes x 1,000 rows a fit took 6.7 s, and one
fitted ahead and then not kept made the fit 16 s against 9 s.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType

import numpy as np
import torch

from tabfm.preprocess import Cells
from tabfm.tree_base import TreeModel, fit_trees


class TreeFits:
    """The trees of each fold's kept rows and (where `ahead`) of every row, fitted in order on one thread of
    `threads` OpenMP threads. Use as a context manager: leaving the block drops the fits not yet started (and,
    after an exception, does not wait for the running one)."""

    def __init__(self, cells: Cells, targets: np.ndarray, n_classes: int | None, seed: int,
                 folds: list[np.ndarray], threads: int, ahead: bool = True):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tabfm-trees", initializer=torch.set_num_threads,
                                        initargs=(threads,))  # tree_base reads the count from torch's, per thread
        n = len(targets)
        kept = [np.setdiff1d(np.arange(n), fold) for fold in folds]
        self._folds: list[Future] = [self._pool.submit(fit_trees, cells.take(keep), targets[keep], n_classes, seed)
                                     for keep in kept]
        self._all_rows = (cells, targets, n_classes, seed)
        self._all: Future | None = self._pool.submit(fit_trees, *self._all_rows) if ahead else None

    def fold_model(self, fold: int) -> TreeModel:
        """The trees fitted without the rows of folds[fold] (waits for them)."""
        return self._folds[fold].result()

    def all_rows_model(self) -> TreeModel:
        """The trees fitted on every train row: those started ahead, or started now, on the trees' thread with its
        `threads` either way (waits for them). Why not on the calling thread with its threads, the forwards being
        done by then: on a CPU whose cores something else keeps busy, a team of OpenMP threads waits at every
        node's parallel region for a thread that has no core; a HistGradientBoosting fit of 1,000 rows x 8 classes
        took 4.5-140 s on 2 threads beside other processes, 1.4-1.5 s on one."""
        if self._all is None:
            self._all = self._pool.submit(fit_trees, *self._all_rows)
        return self._all.result()

    def __enter__(self) -> TreeFits:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self._pool.shutdown(wait=kind is None, cancel_futures=True)
