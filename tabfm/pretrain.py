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

The layout is checked before any process group is created: dp * d0 * d1 must equal WORLD_SIZE and (d0, d1) must
divide the model's heads and widths; otherwise main exits with status 2 and lists the layouts that fit.
`tabfm pretrain --nproc N` runs the same checks (config, layout for N processes, out_dir) before starting torchrun.

With `train.eval_every` > 0 the model is evaluated on a few real tables (tabfm.evaluate) every that many steps and
at the end; rank 0 appends {"step": s, "eval": {...}} to metrics.jsonl. Evaluation draws no random numbers from
the training streams and changes no batch, so resumed runs stay exact with it on.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from tabfm import checkpoint as ckpt
from tabfm._cli_train import add_run_dir_arguments, read_metrics_file
from tabfm.config import OptimConfig, RunConfig, dump_config, load_config
from tabfm.data.encode import Batch
from tabfm.data.loader import make_loader
from tabfm.evaluate import evaluate, load_tables
from tabfm.layout import check_layout, fitting_layouts, resolve_layout
from tabfm.model import TabFM, build_model
from tabfm.parallel_model import parallelize_model
from tabfm.parallel.comm import all_reduce
from tabfm.parallel.mesh import LayoutError, ParallelDims, TPMesh
from tabfm.parallel.parallelize import shard_specs
from tabfm.parallel.process_group import process_group
from tabfm.precision import autocast, make_optimizer, matmul_precision

DTYPES = {"float32": torch.float32, "float64": torch.float64}
"""train.dtype -> the parameters' dtype (bf16 compute is train.precision: autocast, float32 master weights)."""


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup to cfg.lr, then cosine to lr*min_lr_ratio."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, total_steps - 1 - cfg.warmup_steps)
    t = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * t))


def global_grad_norm(model: TabFM, mesh: TPMesh) -> torch.Tensor:
    """The 2-norm of the full gradient: each tensor's local sum of squares is summed over the mesh axes that
    split it (replicated tensors are counted once)."""
    specs = shard_specs(model)  # empty for a plain model
    sums: dict[tuple[bool, bool], torch.Tensor] = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        dims = set(specs[name].dims) if name in specs else set()
        key = (bool(dims & {"tp0", "tp"}), bool(dims & {"tp1", "tp"}))
        sq = p.grad.detach().double().square().sum()
        sums[key] = sums.get(key, torch.zeros((), dtype=torch.float64, device=sq.device)) + sq
    total = torch.zeros((), dtype=torch.float64)
    for (over0, over1), sq in sorted(sums.items()):
        if over0:
            sq = all_reduce(sq, mesh.axis0)
        if over1:
            sq = all_reduce(sq, mesh.axis1)
        total = total + sq.cpu()
    return total.sqrt()


def average_over_replicas(model: TabFM, mesh: TPMesh) -> None:
    """Average the gradients over the data-parallel replicas (one flat all-reduce)."""
    if mesh.dp_axis.size == 1:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = all_reduce(torch.cat([g.reshape(-1) for g in grads]), mesh.dp_axis) / mesh.dp_axis.size
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def train_step(model: TabFM, optimizer: torch.optim.Optimizer, batch: Batch, mesh: TPMesh, lr: float,
               cfg: OptimConfig, precision: str = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step at learning rate `lr`: loss (under `precision`'s autocast), backward, replica averaging,
    global-norm clipping, AdamW. Returns (loss, global gradient norm before clipping)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    with autocast(precision, batch.values.device):
        loss = model.loss(batch)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    average_over_replicas(model, mesh)
    norm = global_grad_norm(model, mesh)
    if cfg.grad_clip and norm > cfg.grad_clip:
        scale = cfg.grad_clip / (float(norm) + 1e-6)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
    optimizer.step()
    return loss, norm


FAULT_ENV = "TABFM_FAULT_AT_STEP"
"""Test-only fault injection: when set to a step index, rank TABFM_FAULT_RANK (default 1) SIGKILLs itself just
before running that step, once per out_dir (the marker file FAULT_MARKER records that it fired)."""
FAULT_MARKER = "fault_fired"


def _maybe_fault(step: int, out_dir: Path) -> None:
    at = os.environ.get(FAULT_ENV)
    if at is None or int(at) != step:
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank != int(os.environ.get("TABFM_FAULT_RANK", "1")):
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    marker = out_dir / FAULT_MARKER
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # fire once, even across restarts
    except FileExistsError:
        return
    os.write(fd, f"rank {rank} killed itself before step {step}\n".encode())
    os.fsync(fd)
    os.close(fd)
    print(f"{FAULT_ENV}: rank {rank} kills itself before step {step}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _device(cfg: RunConfig) -> torch.device:
    want = cfg.train.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("train.device=cuda but no GPU is visible; use train.device=cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def _build_mesh(cfg: RunConfig, device: torch.device) -> TPMesh:
    dims = ParallelDims(cfg.parallel.d0, cfg.parallel.d1, cfg.parallel.dp)
    dims.check_world_size(dist.get_world_size() if dist.is_initialized() else 1)
    return dims.build(device.type)


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under <out_dir>/checkpoints (None when there is none); see
    checkpoint.latest_checkpoint (a `latest` file naming anything but a step_<digits> folder is refused)."""
    return ckpt.latest_checkpoint(out_dir)


def _after_save(ckpt_root: Path, name: str, keep: int) -> None:
    ckpt.mark_latest(ckpt_root, name, keep)  # `latest` -> name, then prune old checkpoints and step_N.tmp leftovers


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


def _trim_metrics(path: Path, step: int) -> None:
    """On resume, keep only the metric lines up to `step` (none when the run starts afresh from step 0): a crashed
    run wrote lines after the checkpoint it resumes from. Written to a temporary file and renamed."""
    if not path.is_file():
        return
    kept = [r for r in read_metrics_file(path) if r["step"] <= step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    tmp.replace(path)


RUN_FILES = ("metrics.jsonl", "curves.png", "checkpoints")
"""What a run leaves in its out_dir and `--overwrite` removes (config.yaml and layout.json are rewritten anyway)."""


def previous_run(out_dir: Path) -> list[str]:
    """What of an earlier run `out_dir` holds: a non-empty metrics log and a non-empty checkpoints folder."""
    held = []
    metrics, ckpts = out_dir / "metrics.jsonl", out_dir / "checkpoints"
    if metrics.is_file() and metrics.stat().st_size:
        held.append(str(metrics))
    if ckpts.is_dir() and any(ckpts.iterdir()):
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
    if held and resume is None and not overwrite:
        raise ValueError(f"{out_dir} already holds a run ({' and '.join(held)}): continue it with --resume auto, "
                         "start another with --set train.out_dir=NEW_DIR, or delete it with --overwrite")
    if resume is not None and (out_dir / "metrics.jsonl").is_file():
        read_metrics_file(out_dir / "metrics.jsonl", warn=False)  # corrupt: refused now, not on rank 0 mid-run
    if resume == "auto":
        latest_checkpoint(out_dir)  # a `latest` naming anything but a step folder: refused here, in one line


def clear_run(out_dir: Path) -> str | None:
    """Delete an earlier run's metrics log, plot and checkpoints from `out_dir`; say what was removed."""
    removed = []
    for name in RUN_FILES:
        path = out_dir / name
        if path.is_dir():
            count = sum(1 for p in path.glob("step_*") if p.is_dir())
            shutil.rmtree(path)
            removed.append(f"{path}/ ({count} checkpoint{'s' if count != 1 else ''})")
        elif path.exists():
            removed.append(str(path))
            path.unlink()
    return f"--overwrite removed {', '.join(removed)}" if removed else None


class NonFiniteLossError(RuntimeError):
    """A step's loss or gradient norm is NaN or infinite: the run stops before logging or saving it, so the last
    checkpoint on disk is the last good state."""

    def __init__(self, step: int, task: str, loss: float, grad_norm: float, last_good: Path | None) -> None:
        kept = f"the last good checkpoint is {last_good}" if last_good else "no checkpoint was saved yet"
        super().__init__(f"step {step} ({task} batch): loss {loss}, gradient norm {grad_norm}; stopped without "
                         f"saving, {kept} (lower optim.lr or raise optim.warmup_steps, then --resume auto)")


def train(cfg: RunConfig, resume: str | None = None, mesh: TPMesh | None = None) -> list[dict[str, Any]]:
    """Run (or continue) the pretraining described by `cfg`; return the metric records (every rank)."""
    device = _device(cfg)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if mesh is None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        cfg, reason = resolve_layout(cfg, world, Path(cfg.train.out_dir))
        if reason and rank0:
            print(f"layout auto: {reason}", flush=True)
    mesh = mesh or _build_mesh(cfg, device)
    out_dir = Path(cfg.train.out_dir)
    ckpt_root = out_dir / "checkpoints"
    metrics_path = out_dir / "metrics.jsonl"

    path = None
    if resume is not None:
        path = latest_checkpoint(out_dir) if resume == "auto" else Path(resume)
        if path is None and rank0:
            print(f"--resume auto: no checkpoint under {ckpt_root}, starting from step 0", file=sys.stderr)

    model = build_model(cfg.model, seed=cfg.train.seed).to(device=device, dtype=DTYPES[cfg.train.dtype])
    if cfg.train.init_from and path is None:  # a checkpoint to resume from takes precedence
        ckpt.init_weights(model, cfg.train.init_from)
    p = cfg.parallel
    model = parallelize_model(model, mesh, p.sequence_parallel, overlap_chunks=p.overlap_chunks, kernels=p.kernels)
    o = cfg.optim
    optimizer = make_optimizer(model, o)  # weight decay on linear weight matrices only

    start = 0
    if path is not None:
        state = ckpt.load_checkpoint(path, model, optimizer)
        start = int(state.data_position.get("next_step", state.step))
    if rank0 and resume is not None:  # no checkpoint: start = 0 empties the log of the run that crashed before one
        _trim_metrics(metrics_path, start)
    if rank0:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(dump_config(cfg))
    if start >= cfg.train.steps:
        return []

    eval_tables: list = []
    if cfg.train.eval_every:
        eval_tables, notes = load_tables(cfg.train.eval_tables, cfg.train.eval_max_train_rows, model_cfg=cfg.model)
        if rank0:
            for note in notes:
                print(f"evaluation skips {note}", file=sys.stderr)
    total = cfg.train.steps
    loader = make_loader(cfg.data, dp_rank=mesh.dp_axis.index, start_step=start, num_steps=total - start,
                         pin_memory=device.type == "cuda")
    bar = tqdm(total=total, initial=start, disable=not (rank0 and cfg.train.progress), desc="pretrain",
               dynamic_ncols=True)
    records: list[dict[str, Any]] = []
    tic = time.perf_counter()
    model.train()
    postfix: dict[str, str] = {}
    for step, batch in zip(range(start, total), loader, strict=False):
        _maybe_fault(step, out_dir)
        batch = batch.to(device)
        lr = lr_at(step, o, total)
        with matmul_precision(cfg.train.precision, device):  # TF32 matmuls for precision tf32 on CUDA
            loss, norm = train_step(model, optimizer, batch, mesh, lr, o, cfg.train.precision)

        done = step + 1
        loss_value = loss.detach().double().reshape(1)
        if mesh.dp_axis.size > 1:
            loss_value = all_reduce(loss_value, mesh.dp_axis) / mesh.dp_axis.size
        record = {"step": done, "loss": float(loss_value), "lr": lr, "grad_norm": float(norm), "task": batch.task,
                  "batch_shape": list(batch.values.shape), "seconds": round(time.perf_counter() - tic, 4)}
        if not (math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"])):
            bar.close()  # the same on every rank (both are reduced over the mesh): all stop, none saves
            raise NonFiniteLossError(done, batch.task, record["loss"], record["grad_norm"], latest_checkpoint(out_dir))
        records.append(record)
        tic = time.perf_counter()
        if rank0:
            bar.update(1)
            postfix.update(loss=f"{record['loss']:.4f}", lr=f"{lr:.2e}")
            if done % cfg.train.log_every == 0 or done == total:
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(record) + "\n")
        if eval_tables and (done % cfg.train.eval_every == 0 or done == total):
            # Before the checkpoint: a run resumed from it never repeats this evaluation, so it must be on disk.
            result = evaluate(model, eval_tables, mesh)  # every rank of the mesh takes part
            if rank0 and result is not None:
                record["eval"] = result
                with open(metrics_path, "a") as f:
                    f.write(json.dumps({"step": done, "eval": result}) + "\n")
                postfix.update(auc=f"{result['mean_roc_auc']:.3f}", acc=f"{result['mean_accuracy']:.3f}")
        if rank0:
            bar.set_postfix(postfix)
        every = cfg.train.checkpoint_every
        if (every and done % every == 0) or done == total:
            name = f"step_{done:07d}"
            ckpt.save_checkpoint(ckpt_root / name, model, optimizer, mesh=mesh, step=done,
                                 data_position={"next_step": done, "seed": cfg.data.seed},
                                 run_config=cfg.to_dict())
            if rank0:
                _after_save(ckpt_root, name, cfg.train.keep_checkpoints)
            if dist.is_initialized():
                dist.barrier()
    bar.close()
    return records


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


def check_run(cfg: RunConfig, world_size: int, resume: str | None, overwrite: bool) -> None:
    """Everything checkable before any process group starts (ValueError, one line): the layout against the
    process count and the model, the topology preset of layout auto, the device, and what train.out_dir holds."""
    check_run_layout(cfg, world_size)
    if cfg.parallel.layout == "auto" and cfg.parallel.topology != "measure":
        from tabfm.config import load_topology

        load_topology(cfg.parallel.topology)  # a misspelled preset: here, not on rank 0 once every rank has started
    _device(cfg)
    check_out_dir(Path(cfg.train.out_dir), resume, overwrite)


def _config_error(message: str) -> int:
    """One line on stderr, from rank 0 only under torchrun; exit status 2."""
    if os.environ.get("RANK", "0") == "0":
        print(f"config error: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = load_run_config(args.config, args.set) if args.config or not args.print_config else load_config()
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
        check_run(cfg, world, args.resume, args.overwrite)
    except ValueError as e:
        return _config_error(str(e))
    if args.overwrite and (note := clear_run(Path(cfg.train.out_dir))):
        print(note, file=sys.stderr)
    with process_group(_device(cfg)):  # torchrun's ranks join it (tabfm.parallel.process_group); one process not
        try:
            train(cfg, resume=args.resume)
        except NonFiniteLossError as e:
            if not dist.is_initialized() or dist.get_rank() == 0:
                print(f"error: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
