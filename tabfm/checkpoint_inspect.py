"""Reading a checkpoint, which is untrusted input (DESIGN 6).

Before any tensor is read or any model allocated, `inspect_checkpoint` checks the manifest's structure and types
(one ValueError naming the field and the file), that the layout matches the files listed, that the declared
shapes, dtypes (a whitelist) and shard specs agree with the model config (a model built on the meta device) and
with every file's safetensors header; reading then checks sizes, checksums and that every weight is finite.
verify, load, merge and reshard all start here, so `verify_checkpoint` passes exactly when loading would.
"""

from __future__ import annotations

import json
import re
import reprlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from tabfm.checkpoint_format import (DTYPES, FORMAT, MANIFEST, MODEL, OPTIM, RNG, global_shape, model_specs,
                                     rank_file, sha256, spec_from_json, spec_to_json)
from tabfm.model import ModelConfig, TabFM
from tabfm.parallel.mesh import TPMesh
from tabfm.parallel.sharding import ShardSpec, unshard_tensor
from tabfm.parallel_model import model_mesh
from tabfm.skip_init import SkipInit

MAX_MANIFEST_BYTES = 64 << 20
"""A real manifest is a few hundred kB; a larger file is refused before it is parsed."""
_HEADER_DTYPES = {"F32": torch.float32, "F64": torch.float64, "BF16": torch.bfloat16, "F16": torch.float16,
                  "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool}
_PLACEMENTS = (None, "tp0", "tp1", "tp")
_RNG_KEYS = (RNG + "torch_cpu", RNG + "torch_cuda")
_DAMAGED = "the manifest is damaged or was not written by tabfm"


class _NonFiniteNumber(ValueError):
    """A NaN or Infinity where JSON allows only numbers."""


def no_constants(name: str) -> Any:
    """json.loads' parse_constant: NaN and Infinity are no numbers a manifest may hold."""
    raise _NonFiniteNumber(name)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _nonneg_int(v: Any) -> bool:
    return _is_int(v) and v >= 0


def pos_int(v: Any) -> bool:
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


def config_from_dict(d: Any, where: str) -> ModelConfig:
    """ModelConfig from untrusted data: any problem is one ValueError naming `where`."""
    if not isinstance(d, dict):
        raise ValueError(f"{where} must be a JSON object of model settings, got {type(d).__name__}")
    if "preset" in d:  # a path the config loader would open: never one a file names (to_dict writes none)
        raise ValueError(f"{where} names a preset ({reprlib.repr(d['preset'])}); a checkpoint's model settings are "
                         "written out whole, never as a preset: the checkpoint is damaged or not tabfm's")
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
    config_from_dict(_field(m, "model_config", _is_dict, "a JSON object", path), f"{path}: field model_config")
    layout = _field(m, "layout", _is_dict, "a JSON object {d0, d1, dp}", path)
    d0, d1, _ = (_field(layout, k, pos_int, "a positive integer", path, "layout.") for k in ("d0", "d1", "dp"))
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
        _field(spec, "qkv_heads", pos_int, "a positive integer or null", path, at + "spec.")
    problems = spec_from_json(spec).problems(tuple(shape), d0, d1, key)
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


def own_file(ckpt_dir: Path, path: Path) -> Path:
    """`path`, a file of the checkpoint folder, refused (ValueError) when it is a link: a checkpoint's files are
    written into its folder, and a link would read (or let merge write over) a file outside it."""
    if path.is_symlink() or (path.exists() and path.resolve().parent != ckpt_dir.resolve()):
        raise ValueError(f"{path} is a link (to {path.resolve()}); a checkpoint reads only files of its own folder: "
                         "copy the file in instead")
    return path


def check_folder(ckpt_dir: Path) -> None:
    """ValueError (one line) unless ckpt_dir is a folder: what a mistyped checkpoint path gets."""
    if not ckpt_dir.is_dir():
        what = "a file, not a folder" if ckpt_dir.is_file() else "no such directory"
        raise ValueError(f"{ckpt_dir} is not a checkpoint folder ({what})")


def read_manifest(ckpt_dir: str | Path) -> dict:
    """The manifest, checked for format, structure, types and consistency (ValueError naming the field)."""
    ckpt_dir = Path(ckpt_dir)
    path = ckpt_dir / MANIFEST
    check_folder(ckpt_dir)
    own_file(ckpt_dir, path)
    if not path.is_file():
        raise ValueError(f"{ckpt_dir} has no {MANIFEST}: not a checkpoint, or its write never finished")
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise ValueError(f"{path} is {path.stat().st_size} bytes, more than any manifest ({MAX_MANIFEST_BYTES}); "
                         f"{_DAMAGED}")
    try:
        manifest = json.loads(path.read_bytes(), parse_constant=no_constants)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}): the manifest is corrupt") from None
    except _NonFiniteNumber as e:
        raise ValueError(f"{path} holds the non-number {e}; {_DAMAGED}") from None
    except RecursionError:
        raise ValueError(f"{path} is nested too deeply to be a manifest; {_DAMAGED}") from None
    except ValueError as e:  # json's own, e.g. an integer of more digits than Python converts
        raise ValueError(f"{path} is not valid JSON ({e}): the manifest is corrupt") from None
    _check_manifest(manifest, path)
    return manifest


def meta_model(cfg: ModelConfig, n_tensors: int, where: str) -> TabFM:
    """The model a config describes, on the meta device: its names and shapes, without allocating a byte (nor
    initialising: `SkipInit`).
    A config declaring more blocks than there are tensors is refused first (each block holds tensors), so a
    hostile block count cannot make building even the meta model slow."""
    blocks = sum(v for k, v in cfg.to_dict().items() if k.endswith("_num_blocks"))
    if blocks > n_tensors:
        raise ValueError(f"{where}: the model config declares {blocks} blocks but the weights hold only {n_tensors} "
                         "tensors; the config does not describe these weights")
    try:
        with torch.device("meta"), SkipInit():
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
        if spec_from_json(meta["spec"]) != want:
            raise ValueError(f"{where}: {key} is cut as {meta['spec']} in the manifest, but the model cuts it as "
                             f"{spec_to_json(want)}")


def read_header(path: Path, size: int | None = None) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]],
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
        path = own_file(ckpt_dir, ckpt_dir / name)
        header, _ = read_header(path, info["bytes"])
        i, j = info["coord"]
        for key, meta in manifest["tensors"].items():
            if key not in header:
                raise ValueError(f"{path} lacks tensor {key!r} listed in the manifest")
            spec = spec_from_json(meta["spec"])
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
        model = meta_model(cfg, sum(k.startswith(MODEL) for k in manifest["tensors"]), str(ckpt_dir))
    _check_against_model(manifest, model, str(ckpt_dir))
    _check_headers(ckpt_dir, manifest)
    return manifest


def check_finite(tensors: dict[str, torch.Tensor], where: str,
                  hint: str = "these weights are unusable; load an earlier checkpoint") -> None:
    """Refuse NaN and infinite values: they would load silently and make every prediction NaN."""
    for key, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise ValueError(f"{where}: {key} holds {bad} non-finite value(s) (NaN or inf) of {t.numel()}; {hint}")


def read_rank_file(ckpt_dir: Path, manifest: dict, name: str) -> dict[str, torch.Tensor]:
    """One rank file's tensors, after its checksum (its header was checked by inspect_checkpoint); every
    floating-point tensor must be finite."""
    path = own_file(ckpt_dir, ckpt_dir / name)
    info = manifest["files"][name]
    if not path.is_file() or path.stat().st_size != info["bytes"]:
        raise ValueError(f"{path} is missing or changed size since it was checked")
    if sha256(path) != info["sha256"]:
        raise ValueError(f"{path} is corrupt: its sha256 does not match the manifest's")
    return load_finite(path)


def load_finite(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file whose header was already checked; unreadable bytes or a non-finite
    floating-point tensor raise one ValueError naming the file."""
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path} cannot be read as safetensors (corrupt or truncated?): {e}") from None
    check_finite(tensors, str(path))
    return tensors


def verify_checkpoint(ckpt_dir: str | Path) -> dict:
    """Every check loading runs (inspect_checkpoint), plus every file's checksum and finite weights; returns the
    manifest."""
    manifest = inspect_checkpoint(ckpt_dir)
    for name in manifest["files"]:
        read_rank_file(Path(ckpt_dir), manifest, name)
    return manifest


def gather_full(ckpt_dir: Path, manifest: dict, prefix: str | None = None) -> dict[str, torch.Tensor]:
    """Every (or every `prefix`) tensor reassembled to its global shape, from all rank files."""
    d0, d1 = manifest["layout"]["d0"], manifest["layout"]["d1"]
    shards = {}
    for name, info in manifest["files"].items():
        shards[tuple(info["coord"])] = read_rank_file(ckpt_dir, manifest, name)
    full = {}
    for key, meta in manifest["tensors"].items():
        if prefix is not None and not key.startswith(prefix):
            continue
        spec = spec_from_json(meta["spec"])
        full[key] = unshard_tensor({c: sd[key] for c, sd in shards.items()}, spec, d0, d1)
    return full


def config_diff(saved: dict, ours: dict) -> dict[str, tuple[Any, Any]]:
    """{setting: (saved value, our value)} for each model-config setting that differs, in key order."""
    return {k: (saved.get(k), ours.get(k)) for k in sorted(set(saved) | set(ours)) if saved.get(k) != ours.get(k)}


def _check_model_config(saved: dict, model: TabFM, where: str) -> None:
    """The saved model config equals the model's, else one line listing each differing setting."""
    diff = config_diff(saved, model.config.to_dict())
    if diff:
        shown = ", ".join(f"{k}: saved {a!r} vs model {b!r}" for k, (a, b) in diff.items())
        raise ValueError(f"{where} was saved for a different model config ({shown}); build the model from the "
                         "checkpoint's config (load_model) or pick a matching checkpoint")


def _expected_globals(model: TabFM, mesh: TPMesh) -> tuple[dict[str, tuple[int, ...]], dict[str, ShardSpec]]:
    """The global shape of each of the model's tensors on `mesh`, and the model's shard specs."""
    specs = model_specs(model)
    d0, d1 = mesh.d0, mesh.d1
    shapes = {}
    for name, t in model.state_dict().items():
        spec = specs.get(name, ShardSpec((None,) * t.dim()))
        shapes[name] = tuple(global_shape(tuple(t.shape), spec, d0, d1))
    return shapes, specs

