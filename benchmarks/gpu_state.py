"""The GPU recipe's resumable state, the leg that one short GPU lease runs, and the developer's side after it.

The state is two files in benchmarks/gpu_state/, replaced in place after each leg (so the repository grows by
one state file's compressed size per leg, plus the merged default when a leg replaces it):

    state.safetensors   one checkpoint folder of the recipe's run (manifest.json + rank files: weights, AdamW
                        state, RNG), each file's bytes as one uint8 tensor; unpacking writes the same bytes back,
                        so the folder's checksums hold and `--resume` continues exactly
    state.json          the step and data position, the stages, the tables seen, and every leg so far (steps,
                        tables, seconds, the evaluation of pretraining, accuracy.py scores, whether the default
                        was replaced); its state_file.sha256 ties it to state.safetensors

    python benchmarks/gpu_state.py pack RUN/checkpoints/step_0000400 -o state.safetensors
    python benchmarks/gpu_state.py unpack benchmarks/gpu_state/state.safetensors RUN   # then --resume auto
    python benchmarks/gpu_state.py leg ...       # run by benchmarks/gpu_recipe.sh on the GPU machine
    python benchmarks/gpu_state.py decide --candidate A.csv --default B.csv        # which scores better
    python benchmarks/gpu_state.py adopt FILES [--apply]     # after a lease: check, score, keep, replace

The recipe has stages (configs/pretrain/gpu.yaml from step 0, gpu_stage2.yaml from step 1500): a config holds
one table range, and `train.steps` is also the length of the learning-rate schedule, so the leg runs one
`tabfm.pretrain` process per stage it crosses, all with the same schedule, and stops a process at a stage
boundary, at the leg's step cap or at its deadline by SIGINT to the process group, then rolls the run back to
the last checkpoint at or before the boundary.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file, save_file

STATE_FORMAT = "tabfm-gpu-state-v1"
HISTORY_FORMAT = "tabfm-gpu-recipe-v1"
STATE_FILE, HISTORY_FILE = "state.safetensors", "state.json"
FILE_PREFIX = "file/"
_FILE_NAME = re.compile(r"manifest\.json|rank[0-9]{3}\.safetensors")
"""The only files a packed checkpoint folder may hold (no separators: unpacking never leaves the folder)."""
MAX_STATE_BYTES = 1 << 30
REPO = Path(__file__).resolve().parent.parent
DEFAULT_WEIGHTS = REPO / "tabfm" / "weights" / "tabfm-small.safetensors"
DEFAULT_STATE_DIR = REPO / "benchmarks" / "gpu_state"


def sha256(path: Path) -> str:
    """Hex SHA-256 of a file, read in chunks."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _write_atomic(path: Path, write: Any) -> None:
    """Write through `write(tmp_path)` beside `path`, then rename: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    tmp.replace(path)


# ---------------------------------------------------------------------------------------------------------
# pack / unpack: a checkpoint folder <-> one file
# ---------------------------------------------------------------------------------------------------------

def _folder_files(ckpt_dir: Path) -> tuple[dict, list[str]]:
    """The manifest of a checkpoint folder and the files to pack (manifest first), each rank file's checksum
    checked against the manifest, so a torn or edited folder is never packed."""
    manifest_path = ckpt_dir / "manifest.json"
    if not manifest_path.is_file():
        raise ValueError(f"{ckpt_dir} is not a checkpoint folder (no manifest.json); give a run's step_N folder")
    manifest = json.loads(manifest_path.read_text())
    names = sorted(manifest.get("files", {}))
    for name in names:
        if not _FILE_NAME.fullmatch(name):
            raise ValueError(f"{ckpt_dir}: its manifest lists {name!r}, not a rank file")
        if sha256(ckpt_dir / name) != manifest["files"][name]["sha256"]:
            raise ValueError(f"{ckpt_dir}/{name} does not match its manifest's checksum: the folder is damaged")
    return manifest, ["manifest.json", *names]


def pack(ckpt_dir: str | Path, out: str | Path) -> dict[str, Any]:
    """Pack checkpoint folder `ckpt_dir` into the single file `out` (replaced atomically); returns its step,
    data position, size and sha256."""
    ckpt_dir, out = Path(ckpt_dir), Path(out)
    manifest, names = _folder_files(ckpt_dir)
    tensors = {FILE_PREFIX + n: np.frombuffer((ckpt_dir / n).read_bytes(), dtype=np.uint8) for n in names}
    meta = {"format": STATE_FORMAT, "step": str(manifest["step"]), "source": ckpt_dir.name}
    _write_atomic(out, lambda tmp: save_file(tensors, str(tmp), meta))
    return {"step": int(manifest["step"]), "data_position": manifest.get("data_position", {}),
            "bytes": out.stat().st_size, "sha256": sha256(out)}


def read_state(path: str | Path) -> tuple[int, dict[str, bytes]]:
    """(step, {file name: bytes}) of a state file, checked: our format, only manifest and rank files, and the
    rank files' checksums against the manifest. Nothing is written."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such state file")
    if path.stat().st_size > MAX_STATE_BYTES:
        raise ValueError(f"{path} is larger than any state ({MAX_STATE_BYTES} bytes); it is not one")
    try:
        with safe_open(str(path), "np") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path} cannot be read as a state file ({e})") from None
    if meta.get("format") != STATE_FORMAT:
        raise ValueError(f"{path} is not a {STATE_FORMAT} file (format {meta.get('format')!r})")
    files = {}
    for key, t in tensors.items():
        name = key[len(FILE_PREFIX):]
        if not key.startswith(FILE_PREFIX) or not _FILE_NAME.fullmatch(name) or t.dtype != np.uint8:
            raise ValueError(f"{path} holds {key!r}, not a checkpoint file")
        files[name] = t.tobytes()
    try:
        manifest = json.loads(files["manifest.json"])
        step, listed = manifest["step"], {n: i["sha256"] for n, i in manifest["files"].items()}
    except (KeyError, TypeError, ValueError, AttributeError):
        raise ValueError(f"{path}: its manifest.json is missing or damaged (no step or file checksums)") from None
    if not isinstance(step, int) or step < 0 or set(listed) != set(files) - {"manifest.json"}:
        raise ValueError(f"{path}: its manifest's step or file list does not match the files it holds")
    for name, digest in listed.items():
        if hashlib.sha256(files[name]).hexdigest() != digest:
            raise ValueError(f"{path}: {name} does not match the manifest's checksum")
    return step, files


def unpack(state: str | Path, run_dir: str | Path) -> Path:
    """Write the checkpoint of `state` into <run_dir>/checkpoints/step_N with `latest` naming it, so that
    `tabfm pretrain ... --set train.out_dir=RUN_DIR --resume auto` continues it. Refused when run_dir holds a
    run already. Returns the checkpoint folder."""
    from tabfm import checkpoint as ckpt

    run_dir = Path(run_dir)
    step, files = read_state(state)
    if (run_dir / "metrics.jsonl").exists() or any((run_dir / "checkpoints").glob("*")):
        raise ValueError(f"{run_dir} already holds a run; unpack into a new folder")
    root = run_dir / "checkpoints"
    folder = root / f"step_{step:07d}"
    tmp = folder.with_name(folder.name + ".tmp")
    tmp.mkdir(parents=True)
    try:
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        ckpt.verify_checkpoint(tmp)  # every check a resume runs, against this code's model
    except ValueError:
        shutil.rmtree(tmp)
        raise
    tmp.rename(folder)
    ckpt.mark_latest(root, folder.name)
    return folder


# ---------------------------------------------------------------------------------------------------------
# state.json: the recipe's history
# ---------------------------------------------------------------------------------------------------------

def read_history(path: str | Path) -> dict[str, Any]:
    """A state.json, checked for its format and the fields the leg and adopt read."""
    path = Path(path)
    try:
        history = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read as the recipe's state.json ({e})") from None
    if not isinstance(history, dict) or history.get("format") != HISTORY_FORMAT:
        raise ValueError(f"{path} is not a {HISTORY_FORMAT} state.json")
    for key, kind in (("step", int), ("legs", list), ("state_file", dict), ("tables_seen", int)):
        if not isinstance(history.get(key), kind):
            raise ValueError(f"{path}: field {key!r} is missing or not a {kind.__name__}")
    return history


def write_history(path: Path, history: dict[str, Any]) -> None:
    _write_atomic(path, lambda tmp: tmp.write_text(json.dumps(history, indent=1) + "\n"))


def committed(state_dir: Path) -> tuple[dict[str, Any] | None, Path | None]:
    """The committed (history, state file), both None before the first leg; refused when they disagree."""
    hist_path, state_path = state_dir / HISTORY_FILE, state_dir / STATE_FILE
    if not hist_path.exists() and not state_path.exists():
        return None, None
    if not (hist_path.is_file() and state_path.is_file()):
        raise ValueError(f"{state_dir} needs both {STATE_FILE} and {HISTORY_FILE} (or neither, before the first "
                         "leg); restore the missing one from git")
    history = read_history(hist_path)
    if sha256(state_path) != history["state_file"].get("sha256"):
        raise ValueError(f"{state_path} is not the state {hist_path} describes (sha256 differs); restore both "
                         "from the same commit")
    return history, state_path


# ---------------------------------------------------------------------------------------------------------
# The leg: resume, train until a stage boundary, a step cap or the deadline, pack into OUT
# ---------------------------------------------------------------------------------------------------------

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


def stage_configs(stages: list[Stage], overrides: list[str], repo: Path) -> list[Any]:
    """The RunConfig of every stage, checked to share one schedule (steps and optim) and one model, so that a
    process of any stage continues the state of another exactly."""
    from tabfm.config import load_config

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


def _segment_command(leg: Leg, stage: Stage, step: int) -> list[str]:
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
        proc = subprocess.Popen(_segment_command(leg, stage, step0), stdout=f, stderr=subprocess.STDOUT,
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
    """Train segment after segment until the deadline, the leg's step cap or the end of the schedule; then pack
    the state, merge the model and write state.json into leg.out. Returns the history written."""
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


def _device_name(device: str) -> str:
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
        "device": _device_name(leg.device),
        "from_step": leg.from_step, "to_step": step, "steps": step - leg.from_step, "tables": tables,
        "train_seconds": round(sum(s["seconds"] for s in segments), 1),
        "lease_seconds": round(time.time() - leg.started, 1),
        "segments": segments, "stopped": leg.stopped if final else "running",
        "eval": _last_eval(rows),
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


def cmd_leg(args: argparse.Namespace) -> int:
    """Prepare the run folder from the committed state (or the shipped weights), then run the leg."""
    repo, run_dir, out = Path(args.repo), Path(args.run), Path(args.out)
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ValueError(f"{run_dir} is not empty; the leg needs a fresh run folder")
    history, state = committed(Path(args.state_dir))
    import torch

    print(f"torch {torch.__version__} on {_device_name(args.device)}; state: "
          f"{'step ' + str(history['step']) if history else 'none yet (the first leg)'}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    if state is not None:
        unpack(state, run_dir)
    else:
        history = new_history(args.init_from)
    init_from = str(repo / args.init_from) if args.init_from else ""
    leg = Leg(repo=repo, run_dir=run_dir, out=out, deadline=args.deadline, stages=parse_stages(args.stage),
              overrides=args.set, device=args.device, init_from=init_from, leg_steps=args.leg_steps,
              min_segment_s=args.min_segment_s, save_every_s=args.save_every_s, started=args.started,
              history=history)
    result = run_leg(leg)
    last = result["legs"][-1] if len(result["legs"]) > len(history["legs"]) else None
    if last is None:
        print(f"leg: nothing trained ({leg.stopped}); the committed state stays at step {history['step']}")
    else:
        print(f"leg {last['leg']}: steps {last['from_step']}..{last['to_step']} ({last['tables']} tables, "
              f"{last['train_seconds']} s training), stopped: {last['stopped']}, eval: {last['eval']}")
    return 1 if leg.stopped.startswith("error") else 0


# ---------------------------------------------------------------------------------------------------------
# Which checkpoint scores better on benchmarks/accuracy.py
# ---------------------------------------------------------------------------------------------------------

METRICS = (("roc_auc", "roc_auc_mean", 1), ("log_loss", "log_loss_mean", -1), ("r2", "r2_mean", 1))
"""(name, accuracy.csv column, +1 when higher is better): the three targets accuracy.py checks."""


def read_scores(path: str | Path) -> dict[str, dict[str, Any]]:
    """tabfm's per-table rows of an accuracy.csv: {dataset: {task, n_folds, roc_auc, log_loss, r2}}; refused
    when tabfm failed on a table (a missing score would flatter the mean)."""
    path = Path(path)
    try:
        rows = [r for r in csv.DictReader(open(path, newline="")) if r.get("model") == "tabfm"]
    except OSError as e:
        raise ValueError(f"{path} cannot be read ({e}); give an accuracy.csv of benchmarks/accuracy.py") from None
    if not rows:
        raise ValueError(f"{path} has no tabfm rows; score with benchmarks/accuracy.py --models tabfm")
    scores = {}
    for r in rows:
        if r.get("error") or r.get("failed_folds", "0") not in ("", "0"):
            raise ValueError(f"{path}: tabfm failed on {r['dataset']} ({r.get('error') or 'failed folds'})")
        scores[r["dataset"]] = {"task": r["task"], "n_folds": r["n_folds"],
                                **{m: float(r[col]) if r.get(col) else None for m, col, _ in METRICS}}
    return scores


def mean_scores(scores: dict[str, dict[str, Any]]) -> dict[str, float | int]:
    """Mean of each metric over the tables that have it (classification: ROC-AUC, log-loss; regression: R^2)."""
    out: dict[str, float | int] = {"tables": len(scores)}
    for name, _, _ in METRICS:
        values = [s[name] for s in scores.values() if s[name] is not None]
        if values:
            out[name] = round(sum(values) / len(values), 5)
    return out


def decide(candidate: str | Path, default: str | Path) -> tuple[bool, str]:
    """(whether the candidate scores better, a report): both scored on the same tables and folds, the candidate
    is not worse on any of mean ROC-AUC, mean log-loss and mean R^2, and better on at least one."""
    cand, base = read_scores(candidate), read_scores(default)
    if {k: (v["task"], v["n_folds"]) for k, v in cand.items()} != {k: (v["task"], v["n_folds"]) for k, v in
                                                                  base.items()}:
        raise ValueError(f"{candidate} and {default} score different tables or folds; score both with the same "
                         "accuracy.py command")
    c, d = mean_scores(cand), mean_scores(base)
    lines, better, worse = [f"{'metric':10s} {'default':>9s} {'candidate':>9s}"], False, False
    for name, _, sign in METRICS:
        if name in c:
            lines.append(f"{name:10s} {d[name]:9.5f} {c[name]:9.5f}")
            better |= sign * (c[name] - d[name]) > 0
            worse |= sign * (c[name] - d[name]) < 0
    ok = better and not worse
    lines.append(f"{c['tables']} tables: the candidate is {'better' if ok else 'not better'} "
                 f"({'no metric worse, one better' if ok else 'a metric is worse, or none is better'})")
    return ok, "\n".join(lines)


def cmd_decide(args: argparse.Namespace) -> int:
    ok, report = decide(args.candidate, args.default)
    print(report)
    return 0 if ok else 3


# ---------------------------------------------------------------------------------------------------------
# After a lease: check what came back, score it, keep the state, replace the default only if better
# ---------------------------------------------------------------------------------------------------------

ACCURACY_ARGS = ["--models", "tabfm", "--folds", "1"]
"""The quick accuracy.py check: tabfm alone (the two sides are compared with each other, not with baselines), fold
0 of every table of both suites; the candidate and the default are scored alike."""


def check_returned(files: Path, state_dir: Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the lease's history, the committed one): the lease's state matches its state.json, extends the committed
    history leg by leg and moved the step forward, and its checkpoint verifies."""
    new = read_history(files / HISTORY_FILE)
    if not (files / STATE_FILE).is_file() or sha256(files / STATE_FILE) != new["state_file"].get("sha256"):
        raise ValueError(f"{files}/{STATE_FILE} is missing or not the state its {HISTORY_FILE} describes "
                         "(a lease cut between the two writes?); nothing adopted")
    old, _ = committed(state_dir)
    if old is not None and new["legs"][:len(old["legs"])] != old["legs"]:
        raise ValueError(f"{files} does not continue the committed state ({len(old['legs'])} legs, step "
                         f"{old['step']}): it was run from another commit, or is adopted already; nothing adopted")
    if old is not None and new["step"] <= old["step"]:
        raise ValueError(f"{files} trained no step past the committed state (step {old['step']}); nothing adopted")
    with tempfile.TemporaryDirectory() as tmp:
        unpack(files / STATE_FILE, Path(tmp) / "run")  # verify_checkpoint: every check a resume runs
    return new, old


def score(checkpoint: Path | None, out: Path, device: str, tables: str | None = None) -> Path:
    """Run the quick accuracy.py check on `checkpoint` (None: the shipped weights), on `tables` (comma-separated;
    None: all); returns its accuracy.csv."""
    cmd = [sys.executable, str(REPO / "benchmarks" / "accuracy.py"), *ACCURACY_ARGS, "--device", device,
           "--out", str(out), *(["--checkpoint", str(checkpoint)] if checkpoint else []),
           *(["--tables", tables] if tables else [])]
    print("$", " ".join(cmd), flush=True)
    try:
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    except subprocess.CalledProcessError as e:
        raise ValueError(f"accuracy.py failed (exit status {e.returncode}); run the command above to see why") from None
    return out / "accuracy.csv"


def cmd_score(args: argparse.Namespace) -> int:
    """The quick check of one checkpoint, its accuracy.csv copied to --csv (the lease scores both sides so)."""
    csv_path = score(Path(args.checkpoint) if args.checkpoint else None, Path(args.out), args.device, args.tables)
    shutil.copy(csv_path, args.csv)
    print(f"{args.csv}: {mean_scores(read_scores(args.csv))}")
    return 0


def _scores_for(args: argparse.Namespace, files: Path, new: dict[str, Any], weights: Path,
                tmp: Path) -> tuple[Path, Path]:
    """(candidate csv, default csv): given ones, else the lease's pair when it scored today's default, else
    scored here."""
    leg = new["legs"][-1]
    lease_pair = (files / "accuracy.csv").is_file() and (files / "accuracy_default.csv").is_file()
    if args.candidate_csv or args.default_csv:
        if not (args.candidate_csv and args.default_csv):
            raise ValueError("give both --candidate-csv and --default-csv, or neither")
        return Path(args.candidate_csv), Path(args.default_csv)
    if lease_pair and leg.get("default_sha256") == sha256(weights):
        return files / "accuracy.csv", files / "accuracy_default.csv"
    return (score(files / "model.safetensors", tmp / "candidate", args.device),
            score(None if weights == DEFAULT_WEIGHTS else weights, tmp / "default", args.device))


def cmd_adopt(args: argparse.Namespace) -> int:
    """Check the lease's files, score candidate and default alike, then (with --apply) replace the committed
    state and, only if the candidate scores better, the shipped default."""
    files, state_dir, weights = Path(args.files), Path(args.state_dir), Path(args.weights)
    new, _ = check_returned(files, state_dir)
    if not (files / "model.safetensors").is_file():
        raise ValueError(f"{files} has no model.safetensors; nothing adopted")
    with tempfile.TemporaryDirectory() as tmp:
        cand_csv, default_csv = _scores_for(args, files, new, weights, Path(tmp))
        print(f"scores: candidate {cand_csv}, default {default_csv}")
        better, report = decide(cand_csv, default_csv)
        leg = new["legs"][-1]
        leg["accuracy"] = {"command": "benchmarks/accuracy.py " + " ".join(ACCURACY_ARGS),
                           "candidate": mean_scores(read_scores(cand_csv)),
                           "default": mean_scores(read_scores(default_csv))}
    leg["default_replaced"] = better
    print(report)
    if not args.apply:
        print("dry run: nothing written; --apply keeps the state" + (" and replaces the default" if better else ""))
        return 0
    state_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(files / STATE_FILE, state_dir / (STATE_FILE + ".tmp"))
    (state_dir / (STATE_FILE + ".tmp")).replace(state_dir / STATE_FILE)
    write_history(state_dir / HISTORY_FILE, new)
    changed = [state_dir / STATE_FILE, state_dir / HISTORY_FILE]
    if better:
        shutil.copy(files / "model.safetensors", weights.with_name(weights.name + ".tmp"))
        weights.with_name(weights.name + ".tmp").replace(weights)
        changed.append(weights)
    print(f"kept the state at step {new['step']}{'; replaced ' + str(weights) if better else ''}. Commit: git add "
          + " ".join(str(p) for p in changed))
    return 0


# ---------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python benchmarks/gpu_state.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("pack", help="a checkpoint folder -> one state file")
    a.add_argument("checkpoint")
    a.add_argument("-o", "--output", required=True)
    a = sub.add_parser("unpack", help="a state file -> RUN/checkpoints/step_N (then --resume auto)")
    a.add_argument("state")
    a.add_argument("run_dir")
    a = sub.add_parser("leg", help="one lease's training (run by benchmarks/gpu_recipe.sh)")
    a.add_argument("--repo", default=str(REPO))
    a.add_argument("--state-dir", default=str(DEFAULT_STATE_DIR), help="the committed state")
    a.add_argument("--run", required=True, help="a fresh run folder")
    a.add_argument("--out", required=True, help="where the state, model and state.json go")
    a.add_argument("--deadline", type=float, required=True, help="Unix time by which training stops")
    a.add_argument("--started", type=float, default=time.time(), help="Unix time the lease's script started")
    a.add_argument("--stage", action="append", required=True, metavar="CONFIG:FIRST_STEP")
    a.add_argument("--set", nargs="*", default=[], metavar="A.B=C", help="overrides for every stage")
    a.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    a.add_argument("--init-from", default="tabfm/weights/tabfm-small.safetensors",
                   help="weights of the recipe's step 0, relative to --repo ('' = from scratch)")
    a.add_argument("--leg-steps", type=int, default=0, help="stop after this many steps (0 = the clock decides)")
    a.add_argument("--min-segment-s", type=float, default=60.0, help="start no process with less time left")
    a.add_argument("--save-every-s", type=float, default=60.0, help="pack into --out this often while training")
    a = sub.add_parser("score", help="the quick accuracy.py check of one checkpoint (the shipped one by default)")
    a.add_argument("--checkpoint", help="a merged .safetensors file (default: the shipped weights)")
    a.add_argument("--device", default="cpu")
    a.add_argument("--out", required=True, help="accuracy.py's --out folder")
    a.add_argument("--csv", required=True, help="where its accuracy.csv is copied")
    a.add_argument("--tables", help="only these tables, comma-separated (default: all)")
    a = sub.add_parser("decide", help="exit 0 when --candidate scores better than --default, else 3")
    a.add_argument("--candidate", required=True, help="accuracy.csv of the candidate")
    a.add_argument("--default", required=True, help="accuracy.csv of the shipped default")
    a = sub.add_parser("adopt", help="after a lease: check, score, keep the state, replace the default if better")
    a.add_argument("files", help="the folder of the lease's $OUT files")
    a.add_argument("--apply", action="store_true", help="write (without it: check and score only)")
    a.add_argument("--state-dir", default=str(DEFAULT_STATE_DIR))
    a.add_argument("--weights", default=str(DEFAULT_WEIGHTS), help="the shipped default to replace if better")
    a.add_argument("--candidate-csv", help="the candidate's accuracy.csv (default: the lease's, or scored here)")
    a.add_argument("--default-csv", help="the default's accuracy.csv, scored by the same command")
    a.add_argument("--device", default="cpu", help="accuracy.py --device when scoring here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "pack":
            info = pack(args.checkpoint, args.output)
            print(f"packed step {info['step']} into {args.output} ({info['bytes']} bytes)")
            return 0
        if args.command == "unpack":
            print(f"unpacked into {unpack(args.state, args.run_dir)}; resume with --set "
                  f"train.out_dir={args.run_dir} --resume auto")
            return 0
        commands = {"leg": cmd_leg, "score": cmd_score, "decide": cmd_decide, "adopt": cmd_adopt}
        return commands[args.command](args)
    except ValueError as e:
        print(f"gpu_state {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
