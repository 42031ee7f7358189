"""Autograd-aware collectives along one mesh axis, each paired with its dual in backward.

    forward               backward
    copy_to     identity          all-reduce      (enter a region whose dX is partial over the axis)
    reduce_from all-reduce        identity        (leave a region whose output is partial)
    gather      all-gather(dim)   reduce-scatter  (or split, when the gradient is replicated)
    reduce_scatter(dim)           all-gather
    split(dim)  take own chunk    all-gather

Every collective takes the `MeshAxis` it runs on (never a global group), skips all work on an axis of size 1,
and is counted in that axis's `CommTally`: calls and bytes per kind, plus the ring traffic per device that the
cost model of DESIGN 3.3 predicts (all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n of the full
tensor). Async variants return a handle for the overlap code.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist

ALL_REDUCE = "all_reduce"
ALL_GATHER = "all_gather"
REDUCE_SCATTER = "reduce_scatter"
KINDS = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER)


@dataclass
class CommTally:
    """Collectives issued on one axis: count, payload bytes and ring traffic bytes per device, per kind."""

    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Bytes of the full (unsharded) tensor each collective reduces or assembles."""
    traffic: dict[str, Fraction] = field(default_factory=lambda: defaultdict(Fraction))
    """Bytes each device sends in a ring implementation (the cost model's volume)."""

    def record(self, kind: str, full_bytes: int, size: int) -> None:
        factor = Fraction(2 * (size - 1), size) if kind == ALL_REDUCE else Fraction(size - 1, size)
        self.calls[kind] += 1
        self.bytes[kind] += full_bytes
        self.traffic[kind] += factor * full_bytes

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()
        self.traffic.clear()

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    @property
    def total_traffic(self) -> Fraction:
        return sum(self.traffic.values(), Fraction(0))

    def snapshot(self) -> dict[str, Any]:
        """A plain, picklable copy (for tests that ship tallies between processes)."""
        return {
            "calls": dict(self.calls),
            "bytes": dict(self.bytes),
            "traffic": {k: Fraction(v) for k, v in self.traffic.items()},
        }


@dataclass
class MeshAxis:
    """One axis of the mesh as seen by this rank: its size, this rank's index on it, and its process group."""

    name: str
    size: int
    index: int
    group: Any = None
    tally: CommTally = field(default_factory=CommTally, repr=False, compare=False)
    delay: Callable[[str, Fraction, float], None] | None = field(default=None, repr=False, compare=False)
    """Optional hook called as delay(kind, traffic_bytes, started) when a collective's result is first needed,
    `started` being its launch time (perf_counter): emulated slow links wait out the rest of the modelled time,
    so an async collective overlapped with compute hides the wait as a real one would."""
    dry_run: bool = False
    """Count collectives without communicating: outputs get the right shapes but not the right values. Lets
    the planner read exact volumes off the real layers for any layout in one process (even on meta tensors)."""

    def __post_init__(self) -> None:
        if self.size > 1 and self.group is None and not self.dry_run:
            raise ValueError(f"mesh axis {self.name} of size {self.size} needs a process group")

    def _done(self, kind: str, full_bytes: int, started: float | None = None) -> None:
        self.tally.record(kind, full_bytes, self.size)
        if self.delay is not None:
            factor = Fraction(2 * (self.size - 1), self.size) if kind == ALL_REDUCE else Fraction(self.size - 1, self.size)
            self.delay(kind, factor * full_bytes, time.perf_counter() if started is None else started)


class Handle:
    """Wait handle of an async collective; `wait()` returns the result tensor."""

    def __init__(self, result: torch.Tensor, work: Any = None, finish: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 on_wait: Callable[[], None] | None = None):
        self._result, self._work, self._finish, self._on_wait = result, work, finish, on_wait

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
            if self._on_wait is not None:
                self._on_wait()
            if self._finish is not None:
                self._result = self._finish(self._result)
        return self._result


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---------------------------------------------------------------------------------------------------------
# Plain collectives (no autograd). Each returns a new tensor or a Handle; none modifies its input.
# ---------------------------------------------------------------------------------------------------------

_OBSERVER: Callable[..., Handle] | None = None


@contextlib.contextmanager
def observing(observer: Callable[..., Handle]) -> Iterator[None]:
    """Within the block, every async collective launch goes through observer(launch, *args, **kwargs), which
    must call launch(*args, **kwargs) and return its Handle: the planner's tracer sees which compute each
    collective overlaps without patching the modules that call comm."""
    global _OBSERVER
    previous, _OBSERVER = _OBSERVER, observer
    try:
        yield
    finally:
        _OBSERVER = previous


def _observable(launch: Callable[..., Handle]) -> Callable[..., Handle]:
    @functools.wraps(launch)
    def call(*args, **kwargs) -> Handle:
        if _OBSERVER is None:
            return launch(*args, **kwargs)
        return _OBSERVER(launch, *args, **kwargs)
    return call


@_observable
def all_reduce_async(x: torch.Tensor, axis: MeshAxis, inplace: bool = False) -> Handle:
    """Sum `x` over the axis; the result arrives at `handle.wait()`. With `inplace`, a contiguous `x` is
    overwritten instead of copied (for fresh matmul outputs nobody else holds)."""
    if axis.size == 1:
        return Handle(x)
    out = x if inplace and x.is_contiguous() else x.contiguous().clone()
    if axis.dry_run:
        axis._done(ALL_REDUCE, _nbytes(out))
        return Handle(out)
    started = time.perf_counter()
    work = dist.all_reduce(out, group=axis.group, async_op=True)
    return Handle(out, work, on_wait=lambda: axis._done(ALL_REDUCE, _nbytes(out), started))


@_observable
def all_gather_async(x: torch.Tensor, dim: int, axis: MeshAxis) -> Handle:
    """Concatenate every rank's `x` along `dim`, in axis order."""
    if axis.size == 1:
        return Handle(x)
    dim = dim % x.dim()
    front = x.movedim(dim, 0).contiguous()
    if axis.dry_run:
        out = torch.cat([front] * axis.size)
        axis._done(ALL_GATHER, _nbytes(out))
        return Handle(out.movedim(0, dim))
    out = front.new_empty((axis.size * front.shape[0], *front.shape[1:]))
    started = time.perf_counter()
    work = dist.all_gather_single(out, front, group=axis.group, async_op=True)
    return Handle(out, work, finish=lambda t: t.movedim(0, dim),
                  on_wait=lambda: axis._done(ALL_GATHER, _nbytes(out), started))


@_observable
def reduce_scatter_async(x: torch.Tensor, dim: int, axis: MeshAxis) -> Handle:
    """Sum `x` over the axis and keep this rank's chunk of `dim` (which the axis size must divide)."""
    if axis.size == 1:
        return Handle(x)
    dim = dim % x.dim()
    if x.shape[dim] % axis.size:
        raise ValueError(
            f"reduce-scatter over {axis.name} needs dim {dim} (size {x.shape[dim]}) divisible by {axis.size}"
        )
    front = x.movedim(dim, 0).contiguous()
    if axis.dry_run:
        axis._done(REDUCE_SCATTER, _nbytes(front))
        return Handle(front[: front.shape[0] // axis.size].clone().movedim(0, dim))
    out = front.new_empty((front.shape[0] // axis.size, *front.shape[1:]))
    started = time.perf_counter()
    work = dist.reduce_scatter_single(out, front, group=axis.group, async_op=True)
    return Handle(out, work, finish=lambda t: t.movedim(0, dim),
                  on_wait=lambda: axis._done(REDUCE_SCATTER, _nbytes(front), started))


def all_reduce(x: torch.Tensor, axis: MeshAxis, inplace: bool = False) -> torch.Tensor:
    return all_reduce_async(x, axis, inplace).wait()


def all_gather(x: torch.Tensor, dim: int, axis: MeshAxis) -> torch.Tensor:
    return all_gather_async(x, dim, axis).wait()


def reduce_scatter(x: torch.Tensor, dim: int, axis: MeshAxis) -> torch.Tensor:
    return reduce_scatter_async(x, dim, axis).wait()


def split(x: torch.Tensor, dim: int, axis: MeshAxis) -> torch.Tensor:
    """This rank's chunk of `dim` (no communication)."""
    if axis.size == 1:
        return x
    if x.shape[dim] % axis.size:
        raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} over {axis.name} of size {axis.size}")
    return x.chunk(axis.size, dim=dim)[axis.index].contiguous()


# ---------------------------------------------------------------------------------------------------------
# Autograd pairs: forward collective, dual in backward.
# ---------------------------------------------------------------------------------------------------------

class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.axis), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, inplace):
        if inplace and x.is_contiguous():
            ctx.mark_dirty(x)
            return all_reduce(x, axis, inplace=True)
        return all_reduce(x, axis)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, axis, grad_is_partial):
        ctx.dim, ctx.axis, ctx.grad_is_partial = dim, axis, grad_is_partial
        return all_gather(x, dim, axis)

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_is_partial:
            return reduce_scatter(grad, ctx.dim, ctx.axis), None, None, None
        return split(grad, ctx.dim, ctx.axis), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, axis):
        ctx.dim, ctx.axis = dim, axis
        return reduce_scatter(x, dim, axis)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.dim, ctx.axis), None, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, axis):
        ctx.dim, ctx.axis = dim, axis
        return split(x, dim, axis)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.dim, ctx.axis), None, None


def copy_to(x: torch.Tensor, axis: MeshAxis) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient over `axis` backward (input replicated, dX partial)."""
    return x if axis.size == 1 else _CopyTo.apply(x, axis)


def reduce_from(x: torch.Tensor, axis: MeshAxis, inplace: bool = False) -> torch.Tensor:
    """All-reduce forward (partial sums become the full result); identity backward. `inplace` reuses the
    input's memory (autograd's version counter still catches a later use of the overwritten input)."""
    return x if axis.size == 1 else _ReduceFrom.apply(x, axis, inplace)


def gather(x: torch.Tensor, dim: int, axis: MeshAxis, grad_is_partial: bool = True) -> torch.Tensor:
    """All-gather along `dim` forward. Backward reduce-scatters the gradient when each rank holds a partial
    gradient of the gathered tensor (the usual case), or just keeps its own chunk when it is replicated."""
    return x if axis.size == 1 else _Gather.apply(x, dim, axis, grad_is_partial)


def scatter_reduce(x: torch.Tensor, dim: int, axis: MeshAxis) -> torch.Tensor:
    """Reduce-scatter along `dim` forward; all-gather of the gradient backward."""
    return x if axis.size == 1 else _ReduceScatter.apply(x, dim, axis)


def scatter(x: torch.Tensor, dim: int, axis: MeshAxis) -> torch.Tensor:
    """Keep this rank's chunk of a replicated tensor forward; all-gather the gradient backward."""
    return x if axis.size == 1 else _Split.apply(x, dim, axis)
