"""Typed run configuration (STYLE 9): nested dataclasses with one docstring per field, YAML files, and
`--set a.b=c` overrides. Precedence: --set over the file over the defaults. Unknown keys are rejected with the
valid ones listed; each component is handed only its own section (the model gets `model`, the loader `data`).

    model:    ModelConfig (tabfm.model); `model: small` names a preset, `model: {preset: small, embed_dim: 64}`
              starts from one
    data:     DataConfig (tabfm.data.config): prior, table sizes, curriculum, batch size
    optim:    OptimConfig: AdamW, warmup + cosine schedule, gradient clipping
    parallel: ParallelConfig: the (d0, d1) tensor-parallel mesh, data-parallel replicas, sequence parallelism
    train:    TrainConfig: steps, seed, dtype and precision, logging, checkpoints

Distribution-valued fields of the prior (Uniform, Choice, ...) are written `{type: Uniform, low: 0.1, high: 2}`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tabfm.data.config import DataConfig
from tabfm.model import ModelConfig


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup then cosine decay, and global gradient-norm clipping."""

    lr: float = 1e-3
    """Peak learning rate, reached at the end of warmup."""
    min_lr_ratio: float = 0.1
    """The cosine decays to lr * min_lr_ratio at the last step."""
    warmup_steps: int = 100
    """Steps of linear warmup from 0 to lr."""
    beta1: float = 0.9
    """AdamW's first-moment decay."""
    beta2: float = 0.95
    """AdamW's second-moment decay."""
    eps: float = 1e-8
    """AdamW's denominator epsilon."""
    weight_decay: float = 0.01
    """Decoupled weight decay (all parameters)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm (over all shards) to this; 0 turns clipping off."""

    def __post_init__(self) -> None:
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1 or self.warmup_steps < 0:
            raise ValueError("optim: need lr > 0, 0 <= min_lr_ratio <= 1 and warmup_steps >= 0")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1) or self.eps <= 0:
            raise ValueError("optim: beta1 and beta2 must lie in [0, 1) and eps must be > 0")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError("optim: weight_decay and grad_clip must be >= 0 (grad_clip 0 = off)")


@dataclass(frozen=True)
class ParallelConfig:
    """How the processes are laid out: dp replicas of a (d0, d1) tensor-parallel mesh."""

    d0: int = 1
    """Tensor-parallel degree of axis 0 (strided ranks, the slow link)."""
    d1: int = 1
    """Tensor-parallel degree of axis 1 (consecutive ranks, the fast link)."""
    dp: int = 1
    """Data-parallel replicas; d0 * d1 * dp must equal the number of processes."""
    sequence_parallel: bool = False
    """Split each stage's sequence over axis 0 as well (DESIGN 3.2)."""
    layout: str = "manual"
    """manual: use d0, d1, sequence_parallel and overlap_chunks as given; auto: the ATP planner chooses them for
    the processes started (divided by dp) on `topology`, and the run logs why it won (out_dir/layout.json)."""
    topology: str = "measure"
    """For layout auto: a preset of configs/topology, a path to a preset YAML, or measure (this machine, once)."""
    overlap_chunks: int = 1
    """Chunks of overlapped communication per tensor-parallel linear (DESIGN 3.4); 1 = off."""
    kernels: str = "auto"
    """Fused chunk epilogues: auto (Triton on CUDA tensors of 2^24+ elements, the torch reference elsewhere), triton
    or torch."""

    def __post_init__(self) -> None:
        for name in ("d0", "d1", "dp", "overlap_chunks"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name} must be >= 1")
        if self.layout not in ("manual", "auto"):
            raise ValueError(f"parallel.layout={self.layout!r}; use manual or auto")
        if self.kernels not in ("auto", "triton", "torch"):
            raise ValueError(f"parallel.kernels={self.kernels!r}; use auto, triton or torch")


PRECISIONS = ("fp32", "tf32", "bf16")
"""train.precision choices (see TrainConfig.precision)."""


@dataclass(frozen=True)
class TrainConfig:
    """The loop: length, seed, precision, logging and checkpoints."""

    steps: int = 1000
    """Optimizer steps of the whole run (a resumed run continues up to this)."""
    seed: int = 0
    """Seed of the model's initialisation (data has its own, data.seed)."""
    dtype: str = "float32"
    """Dtype of the parameters (the master weights) and the optimizer state: float32, or float64 for the
    equivalence tests. Lower-precision compute is `precision`, never lower-precision parameters."""
    precision: str = "fp32"
    """Compute precision: fp32; tf32 (float32 with TensorFloat-32 matmuls on CUDA; a no-op on CPU); or bf16
    (torch.autocast to bfloat16 around forward and loss; parameters, gradients and AdamW state stay float32)."""
    device: str = "auto"
    """cpu, cuda, or auto (cuda when available)."""
    out_dir: str = "runs/default"
    """Where metrics.jsonl and checkpoints/ go."""
    log_every: int = 10
    """Write a metrics line every this many steps (and at the last step)."""
    checkpoint_every: int = 200
    """Save a checkpoint every this many steps (and at the last step); 0 saves only at the end."""
    keep_checkpoints: int = 2
    """Checkpoints kept on disk (older ones are deleted); 0 keeps all."""
    progress: bool = True
    """Show a tqdm progress bar on rank 0."""
    eval_every: int = 0
    """Evaluate on the real tables `eval_tables` every this many steps (and at the last step); 0 turns it off.
    Rank 0 appends {"step", "eval": {mean_roc_auc, mean_log_loss, mean_accuracy, tables}} to metrics.jsonl."""
    eval_tables: tuple[str, ...] = ("skl_iris", "skl_breast_cancer", "penguins_species", "mass_crabs_species",
                                    "skl_wine")
    """Classification tables of benchmarks/datasets to evaluate on (fold 0 = test rows, the rest = train rows)."""
    eval_max_train_rows: int = 512
    """Train (context) rows of an evaluation table are subsampled, deterministically, to at most this many."""
    init_from: str | None = None
    """Start from these weights (a merged .safetensors file or a checkpoint folder, e.g. the shipped
    tabfm/weights/tabfm-small.safetensors) with a fresh optimizer and schedule: fine-tuning, or a new pretraining
    stage on other tables. A checkpoint that --resume finds takes precedence (a restarted run continues)."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.log_every < 1 or self.checkpoint_every < 0 or self.keep_checkpoints < 0:
            raise ValueError("train: need steps >= 1, log_every >= 1, checkpoint_every >= 0, keep_checkpoints >= 0")
        if self.eval_every < 0 or self.eval_max_train_rows < 1:
            raise ValueError("train: need eval_every >= 0 (0 = off) and eval_max_train_rows >= 1")
        if self.dtype == "bfloat16":
            raise ValueError("train.dtype=bfloat16 is no longer supported (no float32 master weights); use "
                             "train.dtype: float32 with train.precision: bf16")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"train.dtype={self.dtype!r}; use float32 or float64 (bf16 compute: train.precision)")
        if self.precision not in PRECISIONS:
            raise ValueError(f"train.precision={self.precision!r}; use {', '.join(PRECISIONS)}")
        if self.precision != "fp32" and self.dtype != "float32":
            raise ValueError(f"train.precision={self.precision} needs train.dtype=float32 (float64 runs use fp32)")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"train.device={self.device!r}; use auto, cpu or cuda")

    @property
    def compute_dtype(self) -> str:
        """The dtype most activations are computed in (what the layout planner counts): bfloat16 under
        precision bf16, else the parameters' dtype."""
        return "bfloat16" if self.precision == "bf16" else self.dtype


@dataclass(frozen=True)
class RunConfig:
    """A pretraining run."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig.load("small"))
    """The model's constructor arguments (default: the small preset)."""
    data: DataConfig = field(default_factory=DataConfig)
    """The synthetic prior and the batches."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Process layout."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The training loop."""

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)


# ---------------------------------------------------------------------------------------------------------
# dict <-> dataclass
# ---------------------------------------------------------------------------------------------------------

def to_dict(obj: Any) -> Any:
    """A config as plain YAML/JSON-able data (distribution fields carry their `type`)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        if _is_distribution(type(obj)):
            out = {"type": type(obj).__name__, **out}
        return out
    if isinstance(obj, tuple | list):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def _is_distribution(cls: type) -> bool:
    return hasattr(cls, "sample") and hasattr(cls, "check")


def _union_args(tp: Any) -> tuple | None:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return None


def _convert(value: Any, tp: Any, where: str) -> Any:
    """`value` (from YAML) as type `tp`, or ValueError naming `where`."""
    if tp is Any:  # lists become tuples, as in the defaults (frozen configs stay hashable)
        return tuple(_convert(v, Any, where) for v in value) if isinstance(value, list) else value
    args = _union_args(tp)
    if args is not None:
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        classes = [a for a in options if dataclasses.is_dataclass(a)]
        if classes and isinstance(value, dict):
            names = {c.__name__.lower(): c for c in classes}
            kind = str(value.get("type", "")).lower()
            if kind not in names:
                raise ValueError(f"{where}: give 'type' as one of {[c.__name__ for c in classes]}, got {value!r}")
            return from_dict(names[kind], {k: v for k, v in value.items() if k != "type"}, where)
        for option in options:
            try:
                return _convert(value, option, where)
            except ValueError:
                continue
        raise ValueError(f"{where}: {value!r} is not any of {[getattr(a, '__name__', str(a)) for a in options]}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, str) and hasattr(tp, "load"):
            return tp.load(value)
        if not isinstance(value, dict):
            raise ValueError(f"{where} must be a mapping of {tp.__name__} fields, got {value!r}")
        return from_dict(tp, value, where)
    origin = typing.get_origin(tp)
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where} must be a mapping, got {value!r}")
        kt, vt = typing.get_args(tp) or (Any, Any)
        return {_convert(k, kt, where): _convert(v, vt, f"{where}.{k}") for k, v in value.items()}
    if origin in (tuple, list) or tp in (tuple, list):
        if not isinstance(value, list | tuple):
            raise ValueError(f"{where} must be a list, got {value!r}")
        targs = typing.get_args(tp)
        if origin is tuple and len(targs) == 2 and targs[1] is Ellipsis:
            items = [_convert(v, targs[0], where) for v in value]
        elif origin is tuple and targs:
            if len(targs) != len(value):
                raise ValueError(f"{where} needs {len(targs)} items, got {value!r}")
            items = [_convert(v, t, where) for v, t in zip(value, targs, strict=True)]
        else:
            items = list(value)
        return tuple(items) if (origin or tp) is tuple else items
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{where} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"{where} must be a string, got {value!r}")
        return value
    return value


def from_dict(cls: type, d: dict[str, Any], where: str = "") -> Any:
    """Build dataclass `cls` from a (partial) mapping; missing fields keep their defaults. Unknown keys raise
    ValueError listing the valid ones."""
    if cls is ModelConfig and "preset" in d:  # start from a preset, then apply the rest
        d = {**ModelConfig.load(d["preset"]).to_dict(), **{k: v for k, v in d.items() if k != "preset"}}
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in d if k not in names]
    if unknown:
        prefix = f"{where}." if where else ""
        raise ValueError(f"unknown config key{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(prefix + k for k in unknown)}; valid keys{' of ' + where if where else ''}: "
                         f"{', '.join(names)}")
    hints = typing.get_type_hints(cls)
    kwargs = {k: _convert(v, hints[k], f"{where}.{k}" if where else k) for k, v in d.items()}
    return cls(**kwargs)


# ---------------------------------------------------------------------------------------------------------
# Files and overrides
# ---------------------------------------------------------------------------------------------------------

def parse_override(text: str) -> tuple[list[str], Any]:
    """'a.b=c' -> (['a', 'b'], c parsed as YAML: numbers, booleans, lists, mappings)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--set {text!r}: write it as section.key=value, e.g. optim.lr=3e-4")
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else ""


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`raw` with every `a.b=c` override set (nested mappings are created as needed)."""
    raw = _expand_model(dict(raw))
    for text in overrides:
        path, value = parse_override(text)
        node = raw
        for key in path[:-1]:
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            elif not isinstance(child, dict):
                raise ValueError(f"--set {text!r}: {key} is a value, not a section")
            else:
                child = node[key] = dict(child)
            node = child
        if path == ["model"] and isinstance(value, str):
            value = ModelConfig.load(value).to_dict()
        node[path[-1]] = value
    return raw


def _expand_model(raw: dict[str, Any]) -> dict[str, Any]:
    """`model: small` or `model: {preset: small, ...}` as the full mapping, so overrides can refine it."""
    model = raw.get("model")
    if isinstance(model, str):
        raw["model"] = ModelConfig.load(model).to_dict()
    elif isinstance(model, dict) and "preset" in model:
        raw["model"] = {**ModelConfig.load(model["preset"]).to_dict(),
                        **{k: v for k, v in model.items() if k != "preset"}}
    return raw


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Defaults, then the YAML file (if any), then the `a.b=c` overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config file {path} does not exist")
        raw = yaml.safe_load(path.read_text()) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{path} must hold a mapping of sections ({', '.join(_sections())})")
    return from_dict(RunConfig, apply_overrides(raw, overrides or []))


def _sections() -> list[str]:
    return [f.name for f in dataclasses.fields(RunConfig)]


def dump_config(cfg: RunConfig) -> str:
    """The full config as YAML (every field, defaults included): what a run actually used."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
