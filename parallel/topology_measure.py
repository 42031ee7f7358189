"""This machine's communication matrix, measured (DESIGN 3.3): collective microbenchmarks on the real groups of
every candidate mesh, all groups of an axis at once, fitted by least squares to (alpha, bandwidth) per mesh and
axis, and cached in a JSON file per machine and world size. `topology.load_or_measure` (re-exported there) is the
entry point; `torchrun --nproc-per-node N -m tabfm.parallel.topology_measure` measures under torchrun.

The planner also needs this machine's compute rates and memory (for ops too large to replay) and, on CPU, the
slowdown of N ranks sharing the cores: measured here too, into the same file.
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
from dataclasses import asdict
from pathlib import Path

import torch

from tabfm.parallel.mesh import factorizations
from tabfm.parallel.process_group import init_process_group, process_group
from tabfm.parallel.topology import AXES, GB, AxisCost, ComputeRates, MeasuredTopology


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
    out: dict[str, dict[str, dict]] = {}
    for d0, d1 in factorizations(world_size):
        mesh = mesh_for(d0, d1)
        out[f"{d0}x{d1}"] = {}
        for name in AXES:
            axis = mesh.axis(name)
            if axis.size > 1:
                out[f"{d0}x{d1}"][name] = _measure_axis(axis, sizes, repeats, device)
    return out


def _measure_axis(axis, sizes: tuple[int, ...], repeats: int, device: str) -> dict:
    """(traffic, seconds) points of the three collectives at every size on one axis, and their fits: all kinds
    together and each kind alone."""
    from tabfm.parallel import comm

    points, per_kind = [], defaultdict(list)
    for nbytes in sizes:
        numel = max(axis.size, nbytes // 4 // axis.size * axis.size)
        x = torch.randn(numel, device=device)
        for kind, fn in ((comm.ALL_REDUCE, lambda t: comm.all_reduce(t, axis)),
                         (comm.ALL_GATHER, lambda t: comm.all_gather(t[: numel // axis.size], 0, axis)),
                         (comm.REDUCE_SCATTER, lambda t: comm.reduce_scatter(t, 0, axis))):
            seconds = _slowest_rank_median(lambda: fn(x), repeats, device)
            factor = 2 * (axis.size - 1) / axis.size if kind == comm.ALL_REDUCE else (axis.size - 1) / axis.size
            points.append((factor * numel * 4, seconds))
            per_kind[kind].append(points[-1])
    axis.tally.reset()
    fit = fit_alpha_beta(points)
    kinds = {k: asdict(fit_alpha_beta(p)) for k, p in per_kind.items()}
    return {"alpha": fit.alpha, "bandwidth": fit.bandwidth, "kinds": kinds, "points": points}


def _slowest_rank_median(fn, repeats: int, device: str) -> float:
    """The median seconds of `repeats` calls of a collective after a warm-up, the largest over ranks."""
    import torch.distributed as dist

    fn()
    dist.barrier()
    times = [_seconds(fn, device) for _ in range(repeats)]
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _seconds(fn, device: str) -> float:
    """Wall seconds of one call of fn, the GPU's queued work included."""
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


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
        return work / min(_seconds(fn, device) for _ in range(5))

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
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    with process_group(device, rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}"):
        run_measurement(Path(path), world_size, backend, device)


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


MAX_RANKS_PER_CORE = 4
"""Measured CPU ranks per core at most: past that the gloo ranks time each other's waits for a core, and a --nproc
typo (64, 100,000) would start that many torch processes."""


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
    cores = os.cpu_count() or 1
    if not use_cuda and not dist.is_initialized() and nproc > MAX_RANKS_PER_CORE * cores:
        raise ValueError(f"measuring {nproc} ranks here would start {nproc} processes on {cores} CPU cores (at most "
                         f"{MAX_RANKS_PER_CORE * cores} are measured): measure on the machine the run goes to, or "
                         "give a topology preset or file with --topology")
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


def main() -> int:
    """Under torchrun (any number of ranks, one included): measure this machine's links for the world size and
    write the cache file."""
    import torch.distributed as dist

    backend = init_process_group("auto")
    try:
        world, device = dist.get_world_size(), "cuda" if backend == "nccl" else "cpu"
        target = cache_path(world, backend)
        run_measurement(target, world, backend, device)
        if dist.get_rank() == 0:
            print(f"wrote {target}")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":  # torchrun --nproc-per-node N -m tabfm.parallel.topology_measure
    raise SystemExit(main())
