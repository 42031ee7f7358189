"""One optimizer step of pretraining: the learning-rate schedule, replica averaging, the global gradient norm over
the shards, clipping and AdamW (tabfm.pretrain runs it in a loop; benchmarks time it alone).

    lr_at(step, cfg, total)          linear warmup to cfg.lr, then cosine decay to lr * min_lr_ratio
    train_step(model, opt, batch, mesh, lr, cfg, precision)   loss, backward, average, clip, step
    replica_mean(loss, mesh)         the loss averaged over the data-parallel replicas (what the log shows)

Replica averaging is one flat all-reduce of every gradient over the mesh's data-parallel axis, then a division by
the replica count. It is hand-written rather than DistributedDataParallel or torch.nn.utils.clip_grad_norm_, on
purpose: DDP wraps the module (its state-dict names gain a `module.` prefix, so checkpoints would change) and
prepares its reducer in forward(), which the loop never calls (it calls model.loss); clip_grad_norm_ sums the
norm over local tensors only, while a sharded tensor's norm must be summed over the mesh axes that cut it, and
it computes its coefficient as a reciprocal times max_norm, which can differ from the division below in the last
bit, so checkpoints would no longer be byte-identical to earlier runs.
"""

from __future__ import annotations

import math

import torch

from tabfm.config import OptimConfig
from tabfm.data.encode import Batch
from tabfm.model import TabFM
from tabfm.parallel.comm import all_reduce
from tabfm.parallel.mesh import TPMesh
from tabfm.parallel.parallelize import shard_specs
from tabfm.precision import autocast


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
    """Average the gradients over the data-parallel replicas: one flat all-reduce of every gradient (see the
    module docstring for why not DDP).

    Replicas may see different tasks in one step (a classification batch here, regression there), so a head can
    have a gradient on some replicas and none on others. A first, small all-reduce counts the replicas holding each
    gradient; a parameter that some replica has a gradient for takes part on every replica (zeros where it has
    none), one that none has keeps no gradient (AdamW then skips it, as on one process). When every replica holds
    the same gradients the flat all-reduce is the same as without the count."""
    if mesh.dp_axis.size == 1:
        return
    params = list(model.parameters())
    held = torch.tensor([float(p.grad is not None) for p in params], device=params[0].device)
    held = all_reduce(held, mesh.dp_axis).tolist()
    reduced = [p for p, n in zip(params, held, strict=True) if n > 0]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in reduced]
    flat = all_reduce(torch.cat([g.reshape(-1) for g in grads]), mesh.dp_axis) / mesh.dp_axis.size
    offset = 0
    for p in reduced:
        piece = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
        if p.grad is None:
            p.grad = piece.clone()
        else:
            p.grad.copy_(piece)


def clip_gradients(model: TabFM, norm: torch.Tensor, max_norm: float) -> None:
    """Scale every gradient by max_norm / norm when the global norm exceeds max_norm (0: no clipping)."""
    if max_norm and norm > max_norm:
        scale = max_norm / (float(norm) + 1e-6)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)


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
    clip_gradients(model, norm, cfg.grad_clip)
    optimizer.step()
    return loss, norm


def replica_mean(loss: torch.Tensor, mesh: TPMesh) -> float:
    """A step's loss averaged over the data-parallel replicas, in float64: the number every rank logs."""
    value = loss.detach().double().reshape(1)
    if mesh.dp_axis.size > 1:
        value = all_reduce(value, mesh.dp_axis) / mesh.dp_axis.size
    return float(value)
