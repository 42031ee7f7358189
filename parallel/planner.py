"""The ATP planner (DESIGN 3.3): count, price and rank every layout of N ranks for the model actually configured.

For each ordered factorisation N = d0 * d1, sequence parallelism on/off and overlap chunk count k, the planner
traces one training step of the layout (plan_trace.py: every op, every collective and where it is awaited, on the
meta device, exact at full size), prices it on a topology (plan_cost.py: op times replayed here or a preset's
roofline, each collective's alpha + traffic / bandwidth, the exposed communication, the memory per device) and
ranks the candidates by predicted step time (here); plan_report.py prints and draws the ranking.

A candidate is rejected, saying why, when the shapes don't divide (parallelize.layout_problems, or the source's
own layout_problems), the tokens don't split over d0 (sequence parallel) or into k chunks, or the memory per
device (weights, gradients, optimizer state, saved activations) does not fit. `plan()` returns every candidate,
ranked; `choose_layout()` the winner and a reason (for `layout: auto`).

Every name of the parts is importable from here as before the split (`from tabfm.parallel.planner import trace,
price, table, ...`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from tabfm.parallel.mesh import factorizations
from tabfm.parallel.parallelize import layout_problems
from tabfm.parallel.plan_cost import Candidate, ComputeModel, Memory, memory, price
from tabfm.parallel.plan_report import draw, format_bytes, table
from tabfm.parallel.plan_trace import (DTYPES, OPTIMIZERS, PHASES, Collective, Extrapolated, InputSpec,
                                       ModelSource, Op, Parallelizer, Trace, TransformerSpec, Wait, build_source,
                                       resolve_dtype, trace)
from tabfm.parallel.topology import AXES, Topology

__all__ = ["AXES", "CHUNKS", "DTYPES", "OPTIMIZERS", "PHASES", "Candidate", "Collective", "ComputeModel",
           "Extrapolated", "InputSpec", "Memory", "ModelSource", "Op", "Parallelizer", "PlanOptions", "Trace",
           "TransformerSpec", "Wait", "choose_layout", "choose_layout_from", "draw", "dtype_name", "format_bytes",
           "memory", "plan", "price", "table", "trace"]

CHUNKS = (1, 2, 4, 8)


def plan(source: ModelSource, topology: Topology, nproc: int, *, dtype: str | torch.dtype | None = None,
         sequence_parallel: Iterable[bool] = (False, True), chunks: Iterable[int] = CHUNKS,
         optimizer: str = "adamw", memory_fraction: float = 0.9, compute: ComputeModel | None = None,
         traces: dict | None = None, trace_device: str = "meta") -> list[Candidate]:
    """Every candidate layout of `nproc` ranks, valid ones ranked by predicted step time, then the rejected
    ones with their reasons. Raises ValueError when the inputs are bad or nothing fits.

    compute: the op-time model (default: from the topology's rates); traces: a dict reused across calls (the
    traces depend on the model, layout, dtype and optimizer, not on the topology); trace_device: see trace().
    """
    chunks, sps = _check_options(topology, nproc, chunks, sequence_parallel, optimizer, memory_fraction)
    dt = resolve_dtype(dtype or topology.dtype)
    compute = compute or ComputeModel(topology.compute)
    if topology.compute.replay:
        compute.calibrate_overhead()
    traces = {} if traces is None else traces

    foreach = None if (topology.compute.replay and topology.compute.device == "cpu") else True
    model, plan_dict, spec = build_source(source, dt)
    problems_of = _problems_of(source, model, plan_dict)
    out = _candidates(nproc, sps, chunks, spec, problems_of)
    for cand in out:
        if cand.problems:
            continue
        key = (cand.d0, cand.d1, cand.sequence_parallel, cand.chunks, dt, optimizer)
        if key not in traces:
            traces[key] = _trace_for_plan(source, *key[:4], dt, optimizer, foreach, trace_device)
        _price(cand, traces[key], topology, compute, optimizer, memory_fraction)
    compute.save()
    valid = sorted((c for c in out if c.valid), key=lambda c: (c.step_seconds, c.chunks, c.d1, c.sequence_parallel))
    if not valid:
        raise ValueError(_nothing_fits(out, problems_of, nproc, chunks))
    for r, c in enumerate(valid, 1):
        c.rank = r
    return valid + [c for c in out if not c.valid]


def check_shapes_fit(source: ModelSource, nproc: int) -> None:
    """ValueError, saying which process counts would do, where no (d0, d1) of `nproc` ranks divides the model's
    shapes: what `plan` finds last, checked first where the topology is still to be measured (starting and timing
    6 local ranks took 2 minutes before this said 6 cannot work)."""
    model, plan_dict, spec = build_source(source, torch.float32)
    problems_of = _problems_of(source, model, plan_dict)
    if all(problems_of(d0, d1) for d0, d1 in factorizations(nproc)):
        raise ValueError(_nothing_fits(_candidates(nproc, (False,), (1,), spec, problems_of), problems_of, nproc,
                                       (1,)))


def _check_options(topology: Topology, nproc: int, chunks: Iterable[int], sequence_parallel: Iterable[bool],
                   optimizer: str, memory_fraction: float) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """The search settings checked (ValueError saying what to change): the chunk counts and the distinct
    sequence-parallel settings to try."""
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive integer, got {nproc!r}")
    topology.check_nproc(nproc)
    chunks = tuple(chunks)
    if not chunks or any(not isinstance(k, int) or k < 1 for k in chunks):
        raise ValueError(f"chunk counts must be positive integers, got {list(chunks)}; e.g. {list(CHUNKS)}")
    sps = tuple(dict.fromkeys(bool(s) for s in sequence_parallel))
    if not sps:
        raise ValueError("sequence_parallel needs at least one of [false, true]")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose from {list(OPTIMIZERS)}")
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    return chunks, sps


def _candidates(nproc: int, sps: tuple[bool, ...], chunks: tuple[int, ...], spec: InputSpec,
                problems_of: Callable[[int, int], list[str]]) -> list[Candidate]:
    """Every (d0, d1, sequence parallel, chunks) of `nproc` ranks, with what rules it out before any tracing: the
    model's shapes, the tokens per sequence over d0, the local tokens over k chunks."""
    out: list[Candidate] = []
    for d0, d1 in factorizations(nproc):
        shape_problems = problems_of(d0, d1)
        for sp in sps:
            if sp and d0 == 1 and False in sps:
                continue  # sequence parallelism over an axis of size 1 is the same layout as without
            base = list(shape_problems)
            local_tokens = None
            if not callable(spec):
                if sp and spec[-2] % d0:
                    base.append(f"sequence parallelism needs the {spec[-2]} tokens per sequence divisible by d0={d0}")
                local_tokens = math.prod(spec[:-1]) // (d0 if sp else 1)
            for k in chunks:
                cand = Candidate(d0, d1, sp, k, problems=list(base))
                if local_tokens is not None and k > local_tokens:
                    cand.problems.append(f"{k} chunks of {local_tokens} local tokens")
                out.append(cand)
    return out


def _price(cand: Candidate, tr: Trace | Extrapolated, topology: Topology, compute: ComputeModel, optimizer: str,
           memory_fraction: float) -> None:
    """Fill in a candidate from its trace: volumes, calls, memory, and its step time, or the memory problem that
    rejects it."""
    cand.volume = {a: float(tr.volume(a)) for a in AXES}
    cand.calls = {a: tr.calls(a) for a in AXES}
    cand.memory = memory(tr, optimizer)
    limit = memory_fraction * topology.memory_bytes
    if cand.memory.total > limit:
        cand.problems.append(f"needs {format_bytes(cand.memory.total)} per device, more than "
                             f"{memory_fraction:.0%} of {format_bytes(topology.memory_bytes)}")
    else:
        cand.compute_seconds, cand.comm_seconds = price(tr, topology, compute)
        cand.step_seconds = cand.compute_seconds + cand.exposed_seconds


def _problems_of(source: ModelSource, model: nn.Module, plan_dict) -> Callable[[int, int], list[str]]:
    if callable(plan_dict):
        return getattr(source, "layout_problems", lambda d0, d1: [])
    return lambda d0, d1: layout_problems(model, plan_dict, d0, d1)


def _trace_for_plan(source, d0, d1, sp, k, dt, optimizer, foreach, device) -> Trace | Extrapolated:
    options = {"dtype": dt, "optimizer": optimizer, "foreach": foreach, "device": device}
    depth, with_depth = getattr(source, "depth", None), getattr(source, "with_depth", None)
    if isinstance(depth, int) and depth > 2 and callable(with_depth):
        one, two = (trace(with_depth(n), d0, d1, sp, k, **options) for n in (1, 2))
        return Extrapolated(one, two, depth)
    return trace(source, d0, d1, sp, k, **options)


def _nothing_fits(out: list[Candidate], problems_of, nproc: int, chunks) -> str:
    reasons = {}
    for c in out:
        reasons.setdefault(f"{c.layout}{' sp' if c.sequence_parallel else ''}", "; ".join(c.problems[:3]))
    fits = [n for n in range(1, 65) if any(not problems_of(a, b) for a, b in factorizations(n))]
    lines = "\n  ".join(f"{k}: {v}" for k, v in reasons.items())
    return (f"no layout of {nproc} ranks satisfies the constraints:\n  {lines}\n"
            f"process counts whose layouts divide this model's shapes: {fits or 'none up to 64'}; "
            f"chunk counts tried: {list(chunks)}")


def choose_layout(source: ModelSource, topology: Topology, nproc: int, **options) -> tuple[Candidate, str]:
    """The best layout for `layout: auto`, and a human-readable reason (options as for `plan`)."""
    return choose_layout_from(plan(source, topology, nproc, **options), topology)


def choose_layout_from(ranked: list[Candidate], topology: Topology) -> tuple[Candidate, str]:
    """The winner of a `plan()` ranking and why: its predicted time, the runner-up, what was rejected."""
    best = ranked[0]
    reason = (f"{best.layout} (d0={best.d0}, d1={best.d1}), sequence parallel "
              f"{'on' if best.sequence_parallel else 'off'}, {best.chunks} chunk{'s' if best.chunks > 1 else ''}: "
              f"predicted {best.step_seconds * 1e3:.3g} ms/step (compute {best.compute_seconds * 1e3:.3g} ms + "
              f"exposed communication {best.exposed_seconds * 1e3:.3g} ms) on {topology.name}")
    others = [c for c in ranked[1:] if c.valid and (c.d0, c.d1) != (best.d0, best.d1)]
    if others:
        nxt = others[0]
        reason += (f"; the best other mesh, {nxt.label}, is {100 * (nxt.step_seconds / best.step_seconds - 1):.1f}% "
                   f"slower")
    rejected: dict[str, str] = {}
    for c in ranked:
        if not c.valid:
            rejected.setdefault(f"{c.layout}{' sp' if c.sequence_parallel else ''}", c.problems[0])
    if rejected:
        reason += "; rejected: " + "; ".join(f"{k} ({v})" for k, v in rejected.items())
    return best, reason


def dtype_name(dtype: str | torch.dtype) -> str:
    """float32, bfloat16, ...: a dtype's name as configs spell it."""
    return str(resolve_dtype(dtype)).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------------------
# Search settings (the `plan:` section of a plan config; tabfm.plan_config.load_plan reads the file)
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PlanOptions:
    """Search settings of `tabfm plan` (the `plan:` section of the config)."""

    dtype: str | None = None
    """Training dtype the volumes and memory are counted in (default: the topology's)."""
    sequence_parallel: tuple[bool, ...] = (False, True)
    """Sequence-parallel settings to try."""
    chunks: tuple[int, ...] = CHUNKS
    """Overlap chunk counts to try."""
    optimizer: str = "adamw"
    """Optimizer whose state counts toward memory and whose step counts toward time."""
    memory_fraction: float = 0.9
    """Share of a device's memory the plan may use."""

    def kwargs(self) -> dict[str, Any]:
        """The settings as keyword arguments of plan()."""
        return {f.name: getattr(self, f.name) for f in fields(self)}
