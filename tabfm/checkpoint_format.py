"""The on-disk format of a sharded checkpoint (DESIGN 6): names, the dtype whitelist, how shard specs are written,
and the two write primitives every writer uses (a file fsynced with its checksum, a folder swapped into place).

A checkpoint is a folder:
    manifest.json            format, model config, run config, layout (d0, d1, dp), step, data position, every
                             tensor's global shape, dtype and ShardSpec, the optimizer's hyperparameters, and each
                             rank file's size and sha256
    rank000.safetensors ...  one file per tensor-parallel rank t = i * d1 + j (data-parallel replica 0 writes it):
        model/<name>             the local shard of parameter or buffer <name> (plain-model names)
        optim/<name>/<field>     the local shard of its optimizer state (exp_avg, exp_avg_sq: cut like the
                                 parameter; step: replicated)
        rng/torch_cpu [, rng/torch_cuda]   this rank's RNG states (per rank: restored only on the same layout)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch import nn

from tabfm.model import TabFM
from tabfm.parallel.parallelize import full_shard_specs, shard_specs
from tabfm.parallel.sharding import ShardSpec
from tabfm.parallel_model import model_mesh, tp_plan

FORMAT = "tabfm-checkpoint-v1"
MERGED_FORMAT = "tabfm-merged-v1"
MANIFEST = "manifest.json"
MODEL, OPTIM, RNG = "model/", "optim/", "rng/"

DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32,
                              torch.uint8, torch.bool)}
"""The dtypes a manifest may name, as str(dtype) (a whitelist: never getattr(torch, <file contents>))."""


def model_specs(model: TabFM) -> dict[str, ShardSpec]:
    """How each parameter is cut: read off the ATP layers of a parallelized model, or, for a plain model, the
    specs `parallelize` would give it (so a 1x1 checkpoint still reshards to any layout), read off a twin on the
    meta device (parallelize works on a copy, which for a real model would double its memory)."""
    if model_mesh(model) is None:
        with torch.device("meta"):
            twin = TabFM(model.config)
        return full_shard_specs(twin, tp_plan(twin))
    return shard_specs(model)


def spec_to_json(spec: ShardSpec) -> dict:
    """A shard spec as the manifest writes it."""
    return {"dims": list(spec.dims), "qkv_heads": spec.qkv_heads}


def spec_from_json(d: dict) -> ShardSpec:
    """A shard spec from the manifest (its fields checked by checkpoint_inspect first)."""
    return ShardSpec(tuple(d["dims"]), qkv_heads=d.get("qkv_heads"))


def global_shape(local: tuple[int, ...], spec: ShardSpec, d0: int, d1: int) -> list[int]:
    """The full shape of a tensor whose shard on a d0 x d1 layout is `local`."""
    return [n * spec.parts(p, d0, d1) for n, p in zip(local, spec.dims, strict=True)]


def rank_file(t: int) -> str:
    """The file of tensor-parallel rank t."""
    return f"rank{t:03d}.safetensors"


def sha256(path: Path) -> str:
    """A file's checksum, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> dict:
    """Write a safetensors file and fsync it; return its manifest entry (bytes, sha256). A write that fails (a full
    disk, a read-only folder) is an OSError naming the file, as Python's own writes raise (safetensors raises its
    own error type, which the commands' one-line handlers did not know)."""
    try:
        save_file({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}, str(path), metadata)
    except SafetensorError as e:
        raise OSError(f"cannot write {path}: {e}") from None
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return {"bytes": path.stat().st_size, "sha256": sha256(path)}


def param_names(model: nn.Module) -> dict[int, str]:
    """Each parameter's name by its id: the optimizer holds parameters, the checkpoint names."""
    return {id(p): n for n, p in model.named_parameters()}



def finish_folder(tmp: Path, ckpt_dir: Path, manifest: dict, aside: Path | None = None) -> None:
    """Write the manifest last, then swap the folder into place with renames; an earlier folder at ckpt_dir goes
    to `aside` (default ckpt_dir.old, the name a run's interrupted saves are recognised by) until the swap is done."""
    path = tmp / MANIFEST
    path.write_text(json.dumps(manifest, indent=1))
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    old = aside if aside is not None else ckpt_dir.with_name(ckpt_dir.name + ".old")
    if ckpt_dir.exists() or ckpt_dir.is_symlink():
        _remove_aside(old)
        ckpt_dir.rename(old)
    tmp.rename(ckpt_dir)
    _remove_aside(old)


def _remove_aside(path: Path) -> None:
    """Remove a folder set aside, or the link it was: a link is unlinked, never followed (rmtree refuses a link,
    and a linked step_N renamed aside stayed as step_N.old, which pruning, also not following links, kept)."""
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)
