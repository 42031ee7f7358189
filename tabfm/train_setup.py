"""What a pretraining run is set up with before its first step: the device, the layout and its mesh, and the model
(built from the run's seed, optionally started from other weights, parallelized) with its optimizer."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from tabfm import checkpoint as ckpt
from tabfm.config import RunConfig
from tabfm.layout import resolve_layout
from tabfm.model import TabFM, build_model
from tabfm.parallel.mesh import ParallelDims, TPMesh
from tabfm.parallel_model import ParallelOptions, parallelize_model
from tabfm.precision import make_optimizer

DTYPES = {"float32": torch.float32, "float64": torch.float64}
"""train.dtype -> the parameters' dtype (bf16 compute is train.precision: autocast, float32 master weights)."""


def is_rank0() -> bool:
    """Global rank 0, or the only process: the one that prints, logs and prunes."""
    return not dist.is_initialized() or dist.get_rank() == 0


def resolve_device(cfg: RunConfig) -> torch.device:
    """train.device as a torch device (auto: this rank's GPU when one is visible); ValueError for cuda without
    one."""
    want = cfg.train.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("train.device=cuda but no GPU is visible; use train.device=cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def resolve_run_layout(cfg: RunConfig) -> RunConfig:
    """The config with `parallel.layout: auto` resolved for this world size (rank 0 says what was chosen)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    cfg, reason = resolve_layout(cfg, world, Path(cfg.train.out_dir))
    if reason and is_rank0():
        print(f"layout auto: {reason}", flush=True)
    return cfg


def build_mesh(cfg: RunConfig, device: torch.device) -> TPMesh:
    """The (dp, d0, d1) mesh of the config's layout; LayoutError when it does not match the world size."""
    dims = ParallelDims(cfg.parallel.d0, cfg.parallel.d1, cfg.parallel.dp)
    dims.check_world_size(dist.get_world_size() if dist.is_initialized() else 1)
    return dims.build(device.type)


def build_model_and_optimizer(cfg: RunConfig, mesh: TPMesh, device: torch.device,
                              init_from: str | None) -> tuple[TabFM, torch.optim.Optimizer]:
    """The run's model (seeded by train.seed, in train.dtype, weights copied from `init_from` when given),
    parallelized on `mesh`, and its AdamW (weight decay on linear weight matrices only)."""
    model = build_model(cfg.model, seed=cfg.train.seed).to(device=device, dtype=DTYPES[cfg.train.dtype])
    if init_from:
        regrouped = ckpt.init_weights(model, init_from)
        if regrouped and is_rank0():
            print("init_from: the weights' heads regrouped, "
                  + ", ".join(f"{k} {a} -> {b}" for k, (a, b) in regrouped.items()), flush=True)
    model = parallelize_model(model, mesh, ParallelOptions.from_config(cfg.parallel))
    if cfg.train.compile is not None:  # in place: the parameter names (checkpoints, optimizer) stay the same
        model.compile(backend=cfg.train.compile)
    return model, make_optimizer(model, cfg.optim)
