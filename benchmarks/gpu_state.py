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

This file is the entry point and the developer's side (score, decide, adopt); the state file and state.json
are benchmarks/gpu_statefile.py's, the leg driver benchmarks/gpu_leg.py's, and their names are reachable from
here too (gpu_state.pack, gpu_state.Leg, ...).
"""

from __future__ import annotations

import argparse
import csv
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:  # the sibling modules, also when loaded by file path
    sys.path.append(str(Path(__file__).resolve().parent))

from gpu_leg import (LEG_SETS, Leg, Stage, device_name, new_history, parse_stages, run_leg,  # noqa: E402
                     run_segment, stage_at, stage_configs, stop_process)
from gpu_statefile import (  # noqa: E402
    HISTORY_FILE, STATE_FILE, committed, pack, read_history, sha256, unpack, write_history)

__all__ = ["LEG_SETS", "Leg", "Stage", "committed", "decide", "main", "new_history", "pack", "parse_stages", "run_segment",
           "stage_at", "stage_configs", "stop_process", "unpack"]
"""The names callers reach through this module (tests/test_gpu_recipe.py), some of them gpu_leg's or
gpu_statefile's, re-exported."""

REPO = Path(__file__).resolve().parent.parent
DEFAULT_WEIGHTS = REPO / "tabfm" / "weights" / "tabfm-small.safetensors"
DEFAULT_STATE_DIR = REPO / "benchmarks" / "gpu_state"


def cmd_leg(args: argparse.Namespace) -> int:
    """Prepare the run folder from the committed state (or the shipped weights), then run the leg."""
    repo, run_dir, out = Path(args.repo), Path(args.run), Path(args.out)
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ValueError(f"{run_dir} is not empty; the leg needs a fresh run folder")
    history, state = committed(Path(args.state_dir))
    import torch

    print(f"torch {torch.__version__} on {device_name(args.device)}; state: "
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
        command = (f"given: {cand_csv} against {default_csv}" if args.candidate_csv
                   else "benchmarks/accuracy.py " + " ".join(ACCURACY_ARGS))
        leg["accuracy"] = {"command": command,
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
    a.add_argument("--set", nargs="*", action="extend", default=[], metavar="A.B=C", help="overrides for every stage")
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
