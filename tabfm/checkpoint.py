"""Sharded checkpoints (DESIGN 6): save / load on any layout, merge into one file, reshard for another layout.

A checkpoint is a folder:
    manifest.json            format, model config, run config, layout (d0, d1, dp), step, data position, every
                             tensor's global shape, dtype and ShardSpec, the optimizer's hyperparameters, and each
                             rank file's size and sha256
    rank000.safetensors ...  one file per tensor-parallel rank t = i * d1 + j (data-parallel replica 0 writes it):
        model/<name>             the local shard of parameter or buffer <name> (plain-model names)
        optim/<name>/<field>     the local shard of its optimizer state (exp_avg, exp_avg_sq: cut like the
                                 parameter; step: replicated)
        rng/torch_cpu [, rng/torch_cuda]   this rank's RNG states (per rank: restored only on the same layout)
Writes are atomic: everything goes to `<dir>.tmp`, then one rename makes it the checkpoint, so a crash mid-write
leaves the last good checkpoint untouched (the writing ranks must share the filesystem holding <dir>). Loading checks the manifest, file sizes, checksums, names, shapes and
the model config, and raises ValueError saying what is wrong. A checkpoint saved on one layout loads on any
other: tensors are gathered (bit-exact, pure slicing) and cut again for the new coordinate.

    merge(ckpt_dir, out)              one safetensors file: the plain model's state dict, config in its metadata
    reshard(ckpt_dir, d0, d1, out)    the same checkpoint cut for another layout (optimizer state included)
    load_merged / load_model          a merged file (or a checkpoint folder) into a model on any layout
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from tabfm.model import ModelConfig, TabFM, build_model, parallelize_model, tp_plan
from tabfm.parallel.mesh import TPMesh
from tabfm.parallel.parallelize import full_shard_specs, shard_specs
from tabfm.parallel.sharding import ShardSpec, shard_tensor, unshard_tensor

FORMAT = "tabfm-checkpoint-v1"
MERGED_FORMAT = "tabfm-merged-v1"
MANIFEST = "manifest.json"
MODEL, OPTIM, RNG = "model/", "optim/", "rng/"


@dataclass
class CheckpointState:
    """What `load_checkpoint` returns besides filling the model and optimizer."""

    step: int
    data_position: dict[str, Any]
    run_config: dict[str, Any]
    model_config: ModelConfig
    layout: dict[str, int]
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------------
# Specs, names, files
# ---------------------------------------------------------------------------------------------------------

def model_specs(model: TabFM) -> dict[str, ShardSpec]:
    """How each parameter is cut: read off the ATP layers of a parallelized model, or, for a plain model, the
    specs `parallelize` would give it (so a 1x1 checkpoint still reshards to any layout)."""
    if model.region.mesh is None:
        return full_shard_specs(model, tp_plan(model))
    return shard_specs(model)


def _spec_to_json(spec: ShardSpec) -> dict:
    return {"dims": list(spec.dims), "qkv_heads": spec.qkv_heads}


def _spec_from_json(d: dict) -> ShardSpec:
    return ShardSpec(tuple(d["dims"]), qkv_heads=d.get("qkv_heads"))


def _global_shape(local: tuple[int, ...], spec: ShardSpec, d0: int, d1: int) -> list[int]:
    return [n * spec.parts(p, d0, d1) for n, p in zip(local, spec.dims, strict=True)]


def rank_file(t: int) -> str:
    return f"rank{t:03d}.safetensors"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> dict:
    save_file({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}, str(path), metadata)
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


def _param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def _local_tensors(model: TabFM, optimizer: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    """model/..., optim/... and rng/... tensors of this rank."""
    out = {MODEL + n: t for n, t in model.state_dict().items()}
    if optimizer is not None:
        names = _param_names(model)
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
    names = _param_names(model)
    groups = []
    for group in optimizer.param_groups:
        hp = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"}
        groups.append({**hp, "params": [names[id(p)] for p in group["params"]]})
    return groups


# ---------------------------------------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------------------------------------

def _world(group: Any) -> tuple[int, int]:
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
    mesh = mesh or model.region.mesh or TPMesh.single()
    if model.region.mesh is None and mesh.tp > 1:
        raise ValueError(f"the model is plain but the mesh is {mesh}: parallelize it first (parallelize_model)")
    rank, world = _world(group)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    if world > 1:
        dist.barrier(group)

    d0, d1 = mesh.d0, mesh.d1
    specs = model_specs(model)
    local = _local_tensors(model, optimizer)
    info = None
    if mesh.dp_axis.index == 0:
        name = rank_file(mesh.tp_rank)
        info = {"name": name, "coord": [mesh.i, mesh.j], **_save_tensors(local, tmp / name)}
    infos = [info]
    if world > 1:
        infos = [None] * world
        dist.all_gather_object(infos, info, group=group)

    if rank == 0:
        tensors = {}
        for key, t in local.items():
            if key.startswith(RNG):
                continue
            spec = _tensor_spec(key, t, specs)
            tensors[key] = {"shape": _global_shape(tuple(t.shape), spec, d0, d1), "dtype": str(t.dtype),
                            "spec": _spec_to_json(spec)}
        files = {i["name"]: {k: v for k, v in i.items() if k != "name"} for i in infos if i is not None}
        manifest = {
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
        _finish(tmp, ckpt_dir, manifest)
    if world > 1:
        dist.barrier(group)
    return ckpt_dir


def _finish(tmp: Path, ckpt_dir: Path, manifest: dict) -> None:
    """Write the manifest last, then swap the folder into place with renames."""
    path = tmp / MANIFEST
    path.write_text(json.dumps(manifest, indent=1))
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    old = ckpt_dir.with_name(ckpt_dir.name + ".old")
    if ckpt_dir.exists():
        shutil.rmtree(old, ignore_errors=True)
        ckpt_dir.rename(old)
    tmp.rename(ckpt_dir)
    shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------
# Read and verify
# ---------------------------------------------------------------------------------------------------------

def read_manifest(ckpt_dir: str | Path) -> dict:
    """The manifest, checked for format and completeness (ValueError otherwise)."""
    ckpt_dir = Path(ckpt_dir)
    path = ckpt_dir / MANIFEST
    if not ckpt_dir.is_dir():
        raise ValueError(f"{ckpt_dir} is not a checkpoint folder (no such directory)")
    if not path.is_file():
        raise ValueError(f"{ckpt_dir} has no {MANIFEST}: not a checkpoint, or its write never finished")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}): the manifest is corrupt") from None
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    missing = [k for k in ("model_config", "layout", "tensors", "files", "step") if k not in manifest]
    if missing:
        raise ValueError(f"{path} lacks {missing}: the manifest is incomplete")
    d0, d1 = manifest["layout"]["d0"], manifest["layout"]["d1"]
    want = {rank_file(t) for t in range(d0 * d1)}
    if set(manifest["files"]) != want:
        raise ValueError(f"{path}: layout {d0}x{d1} needs files {sorted(want)}, the manifest lists "
                         f"{sorted(manifest['files'])}")
    return manifest


def _read_rank_file(ckpt_dir: Path, manifest: dict, name: str, verify: bool = True) -> dict[str, torch.Tensor]:
    """One rank file's tensors, after checking its size, checksum and every tensor's local shape."""
    path = ckpt_dir / name
    info = manifest["files"][name]
    if not path.is_file():
        raise ValueError(f"{path} is missing (listed in the manifest)")
    size = path.stat().st_size
    if size != info["bytes"]:
        raise ValueError(f"{path} is truncated or altered: {size} bytes, the manifest says {info['bytes']}")
    if verify and _sha256(path) != info["sha256"]:
        raise ValueError(f"{path} is corrupt: its sha256 does not match the manifest's")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path} cannot be read as safetensors: {e}") from None
    d0, d1 = manifest["layout"]["d0"], manifest["layout"]["d1"]
    i, j = info["coord"]
    for key, meta in manifest["tensors"].items():
        if key not in tensors:
            raise ValueError(f"{path} lacks tensor {key!r} listed in the manifest")
        spec = _spec_from_json(meta["spec"])
        want = spec.local_shape(tuple(meta["shape"]), d0, d1)
        if tuple(tensors[key].shape) != want:
            raise ValueError(f"{path}: {key} has shape {tuple(tensors[key].shape)}, expected {want} (global "
                             f"{tuple(meta['shape'])} cut by {spec.dims} on {d0}x{d1}) at coordinate ({i}, {j})")
    return tensors


def verify_checkpoint(ckpt_dir: str | Path) -> dict:
    """Check every file of a checkpoint (sizes, checksums, shapes); return the manifest."""
    manifest = read_manifest(ckpt_dir)
    for name in manifest["files"]:
        _read_rank_file(Path(ckpt_dir), manifest, name)
    return manifest


def _gather_full(ckpt_dir: Path, manifest: dict, prefix: str | None = None) -> dict[str, torch.Tensor]:
    """Every (or every `prefix`) tensor reassembled to its global shape, from all rank files."""
    d0, d1 = manifest["layout"]["d0"], manifest["layout"]["d1"]
    shards = {}
    for name, info in manifest["files"].items():
        shards[tuple(info["coord"])] = _read_rank_file(ckpt_dir, manifest, name)
    full = {}
    for key, meta in manifest["tensors"].items():
        if prefix is not None and not key.startswith(prefix):
            continue
        spec = _spec_from_json(meta["spec"])
        full[key] = unshard_tensor({c: sd[key] for c, sd in shards.items()}, spec, d0, d1)
    return full


# ---------------------------------------------------------------------------------------------------------
# Load into a model on any layout
# ---------------------------------------------------------------------------------------------------------

def _check_model_config(saved: dict, model: TabFM, where: str) -> None:
    ours = model.config.to_dict()
    diff = {k: (saved.get(k), ours.get(k)) for k in sorted(set(saved) | set(ours)) if saved.get(k) != ours.get(k)}
    if diff:
        shown = ", ".join(f"{k}: saved {a!r} vs model {b!r}" for k, (a, b) in diff.items())
        raise ValueError(f"{where} was saved for a different model config ({shown}); build the model from the "
                         "checkpoint's config (load_model) or pick a matching checkpoint")


def _expected_globals(model: TabFM, mesh: TPMesh) -> tuple[dict[str, tuple[int, ...]], dict[str, ShardSpec]]:
    specs = model_specs(model)
    d0, d1 = mesh.d0, mesh.d1
    shapes = {}
    for name, t in model.state_dict().items():
        spec = specs.get(name, ShardSpec((None,) * t.dim()))
        shapes[name] = tuple(_global_shape(tuple(t.shape), spec, d0, d1))
    return shapes, specs


def load_checkpoint(ckpt_dir: str | Path, model: TabFM, optimizer: torch.optim.Optimizer | None = None, *,
                    restore_rng: bool = True) -> CheckpointState:
    """Fill `model` (plain, or parallelized by parallelize_model) and `optimizer` from a checkpoint saved on
    any layout. Not collective: every rank reads the files it needs.

    On the layout it was saved with, each rank reads only its own file; otherwise the tensors are gathered from
    all files and cut for this rank's coordinate. RNG states are restored only on the same layout.
    """
    ckpt_dir = Path(ckpt_dir)
    mesh = model.region.mesh or TPMesh.single()
    manifest = read_manifest(ckpt_dir)
    _check_model_config(manifest["model_config"], model, str(ckpt_dir))
    shapes, specs = _expected_globals(model, mesh)
    saved = {k[len(MODEL):]: tuple(v["shape"]) for k, v in manifest["tensors"].items() if k.startswith(MODEL)}
    if set(saved) != set(shapes):
        raise ValueError(f"{ckpt_dir}: tensors do not match the model: missing {sorted(set(shapes) - set(saved))}, "
                         f"unexpected {sorted(set(saved) - set(shapes))}")
    wrong = {k: (saved[k], shapes[k]) for k in shapes if saved[k] != shapes[k]}
    if wrong:
        raise ValueError(f"{ckpt_dir}: shape mismatch (saved vs model): {wrong}")

    layout = manifest["layout"]
    same_layout = (layout["d0"], layout["d1"]) == (mesh.d0, mesh.d1)
    if same_layout:
        local = _read_rank_file(ckpt_dir, manifest, rank_file(mesh.tp_rank))
    else:
        full = _gather_full(ckpt_dir, manifest)
        local = {}
        for key, t in full.items():
            spec = _spec_from_json(manifest["tensors"][key]["spec"])
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
    names = _param_names(model)
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
    for g in saved["param_groups"]:
        hp = {k: (tuple(v) if isinstance(v, list) else v) for k, v in g.items() if k != "params"}
        groups.append({**hp, "params": [index[n] for n in g["params"]]})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# ---------------------------------------------------------------------------------------------------------
# Merge, reshard, merged files
# ---------------------------------------------------------------------------------------------------------

def merge(ckpt_dir: str | Path, out: str | Path) -> Path:
    """One safetensors file with the plain model's full state dict; the model config (and step) in its metadata."""
    ckpt_dir, out = Path(ckpt_dir), Path(out)
    manifest = read_manifest(ckpt_dir)
    full = {k[len(MODEL):]: v for k, v in _gather_full(ckpt_dir, manifest, MODEL).items()}
    metadata = {"format": MERGED_FORMAT, "model_config": json.dumps(manifest["model_config"]),
                "step": str(manifest["step"]), "source": str(ckpt_dir)}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    _save_tensors(full, tmp, metadata)
    tmp.replace(out)
    return out


def reshard(ckpt_dir: str | Path, d0: int, d1: int, out_dir: str | Path) -> Path:
    """The same checkpoint (model, optimizer state, step, data position) cut for a (d0, d1) layout.

    Per-rank RNG states do not carry over to a different layout and are dropped."""
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    manifest = read_manifest(ckpt_dir)
    full = _gather_full(ckpt_dir, manifest)
    problems = []
    for key, meta in manifest["tensors"].items():
        problems += _spec_from_json(meta["spec"]).problems(tuple(meta["shape"]), d0, d1, key)
    if problems:
        raise ValueError(f"cannot reshard {ckpt_dir} to {d0}x{d1}: " + "; ".join(problems[:6]))
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    files = {}
    for i in range(d0):
        for j in range(d1):
            local = {key: shard_tensor(t, _spec_from_json(manifest["tensors"][key]["spec"]), d0, d1, i, j)
                     for key, t in full.items()}
            name = rank_file(i * d1 + j)
            files[name] = {"coord": [i, j], **_save_tensors(local, tmp / name)}
    new = {**manifest, "layout": {"d0": d0, "d1": d1, "dp": 1}, "files": files,
           "rng": {"torch": f"dropped when resharding from {manifest['layout']['d0']}x{manifest['layout']['d1']}"}}
    _finish(tmp, out_dir, new)
    return out_dir


def load_merged(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(model config, full state dict) of a merged file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such merged checkpoint file")
    try:
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            metadata = f.metadata() or {}
        state = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path} cannot be read as safetensors (corrupt or truncated?): {e}") from None
    if metadata.get("format") != MERGED_FORMAT or "model_config" not in metadata:
        raise ValueError(f"{path} is not a merged tabfm checkpoint (metadata format {metadata.get('format')!r})")
    return ModelConfig.from_dict(json.loads(metadata["model_config"])), state


def load_model(path: str | Path, mesh: TPMesh | None = None, sequence_parallel: bool = False,
               dtype: torch.dtype | None = None) -> TabFM:
    """A model rebuilt from a merged file or a checkpoint folder, parallelized on `mesh` (plain when None), in
    `dtype` (default: the dtype the weights were saved in)."""
    path = Path(path)
    if path.is_dir():
        manifest = read_manifest(path)
        cfg = ModelConfig.from_dict(manifest["model_config"])
        saved = getattr(torch, manifest["tensors"][MODEL + "cells.value_proj.weight"]["dtype"].split(".")[-1])
        model = parallelize_model(build_model(cfg).to(dtype or saved), mesh, sequence_parallel)
        load_checkpoint(path, model, restore_rng=False)
        return model
    cfg, state = load_merged(path)
    model = build_model(cfg).to(dtype or state["cells.value_proj.weight"].dtype)
    missing, unexpected = set(model.state_dict()) - set(state), set(state) - set(model.state_dict())
    if missing or unexpected:
        raise ValueError(f"{path}: tensors do not match the model: missing {sorted(missing)}, "
                         f"unexpected {sorted(unexpected)}")
    wrong = {k: (tuple(v.shape), tuple(model.state_dict()[k].shape)) for k, v in state.items()
             if v.shape != model.state_dict()[k].shape}
    if wrong:
        raise ValueError(f"{path}: shape mismatch (file vs model): {wrong}")
    model.load_state_dict(state)
    # parallelize slices every sharded parameter from the full one: any layout.
    return parallelize_model(model, mesh, sequence_parallel)


def init_weights(model: TabFM, path: str | Path) -> None:
    """Copy the weights of a merged file or checkpoint folder into `model`, a plain (not yet parallelized) model
    of the same config: the start of a fine-tuning run or a new pretraining stage (the optimizer starts fresh)."""
    dtype = next(model.parameters()).dtype
    source = load_model(path, dtype=dtype)
    if source.config != model.config:
        changed = {k: (v, getattr(model.config, k)) for k, v in source.config.to_dict().items()
                   if getattr(model.config, k) != v}
        raise ValueError(f"{path} holds a different model than this run builds (weights' value vs run's): "
                         f"{changed}; set the run's model to the weights' config, or start from other weights")
    model.load_state_dict(source.state_dict())

