"""The configs of the project and their loaders, all built by one typed loader (tabfm.config_io): nested
dataclasses with one docstring per field, YAML files, and `--set a.b=c` overrides (STYLE 9). Precedence: --set over
the file over the defaults. Unknown keys are rejected with the valid ones listed, and every error is one line naming
the key and its file; each component is handed only its own section (the model gets `model`, the loader `data`).

    load_config(path, overrides)     a pretraining run: RunConfig
    ModelConfig.load(name_or_path)   a model preset (configs/model/) or file
    load_plan(path, overrides)       `tabfm plan`: a run config or a plain transformer (configs/plan/), in
                                     tabfm.plan_config (it imports the planner)
    load_topology(name_or_path)      a topology preset (configs/topology/) or file, as the planner's Topology

A run config's sections:

    model:    ModelConfig (tabfm.model); `model: small` names a preset, `model: {preset: small, embed_dim: 64}`
              starts from one
    data:     DataConfig (tabfm.data.config): prior, table sizes, curriculum, batch size
    optim:    OptimConfig: AdamW, warmup + cosine schedule, gradient clipping
    parallel: ParallelConfig: the (d0, d1) tensor-parallel mesh, data-parallel replicas, sequence parallelism
    train:    TrainConfig: steps, seed, dtype and precision, logging, checkpoints

Distribution-valued fields of the prior (Uniform, Choice, ...) are written `{type: Uniform, low: 0.1, high: 2}`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tabfm.config_io import (ConfigError, apply_overrides, from_dict, load, preset_names, preset_path, read_yaml,
                             shown, to_dict)
from tabfm.data.config import DataConfig
from tabfm.model import ModelConfig
from tabfm.parallel.options import ParallelOptions
from tabfm.parallel.topology import HierarchicalTopology, TopologyPreset

__all__ = ["ConfigError", "OptimConfig", "ParallelConfig", "RunConfig", "TrainConfig", "apply_overrides",
           "dump_config", "from_dict", "load_config", "load_topology", "to_dict"]


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
    """Decoupled weight decay of the linear layers' weight matrices; norms, biases, embeddings and learned tokens
    take none (tabfm.precision.param_groups)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm (over all shards) to this; 0 turns clipping off."""

    def __post_init__(self) -> None:
        _check_ranges(self, "optim", {
            "lr": (lambda v: 0 < v < math.inf, "a finite number > 0"),  # NaN fails every comparison
            "min_lr_ratio": (lambda v: 0 <= v <= 1, "within [0, 1]"),
            "warmup_steps": (lambda v: v >= 0, ">= 0"),
            "beta1": (lambda v: 0 <= v < 1, "within [0, 1)"),
            "beta2": (lambda v: 0 <= v < 1, "within [0, 1)"),
            "eps": (lambda v: v > 0, "> 0"),
            "weight_decay": (lambda v: v >= 0, ">= 0"),
            "grad_clip": (lambda v: v >= 0, ">= 0 (0 turns clipping off)")})


def _check_ranges(config: Any, section: str, rules: dict[str, tuple[Callable[[Any], bool], str]]) -> None:
    """ValueError naming the first field of `config` whose value breaks its rule: one field per message, so the
    loader blames the file or the --set override that gave that value (config_io.Origins.blame)."""
    for name, (ok, rule) in rules.items():
        value = getattr(config, name)
        if not ok(value):
            raise ValueError(f"{section}.{name} must be {rule}, got {value!r}")


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
        for name in ("d0", "d1", "dp"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name} must be >= 1")
        if self.layout not in ("manual", "auto"):
            raise ValueError(f"parallel.layout={self.layout!r}; use manual or auto")
        try:  # the layers' own checks of the options they take (one place: ParallelOptions)
            ParallelOptions.from_config(self)
        except ValueError as e:
            raise ValueError(f"parallel.{e}") from None


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
    compile: str | None = None
    """torch.compile the model's forward with this backend (inductor on a GPU; aot_eager traces without generating
    code), or None for eager. The loss's test-row selection stays eager around it (tests/test_compile.py). Each
    new batch shape first recompiles, then PyTorch marks the changing sizes dynamic. One-device meshes only
    (d0 = d1 = 1, any dp): the tensor-parallel layers' collectives are not traced."""
    init_from: str | None = None
    """Start from these weights (a merged .safetensors file or a checkpoint folder, e.g. the shipped
    tabfm/weights/tabfm-small.safetensors) with a fresh optimizer and schedule: fine-tuning, or a new pretraining
    stage on other tables. A checkpoint that --resume finds takes precedence (a restarted run continues)."""

    def __post_init__(self) -> None:
        for name in ("out_dir", "init_from"):  # ~/runs/x was a folder named ~ in the working folder
            value = getattr(self, name)
            if isinstance(value, str) and value.startswith("~"):
                object.__setattr__(self, name, os.path.expanduser(value))
        at_least = {"steps": 1, "log_every": 1, "checkpoint_every": 0, "keep_checkpoints": 0, "eval_every": 0,
                    "eval_max_train_rows": 1}
        _check_ranges(self, "train", {name: (lambda v, low=low: v >= low, f">= {low}")
                                      for name, low in at_least.items()})
        _check_ranges(self, "train", {"seed": (lambda v: 0 <= v < 2**63, "within [0, 2**63): torch.manual_seed "
                                               "takes a 64-bit seed")})
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
        if self.compile is not None:
            import torch._dynamo  # only when asked: the import takes a moment

            backends = torch._dynamo.list_backends(exclude_tags=())
            if self.compile not in backends:
                raise ValueError(f"train.compile={self.compile!r} is not a torch.compile backend; use inductor (or "
                                 "aot_eager, eager), or null for no compile")

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

    def __post_init__(self) -> None:
        tensor_parallel = self.parallel.layout == "auto" or self.parallel.d0 * self.parallel.d1 > 1
        if self.train.compile is not None and tensor_parallel:
            raise ValueError(f"train.compile={self.train.compile} needs parallel.d0 = d1 = 1 and layout manual (the "
                             "tensor-parallel layers' collectives are not traced); drop train.compile or the mesh")

    def to_dict(self) -> dict[str, Any]:
        """Every field as plain YAML/JSON-able data (what checkpoints record as the run's config)."""
        return to_dict(self)


# ---------------------------------------------------------------------------------------------------------
# Loaders
# ---------------------------------------------------------------------------------------------------------

def load_config(path: str | Path | None = None, overrides: Sequence[str] | None = None) -> RunConfig:
    """A pretraining run: defaults, then the YAML file (if any), then the `a.b=c` overrides."""
    return load(RunConfig, path, overrides or ())


def load_topology(name_or_path: str | Path, nproc: int | None = None) -> HierarchicalTopology:
    """A topology preset by name (configs/topology/, or TABFM_TOPOLOGY_DIR) or a path to a preset YAML file; with
    `nproc`, ConfigError naming the presets for that many devices when it describes another number."""
    path = preset_path("topology", name_or_path, also=["measure (this machine)"])
    preset = from_dict(TopologyPreset, read_yaml(path), origin=f"in {shown(path)}")
    topology = preset.topology(default_name=path.stem)
    if nproc is not None:
        try:
            topology.check_nproc(nproc)
        except ValueError as e:
            raise ConfigError(f"{e}{_topologies_for(nproc)} (devices in {shown(path)})") from None
    return topology


def _topologies_for(nproc: int) -> str:
    """' (presets for N devices: a, b)', or '' when there are none."""
    names = []
    for name in preset_names("topology"):
        try:
            if from_dict(TopologyPreset, read_yaml(preset_path("topology", name))).devices == nproc:
                names.append(name)
        except ConfigError:
            continue
    return f" (presets for {nproc} devices: {', '.join(names)})" if names else ""


def dump_config(cfg: RunConfig) -> str:
    """The full config as YAML (every field, defaults included): what a run actually used."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
