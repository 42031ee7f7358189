"""The pretraining loop: for each step, the hooks, one optimizer step (tabfm.train_optim), its metrics line,
evaluation when due (tabfm.train_eval) and a checkpoint when due (tabfm.train_checkpoints). Every rank runs it;
rank 0 alone writes the log and shows the bar.

Hooks are called with the 0-based index of each step before it runs, on every rank. They are how tests inject
faults (tests/fault_worker.py kills a rank under torchrun); the loop itself holds no test code.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tabfm.config import RunConfig
from tabfm.data.encode import Batch
from tabfm.data.loader import make_loader
from tabfm.model import TabFM
from tabfm.parallel.mesh import TPMesh
from tabfm.precision import matmul_precision
from tabfm.train_checkpoints import CheckpointManager
from tabfm.train_eval import PeriodicEvaluation
from tabfm.train_log import MetricsLog, Progress
from tabfm.train_optim import lr_at, replica_mean, train_step

StepHook = Callable[[int], None]
"""Called with a step's 0-based index before the step runs (on every rank)."""


class NonFiniteLossError(RuntimeError):
    """A step's loss or gradient norm is NaN or infinite: the run stops before logging or saving it, so the last
    checkpoint on disk is the last good state."""

    def __init__(self, step: int, task: str, loss: float, grad_norm: float, last_good: Path | None) -> None:
        kept = f"the last good checkpoint is {last_good}" if last_good else "no checkpoint was saved yet"
        super().__init__(f"step {step} ({task} batch): loss {loss}, gradient norm {grad_norm}; stopped without "
                         f"saving, {kept} (lower optim.lr or raise optim.warmup_steps, then --resume auto)")


@dataclass
class Trainer:
    """A set-up run (tabfm.pretrain.train builds it) and the loop over its remaining steps."""

    cfg: RunConfig
    model: TabFM
    optimizer: torch.optim.Optimizer
    mesh: TPMesh
    device: torch.device
    checkpoints: CheckpointManager
    metrics: MetricsLog
    evaluation: PeriodicEvaluation
    rank0: bool
    hooks: Sequence[StepHook] = ()

    def run(self, start: int) -> list[dict[str, Any]]:
        """Steps start .. train.steps - 1; returns their metric records (every rank)."""
        total = self.cfg.train.steps
        loader = make_loader(self.cfg.data, dp_rank=self.mesh.dp_axis.index, start_step=start,
                             num_steps=total - start, pin_memory=self.device.type == "cuda")
        progress = Progress(total, start, enabled=self.rank0 and self.cfg.train.progress)
        records: list[dict[str, Any]] = []
        batches = iter(loader)
        tic = time.perf_counter()
        self.model.train()
        try:
            for step in range(start, total):
                batch = next(batches, None)
                if batch is None:
                    break
                waited = time.perf_counter() - tic  # blocked on the loader: the share a GPU leg must keep small
                for hook in self.hooks:
                    hook(step)
                record = self.step(step, batch)
                record["seconds"] = round(time.perf_counter() - tic, 4)
                record["data_seconds"] = round(waited, 4)
                self._check_finite(record)
                records.append(record)
                tic = time.perf_counter()
                self._after_step(record, progress)
        finally:
            progress.close()  # also when a step fails: the same on every rank for a non-finite loss
        return records

    def step(self, step: int, batch: Batch) -> dict[str, Any]:
        """One optimizer step (0-based `step`) and its record (without its duration)."""
        batch = batch.to(self.device)
        lr = lr_at(step, self.cfg.optim, self.cfg.train.steps)
        with matmul_precision(self.cfg.train.precision, self.device):  # TF32 matmuls for precision tf32 on CUDA
            loss, norm = train_step(self.model, self.optimizer, batch, self.mesh, lr, self.cfg.optim,
                                    self.cfg.train.precision)
        return {"step": step + 1, "loss": replica_mean(loss, self.mesh), "lr": lr, "grad_norm": float(norm),
                "task": batch.task, "batch_shape": list(batch.values.shape)}

    def _check_finite(self, record: dict[str, Any]) -> None:
        """Stop (NonFiniteLossError) before a step with a NaN or infinite loss or norm is logged or saved; both
        are reduced over the mesh, so every rank stops and none saves."""
        if not (math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"])):
            raise NonFiniteLossError(record["step"], record["task"], record["loss"], record["grad_norm"],
                                     self.checkpoints.latest())

    def _after_step(self, record: dict[str, Any], progress: Progress) -> None:
        """Log the step, evaluate when due, then save when due. Evaluation comes before the checkpoint: a run
        resumed from that checkpoint never repeats the evaluation, so its line must be on disk."""
        done, total = record["step"], self.cfg.train.steps
        progress.step(record)
        if done % self.cfg.train.log_every == 0 or done == total:
            self.metrics.append(record)
        if self.evaluation.due(done, total):
            result = self.evaluation(self.model, self.mesh)  # every rank of the mesh takes part
            if result is not None:  # global rank 0
                record["eval"] = result
                self.metrics.append({"step": done, "eval": result})
                progress.evaluated(result)
        progress.show()
        if self.checkpoints.due(done, total):
            self.checkpoints.save(self.model, self.optimizer, done)
