"""Saving a checkpoint from any layout and loading it into a model on any layout (DESIGN 6).

Writes are atomic: everything goes to `<dir>.tmp`, then one rename makes it the checkpoint, so a crash mid-write
leaves the last good checkpoint untouched (the writing ranks must share the filesystem holding <dir>). A checkpoint
saved on one layout loads on any other: tensors are gathered (bit-exact, pure slicing) and cut again for the new
coordinate. Loading runs every check of checkpoint_inspect first.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tabfm.checkpoint_format import (FORMAT, MODEL, OPTIM, RNG, finish_folder, global_shape, model_specs,
                                     param_names, rank_file, save_tensors, spec_from_json, spec_to_json)
from tabfm.checkpoint_inspect import gather_full, inspect_checkpoint, read_rank_file
from tabfm.model import ModelConfig, TabFM
from tabfm.parallel.mesh import TPMesh
from tabfm.parallel.sharding import ShardSpec, shard_tensor
from tabfm.parallel_model import model_mesh

@dataclass
class CheckpointState:
    """What `load_checkpoint` returns besides filling the model and optimizer."""

    step: int
    data_position: dict[str, Any]
    run_config: dict[str, Any]
    model_config: ModelConfig
    layout: dict[str, int]
    extra: dict[str, Any] = field(default_factory=dict)


def _local_tensors(model: TabFM, optimizer: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    """model/..., optim/... and rng/... tensors of this rank."""
    out = {MODEL + n: t for n, t in model.state_dict().items()}
    if optimizer is not None:
        names = param_names(model)
        for group in optimizer.param_groups:
            for p in group["params"]:
                for k, v in optimizer.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor):
                        out[f"{OPTIM}{names[id(p)]}/{k}"] = v
    out[RNG + "torch_cpu"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out[RNG + "torch_cuda"] = torch.cuda.get_rng_state()
    return out


def _tensor_spec(key: str, t: torch.Tensor, param_specs: dict[str, ShardSpec]) -> ShardSpec:
    """Model tensors use their parameter's spec; optimizer state the parameter's when shaped like it."""
    name = key[len(MODEL):] if key.startswith(MODEL) else key[len(OPTIM):].rpartition("/")[0]
    spec = param_specs.get(name)
    if spec is not None and len(spec.dims) == t.dim():
        return spec
    return ShardSpec((None,) * t.dim())


def _optimizer_groups(model: TabFM, optimizer: torch.optim.Optimizer) -> list[dict]:
    """The optimizer's parameter groups as JSON: hyperparameters, and parameters by name."""
    names = param_names(model)
    groups = []
    for group in optimizer.param_groups:
        hp = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"}
        groups.append({**hp, "params": [names[id(p)] for p in group["params"]]})
    return groups


# ---------------------------------------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------------------------------------

def _world(group: Any) -> tuple[int, int]:
    """(rank, size) of `group`; (0, 1) without a process group."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def save_checkpoint(ckpt_dir: str | Path, model: TabFM, optimizer: torch.optim.Optimizer | None = None, *,
                    mesh: TPMesh | None = None, step: int = 0, data_position: dict[str, Any] | None = None,
                    run_config: dict[str, Any] | None = None, extra: dict[str, Any] | None = None,
                    group: Any = None) -> Path:
    """Write this run's checkpoint folder; collective over `group` (default: all ranks, when distributed).

    Each tensor-parallel rank of data-parallel replica 0 writes its file; rank 0 of the group writes the manifest
    and renames the temporary folder into place. All ranks return after the checkpoint is complete.
    """
    ckpt_dir = Path(ckpt_dir)
    tmp = ckpt_dir.with_name(ckpt_dir.name + ".tmp")
    mesh = mesh or model_mesh(model) or TPMesh.single()
    if model_mesh(model) is None and mesh.tp > 1:
        raise ValueError(f"the model is plain but the mesh is {mesh}: parallelize it first (parallelize_model)")
    rank, world = _world(group)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    if world > 1:
        dist.barrier(group)

    specs = model_specs(model)  # before the RNG state is read: building the specs' meta twin must not move it
    local = _local_tensors(model, optimizer)
    info = None
    if mesh.dp_axis.index == 0:
        name = rank_file(mesh.tp_rank)
        info = {"name": name, "coord": [mesh.i, mesh.j], **save_tensors(local, tmp / name)}
    infos = [info]
    if world > 1:
        infos = [None] * world
        dist.all_gather_object(infos, info, group=group)

    if rank == 0:
        files = {i["name"]: {k: v for k, v in i.items() if k != "name"} for i in infos if i is not None}
        manifest = _manifest(model, optimizer, mesh, specs, local, files, step=step, data_position=data_position,
                             run_config=run_config, extra=extra)
        finish_folder(tmp, ckpt_dir, manifest)
    if world > 1:
        dist.barrier(group)
    return ckpt_dir


def _manifest(model: TabFM, optimizer: torch.optim.Optimizer | None, mesh: TPMesh, specs: dict[str, ShardSpec],
              local: dict[str, torch.Tensor], files: dict[str, dict], *, step: int,
              data_position: dict[str, Any] | None, run_config: dict[str, Any] | None,
              extra: dict[str, Any] | None) -> dict:
    """The manifest of a save: every tensor's global shape, dtype and spec (read off this rank's shards), the
    optimizer's groups, the rank files written (`files`) and the run's position."""
    d0, d1 = mesh.d0, mesh.d1
    tensors = {}
    for key, t in local.items():
        if key.startswith(RNG):
            continue
        spec = _tensor_spec(key, t, specs)
        tensors[key] = {"shape": global_shape(tuple(t.shape), spec, d0, d1), "dtype": str(t.dtype),
                        "spec": spec_to_json(spec)}
    return {
        "format": FORMAT,
        "step": step,
        "data_position": data_position or {},
        "model_config": model.config.to_dict(),
        "run_config": run_config or {},
        "layout": {"d0": d0, "d1": d1, "dp": mesh.dims.dp},
        "tensors": tensors,
        "optimizer": None if optimizer is None else {"class": type(optimizer).__name__,
                                                     "param_groups": _optimizer_groups(model, optimizer)},
        "rng": {"torch": "per rank, in each rank file as rng/torch_cpu (and rng/torch_cuda)"},
        "files": dict(sorted(files.items())),
        "extra": extra or {},
    }


# ---------------------------------------------------------------------------------------------------------
# Load into a model on any layout
# ---------------------------------------------------------------------------------------------------------

def load_checkpoint(ckpt_dir: str | Path, model: TabFM, optimizer: torch.optim.Optimizer | None = None, *,
                    restore_rng: bool = True) -> CheckpointState:
    """Fill `model` (plain, or parallelized by parallelize_model) and `optimizer` from a checkpoint saved on
    any layout. Not collective: every rank reads the files it needs.

    On the layout it was saved with, each rank reads only its own file; otherwise the tensors are gathered from
    all files and cut for this rank's coordinate. RNG states are restored only on the same layout.
    """
    ckpt_dir = Path(ckpt_dir)
    mesh = model_mesh(model) or TPMesh.single()
    manifest = inspect_checkpoint(ckpt_dir, model)
    specs = model_specs(model)

    layout = manifest["layout"]
    same_layout = (layout["d0"], layout["d1"]) == (mesh.d0, mesh.d1)
    if same_layout:
        local = read_rank_file(ckpt_dir, manifest, rank_file(mesh.tp_rank))
    else:
        full = gather_full(ckpt_dir, manifest)
        local = {}
        for key, t in full.items():
            spec = spec_from_json(manifest["tensors"][key]["spec"])
            if key.startswith(MODEL):  # cut by the model's spec, which is the saved one
                spec = specs.get(key[len(MODEL):], spec)
            local[key] = shard_tensor(t, spec, mesh.d0, mesh.d1, mesh.i, mesh.j)

    state = {k[len(MODEL):]: v for k, v in local.items() if k.startswith(MODEL)}
    model.load_state_dict(state, strict=True)
    if optimizer is not None:
        _load_optimizer(manifest, local, model, optimizer, ckpt_dir)
    if restore_rng and same_layout and RNG + "torch_cpu" in local:
        torch.set_rng_state(local[RNG + "torch_cpu"])
        if RNG + "torch_cuda" in local and torch.cuda.is_available():
            torch.cuda.set_rng_state(local[RNG + "torch_cuda"])
    return CheckpointState(step=manifest["step"], data_position=manifest.get("data_position", {}),
                           run_config=manifest.get("run_config", {}),
                           model_config=ModelConfig.from_dict(manifest["model_config"]), layout=layout,
                           extra=manifest.get("extra", {}))


def _load_optimizer(manifest: dict, local: dict[str, torch.Tensor], model: TabFM,
                    optimizer: torch.optim.Optimizer, ckpt_dir: Path) -> None:
    saved = manifest.get("optimizer")
    if saved is None:
        raise ValueError(f"{ckpt_dir} holds no optimizer state; load the model alone (optimizer=None)")
    names = param_names(model)
    index = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            index[names[id(p)]] = len(index)
    if [len(g["params"]) for g in saved["param_groups"]] != [len(g["params"]) for g in optimizer.param_groups]:
        raise ValueError(f"{ckpt_dir}: the optimizer's parameter groups differ from the saved ones")
    state: dict[int, dict] = {}
    for key, t in local.items():
        if key.startswith(OPTIM):
            name, _, field_ = key[len(OPTIM):].rpartition("/")
            if name not in index:
                raise ValueError(f"{ckpt_dir}: optimizer state for {name!r}, which the optimizer does not hold")
            state.setdefault(index[name], {})[field_] = t
    groups = []
    for g, ours in zip(saved["param_groups"], optimizer.param_groups, strict=True):
        lacking = [n for n in g["params"] if n not in index]
        if lacking:
            raise ValueError(f"{ckpt_dir}: the saved optimizer steps {lacking[:3]}, which this optimizer does not")
        hp = {k: (tuple(v) if isinstance(v, list) else v) for k, v in g.items() if k != "params"}
        wrong = [k for k, v in hp.items() if k in ours and not _same_kind(v, ours[k])]
        if wrong:
            raise ValueError(f"{ckpt_dir}: saved optimizer settings {wrong} are of another kind than this "
                             f"optimizer's ({[hp[k] for k in wrong]} vs {[ours[k] for k in wrong]})")
        groups.append({**hp, "params": [index[n] for n in g["params"]]})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _same_kind(saved: Any, ours: Any) -> bool:
    """Whether a saved hyperparameter can stand in for the optimizer's (a number for a number, a tuple of as many
    numbers for a tuple, a flag for a flag)."""
    if isinstance(ours, torch.Tensor):
        ours = ours.tolist()
    if isinstance(ours, bool) or ours is None:  # flags and "auto" (None) stand in for each other
        return saved is None or isinstance(saved, bool)
    if isinstance(ours, str):
        return isinstance(saved, str)
    if isinstance(ours, int | float):
        return isinstance(saved, int | float) and not isinstance(saved, bool)
    if isinstance(ours, tuple | list):
        return isinstance(saved, tuple) and len(saved) == len(ours)
    return True

