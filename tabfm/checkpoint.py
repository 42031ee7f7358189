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
leaves the last good checkpoint untouched (the writing ranks must share the filesystem holding <dir>). A checkpoint
saved on one layout loads on any other: tensors are gathered (bit-exact, pure slicing) and cut again for the new
coordinate.

A checkpoint is untrusted input. Before any tensor is read or any model allocated, `inspect_checkpoint` checks the
manifest's structure and types (one ValueError naming the field and the file), that the layout matches the files
listed, that the declared shapes, dtypes (a whitelist) and shard specs agree with the model config (a model built
on the meta device) and with every file's safetensors header; reading then checks sizes, checksums and that every
weight is finite. verify, load, merge and reshard all run it. A run's `checkpoints/latest` file must name a
step_<digits> folder beside it; only complete step_<digits> folders count as checkpoints (never step_N.tmp).

    merge(ckpt_dir, out)              one safetensors file: the plain model's state dict, config in its metadata
    reshard(ckpt_dir, d0, d1, out)    the same checkpoint cut for another layout (optimizer state included)
    load_merged / load_model          a merged file (or a checkpoint folder) into a model on any layout
    verify_checkpoint(ckpt_dir)       every check loading runs, plus every file's checksum and finite weights
    latest_checkpoint(out_dir)        the checkpoint a run resumes from; mark_latest / prune_checkpoints after a save
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import reprlib
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from tabfm.model import ModelConfig, TabFM, build_model
from tabfm.parallel.mesh import TPMesh
from tabfm.parallel.parallelize import full_shard_specs, shard_specs
from tabfm.parallel.sharding import ShardSpec, shard_tensor, unshard_tensor
from tabfm.parallel_model import model_mesh, parallelize_model, tp_plan

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
    specs `parallelize` would give it (so a 1x1 checkpoint still reshards to any layout), read off a twin on the
    meta device (parallelize works on a copy, which for a real model would double its memory)."""
    if model_mesh(model) is None:
        with torch.device("meta"):
            twin = TabFM(model.config)
        return full_shard_specs(twin, tp_plan(twin))
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
    mesh = mesh or model_mesh(model) or TPMesh.single()
    if model_mesh(model) is None and mesh.tp > 1:
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
# A run's checkpoints: <out_dir>/checkpoints/step_<digits>/ and a `latest` file naming the newest
# ---------------------------------------------------------------------------------------------------------

LATEST = "latest"
STEP_DIR = re.compile(r"step_[0-9]+")
"""The name of a complete checkpoint of a run. An interrupted save leaves step_N.tmp (and replacing a folder
briefly leaves step_N.old): they never count as checkpoints, and pruning removes them."""
_LEFTOVER = re.compile(r"step_[0-9]+(\.tmp|\.old)?")


def _complete(path: Path) -> bool:
    """A real folder (not a link leading elsewhere) whose manifest was written: saves write it last."""
    return path.is_dir() and not path.is_symlink() and (path / MANIFEST).is_file()


def step_checkpoints(ckpt_root: str | Path) -> list[Path]:
    """A run's complete checkpoints (step_<digits> folders holding a manifest), oldest first by step number."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_DIR.fullmatch(p.name) and _complete(p)]
    return sorted(found, key=lambda p: int(p.name[len("step_"):]))


def _pointer_name(pointer: Path) -> str:
    """The folder name a `latest` file holds, accepted only as step_<digits>: no separator, no '..', so an
    edited or hostile file cannot lead a resume outside the run's checkpoints folder."""
    try:
        with open(pointer, "rb") as f:
            name = f.read(256).decode().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{pointer} cannot be read as a checkpoint name ({e})") from None
    if not STEP_DIR.fullmatch(name):
        raise ValueError(f"{pointer} names {reprlib.repr(name)}, not a step_<digits> folder beside it; delete the "
                         "file (resuming then takes the newest complete step_* folder) or write such a name into it")
    return name


def read_latest(pointer: str | Path) -> Path:
    """The checkpoint folder a `latest` file names: a step_<digits> folder beside it that exists."""
    pointer = Path(pointer)
    path = pointer.parent / _pointer_name(pointer)
    if not path.is_dir() or path.is_symlink():
        raise ValueError(f"{pointer} names {path.name}, which is not a folder beside it")
    return path


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The checkpoint a run resumes from: the one <out_dir>/checkpoints/latest names when it is complete, else
    the newest complete step_<digits> folder; None when there is none. A `latest` file naming anything but a
    step_<digits> folder is refused (ValueError)."""
    root = Path(out_dir) / "checkpoints"
    pointer = root / LATEST
    if pointer.is_file():
        named = root / _pointer_name(pointer)
        if _complete(named):
            return named
    found = step_checkpoints(root)
    return found[-1] if found else None


def mark_latest(ckpt_root: str | Path, name: str, keep: int = 0) -> list[Path]:
    """After the save of `name` completed: point `latest` at it (write, then rename), then prune_checkpoints."""
    if not STEP_DIR.fullmatch(name):
        raise ValueError(f"checkpoint name {name!r} is not step_<digits>")
    root = Path(ckpt_root)
    tmp = root / (LATEST + ".tmp")
    tmp.write_text(name + "\n")
    tmp.replace(root / LATEST)
    return prune_checkpoints(root, keep, protect=name)


def prune_checkpoints(ckpt_root: str | Path, keep: int, protect: str | None = None) -> list[Path]:
    """Keep the newest `keep` complete checkpoints (all when 0) and `protect`; remove the older ones and what
    interrupted saves left behind (step_N.tmp, step_N.old, a step_N without manifest). Call it only between
    saves. Each removal first deletes the manifest, so a prune killed midway leaves no folder that looks
    complete. Returns the removed folders."""
    root = Path(ckpt_root)
    done = step_checkpoints(root)
    doomed = [p for p in (done[:-keep] if keep else []) if p.name != protect]
    doomed += [p for p in root.iterdir() if _LEFTOVER.fullmatch(p.name) and p.is_dir() and not p.is_symlink()
               and p not in done]
    for p in doomed:
        (p / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(p, ignore_errors=True)
    return doomed


# ---------------------------------------------------------------------------------------------------------
# Read and verify. A checkpoint is untrusted input (DESIGN 6): the manifest's structure, its declared sizes,
# the model config and the files' safetensors headers are checked against each other before any tensor is read
# or any model allocated, and every weight read must be finite. `inspect_checkpoint` holds these checks once:
# verify, load, merge and reshard all run it, so `verify` passes exactly when loading would.
# ---------------------------------------------------------------------------------------------------------

MAX_MANIFEST_BYTES = 64 << 20
"""A real manifest is a few hundred kB; a larger file is refused before it is parsed."""
DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32,
                              torch.uint8, torch.bool)}
"""The dtypes a manifest may name, as str(dtype) (a whitelist: never getattr(torch, <file contents>))."""
_HEADER_DTYPES = {"F32": torch.float32, "F64": torch.float64, "BF16": torch.bfloat16, "F16": torch.float16,
                  "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool}
_PLACEMENTS = (None, "tp0", "tp1", "tp")
_RNG_KEYS = (RNG + "torch_cpu", RNG + "torch_cuda")
_DAMAGED = "the manifest is damaged or was not written by tabfm"


class _NonFiniteNumber(ValueError):
    pass


def _no_constants(name: str) -> Any:
    raise _NonFiniteNumber(name)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _nonneg_int(v: Any) -> bool:
    return _is_int(v) and v >= 0


def _pos_int(v: Any) -> bool:
    return _is_int(v) and v > 0


def _is_dict(v: Any) -> bool:
    return isinstance(v, dict)


def _field(d: dict, key: str, ok: Callable[[Any], bool], want: str, where: Path | str, at: str = "") -> Any:
    """d[key] when `ok` accepts it, else one ValueError naming the field (`at` + key) and the file."""
    if key not in d:
        raise ValueError(f"{where}: field {at}{key} is missing; {_DAMAGED}")
    if not ok(d[key]):
        raise ValueError(f"{where}: field {at}{key} must be {want}, got {reprlib.repr(d[key])}; {_DAMAGED}")
    return d[key]


def _config_from_dict(d: Any, where: str) -> ModelConfig:
    """ModelConfig from untrusted data: any problem is one ValueError naming `where`."""
    if not isinstance(d, dict):
        raise ValueError(f"{where} must be a JSON object of model settings, got {type(d).__name__}")
    try:
        return ModelConfig.from_dict(d)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


def _check_manifest(m: Any, path: Path) -> None:
    """The manifest's structure, types and internal consistency, checked once before anything else reads it.

    Hand-written rather than a schema library: pydantic is not a dependency, and the checks that matter relate
    fields to each other (file names to coordinates to the layout, specs to shapes), which a type schema cannot
    express. Every problem is one ValueError naming the field and the file."""
    if not isinstance(m, dict):
        raise ValueError(f"{path}: the manifest must be a JSON object, got {type(m).__name__}; {_DAMAGED}")
    if m.get("format") != FORMAT:
        raise ValueError(f"{path}: format {reprlib.repr(m.get('format'))}, expected {FORMAT!r}")
    _field(m, "step", _nonneg_int, "a non-negative integer", path)
    for key in ("data_position", "run_config", "extra"):
        if key in m:
            _field(m, key, _is_dict, "a JSON object", path)
    if "next_step" in m.get("data_position", {}):  # where a resumed run continues
        _field(m["data_position"], "next_step", _nonneg_int, "a non-negative integer", path, "data_position.")
    _config_from_dict(_field(m, "model_config", _is_dict, "a JSON object", path), f"{path}: field model_config")
    layout = _field(m, "layout", _is_dict, "a JSON object {d0, d1, dp}", path)
    d0, d1, _ = (_field(layout, k, _pos_int, "a positive integer", path, "layout.") for k in ("d0", "d1", "dp"))
    _check_files(_field(m, "files", _is_dict, "a JSON object of rank files", path), d0, d1, path)
    tensors = _field(m, "tensors", lambda v: _is_dict(v) and bool(v), "a non-empty JSON object", path)
    for key, meta in tensors.items():
        _check_tensor_entry(key, meta, d0, d1, path)
    if m.get("optimizer") is not None:
        _check_optimizer_entry(m["optimizer"], tensors, path)


def _check_files(files: dict, d0: int, d1: int, path: Path) -> None:
    """Exactly one file per coordinate of the d0 x d1 layout, named after it (checked before any name is built
    from the layout, so a huge declared layout costs nothing)."""
    if len(files) != d0 * d1:
        raise ValueError(f"{path}: layout {d0}x{d1} needs {d0 * d1} rank files, the manifest lists {len(files)}")
    for name, info in files.items():
        at = f"files[{name!r}]."
        if not isinstance(info, dict):
            raise ValueError(f"{path}: field {at[:-1]} must be a JSON object, got {reprlib.repr(info)}; {_DAMAGED}")
        i, j = _field(info, "coord", lambda v: isinstance(v, list) and len(v) == 2 and all(map(_is_int, v)),
                      "a list [i, j] of two integers", path, at)
        if not (0 <= i < d0 and 0 <= j < d1):
            raise ValueError(f"{path}: field {at}coord [{i}, {j}] is outside the {d0}x{d1} layout; {_DAMAGED}")
        if name != rank_file(i * d1 + j):
            raise ValueError(f"{path}: file {name!r} holds coordinate ({i}, {j}), whose file is "
                             f"{rank_file(i * d1 + j)}; {_DAMAGED}")
        _field(info, "bytes", _nonneg_int, "a non-negative integer", path, at)
        _field(info, "sha256", lambda v: isinstance(v, str) and re.fullmatch("[0-9a-f]{64}", v) is not None,
               "64 lowercase hex digits", path, at)


def _check_tensor_entry(key: Any, meta: Any, d0: int, d1: int, path: Path) -> None:
    """One `tensors` entry: a model/ or optim/ name, a shape, a whitelisted dtype and a spec that cuts the shape
    on the manifest's own layout."""
    if not isinstance(key, str) or not key.startswith((MODEL, OPTIM)):
        raise ValueError(f"{path}: tensor {key!r} is neither {MODEL}... nor {OPTIM}...; {_DAMAGED}")
    at = f"tensors[{key!r}]."
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: field {at[:-1]} must be a JSON object, got {reprlib.repr(meta)}; {_DAMAGED}")
    shape = _field(meta, "shape", lambda v: isinstance(v, list) and all(map(_nonneg_int, v)),
                   "a list of non-negative integers", path, at)
    _field(meta, "dtype", lambda v: isinstance(v, str) and v in DTYPES, f"one of {', '.join(DTYPES)}", path, at)
    spec = _field(meta, "spec", _is_dict, "a JSON object {dims, qkv_heads}", path, at)
    _field(spec, "dims", lambda v: isinstance(v, list) and len(v) == len(shape) and all(p in _PLACEMENTS for p in v),
           f"a list of {len(shape)} placements from {_PLACEMENTS}", path, at + "spec.")
    if spec.get("qkv_heads") is not None:
        _field(spec, "qkv_heads", _pos_int, "a positive integer or null", path, at + "spec.")
    problems = _spec_from_json(spec).problems(tuple(shape), d0, d1, key)
    if problems:
        raise ValueError(f"{path}: {'; '.join(problems[:3])} (its own layout is {d0}x{d1}); {_DAMAGED}")


def _check_optimizer_entry(opt: Any, tensors: dict, path: Path) -> None:
    """The optimizer's class and parameter groups: names of model parameters and plain hyperparameters."""
    if not isinstance(opt, dict):
        raise ValueError(f"{path}: field optimizer must be a JSON object or null, got {reprlib.repr(opt)}; {_DAMAGED}")
    _field(opt, "class", lambda v: isinstance(v, str), "a string", path, "optimizer.")
    groups = _field(opt, "param_groups", lambda v: isinstance(v, list) and all(map(_is_dict, v)),
                    "a list of JSON objects", path, "optimizer.")
    for n, group in enumerate(groups):
        at = f"optimizer.param_groups[{n}]."
        _field(group, "params", lambda v: isinstance(v, list) and all(isinstance(s, str) and MODEL + s in tensors
                                                                       for s in v),
               "a list of the model's parameter names", path, at)
        for key, value in group.items():
            if key != "params" and not _plain_value(value):
                raise ValueError(f"{path}: field {at}{key} must be a number, string, boolean, null or list of "
                                 f"numbers, got {reprlib.repr(value)}; {_DAMAGED}")


def _plain_value(v: Any) -> bool:
    if isinstance(v, list):
        return all(isinstance(x, int | float) and not isinstance(x, bool) for x in v)
    return v is None or isinstance(v, int | float | str | bool)


def read_manifest(ckpt_dir: str | Path) -> dict:
    """The manifest, checked for format, structure, types and consistency (ValueError naming the field)."""
    ckpt_dir = Path(ckpt_dir)
    path = ckpt_dir / MANIFEST
    if not ckpt_dir.is_dir():
        raise ValueError(f"{ckpt_dir} is not a checkpoint folder (no such directory)")
    if not path.is_file():
        raise ValueError(f"{ckpt_dir} has no {MANIFEST}: not a checkpoint, or its write never finished")
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise ValueError(f"{path} is {path.stat().st_size} bytes, more than any manifest ({MAX_MANIFEST_BYTES}); "
                         f"{_DAMAGED}")
    try:
        manifest = json.loads(path.read_bytes(), parse_constant=_no_constants)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}): the manifest is corrupt") from None
    except _NonFiniteNumber as e:
        raise ValueError(f"{path} holds the non-number {e}; {_DAMAGED}") from None
    except RecursionError:
        raise ValueError(f"{path} is nested too deeply to be a manifest; {_DAMAGED}") from None
    _check_manifest(manifest, path)
    return manifest


def _meta_model(cfg: ModelConfig, n_tensors: int, where: str) -> TabFM:
    """The model a config describes, on the meta device: its names and shapes, without allocating a byte.
    A config declaring more blocks than there are tensors is refused first (each block holds tensors), so a
    hostile block count cannot make building even the meta model slow."""
    blocks = sum(v for k, v in cfg.to_dict().items() if k.endswith("_num_blocks"))
    if blocks > n_tensors:
        raise ValueError(f"{where}: the model config declares {blocks} blocks but the weights hold only {n_tensors} "
                         "tensors; the config does not describe these weights")
    try:
        with torch.device("meta"):
            return TabFM(cfg)
    except (RuntimeError, ValueError, OverflowError) as e:
        raise ValueError(f"{where}: its model config describes no buildable model ({e})") from None


def _check_against_model(manifest: dict, model: TabFM, where: str) -> None:
    """The declared tensors against `model`: the config, every name, global shape and shard spec, and each
    optimizer tensor against its parameter (a scalar, or the parameter's shape and cut)."""
    _check_model_config(manifest["model_config"], model, where)
    shapes, specs = _expected_globals(model, model_mesh(model) or TPMesh.single())
    tensors = manifest["tensors"]
    saved = {k[len(MODEL):]: tuple(v["shape"]) for k, v in tensors.items() if k.startswith(MODEL)}
    if set(saved) != set(shapes):
        raise ValueError(f"{where}: tensors do not match the model: missing {sorted(set(shapes) - set(saved))}, "
                         f"unexpected {sorted(set(saved) - set(shapes))}")
    wrong = {k: (saved[k], shapes[k]) for k in shapes if saved[k] != shapes[k]}
    if wrong:
        raise ValueError(f"{where}: shape mismatch (saved vs model): {wrong}")
    params = {n for n, _ in model.named_parameters()}
    for key, meta in tensors.items():
        name = key[len(MODEL):] if key.startswith(MODEL) else key[len(OPTIM):].rpartition("/")[0]
        if key.startswith(OPTIM) and name not in params:
            raise ValueError(f"{where}: optimizer state {key!r} belongs to no parameter of the model")
        if key.startswith(OPTIM) and meta["shape"] and tuple(meta["shape"]) != shapes[name]:
            raise ValueError(f"{where}: optimizer state {key} has shape {tuple(meta['shape'])}, its parameter "
                             f"{shapes[name]}")
        spec = specs.get(name)
        want = spec if spec is not None and len(spec.dims) == len(meta["shape"]) else ShardSpec(
            (None,) * len(meta["shape"]))
        if _spec_from_json(meta["spec"]) != want:
            raise ValueError(f"{where}: {key} is cut as {meta['spec']} in the manifest, but the model cuts it as "
                             f"{_spec_to_json(want)}")


def _read_header(path: Path, size: int | None = None) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]],
                                                                dict[str, str]]:
    """Names, shapes and dtypes of a safetensors file, and its metadata, from its header alone (no tensor is
    read). `size`: the byte count the file must have."""
    if not path.is_file():
        raise ValueError(f"{path} is missing")
    if size is not None and path.stat().st_size != size:
        raise ValueError(f"{path} is truncated or altered: {path.stat().st_size} bytes, the manifest says {size}")
    try:
        with safe_open(str(path), "pt") as f:
            metadata = f.metadata() or {}
            raw = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path} cannot be read as safetensors (corrupt or truncated?): {e}") from None
    header = {}
    for key, (shape, dtype) in raw.items():
        if dtype not in _HEADER_DTYPES:
            raise ValueError(f"{path}: {key} has dtype {dtype}, not one of {', '.join(_HEADER_DTYPES)}")
        header[key] = (shape, _HEADER_DTYPES[dtype])
    return header, metadata


def _check_headers(ckpt_dir: Path, manifest: dict) -> None:
    """Every rank file: present, of the declared size, holding exactly the declared tensors with the declared
    dtype and the local shape of its coordinate (plus this rank's RNG state), read from its header alone."""
    d0, d1 = manifest["layout"]["d0"], manifest["layout"]["d1"]
    cpu_rng = tuple(torch.get_rng_state().shape)
    for name, info in manifest["files"].items():
        path = ckpt_dir / name
        header, _ = _read_header(path, info["bytes"])
        i, j = info["coord"]
        for key, meta in manifest["tensors"].items():
            if key not in header:
                raise ValueError(f"{path} lacks tensor {key!r} listed in the manifest")
            spec = _spec_from_json(meta["spec"])
            want = spec.local_shape(tuple(meta["shape"]), d0, d1)
            shape, dtype = header[key]
            if shape != want:
                raise ValueError(f"{path}: {key} has shape {shape}, expected {want} (global {tuple(meta['shape'])} "
                                 f"cut by {spec.dims} on {d0}x{d1}) at coordinate ({i}, {j})")
            if dtype != DTYPES[meta["dtype"]]:
                raise ValueError(f"{path}: {key} is {dtype}, the manifest says {meta['dtype']}")
        extra = sorted(set(header) - set(manifest["tensors"]) - set(_RNG_KEYS))
        if extra:
            raise ValueError(f"{path} holds tensors the manifest does not list: {extra[:5]}")
        for key in set(header) & set(_RNG_KEYS):
            shape, dtype = header[key]
            if dtype != torch.uint8 or len(shape) != 1 or (key.endswith("cpu") and shape != cpu_rng):
                raise ValueError(f"{path}: {key} is not an RNG state ({dtype}, shape {shape})")


def inspect_checkpoint(ckpt_dir: str | Path, model: TabFM | None = None) -> dict:
    """Every check that reads no tensor data, in the order cheapest first: the manifest, the declared tensors
    against `model` (or, when None, against the model its config describes, built on the meta device), then
    every file's size and header. Returns the manifest. Loading, merging, resharding and verifying all start
    here, so nothing is allocated for a checkpoint whose declared sizes disagree."""
    ckpt_dir = Path(ckpt_dir)
    manifest = read_manifest(ckpt_dir)
    if model is None:
        cfg = ModelConfig.from_dict(manifest["model_config"])
        model = _meta_model(cfg, sum(k.startswith(MODEL) for k in manifest["tensors"]), str(ckpt_dir))
    _check_against_model(manifest, model, str(ckpt_dir))
    _check_headers(ckpt_dir, manifest)
    return manifest


def _check_finite(tensors: dict[str, torch.Tensor], where: str,
                  hint: str = "these weights are unusable; load an earlier checkpoint") -> None:
    """Refuse NaN and infinite values: they would load silently and make every prediction NaN."""
    for key, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise ValueError(f"{where}: {key} holds {bad} non-finite value(s) (NaN or inf) of {t.numel()}; {hint}")


def _read_rank_file(ckpt_dir: Path, manifest: dict, name: str) -> dict[str, torch.Tensor]:
    """One rank file's tensors, after its checksum (its header was checked by inspect_checkpoint); every
    floating-point tensor must be finite."""
    path = ckpt_dir / name
    info = manifest["files"][name]
    if not path.is_file() or path.stat().st_size != info["bytes"]:
        raise ValueError(f"{path} is missing or changed size since it was checked")
    if _sha256(path) != info["sha256"]:
        raise ValueError(f"{path} is corrupt: its sha256 does not match the manifest's")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path} cannot be read as safetensors: {e}") from None
    _check_finite(tensors, str(path))
    return tensors


def verify_checkpoint(ckpt_dir: str | Path) -> dict:
    """Every check loading runs (inspect_checkpoint), plus every file's checksum and finite weights; returns the
    manifest."""
    manifest = inspect_checkpoint(ckpt_dir)
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
    mesh = model_mesh(model) or TPMesh.single()
    manifest = inspect_checkpoint(ckpt_dir, model)
    specs = model_specs(model)

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


# ---------------------------------------------------------------------------------------------------------
# Merge, reshard, merged files
# ---------------------------------------------------------------------------------------------------------

def _check_output(out: Path, source: Path, overwrite: bool, folder: bool) -> None:
    """Refuse to write over anything unless asked to, and never over the source, or (even when asked) over a
    folder that is not a checkpoint or a folder where a file is wanted."""
    if out.resolve() == source.resolve():
        raise ValueError(f"{out} is the checkpoint being read; write to another path")
    if not (out.exists() or out.is_symlink()):
        return
    if not overwrite:
        raise ValueError(f"{out} already exists; choose another output path, or replace it with --overwrite "
                         "(overwrite=True in Python)")
    replaceable = out.is_dir() and not out.is_symlink() and ((out / MANIFEST).is_file() or not any(out.iterdir()))
    if folder and not replaceable:
        raise ValueError(f"{out} is not a checkpoint folder: --overwrite replaces only a checkpoint (or an empty "
                         "folder); choose another output path")
    if not folder and not out.is_file():
        raise ValueError(f"{out} is not a file: --overwrite replaces only a file; choose another output path")


def merge(ckpt_dir: str | Path, out: str | Path, overwrite: bool = False) -> Path:
    """One safetensors file with the plain model's full state dict; the model config (and step) in its metadata.
    An existing `out` is replaced only when `overwrite`."""
    ckpt_dir, out = Path(ckpt_dir), Path(out)
    _check_output(out, ckpt_dir, overwrite, folder=False)
    manifest = inspect_checkpoint(ckpt_dir)
    full = {k[len(MODEL):]: v for k, v in _gather_full(ckpt_dir, manifest, MODEL).items()}
    metadata = {"format": MERGED_FORMAT, "model_config": json.dumps(manifest["model_config"]),
                "step": str(manifest["step"]), "source": str(ckpt_dir)}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    _save_tensors(full, tmp, metadata)
    tmp.replace(out)
    return out


def reshard(ckpt_dir: str | Path, d0: int, d1: int, out_dir: str | Path, overwrite: bool = False) -> Path:
    """The same checkpoint (model, optimizer state, step, data position) cut for a (d0, d1) layout. An existing
    `out_dir` is replaced only when `overwrite` and only when it is a checkpoint (or empty).

    Per-rank RNG states do not carry over to a different layout and are dropped."""
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    if not (_pos_int(d0) and _pos_int(d1)):
        raise ValueError(f"layout {d0}x{d1}: d0 and d1 must be positive integers")
    _check_output(out_dir, ckpt_dir, overwrite, folder=True)
    manifest = inspect_checkpoint(ckpt_dir)
    problems = []
    for key, meta in manifest["tensors"].items():
        problems += _spec_from_json(meta["spec"]).problems(tuple(meta["shape"]), d0, d1, key)
    if problems:
        raise ValueError(f"cannot reshard {ckpt_dir} to {d0}x{d1}: " + "; ".join(problems[:6]))
    full = _gather_full(ckpt_dir, manifest)
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
    """(model config, full state dict) of a merged file. Its metadata, names, shapes and dtypes are checked from
    the header, against the model its config describes (on the meta device), before any tensor is read; every
    weight must then be finite."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such merged checkpoint file")
    header, metadata = _read_header(path)
    if metadata.get("format") != MERGED_FORMAT or "model_config" not in metadata:
        raise ValueError(f"{path} is not a merged tabfm checkpoint (metadata format {metadata.get('format')!r})")
    try:
        raw = json.loads(metadata["model_config"], parse_constant=_no_constants)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{path}: its metadata model_config is not valid JSON ({e})") from None
    cfg = _config_from_dict(raw, f"{path}: metadata model_config")
    expected = {k: tuple(v.shape) for k, v in _meta_model(cfg, len(header), str(path)).state_dict().items()}
    missing, unexpected = set(expected) - set(header), set(header) - set(expected)
    if missing or unexpected:
        raise ValueError(f"{path}: tensors do not match the model: missing {sorted(missing)}, "
                         f"unexpected {sorted(unexpected)}")
    wrong = {k: (shape, expected[k]) for k, (shape, _) in header.items() if shape != expected[k]}
    if wrong:
        raise ValueError(f"{path}: shape mismatch (file vs model): {wrong}")
    not_float = {k: str(dtype) for k, (_, dtype) in header.items() if not dtype.is_floating_point}
    if not_float:
        raise ValueError(f"{path}: weights must be floating point: {not_float}")
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path} cannot be read as safetensors (corrupt or truncated?): {e}") from None
    _check_finite(state, str(path))
    return cfg, state


def load_model(path: str | Path, mesh: TPMesh | None = None, sequence_parallel: bool = False,
               dtype: torch.dtype | None = None) -> TabFM:
    """A model rebuilt from a merged file or a checkpoint folder, parallelized on `mesh` (plain when None), in
    `dtype` (default: the dtype the weights were saved in). Everything is checked before the model is built."""
    path = Path(path)
    if path.is_dir():
        manifest = inspect_checkpoint(path)
        cfg = ModelConfig.from_dict(manifest["model_config"])
        saved = DTYPES[manifest["tensors"][MODEL + "cells.value_proj.weight"]["dtype"]]
        model = parallelize_model(build_model(cfg).to(dtype or saved), mesh, sequence_parallel)
        load_checkpoint(path, model, restore_rng=False)
    else:
        cfg, state = load_merged(path)
        saved = state["cells.value_proj.weight"].dtype
        model = build_model(cfg).to(dtype or saved)
        model.load_state_dict(state)
        # parallelize slices every sharded parameter from the full one: any layout.
        model = parallelize_model(model, mesh, sequence_parallel)
    if dtype is not None and dtype != saved:
        _check_finite(model.state_dict(), str(path), f"the {saved} weights overflow {dtype}: load them in {saved}")
    return model


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

