"""Pretraining on the synthetic prior: `python -m tabfm.pretrain --config configs/pretrain/small.yaml`.

Several processes: `torchrun --nproc-per-node 4 -m tabfm.pretrain --config ... --set parallel.d0=2 parallel.d1=2`
(d0 * d1 * dp must equal the process count). Every rank of one tensor-parallel mesh sees the same batch
(data depends only on (seed, step, dp rank)); data-parallel replicas average their gradients. AdamW with linear
warmup then cosine decay; the global gradient norm is computed over all shards (each sharded tensor counted once)
before clipping. Rank 0 shows a tqdm bar and appends one JSON line per logged step to <out_dir>/metrics.jsonl.
A checkpoint folder is written every `train.checkpoint_every` steps under <out_dir>/checkpoints/, and
`--resume auto` (the latest one) or `--resume DIR` continues a run exactly: same batches, optimizer state and
schedule, so the losses are those of an uninterrupted run. That also holds under
`torchrun --max-restarts N ... --resume auto`: restarted workers continue from the latest checkpoint. A resume
keeps the metric lines up to the resumed step (none when there was no checkpoint yet). An out_dir that already
holds a run (metrics or checkpoints) is refused unless --resume or --overwrite says what to do with it. A NaN or
infinite loss or gradient norm stops the run before that step is logged or saved (exit status 1).

This module is the entry point: the command line, the checks made before any process group starts, and `train`,
which puts a run together from parts with one job each:
    tabfm.train_setup        device, layout and mesh, the model (init_from, parallelized) and its optimizer
    tabfm.train_checkpoints  CheckpointManager: where to resume from, when to save, save, prune
    tabfm.train_optim        one optimizer step: schedule, replica averaging, global norm, clipping, AdamW
    tabfm.train_eval         evaluation on real tables every train.eval_every steps
    tabfm.train_log          metrics.jsonl and the progress bar (rank 0)
    tabfm.train_loop         Trainer: the loop over the steps, with hooks called before each step
    tabfm.train_heap         on a CPU, large freed blocks kept in malloc's heap between steps (main only)

The layout is checked before any process group is created: dp * d0 * d1 must equal WORLD_SIZE and (d0, d1) must
divide the model's heads and widths; otherwise main exits with status 2 and lists the layouts that fit.
`tabfm pretrain --nproc N` runs the same checks (config, layout for N processes, out_dir) before starting torchrun.

With `train.eval_every` > 0 the model is evaluated on a few real tables (tabfm.evaluate) every that many steps and
at the end; rank 0 appends {"step": s, "eval": {...}} to metrics.jsonl. Evaluation draws no random numbers from
the training streams and changes no batch, so resumed runs stay exact with it on.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tabfm import checkpoint as ckpt
from tabfm._cli_train import add_run_dir_arguments, read_metrics_file, run_overrides
from tabfm.checkpoint import latest_checkpoint
from tabfm.config import RunConfig, dump_config, load_config
from tabfm.data.config import check_tables_fit_memory, physical_memory
from tabfm.layout import check_layout, fitting_layouts, shape_model
from tabfm.out_paths import CHECKPOINTS, checkpoints_of, file_in_the_way
from tabfm.parallel.mesh import LayoutError, ParallelDims, TPMesh
from tabfm.parallel.process_group import process_group
from tabfm.train_checkpoints import CheckpointManager
from tabfm.train_eval import PeriodicEvaluation
from tabfm.train_heap import keep_large_blocks_in_heap
from tabfm.train_log import MetricsLog
from tabfm.train_loop import NonFiniteLossError, StepHook, Trainer
from tabfm.train_optim import average_over_replicas, global_grad_norm, lr_at, train_step
from tabfm.train_setup import (DTYPES, build_mesh, build_model_and_optimizer, is_rank0, resolve_device,
                               resolve_run_layout)

__all__ = ["DTYPES", "CheckpointManager", "NonFiniteLossError", "StepHook", "average_over_replicas", "check_out_dir",
           "check_run", "check_run_layout", "clear_run", "global_grad_norm", "latest_checkpoint", "load_run_config",
           "lr_at", "main", "train", "train_step"]


def check_run_layout(cfg: RunConfig, world_size: int) -> None:
    """Raise LayoutError (listing the layouts that fit) when the configured layout can't run on `world_size`
    processes or doesn't divide the model's heads and widths. Needs no process group."""
    p = cfg.parallel
    dims = ParallelDims(p.d0, p.d1, p.dp) if p.layout == "manual" else ParallelDims(1, world_size // p.dp or 1, p.dp)
    fits = ", ".join(f"dp={d.dp} x {d.d0}x{d.d1}" for d in fitting_layouts(cfg.model, world_size)) or "none"
    hint = f". Layouts of {world_size} process{'es' if world_size > 1 else ''} that fit this model: {fits}"
    try:
        dims.check_world_size(world_size)
    except LayoutError as e:
        raise LayoutError(f"{e}{hint}") from None
    if p.layout == "auto":
        if not any(d.dp == p.dp for d in fitting_layouts(cfg.model, world_size)):
            raise LayoutError(f"layout auto: no tensor-parallel layout of {world_size // p.dp} ranks fits the "
                              f"model{hint}")
        return
    try:
        check_layout(cfg.model, p.d0, p.d1)
    except LayoutError as e:
        raise LayoutError(f"{e}{hint}") from None


RUN_FILES = ("metrics.jsonl", "curves.png", "config.yaml", "layout.json", CHECKPOINTS)
"""What a run leaves in its out_dir and `--overwrite` removes (in checkpoints/ only what a run writes there)."""


def _run_entries(ckpts: Path) -> list[Path]:
    """What a run writes in its checkpoints folder: step_N folders, their .tmp / .old leftovers and `latest`. Both
    previous_run and clear_run go by it, so that a file of the user's there is neither a run nor deleted (a launcher
    that cleared a run while its ranks still saw one there would delete the run and then start nothing)."""
    from tabfm.checkpoint_run import _LEFTOVER

    if not ckpts.is_dir() or ckpts.is_symlink():
        return []
    return [p for p in ckpts.iterdir() if (p.is_dir() and not p.is_symlink() and _LEFTOVER.fullmatch(p.name))
            or p.name in (ckpt.LATEST, ckpt.LATEST + ".tmp")]


def previous_run(out_dir: Path) -> list[str]:
    """What of an earlier run `out_dir` holds: a non-empty metrics log and checkpoints a run wrote."""
    held = []
    metrics, ckpts = out_dir / "metrics.jsonl", checkpoints_of(out_dir)
    if metrics.is_file() and metrics.stat().st_size:
        held.append(str(metrics))
    if _run_entries(ckpts):
        held.append(f"{ckpts}/")
    return held


def check_out_dir(out_dir: Path, resume: str | None, overwrite: bool) -> None:
    """Refuse (ValueError) to start a run over an earlier one's files unless told to resume or overwrite it:
    a restart at step 1 would overwrite its checkpoints and append a second copy of its steps to the log."""
    if resume is not None and overwrite:
        raise ValueError("--resume continues the run in train.out_dir and --overwrite deletes it: give one")
    if resume not in (None, "auto") and not (Path(resume) / ckpt.MANIFEST).is_file():
        raise ValueError(f"--resume {resume}: not a checkpoint folder (no {ckpt.MANIFEST}); give one such as "
                         f"{out_dir}/checkpoints/step_0000010, or --resume auto for the latest in train.out_dir")
    held = previous_run(out_dir)
    if not held:
        _check_not_a_shared_folder(out_dir)
    if held and resume is None and not overwrite:
        raise ValueError(f"{out_dir} already holds a run ({' and '.join(held)}): continue it with --resume auto, "
                         "start another with --set train.out_dir=NEW_DIR, or delete it with --overwrite")
    if resume is not None and (out_dir / "metrics.jsonl").is_file():
        read_metrics_file(out_dir / "metrics.jsonl", warn=False)  # corrupt: refused now, not on rank 0 mid-run
    if resume == "auto":
        latest_checkpoint(out_dir)  # a `latest` naming anything but a step folder: refused here, in one line


def _check_not_a_shared_folder(out_dir: Path) -> None:
    """Refuse to start a run in the filesystem's root, the home folder or a project's root (a folder holding .git
    or pyproject.toml): a fuzzer's train.out_dir=/ and =<the repository> wrote there without a word, and a later
    --overwrite would delete the run's files among the project's. A folder that already holds a run is its own."""
    folder = out_dir.expanduser().resolve()
    if folder == Path(folder.anchor) or folder == Path.home().resolve():
        what = "the filesystem root" if folder == Path(folder.anchor) else "the home folder"
        raise ValueError(f"train.out_dir {out_dir} is {what}; give a folder of the run's own, e.g. "
                         f"{folder / 'runs' / 'my_run'}")
    marker = next((m for m in (".git", "pyproject.toml") if (folder / m).exists()), None)
    if marker is not None:
        raise ValueError(f"train.out_dir {out_dir} is a project's root (it holds {marker}); give a folder of the "
                         f"run's own, e.g. {out_dir}/runs/my_run")


def clear_run(out_dir: Path) -> str | None:
    """Delete an earlier run's metrics log, plot and checkpoints from `out_dir`; say what was removed. In
    checkpoints/ only what a run writes goes (step_N folders and their .tmp / .old leftovers, `latest`): a file of
    the user's there stays, and so does the folder then. Call check_run first: it refuses a linked checkpoints/."""
    removed = []
    for name in RUN_FILES:
        path = out_dir / name
        if path.is_dir() and not path.is_symlink():
            ours = _run_entries(path)
            count = sum(1 for p in ours if ckpt.STEP_DIR.fullmatch(p.name))
            for p in ours:
                shutil.rmtree(p) if p.is_dir() else p.unlink()
            kept = any(path.iterdir())
            if not kept:
                path.rmdir()
            removed.append(f"{path}/ ({count} checkpoint{'s' if count != 1 else ''}"
                           f"{'; other files in it kept' if kept else ''})")
        elif path.exists() or path.is_symlink():
            removed.append(str(path))
            path.unlink()
    return f"--overwrite removed {', '.join(removed)}" if removed else None


def train(cfg: RunConfig, resume: str | None = None, mesh: TPMesh | None = None,
          hooks: Sequence[StepHook] = ()) -> list[dict[str, Any]]:
    """Run (or continue) the pretraining described by `cfg`; return the metric records (every rank).

    resume: None, "auto" or a checkpoint folder (see CheckpointManager). mesh: a mesh built by the caller (tests),
    else the config's layout (auto: resolved for the world size) on the config's device. hooks: called with each
    step's index before it runs (tests inject faults with them)."""
    device = resolve_device(cfg)
    rank0 = is_rank0()
    if mesh is None:
        cfg = resolve_run_layout(cfg)
        mesh = build_mesh(cfg, device)
    out_dir = Path(cfg.train.out_dir)
    metrics = MetricsLog(out_dir / "metrics.jsonl", enabled=rank0)
    checkpoints = CheckpointManager.for_run(cfg, mesh, resume, metrics, rank0)
    # a checkpoint to resume from takes precedence over train.init_from
    init_from = cfg.train.init_from if checkpoints.resume_from is None else None
    model, optimizer = build_model_and_optimizer(cfg, mesh, device, init_from)
    start = checkpoints.restore(model, optimizer)
    if rank0 and checkpoints.resume_from is not None:
        print(f"resuming from {checkpoints.resume_from} (step {start})", file=sys.stderr, flush=True)
    if start >= cfg.train.steps:  # nothing to do, and the run's config.yaml keeps the steps it ran to
        if rank0:
            print(f"the run is already at step {start}, train.steps={cfg.train.steps}: nothing to train; raise "
                  "train.steps to continue it", file=sys.stderr, flush=True)
        return []
    if rank0:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(dump_config(cfg))
    trainer = Trainer(cfg, model, optimizer, mesh, device, checkpoints, metrics, PeriodicEvaluation(cfg, rank0),
                      rank0, hooks)
    return trainer.run(start)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tabfm.pretrain", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML run config (configs/pretrain/*.yaml; required but for "
                        "--print-config, which shows the defaults without it)")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="A.B=C",
                        help="override config fields, e.g. --set optim.lr=3e-4 train.steps=100")
    add_run_dir_arguments(parser)
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    return parser


def shipped_configs() -> list[Path]:
    """The run configs that come with tabfm (configs/pretrain of a checkout, tabfm/configs/pretrain of a wheel)."""
    from tabfm.model import CONFIG_DIR

    return sorted((CONFIG_DIR.parent / "pretrain").glob("*.yaml"))


def load_run_config(path: str | None, overrides: Sequence[str]) -> RunConfig:
    """The run config of --config and --set; ValueError (one line) when --config is missing or anything is wrong.
    Without a config file the defaults would start a many-hour run of the small model into runs/default."""
    if path is None:
        names = ", ".join(str(p) for p in shipped_configs()) or "configs/pretrain/*.yaml"
        raise ValueError(f"--config is required: one of the shipped run configs ({names}) or a YAML file of yours")
    return load_config(path, list(overrides))


def check_run(cfg: RunConfig, world_size: int, resume: str | None, overwrite: bool,
              config_path: str | None = None) -> None:
    """Everything checkable before any process group starts (ValueError, one line): the layout against the
    process count and the model, the topology preset of layout auto, the device, what train.out_dir holds, and
    that a new run's --config file (`config_path`) is not the config.yaml it replaces (or --overwrite deletes)."""
    check_run_layout(cfg, world_size)
    if cfg.parallel.layout == "auto" and cfg.parallel.topology != "measure":
        from tabfm.config import load_topology

        # a misspelled preset, or one of another device count: here, not on rank 0 once every rank has started
        load_topology(cfg.parallel.topology, world_size)
    device = resolve_device(cfg)
    _check_kernels(cfg, device)
    _check_tables_fit_model(cfg)
    if not str(cfg.train.out_dir).strip():  # Path("") is ".": the run would write into the working folder
        raise ValueError("train.out_dir is empty; give the folder the run writes to")
    out_dir = Path(cfg.train.out_dir)
    _check_out_dir_path(out_dir)
    check_out_dir(out_dir, resume, overwrite)
    if resume is None and config_path and Path(config_path).resolve() == (out_dir / "config.yaml").resolve():
        raise ValueError(f"--config {config_path} is train.out_dir's config.yaml, which a new run replaces (and "
                         "--overwrite deletes): copy it outside train.out_dir and pass the copy, or continue the "
                         "run with --resume")
    resumed = None if resume is None else latest_checkpoint(out_dir) if resume == "auto" else Path(resume)
    if cfg.train.init_from and resumed is None:  # a checkpoint that --resume finds takes precedence over init_from
        ckpt.check_init_from(cfg.train.init_from, cfg.model)  # before --overwrite deletes anything
        if Path(cfg.train.init_from).is_dir():  # every file's checksum here, not a traceback once training starts
            ckpt.verify_checkpoint(cfg.train.init_from)
        if overwrite:
            _check_init_from_survives(Path(cfg.train.init_from), out_dir)
    if resumed is not None:
        _check_resume_point(resumed, cfg)


def _check_resume_point(found: Path, cfg: RunConfig) -> None:
    """The checkpoint a resume starts from (`found`), verified (manifest, sizes, headers, every file's checksum and
    finite weights) and checked to be of the run's model: a damaged or foreign checkpoint is one line here, not a
    traceback from every rank (a flipped byte in a shard once was, from the restore)."""
    from tabfm.checkpoint_inspect import config_diff, config_from_dict

    manifest = ckpt.verify_checkpoint(found)
    saved = config_from_dict(manifest["model_config"], f"{found}/{ckpt.MANIFEST}: model_config")
    changed = config_diff(saved.to_dict(), cfg.model.to_dict())
    if changed:
        raise ValueError(f"{found} was saved for another model than this run's (saved vs now: {changed}); resume "
                         "with the run's own model settings (its config.yaml), or start a new run in another "
                         "train.out_dir")


def _check_kernels(cfg: RunConfig, device: Any) -> None:
    """parallel.kernels=triton where the tensor-parallel layers could not run it (every rank's traceback, once
    training had started); with d0 = d1 = 1 the kernels are never used."""
    from tabfm.parallel.kernels.ops import interpreting, triton_available

    if cfg.parallel.kernels != "triton" or cfg.parallel.d0 * cfg.parallel.d1 == 1:
        return
    if device.type != "cuda" and not interpreting():
        raise ValueError(f"parallel.kernels=triton runs on CUDA tensors, and this run's device is {device.type}: use "
                         "parallel.kernels=auto or torch (or train.device=cuda)")
    if not triton_available():
        raise ValueError("parallel.kernels=triton needs the triton package (pip install triton); use "
                         "parallel.kernels=auto or torch")


def _check_tables_fit_model(cfg: RunConfig) -> None:
    """The prior's widest tables and most classes within what the model takes (else the first such batch fails),
    and one batch of the largest within this machine's memory."""
    table, model = cfg.data.table, cfg.model
    _check_model_fits_memory(cfg)
    check_tables_fit_memory(table.max_rows, table.max_features, cfg.data.batch_size,
                            f"data.table.max_rows={table.max_rows} with data.batch_size={cfg.data.batch_size}")
    if table.max_features > model.max_columns:
        raise ValueError(f"data.table.max_features={table.max_features} is more than the model takes "
                         f"(model.max_columns={model.max_columns}): lower it, or use a model with more columns")
    if table.max_classes > model.max_classes:
        raise ValueError(f"data.table.max_classes={table.max_classes} is more than the model's head has "
                         f"(model.max_classes={model.max_classes}): lower it")


def _check_model_fits_memory(cfg: RunConfig) -> None:
    """Each process builds the whole model on the CPU before sharding it: its weights past this machine's memory
    (model.embed_dim=65536: 48 GiB) were an allocator's traceback from every rank. Counted on the meta device."""
    weights = sum(p.numel() for p in shape_model(cfg.model).parameters()) * (8 if cfg.train.dtype == "float64" else 4)
    have = physical_memory()
    if have is not None and weights > have:
        raise ValueError(f"the model's weights alone take {weights / 2**30:,.0f} GiB and this machine has "
                         f"{have / 2**30:,.0f} GiB: use a smaller model (model.embed_dim, its blocks, or a preset)")


def _check_init_from_survives(init_from: Path, out_dir: Path) -> None:
    """--overwrite deletes the run's files (RUN_FILES) before the new run reads train.init_from: weights among them
    would be gone with the old run, and the new one would fail to start."""
    target = init_from.resolve()
    for name in RUN_FILES:
        doomed = (out_dir / name).resolve()
        if target == doomed or doomed in target.parents:
            raise ValueError(f"train.init_from={init_from} lies in {out_dir / name}, which --overwrite deletes: "
                             f"copy the weights out first (`tabfm ckpt merge {init_from} -o model.safetensors`) and "
                             "start from the copy, or start the new run in another train.out_dir")


def _is_checkpoint_manifest(path: Path) -> bool:
    """Whether `path` is a tabfm checkpoint's manifest (JSON naming a model config and rank files), not any file of
    that name (a web app's manifest.json in a project folder)."""
    import json

    if not path.is_file():
        return False
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(manifest, dict) and {"model_config", "files", "layout"} <= set(manifest)


def _checkpoint_above(out_dir: Path) -> Path | None:
    """The checkpoint folder (one holding a manifest) or run's checkpoints/ folder that `out_dir` is or lies in,
    else None: a run written there would be read as that checkpoint (`tabfm ckpt merge`), and deleted when the
    other run prunes or overwrites its checkpoints."""
    resolved = out_dir.resolve()
    for folder in (resolved, *resolved.parents):
        if _is_checkpoint_manifest(folder / ckpt.MANIFEST):
            return folder
        if folder.name == CHECKPOINTS and previous_run(folder.parent):
            return folder
    return None


def _check_out_dir_path(out_dir: Path) -> None:
    """train.out_dir must be (or become) a folder outside any checkpoint, and what a run writes there must not be a
    link out of it."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"train.out_dir={out_dir} is a file; give a folder")
    inside = _checkpoint_above(out_dir)
    if inside is not None:
        raise ValueError(f"train.out_dir={out_dir} lies in {inside}, another run's checkpoints: a run there would be "
                         "read as that checkpoint and deleted with it; give a folder outside it")
    blocker = file_in_the_way(out_dir)
    if blocker is not None:
        raise ValueError(f"train.out_dir={out_dir} lies under {blocker}, which is a file; give a folder")
    existing = next(p for p in (out_dir.absolute(), *out_dir.absolute().parents) if p.exists())
    if not os.access(existing, os.W_OK):  # a read-only mount, another user's folder: every rank's traceback
        raise ValueError(f"train.out_dir={out_dir}: cannot write in {existing} (read-only or not yours); give a "
                         "folder you can write to")
    for name in RUN_FILES:
        if (out_dir / name).is_symlink():
            raise ValueError(f"{out_dir / name} is a link (to {(out_dir / name).resolve()}); a run writes there and "
                             "never through a link out of its folder: remove the link")
        folder = name == CHECKPOINTS
        if (out_dir / name).exists() and (out_dir / name).is_dir() != folder:  # the run trained, then failed saving
            raise ValueError(f"{out_dir / name} is a {'file' if folder else 'folder'}, where a run writes its "
                             f"{'checkpoints folder' if folder else 'file of that name'}: move it away")


def _config_error(message: str) -> int:
    """One line on stderr, from rank 0 only under torchrun; exit status 2."""
    if os.environ.get("RANK", "0") == "0":
        print(f"config error: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None, hooks: Sequence[StepHook] = ()) -> int:
    """`python -m tabfm.pretrain`: check the config, layout and out_dir (status 2 and one line when wrong), then
    train in the process group torchrun set up (status 1 when a loss turns non-finite). hooks: see train."""
    args = build_parser().parse_args(argv)
    try:
        cfg = (load_run_config(args.config, run_overrides(args)) if args.config or not args.print_config
               else load_config())
    except ValueError as e:
        return _config_error(str(e))
    if args.print_config:
        print(dump_config(cfg), end="")
        return 0
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:  # before any process group: a wrong layout is a config error, not a hang or a traceback per rank
        if args.overwrite and world > 1:
            raise ValueError("--overwrite under torchrun: clear the run from one process first, e.g. with "
                             "`tabfm pretrain --nproc N ... --overwrite`, which does so before starting the ranks")
        check_run(cfg, world, args.resume, args.overwrite, args.config)
    except ValueError as e:
        return _config_error(str(e))
    if args.overwrite and (note := clear_run(Path(cfg.train.out_dir))):
        print(note, file=sys.stderr)
    device = resolve_device(cfg)
    if device.type == "cpu":  # this process is tabfm's own: large blocks stay in malloc's heap between steps
        keep_large_blocks_in_heap()
    with process_group(device):  # torchrun's ranks join it; a single process runs without one
        try:
            train(cfg, resume=args.resume, hooks=hooks)
        except NonFiniteLossError as e:
            if is_rank0():
                print(f"error: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # a rank under torchrun on Ctrl-C: the launcher says it once, no traceback per rank
        sys.exit(130)
