"""A pretraining run's checkpoints, as the loop sees them: where a run resumes from, when to save, saving, and
pruning to the newest few. The folders themselves are tabfm.checkpoint's (checkpoint_run: step_<digits>/ and
`latest` under <out_dir>/checkpoints)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tabfm import checkpoint as ckpt
from tabfm.config import RunConfig
from tabfm.model import TabFM
from tabfm.out_paths import checkpoints_of
from tabfm.parallel.mesh import TPMesh
from tabfm.train_log import MetricsLog


class CheckpointManager:
    """Save, prune and resume one run's checkpoints under <out_dir>/checkpoints.

    resume: None (a fresh run), "auto" (the latest checkpoint, or step 0 when there is none) or a checkpoint
    folder. The checkpoint to resume from is found when the manager is made, before the model is built, because
    a run that resumes must not start from `train.init_from`'s weights. `metrics`: the run's log, trimmed on
    resume to the lines up to the resumed step. Only `rank0` prints, trims and prunes; every rank saves.
    """

    def __init__(self, out_dir: str | Path, mesh: TPMesh, *, every: int = 0, keep: int = 0,
                 resume: str | None = None, metrics: MetricsLog | None = None, rank0: bool = True,
                 run_config: dict[str, Any] | None = None, data_seed: int | None = None) -> None:
        self.out_dir = Path(out_dir)
        self.root = checkpoints_of(self.out_dir)
        self.mesh, self.every, self.keep = mesh, every, keep
        self.resuming, self.metrics, self.rank0 = resume is not None, metrics, rank0
        self.run_config, self.data_seed = run_config, data_seed
        self.resume_from = self._find(resume)

    @classmethod
    def for_run(cls, cfg: RunConfig, mesh: TPMesh, resume: str | None, metrics: MetricsLog | None,
                rank0: bool) -> CheckpointManager:
        """The manager of a run config: train.out_dir, checkpoint_every, keep_checkpoints; the config and the data
        seed go into every manifest."""
        return cls(cfg.train.out_dir, mesh, every=cfg.train.checkpoint_every, keep=cfg.train.keep_checkpoints,
                   resume=resume, metrics=metrics, rank0=rank0, run_config=cfg.to_dict(), data_seed=cfg.data.seed)

    def _find(self, resume: str | None) -> Path | None:
        """The checkpoint `resume` names: the latest for "auto" (rank 0 says when there is none)."""
        if resume is None:
            return None
        if resume != "auto":
            return Path(resume)
        path = self.latest()
        if path is None and self.rank0:
            print(f"--resume auto: no checkpoint under {self.root}, starting from step 0", file=sys.stderr)
        return path

    def latest(self) -> Path | None:
        """The newest complete checkpoint of the run (see checkpoint.latest_checkpoint)."""
        return ckpt.latest_checkpoint(self.out_dir)

    def restore(self, model: TabFM, optimizer: torch.optim.Optimizer) -> int:
        """Fill model and optimizer from the checkpoint resumed from and return the step to continue at (0 when
        there is none). On resume the metrics log keeps only the lines up to that step: with no checkpoint yet it
        empties the log of the run that crashed before its first save."""
        start = 0
        if self.resume_from is not None:
            state = ckpt.load_checkpoint(self.resume_from, model, optimizer)
            start = int(state.data_position.get("next_step", state.step))
        if self.rank0 and self.resuming and self.metrics is not None:
            self.metrics.keep_until(start)
        return start

    def due(self, done: int, total: int) -> bool:
        """Whether to save after step `done` of `total`: every `every` steps (never when 0) and after the last."""
        return bool(self.every and done % self.every == 0) or done == total

    def save(self, model: TabFM, optimizer: torch.optim.Optimizer, done: int) -> Path:
        """Save after step `done` (collective: every rank calls it), then rank 0 points `latest` at it and prunes
        to the newest `keep` (all when 0), and all ranks wait for that: see _wait_for_latest."""
        name = f"step_{done:07d}"
        if self.rank0 and self.metrics is not None:
            self.metrics.sync()  # the log's lines up to this step are on disk before the checkpoint that ends them
        path = ckpt.save_checkpoint(self.root / name, model, optimizer, mesh=self.mesh, step=done,
                                    data_position={"next_step": done, "seed": self.data_seed},
                                    run_config=self.run_config)
        if self.rank0:
            ckpt.mark_latest(self.root, name, self.keep)  # `latest` -> name, then prune old ones and leftovers
        self._wait_for_latest()
        return path

    @staticmethod
    def _wait_for_latest() -> None:
        """A barrier after rank 0 marked and pruned: no rank starts the next step before `latest` names this
        checkpoint, so a rank that dies in a later step (and torchrun's restart of all of them) resumes from here,
        and the next save never starts while rank 0 is still removing folders from the checkpoints directory."""
        if dist.is_initialized():
            dist.barrier()
