"""Evaluation during pretraining: every `train.eval_every` steps and at the end, the model is evaluated on a few
real tables (tabfm.evaluate). It draws no random numbers from the training streams and changes no batch, so
resumed runs stay exact with it on."""

from __future__ import annotations

import sys
from typing import Any

from tabfm.config import RunConfig
from tabfm.evaluate import evaluate, load_tables
from tabfm.model import TabFM
from tabfm.parallel.mesh import TPMesh


class PeriodicEvaluation:
    """The evaluation tables of a run (loaded once; rank 0 says which it skips) and when to evaluate."""

    def __init__(self, cfg: RunConfig, rank0: bool) -> None:
        self.every = cfg.train.eval_every
        self.tables: list = []
        if self.every:
            self.tables, notes = load_tables(cfg.train.eval_tables, cfg.train.eval_max_train_rows,
                                             model_cfg=cfg.model)
            if rank0:
                for note in notes:
                    print(f"evaluation skips {note}", file=sys.stderr)

    def due(self, done: int, total: int) -> bool:
        """After step `done` of `total`: every `every` steps and after the last one (never without tables)."""
        return bool(self.tables) and (done % self.every == 0 or done == total)

    def __call__(self, model: TabFM, mesh: TPMesh) -> dict[str, Any] | None:
        """Metrics on every table (global rank 0), None elsewhere; every rank of the mesh must call it."""
        return evaluate(model, self.tables, mesh)
