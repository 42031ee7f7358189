"""Tracing one training step of one layout (the planner's first part; DESIGN 3.3): what rank (0, 0) of a
(d0, d1) mesh runs, op by op and collective by collective, without running it.

`trace(source, d0, d1, sequence_parallel, overlap_chunks)` builds the plain model on the meta device, parallelizes
it on `TPMesh.dry_run(d0, d1)` and runs forward, backward and the optimizer step while recording, in order:

    Op            every aten op, with its FLOPs and bytes (attention as one fused op) and a way to replay it
    Collective    every collective launched on each axis, with its ring traffic (read off the axis's CommTally:
                  exactly what the real collectives tally on real ranks, tested)
    Wait          where the collective's result is first needed (at once when synchronous; after the next
                  chunk's compute when overlap.py launched it async)

On meta tensors nothing is computed or allocated, so the counts are exact at full size for any model. A model of
`depth` identical blocks is traced at depths 1 and 2 and extrapolated, which is exact (see Extrapolated).

The model comes from a `ModelSource`: a callable returning (plain model, plan dict or parallelizer, input), the
input being the shape [B..., S, H] of the replicated activation the first planned layer sees (the tracer shards it
as the layers expect: [B..., S(/d0), H/d1]) or a callable (mesh, sequence_parallel, device, dtype) -> tuple of
model inputs. `TransformerSpec` is one (a dense.BlockStack); tabfm.layout.TabFMSource is the tabular model's.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from fractions import Fraction
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import flop_registry

from tabfm.parallel import comm, dense
from tabfm.parallel.mesh import TPMesh
from tabfm.parallel.parallelize import Plan, block_plan, parallelize
from tabfm.parallel.topology import AXES

PHASES = ("forward", "backward", "optimizer")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
OPTIMIZERS = ("adamw", "sgd", "none")

InputSpec = Sequence[int] | Callable[..., tuple]
"""The replicated block input's shape [B..., S, H], or inputs(mesh, sequence_parallel, device, dtype) -> tuple."""
Parallelizer = Callable[[nn.Module, TPMesh, bool, int], nn.Module]
"""parallelizer(model, mesh, sequence_parallel, overlap_chunks) -> the model on the mesh (instead of a plan dict,
for models that need more than `parallelize`; the source may then offer layout_problems(d0, d1) -> [str])."""
ModelSource = Callable[[], tuple[nn.Module, Plan | Parallelizer, InputSpec]]


# ---------------------------------------------------------------------------------------------------------
# The model source for `tabfm plan` until the tabular model exists
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TransformerSpec:
    """A stack of pre-norm transformer blocks (dense.BlockStack) on a [batch, seq, hidden] input; a plan config
    writes it `model: {kind: transformer, depth: ..., ...}` (tabfm.plan_config.load_plan)."""

    KIND = "transformer"
    """Its tag among the models a plan config may name."""

    depth: int = 2
    """Blocks."""
    hidden: int = 256
    """Hidden size."""
    heads: int = 8
    """Attention heads (must divide by d0 * d1)."""
    mlp_ratio: int = 4
    """MLP width / hidden."""
    seq: int = 256
    """Tokens per sequence."""
    batch: int = 4
    """Sequences per step (per tensor-parallel mesh)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model.{f.name} must be a positive integer, got {value!r}")
        if self.hidden % self.heads:
            raise ValueError(f"model.hidden={self.hidden} is not divisible by model.heads={self.heads}")

    def __call__(self) -> tuple[nn.Module, Plan, tuple[int, ...]]:
        model = dense.BlockStack(self.depth, self.hidden, self.heads, self.mlp_ratio)
        return model, block_plan(), (self.batch, self.seq, self.hidden)

    def with_depth(self, depth: int) -> TransformerSpec:
        """The same model with another number of (identical) blocks: the planner traces depths 1 and 2 and
        extrapolates (see Extrapolated)."""
        return replace(self, depth=depth)

    def describe(self) -> str:
        params = self.depth * (4 + 2 * self.mlp_ratio) * self.hidden ** 2
        size = f"{params / 1e9:.3g}B" if params >= 1e9 else f"{params / 1e6:.3g}M"
        return (f"transformer depth={self.depth} hidden={self.hidden} heads={self.heads} mlp_ratio={self.mlp_ratio} "
                f"seq={self.seq} batch={self.batch} (~{size} parameters)")


# ---------------------------------------------------------------------------------------------------------
# Tracing one training step of one layout on the meta device
# ---------------------------------------------------------------------------------------------------------

@dataclass
class Op:
    """One op this rank runs."""

    name: str
    flops: float
    bytes: float
    view: bool
    key: str
    """Replay signature: op and input shapes / strides / dtypes."""
    replay: Callable[[str], Callable[[], Any]] | None = field(default=None, repr=False)
    """replay(device) -> a zero-argument function that runs the op once on real tensors."""


@dataclass(eq=False)
class Collective:
    """A collective launched on one axis (its result may be awaited later: see Wait)."""

    axis: str
    kind: str
    traffic: Fraction
    """Ring traffic bytes per device (CommTally's measure)."""


@dataclass(eq=False)
class Wait:
    """The point where this rank first needs a collective's result (right after its launch when synchronous;
    later when the overlap code launched it async and computed meanwhile)."""

    collective: Collective


@dataclass
class Trace:
    """One training step of one layout, as this rank (0, 0) runs it."""

    d0: int
    d1: int
    sequence_parallel: bool
    chunks: int
    events: dict[str, list[Op | Collective | Wait]]
    tallies: dict[str, dict[str, dict]]
    """phase -> axis -> CommTally.snapshot()."""
    param_numel: int
    activation_bytes: int
    tokens: int | None
    """Tokens this rank's block input holds (chunking splits them); None for an input function."""
    dtype: torch.dtype

    def volume(self, axis: str) -> Fraction:
        """Ring traffic bytes per device on `axis` for one step."""
        return sum((sum(self.tallies[p][axis]["traffic"].values(), Fraction(0)) for p in PHASES), Fraction(0))

    def calls(self, axis: str) -> int:
        return sum(sum(self.tallies[p][axis]["calls"].values()) for p in PHASES)

    @property
    def flops(self) -> float:
        return sum(e.flops for p in PHASES for e in self.events[p] if isinstance(e, Op))


@dataclass
class Extrapolated:
    """A model of `depth` identical blocks from traces at depth 1 and 2: every count the planner uses (ring
    traffic, calls, parameters, saved activations, step time) is m(1) + (depth - 1) * (m(2) - m(1)), exact
    because the blocks are identical and no collective is in flight across a block boundary (tested)."""

    one: Trace
    two: Trace
    depth: int

    def __getattr__(self, name):  # d0, d1, sequence_parallel, chunks, tokens, dtype
        return getattr(self.__dict__["one"], name)

    def _line(self, m1, m2):
        return m1 + (self.depth - 1) * (m2 - m1)

    def volume(self, axis: str) -> Fraction:
        return self._line(self.one.volume(axis), self.two.volume(axis))

    def calls(self, axis: str) -> int:
        return self._line(self.one.calls(axis), self.two.calls(axis))

    @property
    def param_numel(self) -> int:
        return self._line(self.one.param_numel, self.two.param_numel)

    @property
    def activation_bytes(self) -> int:
        return self._line(self.one.activation_bytes, self.two.activation_bytes)

    @property
    def flops(self) -> float:
        return self._line(self.one.flops, self.two.flops)


def _leaves(tree) -> list:
    """The leaves of nested lists, tuples and dicts in torch's pytree order (an aten op's arguments and results
    are made of these): a few times faster than tree_flatten, and the recorder calls it for every op. Iterative:
    a recursive closure would be a reference cycle holding the op's tensors alive until the next garbage
    collection, and a tensor still referenced when an op returns changes the ops torch dispatches after it."""
    out, stack = [], [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, (list, tuple)):
            stack.extend(reversed(x))
        elif isinstance(x, dict):
            stack.extend(reversed(list(x.values())))
        else:
            out.append(x)
    return out


def _signature(func, args, kwargs) -> str:
    return _signature_of(str(func), _leaves((args, kwargs)))


def _signature_of(name: str, leaves: list) -> str:
    parts = [name]
    for x in leaves:
        if isinstance(x, torch.Tensor):
            parts.append(f"T{tuple(x.shape)}s{tuple(x.stride())}{str(x.dtype)[6:]}")
        else:
            parts.append(repr(x))
    return "|".join(parts)


def _real_like(t: torch.Tensor, device: str) -> torch.Tensor:
    """A real tensor with t's shape, strides and dtype (random floats, True masks, zero indices)."""
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else 0
    base = torch.empty(span, dtype=t.dtype, device=device)
    if t.dtype.is_floating_point:
        base.normal_()
    elif t.dtype == torch.bool:
        base.fill_(True)
    else:
        base.zero_()
    return base.as_strided(tuple(t.shape), tuple(t.stride()))


def _materialize(tree, device: str):
    memo: dict[int, torch.Tensor] = {}

    def conv(x):
        if isinstance(x, torch.Tensor):
            if id(x) not in memo:
                memo[id(x)] = _real_like(x, device)
            return memo[id(x)]
        if isinstance(x, torch.device):
            return torch.device(device)
        return x

    return tree_map(conv, tree)


def _copies(nbytes: float, device: str) -> int:
    """Input copies a replay cycles through so that, as inside the model, its inputs are not in the CPU's
    private cache from the previous call."""
    return 1 if device != "cpu" or nbytes <= 0 else max(1, min(16, math.ceil(_CACHE_BYTES / nbytes)))


_CACHE_BYTES = 16 << 20


def _tensor_bytes(tree) -> int:
    return _leaf_bytes(_leaves(tree))


def _leaf_bytes(leaves: list) -> int:
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


class _Recorder(TorchDispatchMode):
    """Records every aten op (outside collectives) with FLOPs, bytes and a way to replay it."""

    def __init__(self):
        super().__init__()
        self.events: list[Op | Collective] = []
        self.suspended = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.suspended or func.namespace == "profiler":
            return out
        packet = func._overloadpacket
        flops = float(flop_registry[packet](*args, **kwargs, out_val=out)) if packet in flop_registry else 0.0
        name, leaves = str(func), _leaves((args, kwargs))
        nbytes = _leaf_bytes(leaves) + _tensor_bytes(out)
        self.events.append(Op(name, flops, float(nbytes), bool(func.is_view), _signature_of(name, leaves),
                              replay=lambda device, f=func, a=args, k=kwargs: _op_replay(f, a, k, device)))
        return out


def _op_replay(func, args, kwargs, device):
    inputs = [_materialize((args, kwargs), device) for _ in range(_copies(_tensor_bytes((args, kwargs)), device))]
    turn = [0]

    def run():
        a, k = inputs[turn[0] % len(inputs)]
        turn[0] += 1
        return func(*a, **k)

    return run


class _FusedAttention(torch.autograd.Function):
    """Stands in for F.scaled_dot_product_attention while tracing: one fused op forward and one backward (a
    flash-attention kernel's FLOPs: 2 matmuls forward, 5 backward), output of the right shape."""

    @staticmethod
    def forward(ctx, q, k, v, recorder, options):
        ctx.recorder, ctx.options = recorder, options
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        ctx.save_for_backward(q, k, v, out)
        fwd = 2 * q.shape[:-2].numel() * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1])
        ctx.fwd_flops = fwd
        shapes = (q, k, v)
        recorder.events.append(Op(
            "sdpa.forward", float(fwd), float(_tensor_bytes((q, k, v, out))), False,
            _signature("sdpa.forward", shapes, options),
            replay=lambda device: _sdpa_replay(shapes, options, device, backward=False)))
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out = ctx.saved_tensors
        shapes = (q, k, v)
        ctx.recorder.suspended += 1
        ctx.recorder.events.append(Op(
            "sdpa.backward", 2.5 * ctx.fwd_flops, float(2 * _tensor_bytes((q, k, v, out))), False,
            _signature("sdpa.backward", shapes, ctx.options),
            replay=lambda device: _sdpa_replay(shapes, ctx.options, device, backward=True)))
        grads = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), None, None
        ctx.recorder.suspended -= 1
        return grads


def _sdpa_replay(shapes, options, device, backward):
    q, k, v = (_real_like(t, device).requires_grad_(backward) for t in shapes)
    opts = _materialize(options, device)
    if not backward:
        return lambda: F.scaled_dot_product_attention(q, k, v, **opts)
    out = F.scaled_dot_product_attention(q, k, v, **opts)
    grad = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)


class _AttentionAsOneOp(torch.overrides.TorchFunctionMode):
    def __init__(self, recorder: _Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v, *rest = args
            names = ("attn_mask", "dropout_p", "is_causal", "scale")
            options = dict(zip(names, rest)) | kwargs
            with self.recorder_suspended():
                return _FusedAttention.apply(q, k, v, self.recorder, options)
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def recorder_suspended(self):
        self.recorder.suspended += 1
        try:
            yield
        finally:
            self.recorder.suspended -= 1


class _RecordedHandle:
    """A collective's handle that marks in the trace where its result is first needed."""

    def __init__(self, handle, recorder: _Recorder, collective: Collective):
        self._handle, self._recorder, self._collective = handle, recorder, collective

    def wait(self):
        if self._collective is not None:
            self._recorder.events.append(Wait(self._collective))
            self._collective = None
        return self._handle.wait()


def _collectives_traced(recorder: _Recorder):
    """While tracing, observe comm's async collectives (comm.observing): ops inside a dry-run collective belong
    to the collective (their cost is in the link's time), not to compute, and each handle records where its
    result is first awaited."""

    def traced(launch, *args, **kwargs):
        before = len(recorder.events)
        recorder.suspended += 1
        try:
            handle = launch(*args, **kwargs)
        finally:
            recorder.suspended -= 1
        launched = [e for e in recorder.events[before:] if isinstance(e, Collective)]
        return _RecordedHandle(handle, recorder, launched[-1]) if launched else handle

    return comm.observing(traced)


def _inputs(spec: InputSpec, mesh: TPMesh, sp: bool, dtype: torch.dtype, device: str) -> tuple:
    if callable(spec):
        return tuple(spec(mesh, sp, torch.device(device), dtype))
    shape = tuple(int(s) for s in spec)
    if len(shape) < 2:
        raise ValueError(f"the example input shape {shape} needs at least [tokens, hidden]")
    *lead, s, h = shape
    local = (*lead, s // mesh.d0 if sp else s, h // mesh.d1)
    return (torch.zeros(local, device=device, dtype=dtype, requires_grad=True),)


def build_source(source: ModelSource, dtype: torch.dtype, device: str = "meta") -> tuple[nn.Module, Plan, InputSpec]:
    with torch.device(device):
        built = source()
    if not (isinstance(built, tuple) and len(built) == 3):
        raise ValueError("a model source must return (model, plan, example input shape or input function)")
    model, plan_dict, spec = built
    return model.to(dtype), plan_dict, spec


_OPTIMIZER_EVENTS: dict[tuple, list] = {}  # the optimizer step depends only on the local parameter shapes


def trace(source: ModelSource, d0: int, d1: int, sequence_parallel: bool = False, overlap_chunks: int = 1, *,
          dtype: torch.dtype = torch.float32, optimizer: str = "adamw", foreach: bool | None = None,
          device: str = "meta") -> Trace:
    """Run one training step of the layout on a dry-run mesh and record its ops and collectives.

    foreach: the optimizer implementation (None: torch's default, single-tensor on CPU; True as on CUDA).
    device: "meta" (nothing computed: exact counts at any size), or "cpu" for a model whose forward needs
    values (data-dependent shapes); the counts are the same, the cost is running the step once.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # meta kernels warn about resized `out=` tensors
        return _trace(source, d0, d1, sequence_parallel, overlap_chunks, dtype, optimizer, foreach, device)


def _trace(source, d0, d1, sequence_parallel, overlap_chunks, dtype, optimizer, foreach, device) -> Trace:
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose from {list(OPTIMIZERS)}")
    model, plan_dict, spec = build_source(source, dtype, device)
    mesh = TPMesh.dry_run(d0, d1)
    if callable(plan_dict):
        par = plan_dict(model, mesh, sequence_parallel, overlap_chunks)
    else:
        par = parallelize(model, mesh, plan_dict, sequence_parallel=sequence_parallel, overlap_chunks=overlap_chunks)
    inputs = _inputs(spec, mesh, sequence_parallel, dtype, device)
    tokens = None if callable(spec) else math.prod(inputs[0].shape[:-1])
    recorder = _Recorder()
    for name in AXES:
        mesh.axis(name).delay = lambda kind, traffic, started, name=name: recorder.events.append(
            Collective(name, kind, traffic))
    events: dict[str, list] = {}
    tallies: dict[str, dict] = {}
    saved: dict[int, int] = {}
    with _collectives_traced(recorder):
        for phase in PHASES:
            mesh.reset_tallies()
            recorder.events = []
            if phase == "forward":
                out = _forward(par, inputs, recorder, saved)
            elif phase == "backward":
                grad = torch.empty_like(out)  # not recorded: the loss's gradient is no op of the model
                with recorder:
                    out.backward(grad)
            elif optimizer != "none":
                recorder.events = _optimizer_events(par, recorder, optimizer, foreach, dtype, device)
            events[phase] = recorder.events
            tallies[phase] = {a: mesh.axis(a).tally.snapshot() for a in AXES}
    param_numel = sum(p.numel() for p in par.parameters())
    return Trace(d0, d1, sequence_parallel, overlap_chunks, events, tallies, param_numel, sum(saved.values()),
                 tokens, dtype)


def _forward(par: nn.Module, inputs: tuple, recorder: _Recorder, saved: dict[int, int]) -> torch.Tensor:
    """The recorded forward; `saved` gets the bytes of every storage autograd keeps for backward (activation
    memory), each storage counted once."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        saved[st._cdata] = st.nbytes()
        return t

    with recorder, _AttentionAsOneOp(recorder), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = par(*inputs)
    return out[0] if isinstance(out, tuple) else out


def _optimizer_events(par: nn.Module, recorder: _Recorder, optimizer: str, foreach: bool | None,
                      dtype: torch.dtype, device: str) -> list:
    """The ops of one steady-state optimizer step (recorded once per set of local parameter shapes)."""
    params = [p for p in par.parameters() if p.requires_grad]
    key = (optimizer, foreach, dtype, device, tuple(tuple(p.shape) for p in params))
    if key not in _OPTIMIZER_EVENTS:
        opt = (torch.optim.AdamW(params, foreach=foreach) if optimizer == "adamw"
               else torch.optim.SGD(params, lr=0.1, foreach=foreach))
        opt.step()  # state initialisation happens once; time a steady-state step
        with recorder:
            opt.step()
            opt.zero_grad(set_to_none=False)
        _OPTIMIZER_EVENTS[key] = recorder.events
    return list(_OPTIMIZER_EVENTS[key])


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    """A dtype from its name (float32, bfloat16, ...); ValueError naming the choices."""
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose from {sorted(DTYPES)}")
    return DTYPES[name]
