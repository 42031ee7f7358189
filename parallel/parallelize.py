"""parallelize(model, mesh, plan): swap a plain model's modules for ATP layers, in place.

The plan maps module-name patterns (fnmatch, on `named_modules()` names) to a style:
    "mlp"        dense.Mlp        -> ParallelMlp
    "attention"  dense.Attention  -> ParallelAttention
    "norm"       nn.LayerNorm     -> ParallelLayerNorm
    "embedding"  nn.Embedding     -> VocabEmbedding
    "colwise"    nn.Linear        -> ColumnFirstLinear
    "rowwise"    nn.Linear        -> RowFirstLinear
Everything the plan names runs on hidden-sharded activations; the model enters and leaves that region with
`shard_activation` / `gather_activation`. Parameter names stay those of the plain model, so a gathered state
dict is the plain model's state dict. Layout problems are found for the whole plan before anything is swapped.

Run options (the config's `parallel.overlap_chunks` and `parallel.kernels`) reach the layers that use them:
    overlap_chunks  k chunks of overlapped communication (overlap.py): mlp, attention, colwise, rowwise
    kernels         "auto" | "triton" | "torch" fused epilogues (kernels/ops.py): mlp, norm
"""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Callable

from torch import nn

from tabfm.parallel import dense
from tabfm.parallel.kernels.ops import check_kernels
from tabfm.parallel.layers import (ColumnFirstLinear, ParallelAttention, ParallelLayerNorm, ParallelMlp,
                                   RowFirstLinear, VocabEmbedding, _divisibility)
from tabfm.parallel.mesh import LayoutError, TPMesh, factorizations
from tabfm.parallel.overlap import check_chunks
from tabfm.parallel.sharding import ShardSpec

Plan = dict[str, str]

_STYLES: dict[str, tuple[type, Callable[..., nn.Module], Callable[[nn.Module, int, int], list[str]]]] = {
    "mlp": (dense.Mlp, ParallelMlp, ParallelMlp.layout_problems),
    "attention": (dense.Attention, ParallelAttention, ParallelAttention.layout_problems),
    "norm": (nn.LayerNorm, ParallelLayerNorm,
             lambda m, d0, d1: _divisibility({"norm width": m.normalized_shape[-1]}, 1, d1)),
    "embedding": (nn.Embedding, VocabEmbedding, VocabEmbedding.layout_problems),
    "colwise": (nn.Linear, ColumnFirstLinear.from_dense,
                lambda m, d0, d1: _divisibility({"linear output": m.out_features}, d0, 1)
                + _divisibility({"linear input": m.in_features}, 1, d1)),
    "rowwise": (nn.Linear, RowFirstLinear.from_dense,
                lambda m, d0, d1: _divisibility({"linear input": m.in_features}, d0, 1)
                + _divisibility({"linear output": m.out_features}, 1, d1)),
}


# Which run options each style's layer takes.
_OPTIONS: dict[str, tuple[str, ...]] = {
    "mlp": ("overlap_chunks", "kernels"),
    "attention": ("overlap_chunks",),
    "norm": ("kernels",),
    "embedding": (),
    "colwise": ("overlap_chunks",),
    "rowwise": ("overlap_chunks",),
}


def block_plan(prefix: str = "") -> Plan:
    """The plan for every dense.Block / BlockStack under `prefix`: attention, MLP and both norms."""
    p = f"{prefix}." if prefix else ""
    return {f"{p}*attn": "attention", f"{p}*mlp": "mlp", f"{p}*norm1": "norm", f"{p}*norm2": "norm"}


def _matches(model: nn.Module, plan: Plan) -> list[tuple[str, nn.Module, str]]:
    found = []
    for name, module in model.named_modules():
        styles = {style for pattern, style in plan.items() if fnmatch.fnmatchcase(name, pattern)}
        if not styles:
            continue
        if len(styles) > 1:
            raise ValueError(f"module {name!r} matches several styles {sorted(styles)} in the plan")
        style = styles.pop()
        if style not in _STYLES:
            raise ValueError(f"unknown style {style!r} for {name!r}; choose from {sorted(_STYLES)}")
        kind = _STYLES[style][0]
        if type(module) is not kind:
            raise ValueError(f"plan gives {name!r} style {style!r}, which needs {kind.__name__}, "
                             f"but the module is {type(module).__name__}")
        found.append((name, module, style))
    # A matched module inside another matched module would be swapped twice.
    names = [n for n, _, _ in found]
    for n in names:
        for m in names:
            if m != n and m.startswith(n + "."):
                raise ValueError(f"plan matches both {n!r} and its child {m!r}")
    return found


def layout_problems(model: nn.Module, plan: Plan, d0: int, d1: int) -> list[str]:
    """Everything that stops `model` from running on a (d0, d1) mesh under `plan` (empty when it can)."""
    out = []
    for name, module, style in _matches(model, plan):
        out += [f"{name}: {p}" for p in _STYLES[style][2](module, d0, d1)]
    return out


def valid_layouts(model: nn.Module, plan: Plan, n: int) -> list[tuple[int, int]]:
    """Every (d0, d1) with d0 * d1 == n that the model's shapes allow."""
    return [(d0, d1) for d0, d1 in factorizations(n) if not layout_problems(model, plan, d0, d1)]


def check_layout(model: nn.Module, plan: Plan, d0: int, d1: int) -> None:
    """Raise LayoutError, listing the layouts that would work, when (d0, d1) doesn't fit the model."""
    problems = layout_problems(model, plan, d0, d1)
    if problems:
        valid = valid_layouts(model, plan, d0 * d1)
        options = ", ".join(f"{a}x{b}" for a, b in valid) or "none: change the number of processes"
        by_reason: dict[str, list[str]] = {}
        for problem in problems:  # "module: reason" -> one line per reason, naming where it first happens
            module, _, reason = problem.partition(": ")
            by_reason.setdefault(reason, []).append(module)
        shown = "; ".join(f"{reason} ({where[0]}" + (f" and {len(where) - 1} more)" if len(where) > 1 else ")")
                          for reason, where in by_reason.items())
        raise LayoutError(f"layout {d0}x{d1} does not fit the model: {shown}. "
                          f"Layouts with {d0 * d1} tensor-parallel ranks that fit: {options}")


def parallelize(model: nn.Module, mesh: TPMesh, plan: Plan, sequence_parallel: bool = False,
                overlap_chunks: int = 1, kernels: str = "auto") -> nn.Module:
    """Swap the modules the plan names for ATP layers on `mesh` (in place) and return the model.

    overlap_chunks: split each linear's tokens into this many chunks whose collectives overlap compute (1 = off).
    kernels: "auto" (Triton on large CUDA tensors, else torch), "triton" or "torch" for the fused epilogues.
    """
    options = {"overlap_chunks": check_chunks(overlap_chunks), "kernels": check_kernels(kernels)}
    check_layout(model, plan, mesh.d0, mesh.d1)
    for name, module, style in _matches(model, plan):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if not name:
            raise ValueError("the plan cannot swap the root module itself; wrap it in a parent module")
        extra = {name: options[name] for name in _OPTIONS[style]}
        setattr(parent, child, _STYLES[style][1](module, mesh, sequence_parallel=sequence_parallel, **extra))
    return model


def shard_specs(model: nn.Module) -> dict[str, ShardSpec]:
    """How every sharded parameter of a parallelized model is cut, by its (plain-model) name."""
    specs = {}
    for name, module in model.named_modules():
        if hasattr(module, "shard_specs") and callable(module.shard_specs):
            for param, spec in module.shard_specs().items():
                specs[f"{name}.{param}" if name else param] = spec
    return specs


def full_shard_specs(model: nn.Module, plan: Plan) -> dict[str, ShardSpec]:
    """The shard specs `parallelize(model, mesh, plan)` would give, read off the plain model (any mesh)."""
    probe = parallelize(copy.deepcopy(model), TPMesh.single(), plan)
    return shard_specs(probe)
