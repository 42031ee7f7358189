"""Pricing a traced step (the planner's second part; DESIGN 3.3): how long each op takes, how much memory a layout
needs per device, and the step time a layout's timeline adds up to on a topology.

    compute   op times: each op replayed and timed on this machine (CPU time, cached), or a preset's roofline
              max(flops / matmul rate, bytes / memory rate) + launch overhead; times the slowdown of ranks
              sharing cores
    exposed   each collective takes alpha + traffic / bandwidth of its axis (topology.py, one collective at a
              time per axis) from its launch; the time a Wait holds the clock is exposed communication, so
              chunked collectives hide behind the next chunk's compute and about the last chunk's stays exposed
    memory    weights, gradients, optimizer state and saved activations per device

A `Candidate` is one layout's row of the plan: its options, its prices, or the problems that reject it.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tabfm.parallel.mesh import TPMesh
from tabfm.parallel.parallelize import parallelize
from tabfm.parallel.plan_trace import PHASES, Collective, Extrapolated, Op, Trace, TransformerSpec, trace
from tabfm.parallel.topology import AXES, FREE, ComputeRates, Topology, cache_dir, machine_id


# ---------------------------------------------------------------------------------------------------------
# Compute time of an op
# ---------------------------------------------------------------------------------------------------------

class ComputeModel:
    """Seconds per op: a roofline from the topology's rates, or (a measured machine) the op replayed here.

    Replayed op times and the framework overhead per op are cached in a JSON file per machine, so a machine is
    measured once; ops too large to replay quickly fall back to the measured roofline rates.
    """

    MAX_REPLAY_BYTES = 256 << 20
    MAX_REPLAY_FLOPS = 2e10

    def __init__(self, rates: ComputeRates, cache: str | Path | None = None):
        self.rates = rates
        self.path = Path(cache) if cache else cache_dir() / f"compute-{machine_id()}-{rates.device}.json"
        self.table: dict[str, float] = {}
        self.overhead = rates.op_overhead
        """Seconds of framework overhead per op (calibrated on a measured machine)."""
        self.calibrated = False
        self._dirty = False
        if rates.replay and self.path.is_file():
            data = json.loads(self.path.read_text())
            self.table = data.get("ops", {})
            if data.get("overhead") is not None:
                self.overhead, self.calibrated = data["overhead"], True

    def roofline(self, op: Op) -> float:
        if op.view:
            return self.rates.view_overhead
        return max(op.flops / self.rates.matmul_flops, op.bytes / self.rates.memory_bandwidth) + self.rates.op_overhead

    def op_seconds(self, op: Op) -> float:
        """Seconds for one op on one device while every rank of the plan runs (slowdown applied)."""
        if not self.rates.replay:
            return self.roofline(op) * self.rates.slowdown
        return (self.replayed(op) + self.overhead) * self.rates.slowdown

    def replayed(self, op: Op) -> float:
        """Seconds the op itself takes here (cached by its signature)."""
        if op.key in self.table:
            return self.table[op.key]
        if op.view:
            seconds = 0.0
        elif op.replay is None or op.bytes > self.MAX_REPLAY_BYTES or op.flops > self.MAX_REPLAY_FLOPS:
            seconds = self.roofline(op) - self.rates.op_overhead
        else:
            try:
                with _replay_threads(self.rates.device):
                    seconds = _time_call(op.replay(self.rates.device), self.rates.device)
            except Exception:  # noqa: BLE001 - an op that cannot run outside the model: use the roofline
                seconds = self.roofline(op) - self.rates.op_overhead
        self.table[op.key] = seconds
        self._dirty = True
        return seconds

    def calibrate_overhead(self) -> float:
        """Framework overhead per op on this machine (Python modules, autograd, dispatch): a small model's real
        step time minus the sum of its replayed op times, per op. Measured once and cached."""
        if not self.rates.replay or self.calibrated:
            return self.overhead
        spec = TransformerSpec(depth=2, hidden=32, heads=4, mlp_ratio=4, seq=8, batch=2)
        tr = trace(spec, 1, 1, False, dtype=torch.float32, optimizer="adamw")
        ops = [e for p in PHASES for e in tr.events[p] if isinstance(e, Op)]
        replayed = sum(self.replayed(op) for op in ops)
        plain, plan_dict, _ = spec()
        model = parallelize(plain.to(self.rates.device), TPMesh.dry_run(1, 1), plan_dict)  # the traced model
        x = torch.randn(spec.batch, spec.seq, spec.hidden, device=self.rates.device, requires_grad=True)
        opt = torch.optim.AdamW(model.parameters())

        def step():
            y = model(x)
            y.backward(torch.ones_like(y))
            opt.step()
            opt.zero_grad(set_to_none=False)

        with _replay_threads(self.rates.device):
            real = _time_call(step, self.rates.device, min_seconds=0.3)
        self.overhead, self.calibrated, self._dirty = max(0.0, (real - replayed) / len(ops)), True, True
        self.save()
        return self.overhead

    def save(self) -> None:
        if not (self.rates.replay and self._dirty):
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"machine": machine_id(), "overhead": self.overhead if self.calibrated else None,
                                   "ops": self.table}))
        tmp.replace(self.path)
        self._dirty = False


@contextlib.contextmanager
def _replay_threads(device: str):
    """Replay CPU ops with one thread, as each rank runs (torchrun's default OMP_NUM_THREADS=1)."""
    if device != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _time_call(fn: Callable[[], Any], device: str, min_seconds: float = 0.002, samples: int = 5) -> float:
    """Seconds per call of fn: the fastest of `samples` loops of calls at least `min_seconds` long. On CPU it is
    this thread's CPU time, so other processes on the machine don't inflate it (the planner applies the
    measured slowdown of the plan's own ranks sharing cores separately)."""
    if device == "cuda":
        sync, clock = torch.cuda.synchronize, time.perf_counter
    else:
        sync, clock = (lambda: None), time.thread_time
    with _flush_denormals():
        fn()
        sync()
        reps = 1
        while True:
            t0 = clock()
            for _ in range(reps):
                fn()
            sync()
            spent = clock() - t0
            if spent >= min_seconds or reps >= 1024:
                break
            reps *= 4
        best = spent / reps
        for _ in range(samples - 1):
            t0 = clock()
            for _ in range(reps):
                fn()
            sync()
            best = min(best, (clock() - t0) / reps)
    return best


@contextlib.contextmanager
def _flush_denormals():
    before = torch.set_flush_denormal(True)
    try:
        yield
    finally:
        if before:
            torch.set_flush_denormal(False)


# ---------------------------------------------------------------------------------------------------------
# Candidates
# ---------------------------------------------------------------------------------------------------------

@dataclass
class Memory:
    """Bytes per device."""

    weights: float
    grads: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations


@dataclass
class Candidate:
    d0: int
    d1: int
    sequence_parallel: bool
    chunks: int
    problems: list[str] = field(default_factory=list)
    """Why the layout is rejected (empty: valid)."""
    step_seconds: float = math.nan
    compute_seconds: float = math.nan
    comm_seconds: dict[str, float] = field(default_factory=dict)
    """Exposed communication per axis."""
    volume: dict[str, float] = field(default_factory=dict)
    """Ring traffic bytes per device per step, per axis."""
    calls: dict[str, int] = field(default_factory=dict)
    memory: Memory | None = None
    rank: int | None = None

    @property
    def layout(self) -> str:
        return f"{self.d0}x{self.d1}"

    @property
    def valid(self) -> bool:
        return not self.problems

    @property
    def exposed_seconds(self) -> float:
        return sum(self.comm_seconds.values())

    @property
    def label(self) -> str:
        return f"{self.layout}{' sp' if self.sequence_parallel else ''} k={self.chunks}"


def price(tr: Trace | Extrapolated, topology: Topology, compute: ComputeModel) -> tuple[float, dict[str, float]]:
    """(compute seconds, exposed communication seconds per axis) of one traced step.

    Replays the rank's timeline: ops advance the clock; a collective starts when launched (or when the previous
    one on its axis is done: one link, one collective at a time) and takes its axis's alpha + traffic /
    bandwidth; a Wait holds the clock until its collective is done, and that hold is the exposed communication.
    A synchronous collective is awaited right away, so all of it is exposed; the overlap code's async chunks
    hide behind the compute between launch and wait (DESIGN 3.4: with k chunks, about the last one's share
    stays exposed). Where communication cannot progress while the device computes (topology.overlap False:
    gloo on busy CPU cores) it holds the clock at launch, so it is all exposed; a link cost may name such a part
    of itself (`blocking_seconds`: the real gloo collective under an emulated link's wait).
    """
    if isinstance(tr, Extrapolated):
        (c1, x1), (c2, x2) = price(tr.one, topology, compute), price(tr.two, topology, compute)
        return tr._line(c1, c2), {a: tr._line(x1[a], x2[a]) for a in AXES}
    costs: dict[tuple[str, str], Any] = {}
    compute_s, comm_s = 0.0, {a: 0.0 for a in AXES}
    for phase in PHASES:
        compute_s = _replay_phase(tr, tr.events[phase], topology, compute, costs, comm_s, compute_s)
    return compute_s, comm_s


def _replay_phase(tr: Trace, events: list, topology: Topology, compute: ComputeModel, costs: dict,
                  comm_s: dict[str, float], compute_s: float) -> float:
    """One phase's timeline replayed (see price): adds its exposed seconds per axis to `comm_s` and its op
    seconds to `compute_s` (returned); `costs` caches each (axis, kind)'s link cost. Each phase starts with an
    idle clock and idle links."""
    now = 0.0
    free = {a: 0.0 for a in AXES}
    done: dict[int, float] = {}
    for e in events:
        if isinstance(e, Op):
            t = compute.op_seconds(e)
            now += t
            compute_s += t
        elif isinstance(e, Collective):
            if (e.axis, e.kind) not in costs:
                costs[(e.axis, e.kind)] = topology.axis_cost(tr.d0, tr.d1, e.axis, e.kind)
            cost = costs[(e.axis, e.kind)]
            if cost is FREE:
                raise ValueError(f"a collective ran on axis {e.axis} of size 1 ({tr.d0}x{tr.d1})")
            start = max(now, free[e.axis])
            seconds = cost.seconds(float(e.traffic))
            free[e.axis] = done[id(e)] = start + seconds
            if not topology.overlap:
                blocking = seconds
            else:
                blocking = getattr(cost, "blocking_seconds", lambda t: 0.0)(float(e.traffic))
            if blocking:  # holds up compute even when launched async
                held = min(start + blocking, free[e.axis]) - now
                comm_s[e.axis] += held
                now += held
        else:
            end = done.pop(id(e.collective))
            if end > now:
                comm_s[e.collective.axis] += end - now
                now = end
    return compute_s


def memory(tr: Trace | Extrapolated, optimizer: str) -> Memory:
    elem = torch.finfo(tr.dtype).bits // 8
    weights = tr.param_numel * elem
    opt = {"adamw": 8, "sgd": 0, "none": 0}[optimizer] * tr.param_numel
    if optimizer != "none" and tr.dtype not in (torch.float32, torch.float64):
        opt += 4 * tr.param_numel  # float32 master weights
    return Memory(weights, weights, opt, tr.activation_bytes)
