"""Save a fitted estimator to a folder and load it back without re-encoding its train rows; nothing is pickled.

A saved estimator is a folder of two or three files:

    estimator.json       format version, class, versions, get_params(), and every fitted attribute as JSON; an
                         array or tensor is a reference {"kind": "ndarray" | "tensor", "name": ...} into
    arrays.safetensors   every numeric array and tensor: the train cells, the members' column orders, the regressor's
                         mapped bins, each context's statistics and the keys/values of every KVCache
    trees.skops          where the trees have a weight: the fitted trees (tabfm.tree_io: skops, read back only as
                         trusted types, then checked), and only under the scikit-learn that wrote them (else fitted
                         again)

A folder rather than one file: the JSON can be read (and diffed) with any tool, the arrays with any safetensors
reader, and a damaged part is named. Each array's SHA-256 is in the JSON (the trees file's too), and the JSON's in
the safetensors header,
so that a flipped bit anywhere is refused at load instead of moving predictions (folders saved before the digests
load unchecked). The folder is written beside its destination and renamed into place, so a
failed save leaves nothing behind and an earlier save at the same path intact.

Objects are rebuilt only from a whitelist of classes (_CLASSES): scikit-learn transformers from their
get_params() plus their fitted attributes set on a fresh instance (Pipelines through their steps), dataclasses
from their fields, the other tabfm classes from their attributes. The model weights are not saved: the shipped
weights (checkpoint=None) or the checkpoint path, which must exist at load.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tabfm.out_paths import private_name
from tabfm.tree_base import tree_design_width
from tabfm.tree_io import tree_bytes, trees_from_bytes
from tabfm.validation import torch_threads

FORMAT_VERSION = 3
"""2: contexts per member may be local (context_members_, local_); version 1 files are refused.
3: the `precision` parameter and `precision_` (tabfm.inference_precision; bf16 caches hold bfloat16 keys/values).
Version 2 files are still read, as precision "fp32" (they were fitted without autocast), except those of
dtype="bfloat16" (bfloat16 weights), which are refused: refit them with precision="bf16"."""
READABLE_VERSIONS = (2, FORMAT_VERSION)
META_FILE = "estimator.json"
ARRAYS_FILE = "arrays.safetensors"
TREES_FILE = "trees.skops"
JSON_DIGEST = "estimator_json_sha256"
"""The key of the JSON's SHA-256 in the safetensors header's metadata."""


def _whitelist() -> dict[str, type]:
    """The classes a saved estimator may hold, by the stable public name written to the JSON."""
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import PowerTransformer, QuantileTransformer, RobustScaler, StandardScaler

    from tabfm.blocks import KVCache
    from tabfm.category_encoding import CategoryEncoding
    from tabfm.ensemble import Member
    from tabfm.linear_base import LinearBase, LinearDesign, LogisticModel
    from tabfm.local_context import LocalContexts
    from tabfm.model import Context
    from tabfm.numeric_bounds import NumericBounds
    from tabfm.preprocess import Cells, Column, TablePreprocessor
    from tabfm.target_transform import TargetScale, TargetTransform
    from tabfm.yeo_johnson import YeoJohnson

    classes = {"sklearn.preprocessing.StandardScaler": StandardScaler,
               "sklearn.preprocessing.RobustScaler": RobustScaler,
               "sklearn.preprocessing.QuantileTransformer": QuantileTransformer,
               "sklearn.preprocessing.PowerTransformer": PowerTransformer,  # in files saved before YeoJohnson
               "sklearn.pipeline.Pipeline": Pipeline}
    for cls in (KVCache, Member, Context, Cells, Column, TablePreprocessor, TargetScale, TargetTransform,
                LinearBase, LinearDesign, LogisticModel, LocalContexts, YeoJohnson, NumericBounds, CategoryEncoding):
        classes[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return classes


# -- encoding: Python values -> JSON nodes, arrays collected by name ------------------------------------------------

class _Encoder:
    """Turns a fitted estimator's attributes into JSON nodes; arrays and tensors go to `arrays` under unique names."""

    def __init__(self) -> None:
        self.arrays: dict[str, torch.Tensor] = {}
        self.names = {cls: name for name, cls in _whitelist().items()}

    def _store(self, name: str, tensor: torch.Tensor) -> dict[str, Any]:
        while name in self.arrays:
            name += "_"
        self.arrays[name] = tensor.detach().to("cpu", copy=True).contiguous()  # a copy: no storage shared
        return {"name": name, "dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape)}

    def encode(self, value: Any, path: str) -> Any:
        if isinstance(value, np.generic):  # before float: np.float64 is a float
            return {"kind": "npscalar", "dtype": value.dtype.str, "value": self.encode(value.item(), path)}
        if value is None or isinstance(value, bool | int | str):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else {"kind": "float", "value": repr(value)}
        if isinstance(value, list):
            return [self.encode(v, f"{path}.{i}") for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return {"kind": "tuple", "items": [self.encode(v, f"{path}.{i}") for i, v in enumerate(value)]}
        if isinstance(value, dict):
            if all(isinstance(k, str) for k in value):  # JSON's own object, readable
                return {"kind": "dict",
                        "fields": {k: self.encode(v, f"{path}.{k}".lstrip(".")) for k, v in value.items()}}
            return {"kind": "dict", "items": [[self.encode(k, f"{path}.key{i}"), self.encode(v, f"{path}.{i}")]
                                              for i, (k, v) in enumerate(value.items())]}
        if isinstance(value, np.ndarray):
            return self._ndarray(value, path)
        if isinstance(value, torch.Tensor):
            return {"kind": "tensor", **self._store(path, value)}
        if isinstance(value, torch.device):
            return {"kind": "device", "value": str(value)}
        if isinstance(value, torch.dtype):
            return {"kind": "torch_dtype", "value": str(value).removeprefix("torch.")}
        if type(value) in self.names:
            return self._object(value, path)
        raise ValueError(f"cannot save {path} ({type(value).__module__}.{type(value).__qualname__}): tabfm.persist "
                         f"saves only numbers, strings, arrays, tensors and the classes {sorted(self.names.values())}")

    def _ndarray(self, a: np.ndarray, path: str) -> dict[str, Any]:
        """Numbers and booleans to safetensors (dates and durations as int64), strings and objects to JSON."""
        if a.dtype.kind in "biuf":
            return {"kind": "ndarray", "numpy_dtype": a.dtype.str, **self._store(path, torch.from_numpy(a.copy("C")))}
        if a.dtype.kind in "Mm":
            return {"kind": "ndarray", "numpy_dtype": a.dtype.str,
                    **self._store(path, torch.from_numpy(a.view(np.int64).copy("C")))}
        if a.dtype.kind in "USO":
            items = a.ravel().tolist() if a.dtype.kind != "O" else list(a.ravel())
            return {"kind": "ndarray_json", "numpy_dtype": a.dtype.str, "shape": list(a.shape),
                    "items": [self.encode(v, f"{path}.{i}") for i, v in enumerate(items)]}
        raise ValueError(f"cannot save {path}: numpy arrays of dtype {a.dtype} are not supported")

    def _object(self, obj: Any, path: str) -> dict[str, Any]:
        """A whitelisted object: its constructor arguments (scikit-learn params, dataclass fields) and the rest of
        its attributes (scikit-learn's fitted state)."""
        from sklearn.base import BaseEstimator

        attributes = dict(vars(obj))
        if isinstance(obj, BaseEstimator):
            params = obj.get_params(deep=False)
        elif dataclasses.is_dataclass(obj):
            params = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        else:
            params = None
        for key in params or ():
            attributes.pop(key, None)
        return {"kind": "object", "class": self.names[type(obj)],
                "params": None if params is None else self.encode(params, f"{path}.params"),
                "attributes": self.encode(attributes, path)}


# -- decoding: JSON nodes -> Python values ------------------------------------------------------------------------

class _Decoder:
    """Rebuilds the values _Encoder wrote; arrays come from the loaded safetensors, tensors are moved to `device`."""

    def __init__(self, arrays: dict[str, torch.Tensor], device: torch.device) -> None:
        self.arrays, self.device = arrays, device
        self.classes = _whitelist()

    def decode(self, node: Any) -> Any:
        if node is None or isinstance(node, bool | int | float | str):
            return node
        if isinstance(node, list):
            return [self.decode(v) for v in node]
        kind = node["kind"]
        if kind == "float":
            return float(node["value"])
        if kind == "tuple":
            return tuple(self.decode(v) for v in node["items"])
        if kind == "dict":
            if "fields" in node:
                return {k: self.decode(v) for k, v in node["fields"].items()}
            return {self.decode(k): self.decode(v) for k, v in node["items"]}
        if kind == "ndarray":
            a = self.arrays[node["name"]].numpy()
            dtype = np.dtype(node["numpy_dtype"])
            return a.view(dtype) if dtype.kind in "Mm" else a.astype(dtype, copy=False)
        if kind == "ndarray_json":
            dtype = np.dtype(node["numpy_dtype"])
            items = [self.decode(v) for v in node["items"]]
            out = np.empty(len(items), dtype) if dtype.kind == "O" else np.array(items, dtype)
            if dtype.kind == "O":
                out[:] = items
            return out.reshape(node["shape"])
        if kind == "npscalar":
            return np.dtype(node["dtype"]).type(self.decode(node["value"]))
        if kind == "tensor":
            return self.arrays[node["name"]].to(self.device)
        if kind == "device":
            return torch.device(node["value"])
        if kind == "torch_dtype":
            dtype = getattr(torch, node["value"], None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"{node['value']!r} is not a torch dtype")
            return dtype
        if kind == "object":
            return self._object(node)
        raise ValueError(f"unknown node kind {kind!r}")

    def _object(self, node: dict[str, Any]) -> Any:
        name = node["class"]
        if name not in self.classes:
            raise ValueError(f"it holds an object of class {name!r}, which tabfm does not load (known classes: "
                             f"{sorted(self.classes)})")
        cls = self.classes[name]
        attributes = self.decode(node["attributes"])
        if node["params"] is None:  # a plain tabfm class: its attributes are its state, as pickle would restore
            obj = cls.__new__(cls)
            vars(obj).update(attributes)
            return obj
        obj = cls(**self.decode(node["params"]))
        for key, value in attributes.items():
            setattr(obj, key, value)
        return obj


# -- save ---------------------------------------------------------------------------------------------------------

def _plain_params(est: Any) -> dict[str, Any]:
    """get_params() as JSON values (a Path or torch.device as its string, a torch.dtype as its name, numpy scalars
    as numbers, a RandomState or Generator random_state as the seed fit drew from it, `seed_`: the loaded estimator
    refits as this one was fitted); refuses anything else."""
    def plain(name: str, value: Any) -> Any:
        if name == "random_state" and isinstance(value, np.random.RandomState | np.random.Generator):
            return est.seed_
        if isinstance(value, np.generic) and value.dtype.kind in "biuf":
            return value.item()
        if value is None or isinstance(value, bool | int | float | str):
            return value
        if isinstance(value, Path | torch.device):
            return str(value)
        if isinstance(value, torch.dtype):  # torch.float32 as the "float32" the dtype parameter also takes
            return str(value).removeprefix("torch.")
        if isinstance(value, list | tuple):
            return type(value)(plain(name, v) for v in value)
        if isinstance(value, np.ndarray) and value.ndim == 1:  # e.g. categorical_features as an array: a list
            return [plain(name, v) for v in value.tolist()]
        raise ValueError(f"cannot save parameter {name}={value!r} ({type(value).__name__}): set it to a number, "
                         "string, list or None before saving")
    return {k: plain(k, v) for k, v in est.get_params(deep=False).items()}


def save_estimator(est: Any, path: str | Path) -> None:
    """Write the fitted estimator to the folder `path` (created, or replacing an earlier saved estimator)."""
    from safetensors.torch import save_file
    from sklearn.utils.validation import check_is_fitted

    import tabfm

    check_is_fitted(est, "preprocessor_")
    est._validate_params()  # as load will check them: a folder load refuses is never written
    _check_saved_weights(est)
    if est.tensor_parallel is not None and tuple(est.tensor_parallel) != (1, 1):
        raise ValueError("cannot save an estimator fitted with tensor_parallel (each rank holds only its share of "
                         "the caches): fit it with tensor_parallel=None to save it")
    path = Path(path).expanduser().absolute()  # "~/model" as a shell reads it; "." by its name
    if path.is_symlink():  # a link to a saved estimator: replace what it points to and keep the link
        path = path.resolve()
    if path.exists() and not (path.is_dir() and all(
            p.name in (META_FILE, ARRAYS_FILE, TREES_FILE) and p.is_file() and not p.is_symlink()
            for p in path.iterdir())):  # names alone once let a folder named trees.skops be replaced
        raise ValueError(f"{str(path)!r} exists and is not a saved estimator: choose a new path or remove it")
    outer = next((p for p in path.resolve().parents if (p / META_FILE).is_file()), None)
    if outer is not None:  # written there, it made the outer folder one that no later save would replace
        raise ValueError(f"{str(path)!r} is inside the saved estimator {str(outer)!r}: choose a path outside it")
    if est.contexts_ is None:  # unpickled: encode once now, so the loaded estimator never has to
        with torch_threads(est.n_jobs):  # as predict would: the forwards' split follows the thread count
            est._encode_contexts()
    params = _plain_params(est)
    encoder = _Encoder()
    left_out = (*est._UNSTORED, *est._SAVED_APART)  # no model; the trees in their own file
    attributes = {k: v for k, v in vars(est).items() if k not in params and k not in left_out}
    meta = {"format_version": FORMAT_VERSION, "class": type(est).__name__, "tabfm_version": tabfm.__version__,
            "sklearn_version": _sklearn_version(), "params": encoder.encode(params, "params"),
            "attributes": encoder.encode(attributes, "")}
    meta["arrays"] = {name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                             "sha256": _digest(t)} for name, t in encoder.arrays.items()}
    trees = tree_bytes(est.tree_model_) if getattr(est, "tree_model_", None) is not None else None
    if trees is not None:
        meta["trees"] = {"file": TREES_FILE, "sha256": hashlib.sha256(trees).hexdigest()}
    text = json.dumps(meta, indent=1, allow_nan=False)
    tmp = private_name(path, "tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()  # beside the destination (one file system), with the user's usual permissions
    except OSError as e:
        raise ValueError(f"cannot save to {str(path)!r}: {e.strerror} ({e.filename}); choose a path in a folder "
                         "you can write") from None
    try:
        data = text.encode()
        (tmp / META_FILE).write_bytes(data)
        save_file(encoder.arrays, str(tmp / ARRAYS_FILE), metadata={
            "format_version": str(FORMAT_VERSION), JSON_DIGEST: hashlib.sha256(data).hexdigest()})
        if trees is not None:
            (tmp / TREES_FILE).write_bytes(trees)
        _replace_folder(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_saved_weights(est: Any) -> None:
    """Refuse a checkpoint parameter that no longer names the weights of the fit (set_params(checkpoint=...) after
    fit, or the file replaced since): the folder would be saved, then refused by load's own check
    (_TabFMBase._check_weights, which this runs; OSError: the path is gone), so it is refused here in save's words."""
    try:
        est._check_weights()
    except (ValueError, OSError):
        checkpoint = None if est.checkpoint is None else str(est.checkpoint)
        raise ValueError(f"checkpoint={checkpoint!r} does not name the weights this {type(est).__name__} was fitted "
                         "with (set after fit, or the file replaced since), so load would refuse the folder: set "
                         "checkpoint back, or fit again, before saving") from None


def _digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes as safetensors stores them (row-major, any dtype)."""
    flat = t.detach().to("cpu").reshape(-1)
    if flat.stride(0) != 1:  # a broadcast or empty tensor (stride 0): its bytes laid out first
        flat = torch.empty(flat.shape, dtype=flat.dtype).copy_(flat)
    return hashlib.sha256(memoryview(flat.view(torch.uint8).numpy())).hexdigest()


def _replace_folder(new: Path, path: Path) -> None:
    """Rename `new` to `path`; an earlier folder there is moved aside first and removed only once `new` is in."""
    old = None
    if path.exists():
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        path.rename(old)
    try:
        new.rename(path)
    except OSError:
        if old is not None:
            old.rename(path)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _sklearn_version() -> str:
    import sklearn

    return sklearn.__version__


# -- load ---------------------------------------------------------------------------------------------------------

def _inside(folder: Path, name: str) -> Path:
    """folder/name, refused when a link takes it outside the folder."""
    file = folder / name
    if not file.is_file():
        if name != META_FILE and (folder / META_FILE).is_file():  # a saved estimator that lost a file
            raise ValueError(f"{str(folder)!r} is a damaged saved estimator: {name} is missing; save the estimator "
                             "again")
        raise ValueError(f"{str(folder)!r} is not a saved estimator: {name} is missing (save one with est.save(path))")
    if folder.resolve() not in file.resolve().parents:
        raise ValueError(f"{str(file)!r} links outside the folder {str(folder)!r}; refusing to read it")
    return file


def _read_meta(folder: Path, cls: type) -> tuple[dict[str, Any], bytes]:
    """The JSON of a saved estimator, checked for its format version and class, and its bytes as read (which
    _read_arrays checks against the digest in the arrays file)."""
    file = _inside(folder, META_FILE)
    data = file.read_bytes()
    try:
        meta = json.loads(data)
    except RecursionError:
        raise ValueError(f"{str(file)!r} nests too deeply to be a tabfm estimator file: the saved estimator is "
                         "damaged; save it again") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{str(file)!r} is not valid JSON ({e}): the saved estimator is damaged; save it "
                         "again") from None
    if not isinstance(meta, dict) or "format_version" not in meta or not isinstance(meta.get("arrays"), dict):
        raise ValueError(f"{str(file)!r} is not a tabfm estimator file (no format_version or arrays table)")
    if meta["format_version"] not in READABLE_VERSIONS:
        raise ValueError(f"{str(folder)!r} was saved in format version {meta['format_version']!r} but this tabfm "
                         f"({_tabfm_version()}) reads version {FORMAT_VERSION} (and 2): load it with the tabfm that "
                         f"saved it (tabfm {meta.get('tabfm_version')}), or fit and save it again")
    if meta.get("class") != cls.__name__:
        raise ValueError(f"{str(folder)!r} holds a {meta.get('class')}, not a {cls.__name__}: load it with "
                         f"{meta.get('class')}.load")
    if meta.get("sklearn_version") != _sklearn_version():
        warnings.warn(f"{str(folder)!r} was saved with scikit-learn {meta.get('sklearn_version')}, this is "
                      f"{_sklearn_version()}: its fitted transformers may not behave the same; refit if in doubt",
                      stacklevel=3)
    return meta, data


def _tabfm_version() -> str:
    import tabfm

    return tabfm.__version__


def _read_arrays(folder: Path, table: dict[str, Any], meta_bytes: bytes) -> dict[str, torch.Tensor]:
    """The safetensors file, checked to hold exactly the arrays the JSON names, with their dtypes and shapes."""
    from safetensors import safe_open

    file = _inside(folder, ARRAYS_FILE)
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:  # one read: the header and the tensors
            header = f.metadata() or {}
            arrays = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:  # safetensors raises its own error types for a truncated or garbled file
        raise ValueError(f"{str(file)!r} is not a readable safetensors file ({e}): the saved estimator is damaged; "
                         "save it again") from None
    json_digest = header.get(JSON_DIGEST)
    if json_digest is not None and hashlib.sha256(meta_bytes).hexdigest() != json_digest:
        raise ValueError(f"{META_FILE} in {str(folder)!r} is not the file saved with {ARRAYS_FILE} (its SHA-256 "
                         "differs): the saved estimator was changed or damaged; save it again")
    if set(arrays) != set(table):
        missing, extra = sorted(set(table) - set(arrays)), sorted(set(arrays) - set(table))
        raise ValueError(f"{str(file)!r} does not match {META_FILE} (missing arrays {missing[:5]}, unexpected "
                         f"{extra[:5]}): the saved estimator is damaged; save it again")
    for name, t in arrays.items():
        want = table[name]
        if str(t.dtype).removeprefix("torch.") != want["dtype"] or list(t.shape) != want["shape"]:
            raise ValueError(f"array {name!r} in {str(file)!r} is {t.dtype} {list(t.shape)} but {META_FILE} says "
                             f"{want['dtype']} {want['shape']}: the saved estimator is damaged; save it again")
        if "sha256" in want and _digest(t) != want["sha256"]:
            raise ValueError(f"array {name!r} in {str(file)!r} does not have the SHA-256 {META_FILE} gives: the "
                             "saved estimator is damaged; save it again")
    return arrays


def _load_device(device: str | torch.device | None, saved: Any) -> torch.device:
    """The device asked for; by default the one the estimator was saved from when this machine has it, else cpu."""
    from tabfm.validation import resolve_device

    if device is not None:
        return resolve_device(device)
    if isinstance(saved, dict) and saved.get("kind") == "device":
        try:
            return resolve_device(saved["value"])
        except ValueError:
            pass
    return torch.device("cpu")


def _from_version_2(params: dict[str, Any], attributes: dict[str, Any]) -> None:
    """A version 2 estimator as version 3 reads it: fitted in fp32 (no autocast then); bfloat16 weights refused."""
    if params.get("dtype") in ("bfloat16", "float16"):
        raise ValueError(f"it was fitted with dtype={params['dtype']!r} (weights cast to {params['dtype']}), which "
                         "this tabfm no longer runs: fit it again with precision='bf16' (float32 weights, bfloat16 "
                         "autocast) and save it")
    params.setdefault("precision", "fp32")
    attributes.setdefault("precision_", "fp32")


def load_estimator(cls: type, path: str | Path, device: str | torch.device | None = None) -> Any:
    """The fitted estimator saved at `path` by save_estimator, its caches on `device`, ready to predict."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ValueError(f"{str(folder)!r} is not a folder holding a saved estimator (save one with est.save(path))")
    meta, meta_bytes = _read_meta(folder, cls)
    arrays = _read_arrays(folder, meta["arrays"], meta_bytes)
    try:
        attributes_node = meta["attributes"]
        target = _load_device(device, attributes_node["fields"].get("device_"))
        decoder = _Decoder(arrays, target)
        params = decoder.decode(meta["params"])
        attributes = decoder.decode(attributes_node)
        if meta["format_version"] == 2:
            _from_version_2(params, attributes)
        est = cls(**params)
        est._validate_params()  # the parameters as fit would have checked them
    except ValueError as e:
        raise ValueError(f"cannot load {str(folder)!r}: {e}") from None
    except (KeyError, TypeError, AttributeError, RuntimeError) as e:  # RuntimeError: torch's, e.g. a bad device
        raise ValueError(f"cannot load {str(folder)!r}: {META_FILE} is damaged ({type(e).__name__}: {e}); save the "
                         "estimator again") from None
    checkpoint = params.get("checkpoint")
    if checkpoint is not None and not Path(checkpoint).exists():
        raise ValueError(f"{str(folder)!r} was fitted with checkpoint {checkpoint!r}, which does not exist here: "
                         "put the checkpoint at that path (its encoded train rows belong to that model)")
    vars(est).update(attributes)
    _check_fitted_numbers(est, folder)
    encoding = getattr(est, "category_encoding_", None)
    if encoding is not None:
        try:
            encoding.check(est.train_cells_)
        except ValueError as e:
            raise ValueError(f"cannot load {str(folder)!r}: {META_FILE} is damaged ({e}); save the estimator "
                             "again") from None
    est.device_ = target
    try:
        est._model()  # model_ now (the weights are not saved), so the first predict is as fast as the rest
    except ValueError as e:  # the weights at its checkpoint are not those it was fitted with
        raise ValueError(f"cannot load {str(folder)!r}: {e}") from None
    if not _read_trees(est, folder, meta):
        with torch_threads(est.n_jobs):  # the trees on the estimator's threads, as at fit
            est._fit_tree_model()
    return est


_WEIGHTS = ("blend_weight_", "tree_weight_", "correction_weight_")
"""Fitted blend weights, each in [0, 1]."""
_SCALES = ("temperature_", "spread_")
"""Fitted softmax temperature and spread factor, each positive and finite."""


def _check_fitted_numbers(est: Any, folder: Path) -> None:
    """Refuse fitted weights and scales no fit gives (a weight of 2 once moved probabilities outside [0, 1] in a
    crafted file whose digests were recomputed): the JSON is then damaged or not what tabfm wrote."""
    for name in (*_WEIGHTS, *_SCALES):
        if name not in vars(est):
            continue
        value = vars(est)[name]
        number = isinstance(value, int | float | np.floating) and not isinstance(value, bool)
        fine = number and math.isfinite(value) and (0.0 <= value <= 1.0 if name in _WEIGHTS else value > 0.0)
        if not fine:
            raise ValueError(f"cannot load {str(folder)!r}: {META_FILE} is damaged ({name} = {value!r}, which no fit "
                             "gives); save the estimator again")


def _read_trees(est: Any, folder: Path, meta: dict[str, Any]) -> bool:
    """Set est.tree_model_ from the saved trees file; False where there is none (saved before the file existed,
    or the trees have no weight) or it was written by another scikit-learn (their models are then fitted again,
    the same for a seed under this one). A file that is not the one saved, or holds anything but trees, is
    refused."""
    entry = meta.get("trees")
    if entry is None or getattr(est, "tree_weight_", 0.0) <= 0 or meta.get("sklearn_version") != _sklearn_version():
        return False
    if not isinstance(entry, dict) or entry.get("file") != TREES_FILE or not isinstance(entry.get("sha256"), str):
        raise ValueError(f"cannot load {str(folder)!r}: {META_FILE} is damaged (its trees entry is {entry!r}); save "
                         "the estimator again")
    data = _inside(folder, TREES_FILE).read_bytes()
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise ValueError(f"{TREES_FILE} in {str(folder)!r} is not the file saved with {META_FILE} (its SHA-256 "
                         "differs): the saved estimator was changed or damaged; save it again")
    try:
        est.tree_model_ = trees_from_bytes(data, est._tree_targets()[1], tree_design_width(est.train_cells_))
    except ValueError as e:
        raise ValueError(f"cannot load {str(folder)!r}: {TREES_FILE} is damaged: {e}; save the estimator "
                         "again") from None
    return True
