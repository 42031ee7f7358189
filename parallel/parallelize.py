"""parallelize(model, mesh, plan): swap a plain model's modules for ATP layers, in place.

The plan maps module-name patterns (fnmatch, on `named_modules()` names) to a style:
    "mlp"        dense.Mlp        -> ParallelMlp
    "attention"  dense.Attention  -> ParallelAttention
    "norm"       nn.LayerNorm     -> ParallelLayerNorm
    "embedding"  nn.Embedding     -> VocabEmbedding
    "colwise"    nn.Linear        -> ColumnFirstLinear
    "rowwise"    nn.Linear        -> RowFirstLinear
    "region"     any module       kept; its input is sharded on entry and its output gathered on exit (RegionBoundary)
Everything those layers see is hidden-sharded: a "region" marks where a model enters and leaves that state (like
torchtitan's PrepareModuleInput / PrepareModuleOutput), so the plain model never calls a collective. A dense.Block
whose second norm became a ParallelLayerNorm becomes a ParallelBlock (same modules), which fuses its residual add
into the norm. Parameter names stay those of the plain model, so a gathered state dict is the plain model's state
dict. Layout problems are found for the whole plan before anything is swapped.

Run options come as one ParallelOptions (options.py: sequence parallelism, overlap chunks, kernels), checked when
it is made; each layer gets the fields it takes (_OPTIONS).
"""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tabfm.parallel import dense
from tabfm.parallel.layers import (ColumnFirstLinear, ParallelAttention, ParallelBlock, ParallelLayerNorm,
                                   ParallelMlp, RowFirstLinear, VocabEmbedding, _divisibility, gather_activation,
                                   shard_activation)
from tabfm.parallel.mesh import LayoutError, TPMesh, factorizations
from tabfm.parallel.options import ParallelOptions
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


REGION = "region"  # the boundary style: nothing is swapped (RegionBoundary)

# Which ParallelOptions fields each style's layer takes.
_OPTIONS: dict[str, tuple[str, ...]] = {
    "mlp": ("sequence_parallel", "overlap_chunks", "kernels"),
    "attention": ("sequence_parallel", "overlap_chunks"),
    "norm": ("sequence_parallel", "kernels"),
    "embedding": ("sequence_parallel",),
    "colwise": ("sequence_parallel", "overlap_chunks"),
    "rowwise": ("sequence_parallel", "overlap_chunks"),
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
        if style not in _STYLES and style != REGION:
            raise ValueError(f"unknown style {style!r} for {name!r}; choose from {sorted([*_STYLES, REGION])}")
        kind = _STYLES[style][0] if style in _STYLES else None
        if kind is not None and type(module) is not kind:
            raise ValueError(f"plan gives {name!r} style {style!r}, which needs {kind.__name__}, "
                             f"but the module is {type(module).__name__}")
        found.append((name, module, style))
    # A matched module inside a swapped one would be swapped twice; a region inside a region sharded twice. Only a
    # region may hold other matches (the layers that run inside it).
    for n, _, outer in found:
        for m, _, inner in found:
            if m != n and m.startswith(n + ".") and not (outer == REGION and inner != REGION):
                raise ValueError(f"plan matches both {n!r} and its child {m!r}")
    return found


def layout_problems(model: nn.Module, plan: Plan, d0: int, d1: int) -> list[str]:
    """Everything that stops `model` from running on a (d0, d1) mesh under `plan` (empty when it can)."""
    out = []
    for name, module, style in _matches(model, plan):
        if style in _STYLES:  # a region fits any mesh: under sequence parallelism it pads its sequence
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


def parallelize(model: nn.Module, mesh: TPMesh, plan: Plan, options: ParallelOptions | None = None,
                **fields: Any) -> nn.Module:
    """Swap the modules the plan names for ATP layers on `mesh` (in place) and return the model.

    options: how the layers run (ParallelOptions; default: no sequence parallelism, no overlap, kernels auto), or
    its fields as keywords (`sequence_parallel=True, overlap_chunks=2`).
    """
    options = ParallelOptions.of(options, **fields)
    check_layout(model, plan, mesh.d0, mesh.d1)
    matches = _matches(model, plan)
    for name, module, style in matches:
        if style == REGION:
            continue
        if not name:
            raise ValueError("the plan cannot swap the root module itself; wrap it in a parent module")
        _replace(model, name, _STYLES[style][1](module, mesh, **options.pick(_OPTIONS[style])))
    _fuse_residual_norms(model)
    for name, _, style in matches:  # after the swaps, so the hooks sit on the modules that stay
        if style == REGION:
            RegionBoundary(mesh, options.sequence_parallel).attach(model.get_submodule(name))
    return model


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _fuse_residual_norms(model: nn.Module) -> None:
    """Every dense.Block whose norm2 is now a ParallelLayerNorm becomes a ParallelBlock (the same modules). A root
    Block cannot be swapped; it adds the residual before its norm, which gives the same result unfused."""
    blocks = [name for name, m in model.named_modules()
              if name and type(m) is dense.Block and isinstance(m.norm2, ParallelLayerNorm)]
    for name in blocks:
        _replace(model, name, ParallelBlock(model.get_submodule(name)))


class RegionBoundary:
    """The "region" style: `module(x, num_kv=..., attn_mask=..., ...)` runs on hidden-sharded activations.

    On entry x [B..., S, H] (replicated) becomes this rank's [B..., S(/d0), H/d1] (shard_activation); on exit the
    output is gathered back to [B..., S, H]. Under sequence parallelism the sequence is first padded with zero
    tokens to a multiple of d0; they are never keys (num_kv stops before them, a per-query mask gets rows for
    them) and are cut off the output, so they change nothing. Applied as forward hooks, so the module, its name and
    its parameters stay the plain model's.
    """

    def __init__(self, mesh: TPMesh, sequence_parallel: bool = False) -> None:
        self.mesh, self.sequence_parallel = mesh, sequence_parallel
        self._lengths: list[int] = []  # S of the calls in flight (entry pushes, exit pops)

    def attach(self, module: nn.Module) -> None:
        module.register_forward_pre_hook(self.enter, with_kwargs=True)
        module.register_forward_hook(self.leave, with_kwargs=True)

    def enter(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        if len(args) != 1:
            raise TypeError(f"a region's {type(module).__name__} takes its tokens positionally and everything else "
                            f"by keyword (num_kv=..., attn_mask=...); it got {len(args)} positional arguments")
        x, num_kv, attn_mask = args[0], kwargs.get("num_kv"), kwargs.get("attn_mask")
        s = x.shape[-2]
        pad = -s % self.mesh.d0 if self.sequence_parallel else 0
        if pad:
            x = torch.cat([x, x.new_zeros(*x.shape[:-2], pad, x.shape[-1])], dim=-2)
            num_kv = s if num_kv is None else num_kv
            if attn_mask is not None and attn_mask.shape[-2] != 1:
                attn_mask = torch.cat([attn_mask, attn_mask.new_ones(*attn_mask.shape[:-2], pad,
                                                                     attn_mask.shape[-1])], dim=-2)
            kwargs = {**kwargs, "num_kv": num_kv, "attn_mask": attn_mask}
        self._lengths.append(s)
        return (shard_activation(x, self.mesh, self.sequence_parallel),), kwargs

    def leave(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], y: torch.Tensor) -> torch.Tensor:
        s = self._lengths.pop()
        y = gather_activation(y, self.mesh, self.sequence_parallel)
        return y[..., :s, :] if y.shape[-2] != s else y

    def __repr__(self) -> str:
        return f"RegionBoundary({self.mesh}, sequence_parallel={self.sequence_parallel})"


def model_mesh(model: nn.Module) -> TPMesh | None:
    """The mesh `model` was parallelized on, read off its ATP layers (the one place it is kept), or None when the
    model is plain."""
    meshes = {id(m.mesh): m.mesh for m in model.modules() if callable(getattr(m, "shard_specs", None))}
    if len(meshes) > 1:
        raise ValueError(f"the model's layers sit on {len(meshes)} different meshes; parallelize it once")
    return next(iter(meshes.values()), None)


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
