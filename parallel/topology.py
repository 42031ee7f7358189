"""The hierarchical communication matrix (DESIGN 3.3): what one collective on one mesh axis costs.

A machine is a hierarchy of levels (an NVLink pair, a PCIe switch, a node, the network), each a unit of `span`
consecutive ranks. Ranks p and q talk over the lowest level whose unit holds both: M[p][q] = (alpha, bandwidth)
of that level. A mesh axis runs one ring collective per group, all groups at once (rank t = i * d1 + j):

    axis 1 groups   {i*d1 + j : j}    consecutive ranks (the fast link)
    axis 0 groups   {i*d1 + j : i}    strided ranks (the slow link)

so an axis's effective cost is its bottleneck ring edge, where an edge that leaves a unit with a shared uplink
gets the uplink divided by the number of ring edges (of all groups of that axis) leaving or entering that unit.

Costs are in ring traffic: `AxisCost.seconds(traffic)` = alpha + traffic / bandwidth, traffic being the bytes
each device sends (CommTally.traffic: 2(n-1)/n of the tensor for an all-reduce, (n-1)/n for the others).

Two sources:
    preset     a YAML file under configs/topology/ (a machine one may not have): TopologyPreset (here) is its
               schema, read by tabfm.config.load_topology(name)
    measured   collective microbenchmarks on the real groups of every candidate mesh, all groups of an axis at
               once, fitted by least squares to (alpha, bandwidth) per mesh and axis, cached in a JSON file per
               machine and world size (`measure`, `load_or_measure`: topology_measure.py, importable from here)
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

GB = 1e9
AXES = ("tp0", "tp1")


# ---------------------------------------------------------------------------------------------------------
# Link costs
# ---------------------------------------------------------------------------------------------------------

class LinkCost(Protocol):
    alpha: float
    bandwidth: float

    def seconds(self, traffic_bytes: float) -> float: ...


@dataclass(frozen=True)
class AxisCost:
    """alpha + traffic / bandwidth for one collective on one mesh axis (all its groups at once)."""

    alpha: float
    """Seconds per collective."""
    bandwidth: float
    """Ring traffic bytes per second per device."""
    bottleneck: str = ""
    """Where the bandwidth comes from (for the plan's explanation)."""

    def seconds(self, traffic_bytes: float) -> float:
        return self.alpha + float(traffic_bytes) / self.bandwidth


FREE = AxisCost(0.0, math.inf, "no communication (axis of size 1)")


@dataclass(frozen=True)
class SlowerOf:
    """The slower of two costs per collective: an emulated link that waits on top of the real one (DESIGN 3.5),
    so each collective takes max(emulated, real). The emulated wait sleeps, so it can hide behind compute; the
    real collective hides only where the real links run beside compute (`real_overlaps`)."""

    emulated: LinkCost
    real: LinkCost
    real_overlaps: bool = False

    def blocking_seconds(self, traffic_bytes: float) -> float:
        """The part of the collective that holds up this rank's compute even when launched async."""
        return 0.0 if self.real_overlaps else self.real.seconds(traffic_bytes)

    @property
    def alpha(self) -> float:
        return max(self.emulated.alpha, self.real.alpha)

    @property
    def bandwidth(self) -> float:
        return min(self.emulated.bandwidth, self.real.bandwidth)

    @property
    def bottleneck(self) -> str:
        return f"emulated {getattr(self.emulated, 'bottleneck', '')} over real links".strip()

    def seconds(self, traffic_bytes: float) -> float:
        return max(self.emulated.seconds(traffic_bytes), self.real.seconds(traffic_bytes))


# ---------------------------------------------------------------------------------------------------------
# What a machine computes and holds
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ComputeRates:
    """How fast one device computes, for the planner's compute model.

    A preset gives vendor peaks times an assumed efficiency (roofline: max(flops / matmul rate, bytes / memory
    rate) per op, plus a launch overhead). A measured machine sets `replay`: the planner times each op of the
    traced step on this machine instead (cached), using the rates only for ops too large to replay.
    """

    matmul_flops: float
    """Effective FLOP/s of a large matrix multiply."""
    memory_bandwidth: float
    """Effective bytes/s of elementwise ops."""
    op_overhead: float = 5e-6
    """Seconds of framework / launch overhead per op."""
    view_overhead: float = 0.0
    """Seconds per view op (no data moved)."""
    slowdown: float = 1.0
    """Compute time multiplier when every rank of the plan runs at once (ranks sharing cores)."""
    replay: bool = False
    """Time each op by running it here (only meaningful for the local machine)."""
    device: str = "cpu"
    """Device the replay runs on."""


@dataclass(frozen=True)
class Level:
    """One level of the hierarchy: units of `span` consecutive ranks."""

    name: str
    span: int
    """Ranks in one unit of this level; each level's span divides the next's."""
    alpha: float
    """Seconds per collective whose slowest link is at this level."""
    bandwidth: float
    """Effective bytes/s one device sends to a device it shares only this level with."""
    uplink: float | None = None
    """Effective bytes/s out of (and into) one unit of this level towards the next, shared by every ring edge
    that crosses it; None when the unit's uplink is never the bottleneck (one link per device)."""


@dataclass
class Topology:
    """A machine for the planner: how each mesh axis communicates, how fast a device computes, its memory."""

    name: str
    devices: int
    compute: ComputeRates
    memory_bytes: float
    """Memory per device available to the model, bytes."""
    overlap: bool = True
    """Whether a collective can progress while the device computes (GPUs: yes; gloo on busy CPU cores: no). A
    link cost may still name a part that blocks compute (`blocking_seconds`, e.g. the real link under an
    emulated one)."""
    dtype: str = "float32"
    """The training dtype the plan counts bytes in, unless the planner is told otherwise."""
    description: str = ""

    def axis_cost(self, d0: int, d1: int, axis: str, kind: str | None = None) -> LinkCost:
        """What one collective (of `kind`, when the topology tells kinds apart) costs on `axis` of a (d0, d1) mesh."""
        raise NotImplementedError

    def check_nproc(self, nproc: int) -> None:
        if nproc != self.devices:
            raise ValueError(f"topology {self.name!r} describes {self.devices} devices, but --nproc is {nproc}; "
                             f"use --nproc {self.devices}, or a topology for {nproc} devices")


def axis_groups(d0: int, d1: int, axis: str) -> list[list[int]]:
    """The rank groups of one mesh axis, each in ring order."""
    if axis == "tp1":
        return [[i * d1 + j for j in range(d1)] for i in range(d0)]
    if axis == "tp0":
        return [[i * d1 + j for i in range(d0)] for j in range(d1)]
    raise ValueError(f"unknown mesh axis {axis!r}; use one of {AXES}")


@dataclass
class HierarchicalTopology(Topology):
    """A preset machine: the communication matrix comes from its levels."""

    levels: list[Level] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)
    """Where the numbers come from, per field."""

    def __post_init__(self) -> None:
        if not self.levels:
            raise ValueError(f"topology {self.name!r} has no levels")
        spans = [lv.span for lv in self.levels]
        for a, b in zip(spans, spans[1:]):
            if b <= a or b % a:
                raise ValueError(f"topology {self.name!r}: level spans {spans} must grow, each dividing the next")
        if spans[-1] != self.devices:
            raise ValueError(f"topology {self.name!r}: the top level spans {spans[-1]} ranks but devices is "
                             f"{self.devices}")
        for lv in self.levels:
            if lv.alpha < 0 or lv.bandwidth <= 0 or (lv.uplink is not None and lv.uplink <= 0):
                raise ValueError(f"topology {self.name!r}: level {lv.name} needs alpha >= 0 and positive bandwidths")

    def level_of(self, p: int, q: int) -> int | None:
        """Index of the lowest level whose unit holds both ranks (None for p == q)."""
        if p == q:
            return None
        for k, lv in enumerate(self.levels):
            if p // lv.span == q // lv.span:
                return k
        raise ValueError(f"ranks {p}, {q} outside topology {self.name!r} of {self.devices} devices")

    def matrix(self) -> list[list[AxisCost | None]]:
        """M[p][q]: (alpha, bandwidth) of the lowest level p and q share (None on the diagonal)."""
        out = []
        for p in range(self.devices):
            row = []
            for q in range(self.devices):
                k = self.level_of(p, q)
                row.append(None if k is None else AxisCost(self.levels[k].alpha, self.levels[k].bandwidth,
                                                           self.levels[k].name))
            out.append(row)
        return out

    def axis_cost(self, d0: int, d1: int, axis: str, kind: str | None = None) -> AxisCost:
        """The axis's bottleneck ring edge, with shared uplinks divided among all the axis's groups."""
        if d0 * d1 != self.devices:
            raise ValueError(f"mesh {d0}x{d1} has {d0 * d1} ranks but topology {self.name!r} has {self.devices}")
        groups = axis_groups(d0, d1, axis)
        if len(groups[0]) == 1:
            return FREE
        edges = [(g[k], g[(k + 1) % len(g)]) for g in groups for k in range(len(g))]
        load: dict[tuple[int, int, str], int] = defaultdict(int)  # (level, unit, out|in) -> edges
        for p, q in edges:
            for k in range(self.level_of(p, q)):
                load[(k, p // self.levels[k].span, "out")] += 1
                load[(k, q // self.levels[k].span, "in")] += 1
        best = None
        for p, q in edges:
            top = self.level_of(p, q)
            bw, where = self.levels[top].bandwidth, self.levels[top].name
            for k in range(top):
                lv = self.levels[k]
                if lv.uplink is None:
                    continue
                share = lv.uplink / max(load[(k, p // lv.span, "out")], load[(k, q // lv.span, "in")])
                if share < bw:
                    bw, where = share, f"{lv.name} uplink shared by {round(lv.uplink / share)} ring edges"
            cost = AxisCost(self.levels[top].alpha, bw, where)
            if best is None or (cost.bandwidth, -cost.alpha) < (best.bandwidth, -best.alpha):
                best = cost
        # The collective waits for its slowest edge; latency is that of the highest level crossed.
        alpha = max(self.levels[self.level_of(p, q)].alpha for p, q in edges)
        return AxisCost(alpha, best.bandwidth, best.bottleneck)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "devices": self.devices, "levels": [asdict(lv) for lv in self.levels]}


@dataclass
class MeasuredTopology(Topology):
    """This machine, measured: a fitted (alpha, bandwidth) per mesh and axis, read from the JSON cache."""

    axes: dict[str, dict[str, AxisCost]] = field(default_factory=dict)
    """"d0xd1" -> axis -> cost fitted to all three kinds of collective."""
    kinds: dict[str, dict[str, dict[str, AxisCost]]] = field(default_factory=dict)
    """"d0xd1" -> axis -> kind -> cost fitted to that kind alone (a library may implement them differently)."""
    path: str = ""

    def axis_cost(self, d0: int, d1: int, axis: str, kind: str | None = None) -> AxisCost:
        key = f"{d0}x{d1}"
        if key not in self.axes:
            raise ValueError(f"mesh {key} was not measured in {self.path or self.name}; measured meshes: "
                             f"{', '.join(sorted(self.axes))}")
        if len(axis_groups(d0, d1, axis)[0]) == 1:
            return FREE
        per_kind = self.kinds.get(key, {}).get(axis, {})
        return per_kind[kind] if kind in per_kind else self.axes[key][axis]


@dataclass
class EmulatedTopology(Topology):
    """Emulated links (DESIGN 3.5) on top of this machine's real ones: each collective takes the slower of the
    emulated hierarchy's cost and the measured real cost, as `emulate.Link` waits out the difference."""

    emulated: HierarchicalTopology | None = None
    real: MeasuredTopology | None = None

    def axis_cost(self, d0: int, d1: int, axis: str, kind: str | None = None) -> LinkCost:
        link = self.emulated.axis_cost(d0, d1, axis)
        if link is FREE:
            return FREE
        return SlowerOf(link, self.real.axis_cost(d0, d1, axis, kind), real_overlaps=self.real.overlap)

    def links(self, d0: int, d1: int):
        """The emulate.Link per axis that makes a (d0, d1) mesh on this machine behave like the hierarchy."""
        from tabfm.parallel.emulate import Link

        out = {}
        for axis in AXES:
            cost = self.emulated.axis_cost(d0, d1, axis)
            out[axis] = None if cost is FREE else Link(cost.alpha, cost.bandwidth)
        return out


def emulated(name: str, levels: list[Level], real: MeasuredTopology, description: str = "") -> EmulatedTopology:
    """An emulated hierarchy of `real.devices` ranks, computing and holding like the real machine."""
    hier = HierarchicalTopology(name=name, devices=real.devices, compute=real.compute, memory_bytes=real.memory_bytes,
                                levels=levels)
    return EmulatedTopology(name=name, devices=real.devices, compute=real.compute, memory_bytes=real.memory_bytes,
                            overlap=True, dtype=real.dtype, description=description or name, emulated=hier, real=real)


# ---------------------------------------------------------------------------------------------------------
# Presets: the schema of a preset YAML file (configs/topology/; tabfm.config.load_topology reads one)
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PresetCompute:
    """A device's compute as a preset gives it: vendor peaks and the share of them assumed reached."""

    peak_tflops: float
    """Vendor peak of dense matrix multiplies in the preset's dtype, TFLOP/s."""
    memory_bandwidth_gbs: float
    """Vendor peak memory bandwidth, GB/s."""
    matmul_efficiency: float = 1.0
    """Share of peak_tflops a large matrix multiply reaches."""
    memory_efficiency: float = 1.0
    """Share of memory_bandwidth_gbs elementwise ops reach."""
    op_overhead_us: float = 5.0
    """Microseconds of framework / launch overhead per op."""

    def __post_init__(self) -> None:
        _positive("compute", peak_tflops=self.peak_tflops, memory_bandwidth_gbs=self.memory_bandwidth_gbs)
        _shares("compute", matmul_efficiency=self.matmul_efficiency, memory_efficiency=self.memory_efficiency)
        if not 0 <= self.op_overhead_us < math.inf:
            raise ValueError(f"compute.op_overhead_us={self.op_overhead_us} must be a finite number >= 0")

    def rates(self) -> ComputeRates:
        return ComputeRates(matmul_flops=self.peak_tflops * 1e12 * self.matmul_efficiency,
                            memory_bandwidth=self.memory_bandwidth_gbs * GB * self.memory_efficiency,
                            op_overhead=self.op_overhead_us * 1e-6)


@dataclass(frozen=True)
class PresetLevel:
    """One level of a preset's hierarchy, in the units of datasheets."""

    name: str
    span: int
    """Ranks in one unit of this level; each level's span divides the next's."""
    alpha_us: float
    """Microseconds per collective whose slowest link is at this level."""
    bandwidth_gbs: float
    """GB/s one device sends to a device it shares only this level with (vendor figure)."""
    efficiency: float = 1.0
    """Share of bandwidth_gbs (and, unless uplink_efficiency says otherwise, of uplink_gbs) reached."""
    uplink_gbs: float | None = None
    """GB/s out of one unit of this level towards the next, shared by the ring edges that cross it."""
    uplink_efficiency: float | None = None
    """Share of uplink_gbs reached (default: efficiency)."""
    source: str | None = None
    """Where the numbers come from."""

    def __post_init__(self) -> None:
        where = f"level {self.name!r}"
        _positive(where, span=self.span, bandwidth_gbs=self.bandwidth_gbs,
                  **({} if self.uplink_gbs is None else {"uplink_gbs": self.uplink_gbs}))
        if not 0 <= self.alpha_us < math.inf:
            raise ValueError(f"{where}: alpha_us={self.alpha_us} must be a finite number >= 0")
        _shares(where, efficiency=self.efficiency,
                **({} if self.uplink_efficiency is None else {"uplink_efficiency": self.uplink_efficiency}))

    def level(self) -> Level:
        eff = self.efficiency
        up_eff = eff if self.uplink_efficiency is None else self.uplink_efficiency
        up = None if self.uplink_gbs is None else self.uplink_gbs * GB * up_eff
        return Level(self.name, self.span, self.alpha_us * 1e-6, self.bandwidth_gbs * GB * eff, up)


@dataclass(frozen=True)
class TopologyPreset:
    """A preset machine as its YAML file describes it (configs/topology/*.yaml)."""

    devices: int
    """Ranks of the machine."""
    memory_gb: float
    """Memory per device available to the model, GB."""
    compute: PresetCompute
    """How fast one device computes."""
    levels: tuple[PresetLevel, ...]
    """The hierarchy, lowest level first."""
    name: str | None = None
    """The topology's name (default: the file's stem)."""
    description: str = ""
    dtype: str = "bfloat16"
    """The training dtype the plan counts bytes in, unless the planner is told otherwise."""
    overlap: bool = True
    """Whether a collective can progress while the device computes."""
    sources: dict[str, str] = field(default_factory=dict)
    """Where the numbers come from, per field."""

    def __post_init__(self) -> None:
        _positive("the topology", devices=self.devices, memory_gb=self.memory_gb)

    def topology(self, default_name: str) -> HierarchicalTopology:
        """The preset as the planner's topology (named `default_name` unless it names itself)."""
        return HierarchicalTopology(
            name=self.name or default_name, devices=self.devices, compute=self.compute.rates(),
            memory_bytes=self.memory_gb * GB, overlap=self.overlap, dtype=self.dtype, description=self.description,
            levels=[lv.level() for lv in self.levels], sources=dict(self.sources),
        )


def _positive(where: str, **values: float) -> None:
    """ValueError naming the first value that is not a finite number > 0 (a datasheet figure)."""
    for name, v in values.items():
        if not 0 < v < math.inf:
            raise ValueError(f"{where}: {name}={v} must be a finite number > 0")


def _shares(where: str, **values: float) -> None:
    """ValueError naming the first share of a peak that is not in (0, 1] (no device beats its datasheet)."""
    for name, v in values.items():
        if not 0 < v <= 1:
            raise ValueError(f"{where}: {name}={v} is a share of the vendor's peak; set it within (0, 1]")


def describe(topology: Topology, d0: int, d1: int) -> str:
    """One line per axis: what the planner assumes a collective costs there."""
    parts = []
    for axis in AXES:
        cost = topology.axis_cost(d0, d1, axis)
        if cost is FREE:
            continue
        parts.append(f"{axis}: alpha={cost.alpha * 1e6:.1f}us bw={cost.bandwidth / GB:.3g}GB/s "
                     f"({getattr(cost, 'bottleneck', '')})")
    return "; ".join(parts) or "no communication"


# ---------------------------------------------------------------------------------------------------------
# Measured: collective microbenchmarks on the real groups (topology_measure.py), importable from here
# ---------------------------------------------------------------------------------------------------------

_MEASURE_NAMES = ("machine_id", "cache_dir", "cache_path", "fit_alpha_beta", "default_sizes", "measure_axes",
                  "measure_slowdown", "write_measured", "read_measured", "run_measurement", "load_or_measure")


def __getattr__(name: str):
    """The measuring functions live in topology_measure.py, which builds on this module; they are importable from
    here too (`from tabfm.parallel.topology import load_or_measure`), loaded on first use to avoid an import
    cycle."""
    if name in _MEASURE_NAMES:
        from tabfm.parallel import topology_measure

        return getattr(topology_measure, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":  # torchrun --nproc-per-node N -m tabfm.parallel.topology (as before the split)
    from tabfm.parallel.topology_measure import main

    raise SystemExit(main())
