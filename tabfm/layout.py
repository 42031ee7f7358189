"""The parallel layout of a pretraining run: TabFM as the ATP planner sees it, and `parallel.layout: auto`.

`TabFMSource` hands the planner the configured model on fixed-size batches (B tables x rows x features), so
`tabfm plan` and `layout: auto` count the collectives of the real model's layers, not a transformer formula.
`resolve_layout` runs the planner for a run configured with `parallel.layout: auto`: every rank of the world
takes part in measuring the links (when the topology is `measure`), rank 0 ranks the layouts, and all ranks
adopt its choice, so they agree even though timings differ from process to process.

`fitting_layouts(model_cfg, world_size)` answers "which layouts fit this model on N processes" (heads and widths
divisible, parallelize.layout_problems), and `check_layout` refuses one that doesn't, listing those that do: the
launcher's checks, `layout: auto` and the planner's shape checks (TabFMSource.layout_problems) all ask here, of one
uninitialised model per config (`shape_model`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from tabfm.data.encode import Batch
from tabfm.model import ModelConfig, TabFM, build_model
from tabfm.parallel import parallelize
from tabfm.parallel.mesh import ParallelDims, TPMesh, divisors
from tabfm.parallel.options import ParallelOptions
from tabfm.parallel_model import parallelize_model, tp_plan
from tabfm.skip_init import SkipInit


@functools.lru_cache(maxsize=2)
def shape_model(model_cfg: ModelConfig) -> TabFM:
    """The model for its names and shapes only: on the meta device, costing neither memory nor time (on the CPU,
    uninitialised, embed_dim 65,536 asked for 48 GiB and was an allocator's traceback). Cached per config (the
    planner asks about every layout of every process count); read it, never run it."""
    with torch.device("meta"), SkipInit():
        return build_model(model_cfg)


def layout_problems(model_cfg: ModelConfig, d0: int, d1: int) -> list[str]:
    """Everything that stops the model from running on a (d0, d1) tensor-parallel mesh (empty when it can)."""
    model = shape_model(model_cfg)
    return parallelize.layout_problems(model, tp_plan(model), d0, d1)


def fitting_layouts(model_cfg: ModelConfig, world_size: int) -> list[ParallelDims]:
    """Every dp x d0 x d1 layout of `world_size` processes whose tensor-parallel mesh fits the model's shapes."""
    model = shape_model(model_cfg)
    plan = tp_plan(model)
    return [ParallelDims(d0, d1, dp) for dp in divisors(world_size)
            for d0, d1 in parallelize.valid_layouts(model, plan, world_size // dp)]


def check_layout(model_cfg: ModelConfig, d0: int, d1: int) -> None:
    """Raise LayoutError, listing the (d0, d1) of the same size that fit, when (d0, d1) doesn't fit the model."""
    model = shape_model(model_cfg)
    parallelize.check_layout(model, tp_plan(model), d0, d1)


@dataclass(frozen=True)
class TabFMSource:
    """A planner model source: TabFM on classification batches of `batch` tables x `rows` x `features`, the
    first `n_train` rows (default half) being train rows."""

    model: ModelConfig
    batch: int
    rows: int
    features: int
    n_train: int | None = None

    def __call__(self):
        return TabFM(self.model), self._parallelize, self._inputs

    @staticmethod
    def _parallelize(model: TabFM, mesh: TPMesh, sequence_parallel: bool, overlap_chunks: int) -> TabFM:
        """The planner's parallelizer. It traces the torch reference epilogues whatever the run's kernels: the
        trace runs on the meta device, where Triton cannot, and the kernels change no collective."""
        return parallelize_model(model, mesh, ParallelOptions(sequence_parallel, overlap_chunks, kernels="torch"))

    def _inputs(self, mesh: TPMesh, sequence_parallel: bool, device: torch.device, dtype: torch.dtype) -> tuple:
        shape, n_train = (self.batch, self.rows, self.features), self.n_train or self.rows // 2
        batch = Batch(
            values=torch.zeros(shape, device=device), missing=torch.zeros(shape, dtype=torch.bool, device=device),
            cat_codes=torch.full(shape, -1, dtype=torch.int64, device=device),
            is_cat=torch.zeros(shape[0], shape[2], dtype=torch.bool, device=device),
            n_cats=torch.zeros(shape[0], shape[2], dtype=torch.int64, device=device),
            labels=torch.zeros(shape[:2], dtype=torch.int64, device=device),
            n_train=torch.full((shape[0],), n_train, dtype=torch.int64, device=device),
            n_classes=torch.full((shape[0],), 2, dtype=torch.int64, device=device),
            row_pad=torch.zeros(shape[:2], dtype=torch.bool, device=device),
            col_pad=torch.zeros(shape[0], shape[2], dtype=torch.bool, device=device),
            task="classification",
        )
        return batch, n_train

    def layout_problems(self, d0: int, d1: int) -> list[str]:
        """Why the model's shapes don't fit a (d0, d1) mesh (the planner's shape check)."""
        return layout_problems(self.model, d0, d1)

    def describe(self) -> str:
        params = sum(p.numel() for p in shape_model(self.model).parameters())
        return (f"TabFM {params / 1e6:.2f}M parameters (E={self.model.embed_dim}, D={self.model.icl_dim}); "
                f"batch {self.batch} tables x {self.rows} rows x {self.features} features")


def source_for(cfg) -> TabFMSource:
    """The planner source of a run config: its model on the largest tables its data section draws."""
    return TabFMSource(cfg.model, cfg.data.batch_size, cfg.data.table.max_rows, cfg.data.table.max_features)


def _topology(name: str, nproc: int):
    from tabfm.config import load_topology
    from tabfm.parallel.topology import load_or_measure

    return load_or_measure(nproc) if name == "measure" else load_topology(name, nproc)


def resolve_layout(cfg, world_size: int, out_dir: Path | None = None):
    """The run config with `parallel.layout: auto` replaced by the planner's choice for this world size, and the
    reason it won (None for a manual layout). Call on every rank, after the process group exists."""
    p = cfg.parallel
    if p.layout != "auto":
        return cfg, None
    if world_size % p.dp:
        raise ValueError(f"parallel.dp={p.dp} does not divide the {world_size} processes")
    nproc = world_size // p.dp
    if p.topology == "measure" and p.dp > 1:
        raise ValueError("layout: auto with dp > 1 needs a topology preset (parallel.topology); measuring runs on "
                         "the tensor-parallel ranks alone")
    if p.topology == "measure" and nproc > 1:
        _topology("measure", nproc)  # every rank takes part in the collective microbenchmarks (cached)
    rank = dist.get_rank() if dist.is_initialized() else 0
    choice: list = [None]
    if rank == 0:
        from tabfm.parallel import planner

        topology = _topology(p.topology, nproc)
        best, reason = planner.choose_layout(source_for(cfg), topology, nproc, dtype=cfg.train.compute_dtype,
                                             trace_device="cpu" if nproc == 1 else "meta")
        choice = [(best.d0, best.d1, best.sequence_parallel, best.chunks, reason)]
    if dist.is_initialized() and world_size > 1:
        dist.broadcast_object_list(choice, src=0)
    d0, d1, sp, chunks, reason = choice[0]
    parallel = dataclasses.replace(p, layout="manual", d0=d0, d1=d1, sequence_parallel=sp, overlap_chunks=chunks)
    if rank == 0 and out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "layout.json").write_text(json.dumps({"d0": d0, "d1": d1, "sequence_parallel": sp,
                                                         "overlap_chunks": chunks, "reason": reason}, indent=1))
    return dataclasses.replace(cfg, parallel=parallel), reason
