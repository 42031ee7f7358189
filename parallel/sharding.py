"""How each parameter of an ATP layer is cut over the mesh, and the functions that shard a full state dict to
any layout and gather it back (bit-exact: pure slicing and concatenation).

A `ShardSpec` says, for each tensor dimension, which mesh axis splits it:
    None          replicated
    "tp0"         split over axis 0 (block i)
    "tp1"         split over axis 1 (block j)
    "tp"          split over both, block t = i * d1 + j
A fused QKV weight also carries `qkv_heads`: its rows are reordered from [q | k | v] (heads in order inside
each) to [q_g | k_g | v_g] per group g of heads/N heads, so that after the column-first reduce-scatter each rank
holds whole heads. The reordering depends on N, which is why it is part of the spec and not of the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange

Placement = str | None


@dataclass(frozen=True)
class ShardSpec:
    dims: tuple[Placement, ...]
    """One placement per tensor dimension: None, "tp0", "tp1" or "tp"."""
    qkv_heads: int | None = None
    """Heads of a fused [q | k | v] dimension 0, reordered per head group before splitting."""

    def __post_init__(self) -> None:
        for p in self.dims:
            if p not in (None, "tp0", "tp1", "tp"):
                raise ValueError(f"unknown placement {p!r}; use None, 'tp0', 'tp1' or 'tp'")

    def parts(self, placement: Placement, d0: int, d1: int) -> int:
        return {None: 1, "tp0": d0, "tp1": d1, "tp": d0 * d1}[placement]

    def block(self, placement: Placement, i: int, j: int, d1: int) -> int:
        return {None: 0, "tp0": i, "tp1": j, "tp": i * d1 + j}[placement]

    def local_shape(self, shape: tuple[int, ...], d0: int, d1: int) -> tuple[int, ...]:
        return tuple(n // self.parts(p, d0, d1) for n, p in zip(shape, self.dims, strict=True))

    def problems(self, shape: tuple[int, ...], d0: int, d1: int, name: str = "tensor") -> list[str]:
        """Why this tensor cannot be cut on a (d0, d1) mesh (empty when it can)."""
        if len(shape) != len(self.dims):
            return [f"{name} has {len(shape)} dims but its shard spec describes {len(self.dims)}"]
        out = []
        for dim, (n, p) in enumerate(zip(shape, self.dims, strict=True)):
            k = self.parts(p, d0, d1)
            if n % k:
                out.append(f"{name} dim {dim} (size {n}) is not divisible by {p}={k}")
        if self.qkv_heads is not None and self.qkv_heads % (d0 * d1):
            out.append(f"{name}: {self.qkv_heads} heads are not divisible by d0*d1={d0 * d1}")
        return out


def _to_head_groups(full: torch.Tensor, heads: int, groups: int) -> torch.Tensor:
    return rearrange(full, "(c g r) ... -> (g c r) ...", c=3, g=groups)


def _from_head_groups(full: torch.Tensor, heads: int, groups: int) -> torch.Tensor:
    return rearrange(full, "(g c r) ... -> (c g r) ...", c=3, g=groups)


def shard_tensor(full: torch.Tensor, spec: ShardSpec, d0: int, d1: int, i: int, j: int) -> torch.Tensor:
    """The local shard of `full` held by mesh coordinate (i, j)."""
    problems = spec.problems(tuple(full.shape), d0, d1)
    if problems:
        raise ValueError("; ".join(problems))
    out = full
    if spec.qkv_heads is not None:
        out = _to_head_groups(out, spec.qkv_heads, d0 * d1)
    for dim, p in enumerate(spec.dims):
        k = spec.parts(p, d0, d1)
        if k > 1:
            out = out.chunk(k, dim=dim)[spec.block(p, i, j, d1)]
    return out.clone().contiguous()


def unshard_tensor(shards: dict[tuple[int, int], torch.Tensor], spec: ShardSpec, d0: int, d1: int) -> torch.Tensor:
    """Reassemble the full tensor from every coordinate's shard (replicas must agree; the first is used)."""
    missing = [(i, j) for i in range(d0) for j in range(d1) if (i, j) not in shards]
    if missing:
        raise ValueError(f"missing shards for mesh coordinates {missing}")

    def assemble(dim: int, coord_of_block) -> torch.Tensor:
        if dim == len(spec.dims):
            return shards[coord_of_block({})]
        p = spec.dims[dim]
        k = spec.parts(p, d0, d1)
        pieces = []
        for b in range(k):
            pieces.append(assemble(dim + 1, lambda fixed, p=p, b=b: coord_of_block({**fixed, p: b})))
        return pieces[0] if k == 1 else torch.cat(pieces, dim=dim)

    def coord(fixed: dict[Placement, int]) -> tuple[int, int]:
        if "tp" in fixed:
            return divmod(fixed["tp"], d1)
        return fixed.get("tp0", 0), fixed.get("tp1", 0)

    full = assemble(0, coord)
    if spec.qkv_heads is not None:
        full = _from_head_groups(full, spec.qkv_heads, d0 * d1)
    return full.contiguous()


def shard_state_dict(
    full: dict[str, torch.Tensor], specs: dict[str, ShardSpec], d0: int, d1: int, i: int, j: int
) -> dict[str, torch.Tensor]:
    """Cut a full (one-device) state dict down to coordinate (i, j); names without a spec are replicated."""
    replicated = ShardSpec
    return {
        name: shard_tensor(t, specs.get(name) or replicated((None,) * t.dim()), d0, d1, i, j)
        for name, t in full.items()
    }


def gather_state_dict(
    shards: dict[tuple[int, int], dict[str, torch.Tensor]], specs: dict[str, ShardSpec], d0: int, d1: int
) -> dict[str, torch.Tensor]:
    """Reassemble the full state dict from every coordinate's local state dict."""
    names = list(shards[(0, 0)].keys())
    for coord, sd in shards.items():
        if list(sd.keys()) != names:
            raise ValueError(f"shard {coord} holds different tensors from shard (0, 0)")
    full = {}
    for name in names:
        spec = specs.get(name) or ShardSpec((None,) * shards[(0, 0)][name].dim())
        full[name] = unshard_tensor({c: sd[name] for c, sd in shards.items()}, spec, d0, d1)
    return full
