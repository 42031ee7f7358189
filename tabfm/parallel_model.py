"""TabFM on a tensor-parallel mesh: the plan that says which of its modules become ATP layers, applied from outside.

The model (tabfm.model) is one-device code. `parallelize_model(model, mesh, ...)` applies `tp_plan(model)` with
`tabfm.parallel.parallelize`: the blocks of every stage become ATP layers, and each stage's blocks are a "region"
whose input is sharded on entry (rows padded to a multiple of d0 under sequence parallelism) and whose output is
gathered on exit. Everything outside the blocks (cell encoder, label embeddings, output norm, heads) stays
replicated, and parameter names stay the plain model's. The mesh lives in the ATP layers only: `model_mesh(model)`
reads it back (None for a plain model).

Shapes inside a region, mesh (d0, d1): [..., S(/d0), E/d1] for the axial and row-compression blocks, [B, R(/d0), D/d1]
for the in-context blocks; S(/d0) only under sequence parallelism.
"""

from __future__ import annotations

from typing import Any

from tabfm.model import TabFM
from tabfm.parallel.mesh import TPMesh
from tabfm.parallel.options import ParallelOptions
from tabfm.parallel.parallelize import REGION, Plan, block_plan, model_mesh, parallelize

__all__ = ["STAGE_BLOCKS", "ParallelOptions", "model_mesh", "parallelize_model", "tp_plan"]

STAGE_BLOCKS = ("axial.*.column.block", "axial.*.column.summarise", "axial.*.column.read", "axial.*.row.block",
                "compress.block", "icl.blocks")
"""The blocks of each stage (dense.Block, or the in-context BlockStack): the tensor-parallel regions. The column
stage is one block (full attention) or two (inducing column attention, tabfm.column_stage); a model has only one of
the two kinds, and a pattern that matches nothing is no region."""


def tp_plan(model: TabFM) -> Plan:
    """The parallelize plan: each stage's blocks are a region, and their attention, MLP and both norms ATP layers.
    The cell encoder, label embeddings, output norm and heads stay replicated (they run outside the regions)."""
    plan: Plan = {}
    for prefix in STAGE_BLOCKS:
        plan[prefix] = REGION
        plan.update(block_plan(prefix))
    return plan


def parallelize_model(model: TabFM, mesh: TPMesh | None, options: ParallelOptions | None = None,
                      **fields: Any) -> TabFM:
    """Swap the blocks of every stage for ATP layers on `mesh` (in place) and run them there; parameter names
    stay the plain model's. A mesh of None or 1x1 leaves the model plain. options: a ParallelOptions (a run
    config's is ParallelOptions.from_config(cfg.parallel)), or its fields as keywords."""
    options = ParallelOptions.of(options, **fields)  # checked even where the model stays plain
    if mesh is None or mesh.tp == 1:
        return model
    if model_mesh(model) is not None:
        raise ValueError("the model is already parallelized; build a fresh one (or load it) for another mesh")
    return parallelize(model, mesh, tp_plan(model), options)
