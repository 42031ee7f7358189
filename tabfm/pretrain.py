"""Pretraining on the synthetic prior: `python -m tabfm.pretrain --config configs/pretrain/small.yaml`.

Several processes: `torchrun --nproc-per-node 4 -m tabfm.pretrain --config ... --set parallel.d0=2 parallel.d1=2`
(d0 * d1 * dp must equal the process count). Every rank of one tensor-parallel mesh sees the same batch
(data depends only on (seed, step, dp rank)); data-parallel replicas average their gradients. AdamW with linear
warmup then cosine decay; the global gradient norm is computed over all shards (each sharded tensor counted once)
before clipping. Rank 0 shows a tqdm bar and appends one JSON line per logged step to <out_dir>/metrics.jsonl.
A checkpoint folder is written every `train.checkpoint_every` steps under <out_dir>/checkpoints/, and
`--resume auto` (the latest one) or `--resume DIR` continues a run exactly: same batches, optimizer state and
schedule, so the losses are those of an uninterrupted run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from tabfm import checkpoint as ckpt
from tabfm.config import OptimConfig, RunConfig, dump_config, load_config
from tabfm.data.loader import make_loader
from tabfm.model import TabFM, build_model, parallelize_model
from tabfm.parallel.comm import all_reduce
from tabfm.parallel.mesh import ParallelDims, TPMesh
from tabfm.parallel.parallelize import shard_specs

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


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
    specs = shard_specs(model) if model.region.mesh is not None else {}
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
    """The newest complete checkpoint under <out_dir>/checkpoints (None when there is none)."""
    pointer = Path(out_dir) / "checkpoints" / "latest"
    if pointer.is_file():
        path = pointer.parent / pointer.read_text().strip()
        if (path / ckpt.MANIFEST).is_file():
            return path
    found = sorted(p for p in (Path(out_dir) / "checkpoints").glob("step_*") if (p / ckpt.MANIFEST).is_file())
    return found[-1] if found else None


def _after_save(ckpt_root: Path, name: str, keep: int) -> None:
    tmp = ckpt_root / "latest.tmp"
    tmp.write_text(name + "\n")
    tmp.replace(ckpt_root / "latest")
    if keep:
        done = sorted(p for p in ckpt_root.glob("step_*") if p.is_dir() and not p.name.endswith((".tmp", ".old")))
        for old in done[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def _trim_metrics(path: Path, step: int) -> None:
    """On resume, drop metric lines a crashed run wrote after the checkpoint it resumes from."""
    if path.is_file():
        lines = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
        path.write_text("".join(ln + "\n" for ln in lines))


def train(cfg: RunConfig, resume: str | None = None, mesh: TPMesh | None = None) -> list[dict[str, Any]]:
    """Run (or continue) the pretraining described by `cfg`; return the metric records (every rank)."""
    device = _device(cfg)
    mesh = mesh or _build_mesh(cfg, device)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    out_dir = Path(cfg.train.out_dir)
    ckpt_root = out_dir / "checkpoints"
    metrics_path = out_dir / "metrics.jsonl"

    model = build_model(cfg.model, seed=cfg.train.seed).to(device=device, dtype=DTYPES[cfg.train.dtype])
    model = parallelize_model(model, mesh, cfg.parallel.sequence_parallel)
    o = cfg.optim
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                  weight_decay=o.weight_decay)

    start = 0
    if resume is not None:
        path = latest_checkpoint(out_dir) if resume == "auto" else Path(resume)
        if path is None:
            if rank0:
                print(f"--resume auto: no checkpoint under {ckpt_root}, starting from step 0", file=sys.stderr)
        else:
            state = ckpt.load_checkpoint(path, model, optimizer)
            start = int(state.data_position.get("next_step", state.step))
            if rank0:
                _trim_metrics(metrics_path, start)
    if rank0:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(dump_config(cfg))
    if start >= cfg.train.steps:
        return []

    total = cfg.train.steps
    loader = make_loader(cfg.data, dp_rank=mesh.dp_axis.index, start_step=start, num_steps=total - start,
                         pin_memory=device.type == "cuda")
    bar = tqdm(total=total, initial=start, disable=not (rank0 and cfg.train.progress), desc="pretrain",
               dynamic_ncols=True)
    records: list[dict[str, Any]] = []
    tic = time.perf_counter()
    model.train()
    for step, batch in zip(range(start, total), loader, strict=False):
        batch = batch.to(device)
        lr = lr_at(step, o, total)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = model.loss(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        average_over_replicas(model, mesh)
        norm = global_grad_norm(model, mesh)
        if o.grad_clip and norm > o.grad_clip:
            scale = o.grad_clip / (float(norm) + 1e-6)
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        optimizer.step()

        done = step + 1
        loss_value = loss.detach().double().reshape(1)
        if mesh.dp_axis.size > 1:
            loss_value = all_reduce(loss_value, mesh.dp_axis) / mesh.dp_axis.size
        record = {"step": done, "loss": float(loss_value), "lr": lr, "grad_norm": float(norm), "task": batch.task,
                  "batch_shape": list(batch.values.shape), "seconds": round(time.perf_counter() - tic, 4)}
        records.append(record)
        tic = time.perf_counter()
        if rank0:
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{lr:.2e}")
            if done % cfg.train.log_every == 0 or done == total:
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(record) + "\n")
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
    parser.add_argument("--config", help="YAML run config (configs/pretrain/*.yaml); defaults when omitted")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="A.B=C",
                        help="override config fields, e.g. --set optim.lr=3e-4 train.steps=100")
    parser.add_argument("--resume", nargs="?", const="auto", default=None, metavar="auto|DIR",
                        help="continue from the latest checkpoint of train.out_dir (auto) or from DIR")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
    except ValueError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(dump_config(cfg), end="")
        return 0
    world = int(os.environ.get("WORLD_SIZE", "1"))
    started = False
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if _device(cfg).type == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
        started = True
    try:
        train(cfg, resume=args.resume)
    finally:
        if started:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
