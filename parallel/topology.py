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
    preset     a YAML file under configs/topology/ (a machine one may not have), `load_preset(name)`
    measured   collective microbenchmarks on the real groups of every candidate mesh, all groups of an axis at
               once, fitted by least squares to (alpha, bandwidth) per mesh and axis, cached in a JSON file per
               machine and world size (`measure`, `load_or_measure`)
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import socket
import statistics
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from tabfm.parallel.mesh import factorizations

GB = 1e9
AXES = ("tp0", "tp1")
_REPO_CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "topology"
"""configs/topology of a source checkout; in an installed wheel (tabfm/parallel/topology.py) tabfm/configs/topology."""


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
                             f"use --nproc {self.devices}, or a topology for {nproc} devices"
                             + _presets_for(nproc))


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
# Presets
# ---------------------------------------------------------------------------------------------------------

def preset_dir() -> Path:
    return Path(os.environ.get("TABFM_TOPOLOGY_DIR", _REPO_CONFIGS))


def preset_names() -> list[str]:
    d = preset_dir()
    return sorted(p.stem for p in d.glob("*.yaml")) if d.is_dir() else []


def _presets_for(nproc: int) -> str:
    names = []
    for name in preset_names():
        try:
            if load_preset(name).devices == nproc:
                names.append(name)
        except ValueError:
            continue
    return f" (presets for {nproc} devices: {', '.join(names)})" if names else ""


_PRESET_KEYS = {"name", "description", "devices", "memory_gb", "dtype", "overlap", "compute", "levels", "sources"}
_COMPUTE_KEYS = {"peak_tflops", "matmul_efficiency", "memory_bandwidth_gbs", "memory_efficiency", "op_overhead_us"}
_LEVEL_KEYS = {"name", "span", "alpha_us", "bandwidth_gbs", "efficiency", "uplink_gbs", "uplink_efficiency", "source"}


def _check_keys(where: str, got: dict, allowed: set[str], required: set[str]) -> None:
    unknown = set(got) - allowed
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; valid keys are {sorted(allowed)}")
    missing = required - set(got)
    if missing:
        raise ValueError(f"{where}: missing keys {sorted(missing)}")


def load_preset(name: str) -> HierarchicalTopology:
    """A preset by name (a YAML file in configs/topology/) or by path to a YAML file."""
    import yaml

    path = Path(name)
    if not (path.suffix in (".yaml", ".yml") and path.is_file()):
        path = preset_dir() / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown topology preset {name!r}; choose one of {', '.join(preset_names()) or '(none)'}"
                         f", 'measure', or a path to a preset YAML file")
    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    where = f"topology preset {path}"
    _check_keys(where, raw, _PRESET_KEYS, {"devices", "memory_gb", "compute", "levels"})
    c = raw["compute"]
    _check_keys(f"{where} compute", c, _COMPUTE_KEYS, {"peak_tflops", "memory_bandwidth_gbs"})
    compute = ComputeRates(
        matmul_flops=c["peak_tflops"] * 1e12 * c.get("matmul_efficiency", 1.0),
        memory_bandwidth=c["memory_bandwidth_gbs"] * GB * c.get("memory_efficiency", 1.0),
        op_overhead=c.get("op_overhead_us", 5.0) * 1e-6,
    )
    levels = []
    for k, lv in enumerate(raw["levels"]):
        _check_keys(f"{where} level {k}", lv, _LEVEL_KEYS, {"name", "span", "alpha_us", "bandwidth_gbs"})
        eff = lv.get("efficiency", 1.0)
        up = None if lv.get("uplink_gbs") is None else lv["uplink_gbs"] * GB * lv.get("uplink_efficiency", eff)
        levels.append(Level(lv["name"], int(lv["span"]), lv["alpha_us"] * 1e-6, lv["bandwidth_gbs"] * GB * eff, up))
    return HierarchicalTopology(
        name=raw.get("name", path.stem), devices=int(raw["devices"]), compute=compute,
        memory_bytes=raw["memory_gb"] * GB, overlap=bool(raw.get("overlap", True)), dtype=raw.get("dtype", "bfloat16"),
        description=raw.get("description", ""), levels=levels, sources=raw.get("sources", {}),
    )


# ---------------------------------------------------------------------------------------------------------
# Measured: collective microbenchmarks on the real groups, cached per machine and world size
# ---------------------------------------------------------------------------------------------------------

def machine_id(backend: str | None = None) -> str:
    """A stable name for this machine's kind: host, processor or GPU, core count, backend."""
    if torch.cuda.is_available():
        what = torch.cuda.get_device_name(0) + f"x{torch.cuda.device_count()}"
    else:
        what = _cpu_model() + f"-{os.cpu_count()}cores"
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    raw = f"{socket.gethostname()}-{what}-{backend}"
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", raw)[:120]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_dir() -> Path:
    return Path(os.environ.get("TABFM_CACHE_DIR", Path.home() / ".cache" / "tabfm"))


def cache_path(world_size: int, backend: str | None = None) -> Path:
    return cache_dir() / f"topology-{machine_id(backend)}-n{world_size}.json"


def fit_alpha_beta(points: list[tuple[float, float]]) -> AxisCost:
    """Least-squares fit of seconds = alpha + traffic / bandwidth to (traffic bytes, seconds) points."""
    if len(points) < 2:
        raise ValueError("fitting (alpha, bandwidth) needs at least two points")
    n = len(points)
    sx = sum(x for x, _ in points)
    sy = sum(y for _, y in points)
    sxx = sum(x * x for x, _ in points)
    sxy = sum(x * y for x, y in points)
    den = n * sxx - sx * sx
    slope = (n * sxy - sx * sy) / den if den else 0.0
    alpha = (sy - slope * sx) / n
    if alpha < 0:  # refit through the origin
        alpha, slope = 0.0, sxy / sxx
    if slope <= 0:  # no measurable bandwidth cost: all latency
        return AxisCost(statistics.mean(y for _, y in points), math.inf, "measured")
    return AxisCost(alpha, 1.0 / slope, "measured")


def default_sizes(device_type: str) -> tuple[int, ...]:
    """Full-tensor message sizes (bytes) for the microbenchmarks."""
    if device_type == "cuda":
        return (1 << 16, 1 << 20, 1 << 23, 1 << 26)
    return (1 << 14, 1 << 17, 1 << 20, 1 << 22)


def measure_axes(mesh_for, world_size: int, sizes: tuple[int, ...], repeats: int = 7,
                 device: str = "cpu") -> dict[str, dict[str, dict]]:
    """Run on every rank: time all-reduce / all-gather / reduce-scatter on each axis of each mesh (all groups of
    an axis at once) and fit (alpha, bandwidth). `mesh_for(d0, d1)` returns this rank's TPMesh. Every rank
    returns the same result (timings are the max over ranks)."""
    import torch.distributed as dist

    from tabfm.parallel import comm

    out: dict[str, dict[str, dict]] = {}
    for d0, d1 in factorizations(world_size):
        mesh = mesh_for(d0, d1)
        out[f"{d0}x{d1}"] = {}
        for name in AXES:
            axis = mesh.axis(name)
            if axis.size == 1:
                continue
            points, per_kind = [], defaultdict(list)
            for nbytes in sizes:
                numel = max(axis.size, nbytes // 4 // axis.size * axis.size)
                x = torch.randn(numel, device=device)
                for kind, fn in ((comm.ALL_REDUCE, lambda t: comm.all_reduce(t, axis)),
                                 (comm.ALL_GATHER, lambda t: comm.all_gather(t[: numel // axis.size], 0, axis)),
                                 (comm.REDUCE_SCATTER, lambda t: comm.reduce_scatter(t, 0, axis))):
                    times = []
                    fn(x)
                    dist.barrier()
                    for _ in range(repeats):
                        if device == "cuda":
                            torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        fn(x)
                        if device == "cuda":
                            torch.cuda.synchronize()
                        times.append(time.perf_counter() - t0)
                    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
                    factor = 2 * (axis.size - 1) / axis.size if kind == comm.ALL_REDUCE else (axis.size - 1) / axis.size
                    points.append((factor * numel * 4, float(t)))
                    per_kind[kind].append(points[-1])
            axis.tally.reset()
            fit = fit_alpha_beta(points)
            kinds = {k: asdict(fit_alpha_beta(p)) for k, p in per_kind.items()}
            out[f"{d0}x{d1}"][name] = {"alpha": fit.alpha, "bandwidth": fit.bandwidth, "kinds": kinds,
                                       "points": points}
    return out


def measure_slowdown(repeats: int = 5) -> float:
    """Run on every rank at once: how many wall seconds a CPU second of model compute takes while every rank
    computes together. The planner times ops in CPU seconds (thread time, one op alone); this converts them to
    step time on a machine whose cores the ranks share, cache interference and any other load included.

    Workload: forward + backward of one plain transformer block (the op mix of the layers). Each rank first
    times it alone (CPU time, the others waiting), then all run it at once (wall time). Every rank returns the
    same number (the mean over ranks of wall together / CPU alone)."""
    import torch.distributed as dist

    from tabfm.parallel import dense

    torch.manual_seed(0)
    block = dense.Block(256, 8)
    x = torch.randn(4, 128, 256, requires_grad=True)

    def work():
        y = block(x)
        y.backward(torch.ones_like(y))

    work()
    alone = math.inf
    for r in range(dist.get_world_size()):
        dist.barrier()
        if r == dist.get_rank():
            for _ in range(repeats):
                c0 = time.thread_time()
                work()
                alone = min(alone, time.thread_time() - c0)
    dist.barrier()
    w0 = time.perf_counter()
    for _ in range(repeats):
        work()
    together = (time.perf_counter() - w0) / repeats
    t = torch.tensor([together / alone], dtype=torch.float64)
    dist.all_reduce(t)
    return max(1.0, float(t) / dist.get_world_size())


def write_measured(path: Path, world_size: int, backend: str, axes: dict, slowdown: float, device: str) -> None:
    """Write the measured cache (atomically) with this machine's compute rates and memory."""
    rates = _local_rates(device)
    data = {
        "machine": machine_id(backend), "world_size": world_size, "backend": backend, "device": device,
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"), "slowdown": slowdown,
        "compute": {"matmul_flops": rates[0], "memory_bandwidth": rates[1]},
        "memory_bytes": _local_memory(device, world_size), "axes": axes,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def _local_rates(device: str) -> tuple[float, float]:
    """(matmul FLOP/s, elementwise bytes/s) of one process on this machine (fallbacks for ops not replayed)."""
    n = 1024 if device == "cuda" else 512
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    x, y = torch.randn(1 << 22, device=device), torch.randn(1 << 22, device=device)

    def rate(fn, work: float) -> float:
        fn()
        best = math.inf
        for _ in range(5):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return work / best

    return rate(lambda: a @ b, 2 * n ** 3), rate(lambda: x * y, 3 * 4 * x.numel())


def _local_memory(device: str, world_size: int) -> float:
    if device == "cuda":
        return float(torch.cuda.get_device_properties(0).total_memory)
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return pages * size / world_size
    except (ValueError, OSError):
        return 8 * GB


def read_measured(path: Path) -> MeasuredTopology:
    data = json.loads(Path(path).read_text())
    what = f"measured {data['backend']}"
    axes = {mesh: {a: AxisCost(v["alpha"], v["bandwidth"], what) for a, v in per.items()}
            for mesh, per in data["axes"].items()}
    kinds = {mesh: {a: {k: AxisCost(c["alpha"], c["bandwidth"], f"{what} {k}") for k, c in v.get("kinds", {}).items()}
                    for a, v in per.items()} for mesh, per in data["axes"].items()}
    device = data.get("device", "cpu")
    compute = ComputeRates(matmul_flops=data["compute"]["matmul_flops"],
                           memory_bandwidth=data["compute"]["memory_bandwidth"],
                           op_overhead=0.0, slowdown=data.get("slowdown", 1.0), replay=True, device=device)
    return MeasuredTopology(
        name=f"measured:{data['machine']}", devices=int(data["world_size"]), compute=compute,
        memory_bytes=float(data["memory_bytes"]), overlap=device == "cuda",
        dtype="bfloat16" if device == "cuda" else "float32",
        description=f"measured {data['backend']} collectives on {data['machine']} ({data['measured_at']})",
        axes=axes, kinds=kinds, path=str(path),
    )


def _measure_worker(rank: int, world_size: int, port: int, path: str, backend: str, device: str) -> None:
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        run_measurement(Path(path), world_size, backend, device)
    finally:
        dist.destroy_process_group()


def run_measurement(path: Path, world_size: int, backend: str, device: str,
                    mesh_for=None, sizes: tuple[int, ...] | None = None) -> None:
    """Run on every rank of an initialised process group: measure and (rank 0) write the cache file."""
    import torch.distributed as dist

    from tabfm.parallel.mesh import ParallelDims

    meshes = {}

    def default_mesh_for(d0: int, d1: int):
        if (d0, d1) not in meshes:
            meshes[(d0, d1)] = ParallelDims(d0=d0, d1=d1).build(device)
        return meshes[(d0, d1)]

    axes = measure_axes(mesh_for or default_mesh_for, world_size, sizes or default_sizes(device), device=device)
    slowdown = measure_slowdown() if device == "cpu" else 1.0
    if dist.get_rank() == 0:
        write_measured(path, world_size, backend, axes, slowdown, device)
    dist.barrier()


def load_or_measure(nproc: int, path: str | Path | None = None, refresh: bool = False) -> MeasuredTopology:
    """This machine's measured topology for `nproc` ranks: from the cache, or measured now (once).

    Inside a running process group of `nproc` ranks every rank measures together; otherwise `nproc` local
    processes are spawned (NCCL, one GPU each, when there are enough GPUs; gloo on CPU otherwise).
    """
    import torch.distributed as dist

    if nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {nproc}")
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= nproc
    backend, device = ("nccl", "cuda") if use_cuda else ("gloo", "cpu")
    path = Path(path) if path else cache_path(nproc, backend)
    if path.is_file() and not refresh:
        return read_measured(path)
    if nproc == 1:
        write_measured(path, 1, backend, {"1x1": {}}, 1.0, device)
        return read_measured(path)
    if dist.is_initialized():
        if dist.get_world_size() != nproc:
            raise ValueError(f"measuring {nproc} ranks inside a process group of {dist.get_world_size()}; "
                             f"launch with --nproc-per-node {nproc}")
        run_measurement(path, nproc, backend, device)
    else:
        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_measure_worker, args=(nproc, port, str(path), backend, device), nprocs=nproc,
                           start_method="spawn")
    return read_measured(path)


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


if __name__ == "__main__":  # torchrun --nproc-per-node N -m tabfm.parallel.topology
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    world = dist.get_world_size()
    target = cache_path(world, backend)
    run_measurement(target, world, backend, "cuda" if backend == "nccl" else "cpu")
    if dist.get_rank() == 0:
        print(f"wrote {target}")
    dist.destroy_process_group()
