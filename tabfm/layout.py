"""The parallel layout of a pretraining run: TabFM as the ATP planner sees it, and `parallel.layout: auto`.

`TabFMSource` hands the planner the configured model on fixed-size batches (B tables x rows x features), so
`tabfm plan` and `layout: auto` count the collectives of the real model's layers, not a transformer formula.
`resolve_layout` runs the planner for a run configured with `parallel.layout: auto`: every rank of the world
takes part in measuring the links (when the topology is `measure`), rank 0 ranks the layouts, and all ranks
adopt its choice, so they agree even though timings differ from process to process.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from tabfm.data.encode import Batch
from tabfm.model import ModelConfig, TabFM, parallelize_model, tp_plan
from tabfm.parallel.mesh import TPMesh
from tabfm.parallel.parallelize import layout_problems


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
        return parallelize_model(model, mesh, sequence_parallel, overlap_chunks=overlap_chunks)

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
        with torch.device("meta"):
            model = TabFM(self.model)
        return layout_problems(model, tp_plan(model), d0, d1)

    def describe(self) -> str:
        params = sum(p.numel() for p in TabFM(self.model).parameters())
        return (f"TabFM {params / 1e6:.2f}M parameters (E={self.model.embed_dim}, D={self.model.icl_dim}); "
                f"batch {self.batch} tables x {self.rows} rows x {self.features} features")


def source_for(cfg) -> TabFMSource:
    """The planner source of a run config: its model on the largest tables its data section draws."""
    return TabFMSource(cfg.model, cfg.data.batch_size, cfg.data.table.max_rows, cfg.data.table.max_features)


def _topology(name: str, nproc: int):
    from tabfm.parallel.topology import load_or_measure, load_preset

    return load_or_measure(nproc) if name == "measure" else load_preset(name)


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
