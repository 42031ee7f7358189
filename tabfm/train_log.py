"""What a pretraining run reports: one JSON line per logged step (and per evaluation) in <out_dir>/metrics.jsonl,
and a tqdm bar; both on global rank 0 only (other ranks hold disabled ones, so the loop needs no rank tests)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tabfm._cli_train import read_metrics_file


class MetricsLog:
    """<out_dir>/metrics.jsonl: appended line by line, so a crash loses at most the line being written."""

    def __init__(self, path: str | Path, enabled: bool = True) -> None:
        self.path = Path(path)
        self.enabled = enabled

    def append(self, record: dict[str, Any]) -> None:
        """Write one record as a JSON line."""
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def sync(self) -> None:
        """Force the lines written so far onto the disk (fsync). Called before each checkpoint is saved, whose files
        are fsynced too: a checkpoint that survives a machine crash then never finds its own step's line torn or
        missing, which a resume from it could not write again."""
        if self.enabled and self.path.is_file():
            with open(self.path, "rb+") as f:
                os.fsync(f.fileno())

    def keep_until(self, step: int) -> None:
        """Keep only the lines up to `step` (none for step 0): a crashed run wrote lines after the checkpoint it
        resumes from. A torn last line is dropped with a warning. Written to a temporary file, then renamed."""
        if not self.enabled or not self.path.is_file():
            return
        kept = [r for r in read_metrics_file(self.path) if r["step"] <= step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in kept))
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(self.path)


class Progress:
    """The tqdm bar of a run: steps done, and the latest loss, learning rate and evaluation as its postfix."""

    def __init__(self, total: int, start: int, enabled: bool) -> None:
        self.bar = tqdm(total=total, initial=start, disable=not enabled, desc="pretrain", dynamic_ncols=True)
        self.enabled = enabled
        self.postfix: dict[str, str] = {}

    def step(self, record: dict[str, Any]) -> None:
        """One step done: advance the bar and note its loss and learning rate."""
        if self.enabled:
            self.bar.update(1)
            self.postfix.update(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}")

    def evaluated(self, result: dict[str, Any]) -> None:
        """Note an evaluation's mean ROC-AUC and accuracy."""
        self.postfix.update(auc=f"{result['mean_roc_auc']:.3f}", acc=f"{result['mean_accuracy']:.3f}")

    def show(self) -> None:
        """Redraw the postfix (once per step, after the step's evaluation)."""
        if self.enabled:
            self.bar.set_postfix(self.postfix)

    def close(self) -> None:
        self.bar.close()
