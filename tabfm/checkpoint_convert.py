"""A checkpoint into other forms: one merged safetensors file (the plain model's state dict), the same checkpoint
cut for another layout, and a model rebuilt from either (DESIGN 6). Every reader runs checkpoint_inspect's checks
before any tensor is read.

    merge(ckpt_dir, out)              one safetensors file: the plain model's state dict, config in its metadata
    reshard(ckpt_dir, d0, d1, out)    the same checkpoint cut for another layout (optimizer state included)
    load_merged / load_model          a merged file (or a checkpoint folder) into a model on any layout
    init_weights(model, path)         a fresh run's weights from a merged file or checkpoint folder
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tabfm.checkpoint_format import (DTYPES, MANIFEST, MERGED_FORMAT, MODEL, finish_folder, rank_file, save_tensors,
                                     spec_from_json)
from tabfm.checkpoint_inspect import (check_finite, check_folder, config_diff, config_from_dict, gather_full,
                                      inspect_checkpoint, load_finite, meta_model, no_constants, pos_int, read_header,
                                      read_manifest)
from tabfm.checkpoint_io import load_checkpoint
from tabfm.checkpoint_run import LATEST
from tabfm.model import ModelConfig, TabFM, build_model
from tabfm.out_paths import CHECKPOINTS, file_in_the_way, private_name
from tabfm.parallel.mesh import TPMesh
from tabfm.parallel.sharding import shard_tensor
from tabfm.parallel_model import ParallelOptions, parallelize_model

def _check_output(out: Path, source: Path, overwrite: bool, folder: bool) -> None:
    """Refuse to write over anything unless asked to, and never over the source, or (even when asked) over a
    folder that is not a checkpoint or a folder where a file is wanted. A source that is no folder is named first:
    `merge runs/tiny -o runs/tiny/model.safetensors` before the run exists had been told its output lay in the
    checkpoint being read."""
    check_folder(source)
    if out.resolve() == source.resolve() or source.resolve() in out.resolve().parents:
        raise ValueError(f"{out} is the checkpoint being read, or a file in its folder; write to another path")
    blocker = file_in_the_way(out)
    if blocker is not None:  # found now, not after every shard was read
        raise ValueError(f"{out} lies under {blocker}, which is a file; write to a path in a folder")
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


def _check_outside_runs(out: Path, d0: int, d1: int) -> None:
    """Refuse an output folder inside a run's checkpoints/ (a folder called checkpoints, or one that holds a
    `latest` pointer): a --resume would take a step_N there for that run's own state, with another step and
    layout than its name and the run's config say, and the run's pruning deletes what it does not count."""
    parent = out.resolve().parent
    if parent.name == CHECKPOINTS or (parent / LATEST).exists():
        raise ValueError(f"{out} is inside a run's checkpoints folder ({parent}), where it would be taken for one "
                         f"of the run's own checkpoints; write it outside, e.g. {parent.parent / f'resharded_{d0}x{d1}'}")


def _check_merged_output(out: Path) -> None:
    """Refuse a merged file inside a checkpoint folder (a file its manifest does not list, or one of its shards),
    and --overwrite of a file that is not a merged checkpoint (a run's config.yaml or metrics.jsonl): a fuzzer's
    `merge -o run/checkpoints/step_2/rank000.safetensors --overwrite` broke that checkpoint, where reshard refuses."""
    parent = out.resolve().parent
    if (parent / MANIFEST).exists():
        raise ValueError(f"{out} is inside the checkpoint folder {parent}; write the merged file outside it")
    if out.is_file():
        try:
            merged = read_header(out)[1].get("format") == MERGED_FORMAT
        except ValueError:
            merged = False
        if not merged:
            raise ValueError(f"{out} exists and is not a merged checkpoint, the only file --overwrite replaces; "
                             "choose another output path")


def merge(ckpt_dir: str | Path, out: str | Path, overwrite: bool = False) -> Path:
    """One safetensors file with the plain model's full state dict; the model config (and step) in its metadata.
    An existing `out` is replaced only when `overwrite`."""
    ckpt_dir, out = Path(ckpt_dir), Path(out)
    _check_output(out, ckpt_dir, overwrite, folder=False)
    _check_merged_output(out)
    manifest = inspect_checkpoint(ckpt_dir)
    full = {k[len(MODEL):]: v for k, v in gather_full(ckpt_dir, manifest, MODEL).items()}
    metadata = {"format": MERGED_FORMAT, "model_config": json.dumps(manifest["model_config"]),
                "step": str(manifest["step"]), "source": str(ckpt_dir)}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = private_name(out, "tmp")  # never a file of the user's, such as OUT.tmp
    try:
        save_tensors(full, tmp, metadata)
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out



def reshard(ckpt_dir: str | Path, d0: int, d1: int, out_dir: str | Path, overwrite: bool = False) -> Path:
    """The same checkpoint (model, optimizer state, step, data position) cut for a (d0, d1) layout. An existing
    `out_dir` is replaced only when `overwrite` and only when it is a checkpoint (or empty).

    Per-rank RNG states do not carry over to a different layout and are dropped."""
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    if not (pos_int(d0) and pos_int(d1)):
        raise ValueError(f"layout {d0}x{d1}: d0 and d1 must be positive integers")
    _check_output(out_dir, ckpt_dir, overwrite, folder=True)
    _check_outside_runs(out_dir, d0, d1)
    manifest = inspect_checkpoint(ckpt_dir)
    problems = []
    for key, meta in manifest["tensors"].items():
        problems += spec_from_json(meta["spec"]).problems(tuple(meta["shape"]), d0, d1, key)
    if problems:
        raise ValueError(f"cannot reshard {ckpt_dir} to {d0}x{d1}: " + "; ".join(problems[:6]))
    full = gather_full(ckpt_dir, manifest)
    tmp = private_name(out_dir, "tmp")  # never a folder of the user's (or the source), such as OUT.tmp
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    try:
        files = {}
        for i in range(d0):
            for j in range(d1):
                local = {key: shard_tensor(t, spec_from_json(manifest["tensors"][key]["spec"]), d0, d1, i, j)
                         for key, t in full.items()}
                name = rank_file(i * d1 + j)
                files[name] = {"coord": [i, j], **save_tensors(local, tmp / name)}
        layout = f"{manifest['layout']['d0']}x{manifest['layout']['d1']}"
        new = {**manifest, "layout": {"d0": d0, "d1": d1, "dp": 1}, "files": files,
               "rng": {"torch": f"dropped when resharding from {layout}"}}
        finish_folder(tmp, out_dir, new, aside=private_name(out_dir, "old"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def load_merged(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(model config, full state dict) of a merged file. Its metadata, names, shapes and dtypes are checked from
    the header, against the model its config describes (on the meta device), before any tensor is read; every
    weight must then be finite."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such merged checkpoint file")
    header, metadata = read_header(path)
    cfg = _merged_config(path, metadata)
    expected = {k: tuple(v.shape) for k, v in meta_model(cfg, len(header), str(path)).state_dict().items()}
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
    return cfg, load_finite(path)


def load_model(path: str | Path, mesh: TPMesh | None = None, options: ParallelOptions | None = None,
               dtype: torch.dtype | None = None) -> TabFM:
    """A model rebuilt from a merged file or a checkpoint folder, parallelized on `mesh` (plain when None) with
    `options` (default ParallelOptions()), in `dtype` (default: the dtype the weights were saved in). Everything is
    checked before the model is built."""
    path = Path(path)
    if path.is_dir():
        manifest = inspect_checkpoint(path)
        cfg = ModelConfig.from_dict(manifest["model_config"])
        saved = DTYPES[manifest["tensors"][MODEL + "cells.value_proj.weight"]["dtype"]]
        model = parallelize_model(build_model(cfg).to(dtype or saved), mesh, options)
        load_checkpoint(path, model, restore_rng=False)
    else:
        cfg, state = load_merged(path)
        saved = state["cells.value_proj.weight"].dtype
        model = build_model(cfg).to(dtype or saved)
        model.load_state_dict(state)
        # parallelize slices every sharded parameter from the full one: any layout.
        model = parallelize_model(model, mesh, options)
    if dtype is not None and dtype != saved:
        check_finite(model.state_dict(), str(path), f"the {saved} weights overflow {dtype}: load them in {saved}")
    return model


HEAD_COUNTS = ("axial_heads", "icl_heads")
"""Model config fields that change no parameter's shape: the attention splits the same projections into another
number of heads. Weights saved with one head count can start a run with another: a different function at first
(each wider head's softmax mixes what several narrow heads scored apart), which fine-tuning adapts, much closer to
the trained model than a fresh one (the shipped small model regrouped from 4 axial heads of width 8 into 2 of 16
lost 0.002 ROC-AUC before any step; README, "Default checkpoint")."""


def saved_model_config(path: str | Path) -> ModelConfig:
    """The model config of a merged file or a checkpoint folder, read from its metadata or manifest alone (no
    tensor): what a run checks `train.init_from` against before it starts (or deletes anything)."""
    path = Path(path)
    if path.is_dir():
        return config_from_dict(read_manifest(path)["model_config"], f"{path}/{MANIFEST}: model_config")
    if not path.is_file():
        raise ValueError(f"{path}: no such merged checkpoint file or checkpoint folder")
    return _merged_config(path, read_header(path)[1])


def _merged_config(path: Path, metadata: dict[str, str]) -> ModelConfig:
    """The model config in a merged file's header metadata (ValueError when it is not one)."""
    if metadata.get("format") != MERGED_FORMAT or "model_config" not in metadata:
        raise ValueError(f"{path} is not a merged tabfm checkpoint (metadata format {metadata.get('format')!r})")
    try:
        raw = json.loads(metadata["model_config"], parse_constant=no_constants)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{path}: its metadata model_config is not valid JSON ({e})") from None
    return config_from_dict(raw, f"{path}: metadata model_config")


def check_init_from(path: str | Path, model: ModelConfig) -> dict[str, tuple[int, int]]:
    """The fields in which the weights at `path` differ from `model`, all of them HEAD_COUNTS (regrouped at
    init_weights); ValueError when any other field differs."""
    changed = config_diff(saved_model_config(path).to_dict(), model.to_dict())
    if set(changed) - set(HEAD_COUNTS):
        raise ValueError(f"{path} holds a different model than this run builds (weights' value vs run's): "
                         f"{changed}; set the run's model to the weights' config (head counts may differ), or start "
                         "from other weights")
    return changed


def init_weights(model: TabFM, path: str | Path) -> dict[str, tuple[int, int]]:
    """Copy the weights of a merged file or checkpoint folder into `model`, a plain (not yet parallelized) model
    of the same config up to its HEAD_COUNTS: the start of a fine-tuning run or a new pretraining stage (the
    optimizer starts fresh). Returns the regrouped head counts, {field: (weights', run's)}, empty when none."""
    dtype = next(model.parameters()).dtype
    changed = check_init_from(path, model.config)
    source = load_model(path, dtype=dtype)
    model.load_state_dict(source.state_dict())
    return changed

