"""Chunk-based overlap of the tensor-parallel layers' collectives with compute (DESIGN 3.4).

A layer's work is written as a pipeline of ops, each applied to one chunk of the tokens at a time:
    Comm(kind, axis)   a collective, launched async; backward its dual (all-reduce <-> identity ("copy"),
                       all-gather <-> reduce-scatter)
    Linear(weight)     x W^T; backward computes dX first, then dW once dX's collective has started
    Fn(fn, params)     any differentiable chunk function (bias + activation, the attention core); autograd
The ops are cut into stages, each ending with a collective that communicates; the k chunks move through the
stages as a wavefront (at step t, chunk t - q runs stage q), so chunk c+1's compute runs while chunk c
communicates, and the collectives of a block overlap the block's other compute (`_plan` places each launch
inside a step so that it has as much compute as possible to hide behind):
    MLP         [gather x over axis 0 (sp)] fc1 -> all-reduce axis 1 -> bias+act -> fc2 -> all-reduce axis 0
                (reduce-scatter under sp); chunks of tokens
    attention   [gather (sp)] qkv -> reduce-scatter axis 1 -> bias, attention over this chunk's sequences ->
                all-gather axis 1 -> proj -> all-reduce axis 0 (reduce-scatter under sp); chunks of sequences
                (every leading dimension flattened), so it needs at least 2 sequences; with one, each of its
                linears is chunked over tokens on its own
    column-first / row-first linear alone: [gather] matmul -> reduce; chunks of tokens
Under sequence parallelism a column-first linear keeps only its local input for backward and re-gathers it
there chunk by chunk, overlapped with its dX matmul (`regather_input`, on by default; off keeps the gathered
input, as the k = 1 path does).

Every collective goes through `comm` (so tallies, dry runs and emulated links apply), and each axis has at most
one collective in flight (a `_Lane`): launching the next finishes the previous, so collectives on one link never
overlap each other, only compute (and collectives on the other axis), as on a real link.

Shape legend (mesh (d0, d1), g = d0 under sequence parallelism else 1, M = local tokens, M_c one chunk's):
    token chunks      x [B..., S(/d0), F] -> "rank-major" [g, M, F] -> chunk [g*M_c, F] (row r*M_c + m: token m
                      of the chunk, owned by rank r of axis 0), so a chunk of every owner's tokens is one
                      contiguous all-gather / reduce-scatter along rows
    sequence chunks   x [B..., S(/d0), F] -> [Bf, S(/d0), F] (Bf = prod(B...)) -> chunk [Bf_c, S(/d0), F]

Tallies with k chunks (k is capped at the number of rows or sequences): every chunked collective is counted k
times with the same total bytes and ring traffic, forward and backward. Under sequence parallelism the backward
of each column-first linear with `regather_input` adds k all-gathers over axis 0 of its input (the bytes of its
forward all-gather). Collectives outside these layers (norm statistics, the replicated bias and norm gradients)
are not chunked. k = 1 is the unchunked code path of layers.py.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tabfm.parallel import comm
from tabfm.parallel.comm import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, Handle, MeshAxis
from tabfm.parallel.mesh import TPMesh

COPY = "copy"  # identity forward, all-reduce of the gradient backward (comm.copy_to)
_FORWARD = {ALL_REDUCE: ALL_REDUCE, COPY: None, ALL_GATHER: ALL_GATHER, REDUCE_SCATTER: REDUCE_SCATTER}
_BACKWARD = {ALL_REDUCE: None, COPY: ALL_REDUCE, ALL_GATHER: REDUCE_SCATTER, REDUCE_SCATTER: ALL_GATHER}


def check_chunks(k: int) -> int:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"overlap_chunks must be a positive integer (1 = no overlap), got {k!r}")
    return k


def chunk_bounds(n: int, k: int) -> list[tuple[int, int]]:
    """min(k, n) contiguous [start, stop) ranges covering n rows, sizes differing by at most one (uneven ok)."""
    k = max(1, min(k, n))
    base, extra = divmod(n, k)
    bounds, start = [], 0
    for c in range(k):
        stop = start + base + (c < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


# ---------------------------------------------------------------------------------------------------------
# Ops
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class Comm:
    """A collective over `axis` along `dim` of the chunk: `kind` forward, its dual backward."""

    kind: str
    axis: MeshAxis
    dim: int = 0

    def active(self, backward: bool) -> bool:
        """Whether this collective communicates in that direction (not an identity, not on an axis of 1)."""
        return (_BACKWARD if backward else _FORWARD)[self.kind] is not None and self.axis.size > 1

    def start(self, t: torch.Tensor, backward: bool, inplace: bool) -> Callable[[], Handle] | None:
        kind = (_BACKWARD if backward else _FORWARD)[self.kind]
        if kind is None or self.axis.size == 1:
            return None
        if kind == ALL_REDUCE:
            return lambda: comm.all_reduce_async(t, self.axis, inplace=inplace)
        if kind == ALL_GATHER:
            return lambda: comm.all_gather_async(t, self.dim, self.axis)
        return lambda: comm.reduce_scatter_async(t, self.dim, self.axis)


@dataclass(frozen=True, eq=False)
class Linear:
    """x W^T with W = params[weight]. regather (right after an all-gather): keep the local input and gather
    it again in backward, overlapped with the dX matmul."""

    weight: int
    regather: bool = False


@dataclass(frozen=True, eq=False)
class Fn:
    """fn(x, chunk_index, *params[i] for i in params), differentiable; backward by autograd."""

    fn: Callable[..., torch.Tensor]
    params: tuple[int, ...] = ()


class _Lane:
    """The async collectives of one axis, at most one in flight: `launch` first finishes the pending one
    (handing its result to its sink), then starts the next."""

    def __init__(self) -> None:
        self._pending: tuple[Handle, Callable[[torch.Tensor], None]] | None = None

    def launch(self, start: Callable[[], Handle], sink: Callable[[torch.Tensor], None]) -> None:
        self.flush()
        self._pending = (start(), sink)

    def flush(self) -> None:
        if self._pending is not None:
            handle, sink = self._pending
            self._pending = None
            sink(handle.wait())


class _Pending:
    def __init__(self, lane: _Lane):
        self.lane = lane


class _Chunks:
    """Per-chunk values moving through the ops, with the lanes their collectives run on."""

    def __init__(self, values: list[torch.Tensor]):
        self.values: list = list(values)
        self.fresh = [False] * len(values)   # a tensor no one else holds (a matmul output): reduce it in place
        self.lanes: dict[str, _Lane] = {}

    def get(self, c: int) -> torch.Tensor:
        if isinstance(self.values[c], _Pending):
            self.values[c].lane.flush()
        return self.values[c]

    def set(self, c: int, value: torch.Tensor, fresh: bool) -> None:
        self.values[c], self.fresh[c] = value, fresh

    def lane(self, axis: MeshAxis) -> _Lane:
        return self.lanes.setdefault(axis.name, _Lane())

    def communicate(self, c: int, op: Comm, backward: bool) -> None:
        start = op.start(self.values[c], backward, self.fresh[c])
        if start is None:
            return
        lane = self.lane(op.axis)

        def sink(t: torch.Tensor) -> None:
            self.values[c] = t

        lane.launch(start, sink)
        self.values[c] = _Pending(lane)
        self.fresh[c] = True   # a collective's result: a new tensor, or one reduced in place that was fresh

    def finish(self) -> list[torch.Tensor]:
        for lane in self.lanes.values():
            lane.flush()
        return self.values


def _schedule(ops: list, backward: bool) -> tuple[list[int], list[int], list[int]]:
    """How one direction runs: the ops that do something in it (op indices in execution order), the stage
    of each (a stage ends with a collective that communicates), and the order of one wavefront step.

    Step t runs stage q on chunk t - q: a chunk meets its stages one step apart, and the stages of one step
    work on different chunks, so inside a step any order is valid that keeps each stage's own ops in order.
    """
    order = range(len(ops) - 1, -1, -1) if backward else range(len(ops))
    seq = [s for s in order if not (isinstance(ops[s], Comm) and not ops[s].active(backward))]
    kinds = tuple(ops[s].axis.name if isinstance(ops[s], Comm) else None for s in seq)
    stages, step_order = _plan(kinds)
    return seq, list(stages), list(step_order)


@functools.lru_cache(maxsize=256)
def _plan(lanes: tuple[str | None, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Stages and the step order for a sequence of ops (None: compute; else the axis of a collective).

    Compute ops keep their natural order; each collective launch is placed after some number p of them (at
    least the compute ops before it, so after its own stage's). The placement chosen maximises the smallest
    amount of compute (in ops) that a launch has to hide behind before its result is needed, or before the
    next launch on its axis (one in flight per axis) forces it to finish; then the total; then the earliest.
    """
    stage, stages = 0, []
    for lane in lanes:
        stages.append(stage)
        stage += lane is not None
    compute = [i for i, lane in enumerate(lanes) if lane is None]
    index = {i: n for n, i in enumerate(compute)}
    m = len(compute)
    launches = [i for i, lane in enumerate(lanes) if lane is not None]
    lowest = [sum(1 for c in compute if c < i) for i in launches]

    def score(pos: tuple[int, ...]) -> tuple[int, int, int]:
        at = dict(zip(launches, pos, strict=True))
        gaps = []
        for i, p in at.items():
            nxt = i + 1                                   # the same chunk's next op, one step later
            need = 2 * m if nxt >= len(lanes) else (m - p) + (index[nxt] if lanes[nxt] is None else at[nxt])
            same = sorted((q, j) for j, q in at.items() if lanes[j] == lanes[i])
            k = same.index((p, i))
            if k + 1 < len(same):
                free = same[k + 1][0] - p                 # the next launch on this axis, same step
            else:
                free = (m - p) + same[0][0]               # ... or the first one of the next step
            gaps.append(min(need, free))
        return (min(gaps, default=0), sum(gaps), -sum(pos))

    best = max(itertools.product(*(range(lo, m + 1) for lo in lowest)), key=score, default=())
    at = dict(zip(launches, best, strict=True))
    step_order: list[int] = []
    for n in range(m + 1):
        step_order += sorted(i for i, p in at.items() if p == n)
        if n < m:
            step_order.append(compute[n])
    return tuple(stages), tuple(step_order)


def _wavefront(k: int, seq: list[int], stages: list[int], step_order: list[int],
               step: Callable[[int, int], None]) -> None:
    """At time t run the ops of stage q on chunk t - q, in `step_order`."""
    n_stages = (max(stages) + 1) if stages else 1
    for t in range(k + n_stages - 1):
        for p in step_order:
            c = t - stages[p]
            if 0 <= c < k:
                step(seq[p], c)


def _regathers(ops: list, s: int) -> bool:
    """Whether Linear ops[s] keeps its local input and gathers it again in backward."""
    return ops[s].regather and isinstance(ops[s - 1], Comm) and ops[s - 1].active(backward=False)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _Pipeline(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ops, layout, *params):
        chunks = _Chunks(layout.split_in(x))
        k = len(chunks.values)
        leaves: dict[int, torch.Tensor] = {}
        saved: dict[tuple[int, int], object] = {}

        def leaf(i: int) -> torch.Tensor:
            if i not in leaves:
                leaves[i] = params[i].detach().requires_grad_()
            return leaves[i]

        def step(s: int, c: int) -> None:
            op = ops[s]
            v = chunks.get(c)
            if isinstance(op, Comm):
                if s + 1 < len(ops) and isinstance(ops[s + 1], Linear) and _regathers(ops, s + 1):
                    saved[(s + 1, c)] = v                       # the local input, gathered again in backward
                chunks.communicate(c, op, backward=False)
            elif isinstance(op, Linear):
                if not _regathers(ops, s):
                    saved[(s, c)] = v
                chunks.set(c, v @ params[op.weight].t(), fresh=True)
            else:
                with torch.enable_grad():
                    inp = v.detach().requires_grad_()
                    out = op.fn(inp, c, *(leaf(i) for i in op.params))
                saved[(s, c)] = (inp, out)
                chunks.set(c, out.detach(), fresh=False)

        _wavefront(k, *_schedule(ops, backward=False), step)
        out = layout.join_out(chunks.finish())
        ctx.ops, ctx.layout, ctx.params, ctx.leaves, ctx.saved, ctx.k = ops, layout, params, leaves, saved, k
        # Backward runs outside autocast; it re-enters the forward's (as torch.amp.custom_bwd does), so its chunk
        # matmuls take bfloat16 gradients with float32 weights.
        device = x.device.type
        on = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
        ctx.autocast = (device, torch.get_autocast_dtype(device)) if on else None
        return out

    @staticmethod
    def backward(ctx, grad):
        if ctx.autocast is None:
            return _Pipeline._backward(ctx, grad)
        with torch.autocast(ctx.autocast[0], dtype=ctx.autocast[1]):
            return _Pipeline._backward(ctx, grad)

    @staticmethod
    def _backward(ctx, grad):
        """The pipeline's backward, chunk by chunk. One function of ~70 lines on purpose: the order in which each
        chunk's gradient collectives are launched, waited on and its deferred parameter gradients accumulated is
        the overlap itself, and split into helpers that order would be spread over several places."""
        ops, params, saved, leaves = ctx.ops, ctx.params, ctx.saved, ctx.leaves
        need_dx = ctx.needs_input_grad[0]
        need_param = ctx.needs_input_grad[3:]
        grads: list[torch.Tensor | None] = [None] * len(params)
        # Without dX, nothing before the first op with parameters runs (as autograd would skip it).
        first = min(s for s, op in enumerate(ops) if isinstance(op, Linear) or (isinstance(op, Fn) and op.params))
        chunks = _Chunks(ctx.layout.split_out(grad))
        deferred: list[list[Callable[[], None]]] = [[] for _ in range(ctx.k)]

        def accumulate(i: int, g: torch.Tensor | None) -> None:
            if g is not None and need_param[i]:
                grads[i] = g if grads[i] is None else grads[i].add_(g)

        def accumulate_mm(i: int, a: torch.Tensor, b: torch.Tensor) -> None:
            """grads[i] += a @ b, summed inside the matmul (no extra pass over the weight gradient); under autocast
            the bfloat16 products are summed in the weight's dtype."""
            if grads[i] is None:
                grads[i] = (a @ b).to(params[i].dtype)
            elif grads[i].dtype == a.dtype == b.dtype:
                grads[i].addmm_(a, b)
            else:
                grads[i].add_(a @ b)

        def step(s: int, c: int) -> None:
            op = ops[s]
            if s < first and not need_dx:
                return
            want_dx = need_dx or s > first
            v = chunks.get(c)
            if isinstance(op, Comm):
                chunks.communicate(c, op, backward=True)
            elif isinstance(op, Linear):
                w = params[op.weight]
                regather = _regathers(ops, s)
                if regather and need_param[op.weight]:      # gather the input again while dX is computed
                    gather, got, local = ops[s - 1], {}, saved[(s, c)]
                    lane = chunks.lane(gather.axis)
                    lane.launch(lambda: comm.all_gather_async(local, gather.dim, gather.axis),
                                lambda t: got.__setitem__("x", t))
                if want_dx:
                    chunks.set(c, v @ w, fresh=True)
                if need_param[op.weight]:
                    if regather:
                        lane.flush()
                        x_in = got["x"]
                    else:
                        x_in = saved[(s, c)]
                    deferred[c].append(
                        lambda v=v, x_in=x_in, i=op.weight: accumulate_mm(i, _flat(v).t(), _flat(x_in)))
            else:
                inp, out = saved[(s, c)]
                wants = ([inp] if want_dx else []) + [leaves[i] for i in op.params]
                res = torch.autograd.grad(out, wants, v, allow_unused=True)
                if want_dx:
                    chunks.set(c, res[0], fresh=False)
                    res = res[1:]
                for i, g in zip(op.params, res, strict=True):
                    accumulate(i, g)
            # A chunk's deferred dW runs once its stage's collective is in flight (or at its stage's end).
            if (isinstance(op, Comm) or s == seq[-1]) and deferred[c]:
                for work in deferred[c]:
                    work()
                deferred[c].clear()

        seq, stages, step_order = _schedule(ops, backward=True)
        _wavefront(ctx.k, seq, stages, step_order, step)
        values = chunks.finish()
        for works in deferred:
            for work in works:
                work()
        dx = ctx.layout.join_in(values) if need_dx else None
        return (dx, None, None, *grads)


# ---------------------------------------------------------------------------------------------------------
# Layouts: how a layer's input and output are cut into chunks and put back together
# ---------------------------------------------------------------------------------------------------------

def _to_rank_major(x: torch.Tensor, g: int) -> torch.Tensor:
    """[B..., S, F] -> [g, M, F] with row r = the tokens of block r of S (a view when g == 1)."""
    f = x.shape[-1]
    if g == 1:
        return x.reshape(1, -1, f)
    s = x.shape[-2]
    return x.reshape(-1, g, s // g, f).transpose(0, 1).reshape(g, -1, f)


def _from_rank_major(t: torch.Tensor, lead: tuple[int, ...]) -> torch.Tensor:
    """Inverse of `_to_rank_major`: [g, M, F] -> [*lead, F], lead = (B..., S)."""
    g, f = t.shape[0], t.shape[-1]
    if g == 1:
        return t.reshape(*lead, f)
    return t.reshape(g, -1, lead[-1] // g, f).transpose(0, 1).reshape(*lead, f)


class _Tokens:
    """Chunks of tokens, [g*M_c, F] in rank-major order; g_in / g_out: the owners of the input / output rows
    (d0 for a side that holds all the tokens of a sequence-parallel block, else 1)."""

    def __init__(self, k: int, g_in: int = 1, g_out: int = 1):
        self.k, self.g_in, self.g_out = k, g_in, g_out

    def _split(self, x: torch.Tensor, g: int) -> list[torch.Tensor]:
        x_rm = _to_rank_major(x, g)
        return [x_rm[:, lo:hi].reshape(-1, x.shape[-1]) for lo, hi in self.bounds]

    def _join(self, chunks: list[torch.Tensor], g: int, lead: tuple[int, ...]) -> torch.Tensor:
        out = chunks[0].new_empty((g, self.m, chunks[0].shape[-1]))
        for (lo, hi), t in zip(self.bounds, chunks, strict=True):
            out[:, lo:hi] = t.reshape(g, hi - lo, -1)
        return _from_rank_major(out, lead)

    def split_in(self, x):
        self.lead_in = tuple(x.shape[:-1])
        self.m = x.shape[:-1].numel() // self.g_in
        self.bounds = chunk_bounds(self.m, self.k)
        return self._split(x, self.g_in)

    def join_out(self, chunks):
        lead = (*self.lead_in[:-1], self.lead_in[-1] * self.g_out // self.g_in)
        return self._join(chunks, self.g_out, lead)

    def split_out(self, grad):
        return self._split(grad, self.g_out)

    def join_in(self, chunks):
        return self._join(chunks, self.g_in, self.lead_in)


class _Sequences:
    """Chunks of whole sequences: x [B..., S, F] -> [Bf_c, S, F]."""

    def __init__(self, k: int, n: int):
        self.bounds = chunk_bounds(n, k)

    def _split(self, x: torch.Tensor) -> list[torch.Tensor]:
        xb = x.reshape(-1, *x.shape[-2:])
        return [xb[lo:hi] for lo, hi in self.bounds]

    def _join(self, chunks: list[torch.Tensor]) -> torch.Tensor:
        out = torch.cat(chunks, 0)
        return out.reshape(*self.lead, *out.shape[-2:])

    def split_in(self, x):
        self.lead = tuple(x.shape[:-2])
        return self._split(x)

    def join_out(self, chunks):
        return self._join(chunks)

    def split_out(self, grad):
        return self._split(grad)

    def join_in(self, chunks):
        return self._join(chunks)


# ---------------------------------------------------------------------------------------------------------
# The layers' pipelines
# ---------------------------------------------------------------------------------------------------------

def _enter(axis0: MeshAxis, sp: bool, dim: int) -> Comm:
    """How a column-first linear's input enters: gathered over axis 0 (sp), or copied (dX all-reduced)."""
    return Comm(ALL_GATHER, axis0, dim) if sp else Comm(COPY, axis0)


def _leave(axis0: MeshAxis, sp: bool, dim: int) -> Comm:
    """How a row-first linear's partial output leaves: reduce-scattered over axis 0 (sp), or all-reduced."""
    return Comm(REDUCE_SCATTER, axis0, dim) if sp else Comm(ALL_REDUCE, axis0)


def _check_sp_tokens(x: torch.Tensor, d0: int, what: str) -> None:
    if x.shape[-2] % d0:
        raise ValueError(f"{what}: sequence parallelism needs the token count ({x.shape[-2]}) divisible by "
                         f"d0={d0}; pad the sequence")


def column_first(x: torch.Tensor, weight: torch.Tensor, mesh: TPMesh, k: int, *, sequence_parallel: bool = False,
                 scatter_output: bool = False, regather_input: bool = True) -> torch.Tensor:
    """The column-first linear's reduced output (bias not added), its collectives in k overlapped chunks."""
    a0, a1 = mesh.axis0, mesh.axis1
    sp = sequence_parallel
    ops = [_enter(a0, sp, 0), Linear(0, regather=sp and regather_input),
           Comm(REDUCE_SCATTER, a1, -1) if scatter_output else Comm(ALL_REDUCE, a1)]
    return _Pipeline.apply(x, ops, _Tokens(check_chunks(k), 1, a0.size if sp else 1), weight)


def row_first(x: torch.Tensor, weight: torch.Tensor, mesh: TPMesh, k: int, *, sequence_parallel: bool = False,
              gather_input: bool = False, reduce_dx: bool = True) -> torch.Tensor:
    """The row-first linear's reduced output (bias not added), its collectives in k overlapped chunks.

    gather_input: x is still split over axis 1 along features (attention's heads) and is all-gathered here,
    chunk by chunk; its backward reduce-scatters dX. Otherwise reduce_dx all-reduces dX over axis 1 (False
    when the caller's own gather already reduces it).
    """
    a0, a1 = mesh.axis0, mesh.axis1
    sp = sequence_parallel
    if sp:
        _check_sp_tokens(x, a0.size, "row-first linear")
    ops = ([Comm(ALL_GATHER, a1, -1)] if gather_input else [Comm(COPY, a1)] if reduce_dx else [])
    ops += [Linear(0), _leave(a0, sp, 0)]
    return _Pipeline.apply(x, ops, _Tokens(check_chunks(k), a0.size if sp else 1, 1), weight)


def mlp(x: torch.Tensor, fc1_weight: torch.Tensor, fc1_bias: torch.Tensor | None, fc2_weight: torch.Tensor,
        mesh: TPMesh, k: int, *, activation: str, kernels: str = "auto", sequence_parallel: bool = False,
        regather_input: bool = True) -> torch.Tensor:
    """ParallelMlp's fc2(act(fc1(x) + b1)) (fc2's bias not added), pipelined over k chunks of tokens."""
    from tabfm.parallel.kernels.ops import bias_act

    a0, a1 = mesh.axis0, mesh.axis1
    sp = sequence_parallel
    params = [fc1_weight, fc2_weight] + ([] if fc1_bias is None else [fc1_bias])
    if fc1_bias is None:
        epilogue = Fn(lambda h, c: bias_act(h, None, activation, kernels))
    else:
        epilogue = Fn(lambda h, c, b: bias_act(h, b, activation, kernels), (2,))
    ops = [_enter(a0, sp, 0), Linear(0, regather=sp and regather_input), Comm(ALL_REDUCE, a1),   # fc1
           epilogue,                                                                              # bias + act
           Comm(COPY, a1), Linear(1), _leave(a0, sp, 0)]                                          # fc2
    return _Pipeline.apply(x, ops, _Tokens(check_chunks(k)), *params)


def attention(x: torch.Tensor, qkv_weight: torch.Tensor, qkv_bias: torch.Tensor | None, proj_weight: torch.Tensor,
              mesh: TPMesh, k: int, *, local_heads: int, num_kv: int | None = None,
              attn_mask: torch.Tensor | None = None, sequence_parallel: bool = False,
              regather_input: bool = True) -> torch.Tensor | None:
    """ParallelAttention's proj(attend(qkv(x))) (proj's bias not added), pipelined over k chunks of whole
    sequences; None when x holds fewer than 2 sequences (the caller then chunks each linear over tokens)."""
    from tabfm.parallel import dense

    a0, a1 = mesh.axis0, mesh.axis1
    sp = sequence_parallel
    n = x.shape[:-2].numel()
    if n < 2:
        return None
    layout = _Sequences(check_chunks(k), n)
    masks = None
    if attn_mask is not None:
        lead = x.shape[:-2]
        flat = attn_mask.expand(*lead, *attn_mask.shape[-2:]).reshape(-1, *attn_mask.shape[-2:])
        masks = [flat[lo:hi] for lo, hi in layout.bounds]

    def core(qkv: torch.Tensor, c: int, *bias: torch.Tensor) -> torch.Tensor:
        if bias:
            qkv = qkv + bias[0].to(qkv.dtype)                            # [Bf_c, S, 3 * H/N], as nn.Linear
        q, kk, v = qkv.unflatten(-1, (3, local_heads, -1)).movedim(-3, 0).transpose(-3, -2).unbind(0)
        ctx = dense.attend(q, kk, v, num_kv, None if masks is None else masks[c])
        return ctx.transpose(-3, -2).flatten(-2)                         # [Bf_c, S, H/N]

    params = [qkv_weight, proj_weight] + ([] if qkv_bias is None else [qkv_bias])
    ops = [_enter(a0, sp, -2), Linear(0, regather=sp and regather_input), Comm(REDUCE_SCATTER, a1, -1),  # qkv
           Fn(core, () if qkv_bias is None else (2,)),                                                  # heads
           Comm(ALL_GATHER, a1, -1), Linear(1), _leave(a0, sp, -2)]                                      # proj
    return _Pipeline.apply(x, ops, layout, *params)
