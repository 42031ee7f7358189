"""The leg of the GPU recipe (benchmarks/gpu_state.py leg): resume the committed state, run one tabfm.pretrain
process per stage it crosses, stop each at a stage boundary, the leg's step cap or the deadline (SIGINT to its
process group), roll back to the last checkpoint at or before the boundary, and save the state, the merged model
and state.json into OUT, also every save_every_s while training so that a lease cut short still returns a state.
Split from benchmarks/gpu_state.py (the command line) so that each module has one job."""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from gpu_statefile import HISTORY_FILE, HISTORY_FORMAT, STATE_FILE, _write_atomic, pack, sha256, write_history


@dataclass(frozen=True)
class Stage:
    """One config of the recipe, used from step `start` until the next stage's start."""

    config: str
    start: int


def parse_stages(texts: list[str]) -> list[Stage]:
    """'CONFIG:START' items, the first starting at 0 and the starts increasing."""
    stages = []
    for text in texts:
        config, sep, start = text.rpartition(":")
        if not sep or not start.isdigit():
            raise ValueError(f"--stage {text!r}: write it as CONFIG:FIRST_STEP, e.g. configs/pretrain/gpu.yaml:0")
        stages.append(Stage(config, int(start)))
    starts = [s.start for s in stages]
    if not stages or starts[0] != 0 or starts != sorted(set(starts)):
        raise ValueError(f"--stage: the first stage must start at step 0 and the starts increase, got {starts}")
    return stages


def stage_at(stages: list[Stage], step: int) -> tuple[Stage, int | None]:
    """The stage that runs `step` and the step where the next one starts (None for the last)."""
    index = max(i for i, s in enumerate(stages) if s.start <= step)
    return stages[index], stages[index + 1].start if index + 1 < len(stages) else None


LEG_SETS = {"train.out_dir": "the run folder under the state's", "train.device": "--device",
            "train.progress": "off, the log is the session's", "train.keep_checkpoints": "0, every checkpoint kept",
            "train.init_from": "--init-from"}
"""The settings segment_command gives every pretraining process of a leg, with what sets them instead."""


def stage_configs(stages: list[Stage], overrides: list[str], repo: Path) -> list[Any]:
    """The RunConfig of every stage, checked to share one schedule (steps and optim) and one model, so that a
    process of any stage continues the state of another exactly."""
    from tabfm.config import load_config

    for item in overrides:  # each process's command line sets these itself (segment_command): refused there late
        key = item.split("=", 1)[0].strip()
        if key in LEG_SETS:
            raise ValueError(f"--set {key}: a leg sets it itself ({LEG_SETS[key]}); leave it out")
    cfgs = [load_config(repo / s.config, overrides) for s in stages]
    first = cfgs[0]
    for s, c in zip(stages, cfgs, strict=True):
        if (c.train.steps, c.optim, c.model) != (first.train.steps, first.optim, first.model):
            raise ValueError(f"{s.config} differs from {stages[0].config} in train.steps, optim or model: the "
                             "stages must share one schedule and one model")
        if c.train.checkpoint_every < 1 or s.start % c.train.checkpoint_every:
            raise ValueError(f"{s.config}: its start {s.start} must be a multiple of train.checkpoint_every "
                             f"({c.train.checkpoint_every}) so that a checkpoint lands on the boundary")
    return cfgs


def checkpoint_step(run_dir: Path) -> int:
    """The step of the run's latest complete checkpoint (0 without one)."""
    from tabfm import checkpoint as ckpt

    path = ckpt.latest_checkpoint(run_dir)
    return 0 if path is None else int(ckpt.read_manifest(path)["step"])


def roll_back(run_dir: Path, stop_at: int) -> int:
    """Delete the checkpoints after `stop_at` (a process stopped late ran past it) and point `latest` at the
    newest one left; returns its step (0 when none is left)."""
    from tabfm import checkpoint as ckpt

    root = run_dir / "checkpoints"
    kept = []
    for path in ckpt.step_checkpoints(root):
        if int(path.name[len("step_"):]) > stop_at:
            (path / ckpt.MANIFEST).unlink()
            shutil.rmtree(path)
        else:
            kept.append(path)
    if not kept:
        return 0
    ckpt.mark_latest(root, kept[-1].name)
    return int(kept[-1].name[len("step_"):])


def stop_process(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGINT to the process group we started (trainer and loader workers), SIGKILL what is left after
    `grace_s`. Only this group: it was created for `proc` (start_new_session)."""
    for sig, wait in ((signal.SIGINT, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        try:  # the trainer is gone; its workers may not be
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return


@dataclass
class Leg:
    """What one leg does and has done (its record goes into state.json)."""

    repo: Path
    run_dir: Path
    out: Path
    deadline: float
    stages: list[Stage]
    overrides: list[str]
    device: str
    init_from: str
    leg_steps: int
    min_segment_s: float
    save_every_s: float
    started: float
    history: dict[str, Any]
    cfgs: list[Any] = field(default_factory=list)
    """Each stage's RunConfig (with the overrides)."""
    from_step: int = 0
    segments: list[dict[str, Any]] = field(default_factory=list)
    """The processes that ran: config, first and last step, seconds, why they stopped."""
    running: dict[str, Any] | None = None
    """The process running now (config, from, start time), for saves while it trains."""
    stopped: str = "running"
    last_save: float = 0.0


def segment_command(leg: Leg, stage: Stage, step: int) -> list[str]:
    """The command line of one tabfm.pretrain process of `stage` resuming the run at `step` (a test replaces it
    by a stand-in trainer)."""
    # keep_checkpoints=0: the boundary's checkpoint must survive the steps a stopped process ran past it
    sets = [*leg.overrides, f"train.out_dir={leg.run_dir}", f"train.device={leg.device}", "train.progress=false",
            "train.keep_checkpoints=0"]
    if step == 0 and leg.init_from:  # the recipe's first process: the shipped weights, a fresh optimizer
        sets.append(f"train.init_from={leg.init_from}")
    return [sys.executable, "-m", "tabfm.pretrain", "--config", str(leg.repo / stage.config), "--set", *sets,
            "--resume", "auto"]


def run_segment(leg: Leg, stage: Stage, stop_at: int, log: Path) -> str:
    """One tabfm.pretrain process of `stage` from the run's latest checkpoint, stopped once a checkpoint at or
    past `stop_at` (a stage boundary or the leg's step cap) lands, or at the last checkpoint before the deadline,
    or at the deadline. Returns why it stopped: 'boundary', 'deadline', 'complete' (the schedule's last step) or
    'error: ...'."""
    step0 = checkpoint_step(leg.run_dir)
    tic = time.time()
    with open(log, "a") as f:
        f.write(f"=== {stage.config} from step {step0}, stop at {stop_at}\n")
        f.flush()
        proc = subprocess.Popen(segment_command(leg, stage, step0), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    why, seen, arrivals = "", step0, [tic]
    leg.running = {"config": stage.config, "from": step0, "tic": tic}
    try:
        while why == "":
            time.sleep(0.5)
            step, now = checkpoint_step(leg.run_dir), time.time()
            landed = step != seen
            if landed:
                seen = step
                arrivals.append(now)
            # Seconds between checkpoints (the first arrival also holds the start-up): stop at the last checkpoint
            # before the deadline rather than lose the steps after it.
            interval = arrivals[-1] - arrivals[-2] if len(arrivals) > 2 else 0.0
            if step >= stop_at:
                why = "boundary"
            elif now >= leg.deadline or (landed and now + interval > leg.deadline):
                why = "deadline"
            elif proc.poll() is not None:
                why = "complete" if proc.returncode == 0 else f"error: exit status {proc.returncode}, see the log"
            elif landed:
                maybe_save(leg)
    finally:
        running = proc.poll() is None
        stop_process(proc)
    if running:
        with open(log, "a") as f:
            f.write(f"=== stopped by the leg driver (SIGINT to its process group): {why}\n")
    step = roll_back(leg.run_dir, stop_at)
    leg.running = None
    leg.segments.append({"config": stage.config, "from": step0, "to": step, "seconds": round(time.time() - tic, 1),
                         "stopped": why})
    return why


def run_leg(leg: Leg) -> dict[str, Any]:
    """Train segment after segment (run_segment) until the deadline, the leg's step
    cap or the end of the schedule; then pack the state, merge the model and write state.json into leg.out.
    Returns the history written."""
    leg.cfgs = stage_configs(leg.stages, leg.overrides, leg.repo)
    total = leg.cfgs[0].train.steps
    leg.from_step = checkpoint_step(leg.run_dir)
    cap = leg.from_step + leg.leg_steps if leg.leg_steps else total
    while True:
        step = checkpoint_step(leg.run_dir)
        if step >= total or step >= cap or leg.deadline - time.time() < leg.min_segment_s:
            leg.stopped = "complete" if step >= total else "leg_steps" if step >= cap else "deadline"
            break
        stage, end = stage_at(leg.stages, step)
        why = run_segment(leg, stage, min(end or total, cap, total), leg.out / "train.log")
        if why in ("boundary", "complete") and checkpoint_step(leg.run_dir) <= step:
            why = f"error: no checkpoint past step {step} ({why}); see train.log"  # e.g. a cap off the grid
        if why.startswith("error") or why == "deadline":
            leg.stopped = why
            break
    return save(leg, final=True)


def maybe_save(leg: Leg) -> None:
    """Save into OUT at most every save_every_s while training, so a lease cut short still returns a state."""
    if time.time() - leg.last_save >= leg.save_every_s:
        save(leg, final=False)


def _segments(leg: Leg, upto: int) -> list[dict[str, Any]]:
    """The leg's segments so far, the running one up to step `upto`."""
    done = list(leg.segments)
    if leg.running is not None:
        r = leg.running
        done.append({"config": r["config"], "from": r["from"], "to": upto,
                     "seconds": round(time.time() - r["tic"], 1), "stopped": "running"})
    return done


def _tables(leg: Leg, segments: list[dict[str, Any]]) -> int:
    """Tables the segments drew (steps x each stage's batch size x data-parallel replicas)."""
    by_config = {s.config: c for s, c in zip(leg.stages, leg.cfgs, strict=True)}
    return sum((seg["to"] - seg["from"]) * by_config[seg["config"]].data.batch_size
               * by_config[seg["config"]].parallel.dp for seg in segments)


def _metrics(path: Path, upto: int) -> list[dict[str, Any]]:
    """The metric lines of a run up to step `upto` (a stopped process may have logged past the state's step;
    a torn last line is skipped)."""
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if row.get("step", upto + 1) <= upto:
                rows.append(row)
    return rows


def _last_eval(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The last pretraining evaluation among metric lines (its mean_* numbers)."""
    evals = [r for r in rows if "eval" in r]
    if not evals:
        return None
    return {"step": evals[-1]["step"], **{k: v for k, v in evals[-1]["eval"].items() if k.startswith("mean")}}


def _step_timing(rows: list[dict[str, Any]], from_step: int) -> dict[str, float] | None:
    """This leg's logged steps (one in train.log_every): the median step's seconds and the share of step time
    spent waiting for the loader (under 10% is the recipe's target)."""
    steps = [r for r in rows if "seconds" in r and r["step"] > from_step]
    if not steps:
        return None
    total = sum(r["seconds"] for r in steps)
    waited = sum(r.get("data_seconds", 0.0) for r in steps)
    return {"logged_steps": len(steps), "median_step_s": round(statistics.median(r["seconds"] for r in steps), 4),
            "loader_wait_share": round(waited / total, 4) if total > 0 else 0.0}


def device_name(device: str) -> str:
    """The GPU's name, or the CPU's kind and cores: what the leg's record says it ran on."""
    import torch

    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.machine()}, {os.cpu_count()} cores)"


def save(leg: Leg, final: bool) -> dict[str, Any]:
    """Pack the latest checkpoint into OUT/state.safetensors, merge it into OUT/model.safetensors and write
    OUT/state.json (the committed history plus this leg's record); the metrics log goes along."""
    from tabfm import checkpoint as ckpt

    leg.last_save = time.time()
    path = ckpt.latest_checkpoint(leg.run_dir)
    history = json.loads(json.dumps(leg.history))  # a copy: saves while training must not pile up legs
    if path is None:  # nothing trained yet: the committed state stays what it is
        return history
    packed = pack(path, leg.out / STATE_FILE)
    ckpt.merge(path, leg.out / "model.safetensors", overwrite=True)
    step = packed["step"]
    rows = _metrics(leg.run_dir / "metrics.jsonl", step)
    _write_atomic(leg.out / "metrics.jsonl", lambda tmp: tmp.write_text("".join(json.dumps(r) + "\n" for r in rows)))
    segments = _segments(leg, step)
    tables = _tables(leg, segments)
    weights = leg.repo / "tabfm" / "weights" / "tabfm-small.safetensors"
    record = {
        "leg": len(history["legs"]) + 1,
        "started": datetime.fromtimestamp(leg.started, timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(leg.device),
        "from_step": leg.from_step, "to_step": step, "steps": step - leg.from_step, "tables": tables,
        "train_seconds": round(sum(s["seconds"] for s in segments), 1),
        "lease_seconds": round(time.time() - leg.started, 1),
        "segments": segments, "stopped": leg.stopped if final else "running",
        "eval": _last_eval(rows), "step_timing": _step_timing(rows, leg.from_step),
        "default_sha256": sha256(weights) if weights.is_file() else None,
        "accuracy": None, "default_replaced": None,
    }
    history.update(step=step, data_position=packed["data_position"], tables_seen=history["tables_seen"] + tables,
                   total_steps=leg.cfgs[0].train.steps, stages=[vars(s) for s in leg.stages],
                   state_file={"name": STATE_FILE, "bytes": packed["bytes"], "sha256": packed["sha256"]})
    history["legs"].append(record)
    write_history(leg.out / HISTORY_FILE, history)
    return history


def new_history(init_from: str) -> dict[str, Any]:
    """The history before the first leg."""
    return {"format": HISTORY_FORMAT, "step": 0, "data_position": {}, "tables_seen": 0, "init_from": init_from,
            "state_file": {}, "legs": []}
