"""The 2D tensor-parallel mesh (d0 x d1) inside an optional data-parallel dimension.

Rank order is row-major over (dp, d0, d1): axis 1 groups are consecutive ranks (the fast link: one NVLink
pair, one node), axis 0 groups are strided (the slow link). Tensor-parallel rank t = i * d1 + j sits at
mesh coordinate (i, j). A (1, 1) mesh needs no process group at all, so the single-device model and the
estimator run without `torch.distributed`.

One object owns the degrees and the groups; layers receive it (or one of its axes) as an argument and never
look groups up from globals.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tabfm.parallel.comm import MeshAxis

AXIS_NAMES = ("dp", "tp0", "tp1")


class LayoutError(ValueError):
    """A tensor-parallel layout that cannot be built (degrees, world size, or model shapes)."""


def divisors(n: int) -> list[int]:
    """The divisors of n >= 1, ascending, from the candidates up to sqrt(n) (a loop up to n took minutes on a
    --nproc of 10^9 before refusing it)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def factorizations(n: int) -> list[tuple[int, int]]:
    """Every ordered (d0, d1) with d0 * d1 == n."""
    return [(d0, n // d0) for d0 in divisors(n)]


@dataclass(frozen=True)
class ParallelDims:
    """The parallel degrees of a run: data-parallel replicas times a (d0, d1) tensor-parallel mesh."""

    d0: int = 1
    """Tensor-parallel degree of axis 0 (strided ranks, the slow link)."""
    d1: int = 1
    """Tensor-parallel degree of axis 1 (consecutive ranks, the fast link)."""
    dp: int = 1
    """Data-parallel replicas of the whole tensor-parallel mesh."""

    def __post_init__(self) -> None:
        for name in ("d0", "d1", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"parallel degree {name} must be a positive integer, got {value!r}")

    @property
    def tp(self) -> int:
        return self.d0 * self.d1

    @property
    def world_size(self) -> int:
        return self.dp * self.d0 * self.d1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    def check_world_size(self, world_size: int) -> None:
        """Refuse a layout whose degrees don't multiply to the number of processes."""
        if self.world_size != world_size:
            options = ", ".join(f"{a}x{b}" for a, b in factorizations(world_size // self.dp or 1))
            raise LayoutError(
                f"layout dp={self.dp} x {self.d0}x{self.d1} needs {self.world_size} processes but "
                f"{world_size} were started; with dp={self.dp}, tensor-parallel layouts for this world size "
                f"are: {options or 'none (dp does not divide the world size)'}"
            )

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(dp index, i, j) of a global rank, row-major."""
        dp_index, tp_rank = divmod(rank, self.tp)
        i, j = divmod(tp_rank, self.d1)
        return dp_index, i, j

    def build(self, device_type: str = "cpu") -> TPMesh:
        """Create the process groups (collective over all ranks) and return this rank's mesh."""
        if self.world_size == 1:
            return TPMesh.single()
        if not dist.is_initialized():
            how = ("call torch.distributed.init_process_group() first" if "LOCAL_RANK" in os.environ  # under torchrun
                   else f"launch with `torchrun --nproc-per-node {self.world_size}`")
            raise LayoutError(f"layout dp={self.dp} x {self.d0}x{self.d1} needs torch.distributed initialized; {how}")
        self.check_world_size(dist.get_world_size())
        from torch.distributed.device_mesh import init_device_mesh

        device_mesh = init_device_mesh(device_type, (self.dp, self.d0, self.d1), mesh_dim_names=AXIS_NAMES)
        dp_index, i, j = self.coordinates(dist.get_rank())
        return TPMesh(
            dims=self,
            axis0=MeshAxis("tp0", self.d0, i, device_mesh.get_group("tp0")),
            axis1=MeshAxis("tp1", self.d1, j, device_mesh.get_group("tp1")),
            dp_axis=MeshAxis("dp", self.dp, dp_index, device_mesh.get_group("dp")),
            device_mesh=device_mesh,
        )


@dataclass
class TPMesh:
    """This rank's view of the mesh: its two tensor-parallel axes and the data-parallel axis."""

    dims: ParallelDims
    axis0: MeshAxis
    axis1: MeshAxis
    dp_axis: MeshAxis
    device_mesh: object | None = field(default=None, repr=False)

    @classmethod
    def single(cls) -> TPMesh:
        """The (1, 1) mesh of one process: every collective is a no-op and no process group exists."""
        return cls(ParallelDims(), MeshAxis("tp0", 1, 0), MeshAxis("tp1", 1, 0), MeshAxis("dp", 1, 0))

    @classmethod
    def dry_run(cls, d0: int, d1: int, i: int = 0, j: int = 0) -> TPMesh:
        """A mesh that counts collectives at coordinate (i, j) without any process group (see MeshAxis)."""
        return cls(ParallelDims(d0, d1), MeshAxis("tp0", d0, i, dry_run=True), MeshAxis("tp1", d1, j, dry_run=True),
                   MeshAxis("dp", 1, 0))

    @property
    def d0(self) -> int:
        return self.dims.d0

    @property
    def d1(self) -> int:
        return self.dims.d1

    @property
    def tp(self) -> int:
        return self.dims.tp

    @property
    def i(self) -> int:
        """This rank's index along axis 0."""
        return self.axis0.index

    @property
    def j(self) -> int:
        """This rank's index along axis 1."""
        return self.axis1.index

    @property
    def tp_rank(self) -> int:
        """Rank inside the tensor-parallel mesh, t = i * d1 + j."""
        return self.i * self.d1 + self.j

    def axis(self, name: str) -> MeshAxis:
        return {"tp0": self.axis0, "tp1": self.axis1, "dp": self.dp_axis}[name]

    def reset_tallies(self) -> None:
        for axis in (self.axis0, self.axis1, self.dp_axis):
            axis.tally.reset()

    def __str__(self) -> str:
        return f"{self.d0}x{self.d1}" + (f" (dp={self.dims.dp})" if self.dims.dp > 1 else "")


def device_type_for(device: torch.device | str) -> str:
    """The device-mesh type for a torch device (gloo on CPU, NCCL on CUDA)."""
    return torch.device(device).type
