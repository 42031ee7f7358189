"""The ATP planner (DESIGN 3.3): count, price and rank every layout of N ranks for the model actually configured.

For each ordered factorisation N = d0 * d1, sequence parallelism on/off and overlap chunk count k, the planner
builds the plain model on the meta device, parallelizes it on `TPMesh.dry_run(d0, d1)` with those options and
runs one training step (forward, backward, optimizer) while recording this rank's timeline, in order:

    Op            every aten op, with its FLOPs and bytes (attention as one fused op)
    Collective    every collective launched on each axis, with its ring traffic (read off the axis's CommTally:
                  exactly what the real collectives tally on real ranks, tested)
    Wait          where the collective's result is first needed (at once when synchronous; after the next
                  chunk's compute when overlap.py launched it async)

On meta tensors nothing is computed or allocated, so the counts are exact at full size for any model and no
token count is scaled. A model of `depth` identical blocks is traced at depths 1 and 2 and extrapolated, which
is exact (see Extrapolated). Then a candidate's predicted step time is the timeline replayed (`price`):

    compute   op times: each op replayed and timed on this machine (CPU time, cached), or a preset's roofline
              max(flops / matmul rate, bytes / memory rate) + launch overhead; times the slowdown of ranks
              sharing cores
    exposed   each collective takes alpha + traffic / bandwidth of its axis (topology.py, one collective at a
              time per axis) from its launch; the time a Wait holds the clock is exposed communication, so
              chunked collectives hide behind the next chunk's compute and about the last chunk's stays exposed

A candidate is rejected, saying why, when the shapes don't divide (parallelize.layout_problems), the tokens
don't split over d0 (sequence parallel) or into k chunks, or the memory per device (weights, gradients,
optimizer state, saved activations) does not fit. `plan()` returns every candidate, ranked; `choose_layout()`
the winner and a reason (for `layout: auto`).

The model comes from a `ModelSource`: a callable returning (plain model, plan dict, input), the input being the
shape [B..., S, H] of the replicated activation the first planned layer sees (the planner shards it as the
layers expect: [B..., S(/d0), H/d1]) or a callable (mesh, sequence_parallel, device, dtype) -> tuple of model
inputs. `TransformerSpec` is one (a dense.BlockStack); the tabular model plugs in the same way.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

from tabfm.parallel import comm, dense
from tabfm.parallel.mesh import TPMesh, factorizations
from tabfm.parallel.parallelize import Plan, block_plan, layout_problems, parallelize
from tabfm.parallel.topology import AXES, FREE, ComputeRates, Topology, cache_dir, machine_id

PHASES = ("forward", "backward", "optimizer")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
CHUNKS = (1, 2, 4, 8)
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
    """A stack of pre-norm transformer blocks (dense.BlockStack) on a [batch, seq, hidden] input."""

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

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TransformerSpec:
        raw = dict(raw)
        kind = raw.pop("kind", "transformer")
        if kind != "transformer":
            raise ValueError(f"model.kind {kind!r} is not known to the planner; valid kinds: ['transformer']")
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(raw) - set(valid))
        if unknown:
            raise ValueError(f"unknown model keys {unknown}; valid keys are {['kind'] + valid}")
        return cls(**raw)

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


def _signature(func, args, kwargs) -> str:
    leaves, _ = tree_flatten((args, kwargs))
    parts = [str(func)]
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
    leaves, _ = tree_flatten(tree)
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
        key = _signature(func, args, kwargs)
        self.events.append(Op(str(func), flops, float(_tensor_bytes((args, kwargs, out))), bool(func.is_view), key,
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


def _build(source: ModelSource, dtype: torch.dtype, device: str = "meta") -> tuple[nn.Module, Plan, InputSpec]:
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
    model, plan_dict, spec = _build(source, dtype, device)
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

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        saved[st._cdata] = st.nbytes()
        return t

    with _collectives_traced(recorder):
        for phase in PHASES:
            mesh.reset_tallies()
            recorder.events = []
            if phase == "forward":
                with recorder, _AttentionAsOneOp(recorder), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    out = par(*inputs)
                    if isinstance(out, tuple):
                        out = out[0]
            elif phase == "backward":
                grad = torch.empty_like(out)
                with recorder:
                    out.backward(grad)
            elif optimizer != "none":
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
                recorder.events = list(_OPTIMIZER_EVENTS[key])
            events[phase] = recorder.events
            tallies[phase] = {a: mesh.axis(a).tally.snapshot() for a in AXES}
    param_numel = sum(p.numel() for p in par.parameters())
    return Trace(d0, d1, sequence_parallel, overlap_chunks, events, tallies, param_numel, sum(saved.values()),
                 tokens, dtype)


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
        now = 0.0
        free = {a: 0.0 for a in AXES}
        done: dict[int, float] = {}
        for e in tr.events[phase]:
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
        for e_id, end in done.items():  # launched and never awaited: the step still ends after it
            if end > now:
                now = end
    return compute_s, comm_s


def memory(tr: Trace | Extrapolated, optimizer: str) -> Memory:
    elem = torch.finfo(tr.dtype).bits // 8
    weights = tr.param_numel * elem
    opt = {"adamw": 8, "sgd": 0, "none": 0}[optimizer] * tr.param_numel
    if optimizer != "none" and tr.dtype not in (torch.float32, torch.float64):
        opt += 4 * tr.param_numel  # float32 master weights
    return Memory(weights, weights, opt, tr.activation_bytes)


def _dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose from {sorted(DTYPES)}")
    return DTYPES[name]


def plan(source: ModelSource, topology: Topology, nproc: int, *, dtype: str | torch.dtype | None = None,
         sequence_parallel: Iterable[bool] = (False, True), chunks: Iterable[int] = CHUNKS,
         optimizer: str = "adamw", memory_fraction: float = 0.9, compute: ComputeModel | None = None,
         traces: dict | None = None, trace_device: str = "meta") -> list[Candidate]:
    """Every candidate layout of `nproc` ranks, valid ones ranked by predicted step time, then the rejected
    ones with their reasons. Raises ValueError when the inputs are bad or nothing fits.

    compute: the op-time model (default: from the topology's rates); traces: a dict reused across calls (the
    traces depend on the model, layout, dtype and optimizer, not on the topology); trace_device: see trace().
    """
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
    dt = _dtype(dtype or topology.dtype)
    compute = compute or ComputeModel(topology.compute)
    if topology.compute.replay:
        compute.calibrate_overhead()
    traces = {} if traces is None else traces

    foreach = None if (topology.compute.replay and topology.compute.device == "cpu") else True
    model, plan_dict, spec = _build(source, dt)
    problems_of = _problems_of(source, model, plan_dict)
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
                if not cand.problems:
                    key = (d0, d1, sp, k, dt, optimizer)
                    if key not in traces:
                        traces[key] = _trace_for_plan(source, d0, d1, sp, k, dt, optimizer, foreach, trace_device)
                    tr = traces[key]
                    cand.volume = {a: float(tr.volume(a)) for a in AXES}
                    cand.calls = {a: tr.calls(a) for a in AXES}
                    cand.memory = memory(tr, optimizer)
                    limit = memory_fraction * topology.memory_bytes
                    if cand.memory.total > limit:
                        cand.problems.append(f"needs {_fmt_bytes(cand.memory.total)} per device, more than "
                                             f"{memory_fraction:.0%} of {_fmt_bytes(topology.memory_bytes)}")
                    else:
                        cand.compute_seconds, cand.comm_seconds = price(tr, topology, compute)
                        cand.step_seconds = cand.compute_seconds + cand.exposed_seconds
                out.append(cand)
    compute.save()
    valid = sorted((c for c in out if c.valid), key=lambda c: (c.step_seconds, c.chunks, c.d1, c.sequence_parallel))
    if not valid:
        raise ValueError(_nothing_fits(out, problems_of, nproc, chunks))
    for r, c in enumerate(valid, 1):
        c.rank = r
    return valid + [c for c in out if not c.valid]


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
    reason = (f"{best.layout} (d0={best.d0}, d1={best.d1}), sequence parallel {'on' if best.sequence_parallel else 'off'}"
              f", {best.chunks} chunk{'s' if best.chunks > 1 else ''}: predicted {best.step_seconds * 1e3:.3g} ms/step "
              f"(compute {best.compute_seconds * 1e3:.3g} ms + exposed communication {best.exposed_seconds * 1e3:.3g} ms"
              f") on {topology.name}")
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
    return str(_dtype(dtype)).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------------------

def _fmt_bytes(b: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= scale:
            return f"{b / scale:.3g}{unit}"
    return f"{b:.0f}B"


def _fmt_s(s: float) -> str:
    return f"{s * 1e3:.3g}"


def table(candidates: list[Candidate], top: int | None = None) -> str:
    """The ranked table: valid candidates (best first), then rejected layouts with why."""
    head = (f"{'rank':>4}  {'layout':>6}  {'sp':>3}  {'k':>2}  {'step ms':>9}  {'compute':>8}  {'comm tp0':>9}  "
            f"{'comm tp1':>9}  {'vol tp0':>8}  {'vol tp1':>8}  {'mem/dev':>8}")
    lines = [head, "-" * len(head)]
    valid = [c for c in candidates if c.valid]
    for c in valid[:top] if top else valid:
        lines.append(f"{c.rank:>4}  {c.layout:>6}  {'on' if c.sequence_parallel else 'off':>3}  {c.chunks:>2}  "
                     f"{_fmt_s(c.step_seconds):>9}  {_fmt_s(c.compute_seconds):>8}  "
                     f"{_fmt_s(c.comm_seconds['tp0']):>9}  {_fmt_s(c.comm_seconds['tp1']):>9}  "
                     f"{_fmt_bytes(c.volume['tp0']):>8}  {_fmt_bytes(c.volume['tp1']):>8}  "
                     f"{_fmt_bytes(c.memory.total):>8}")
    if top and len(valid) > top:
        lines.append(f"  ... {len(valid) - top} more valid candidates")
    rejected: dict[str, list[str]] = {}
    for c in candidates:
        if not c.valid:
            rejected.setdefault(f"{c.layout} sp={'on' if c.sequence_parallel else 'off'}", [])
            for p in c.problems:
                if p not in rejected[f"{c.layout} sp={'on' if c.sequence_parallel else 'off'}"]:
                    rejected[f"{c.layout} sp={'on' if c.sequence_parallel else 'off'}"].append(p)
    if rejected:
        lines.append("rejected:")
        lines += [f"  {k}: {'; '.join(v[:4])}{' ...' if len(v) > 4 else ''}" for k, v in rejected.items()]
    lines.append("comm = exposed communication ms per step; vol = ring traffic per device per step; "
                 "mem/dev = weights + grads + optimizer + saved activations")
    return "\n".join(lines)


def draw(candidates: list[Candidate], path: str | Path, title: str = "") -> Path:
    """A bar chart: predicted step time (compute + exposed communication per axis) of the best chunk count of each
    (layout, sequence parallel), rejected layouts named with their first reason."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best: dict[tuple, Candidate] = {}
    for c in candidates:
        if c.valid and (c.d0, c.d1, c.sequence_parallel) not in best:
            best[(c.d0, c.d1, c.sequence_parallel)] = c
    rows = sorted(best.values(), key=lambda c: c.step_seconds)
    rejected = {}
    for c in candidates:
        if not c.valid and (c.d0, c.d1, c.sequence_parallel) not in best:
            rejected.setdefault(f"{c.layout}{' sp' if c.sequence_parallel else ''}", c.problems[0])
    fig, ax = plt.subplots(figsize=(9, 1.8 + 0.45 * (len(rows) + len(rejected))))
    labels = [c.label for c in rows]
    y = list(range(len(rows)))
    comp = [c.compute_seconds * 1e3 for c in rows]
    c0 = [c.comm_seconds["tp0"] * 1e3 for c in rows]
    c1 = [c.comm_seconds["tp1"] * 1e3 for c in rows]
    ax.barh(y, comp, color="#4c72b0", label="compute")
    ax.barh(y, c0, left=comp, color="#dd8452", label="exposed comm, axis 0")
    ax.barh(y, c1, left=[a + b for a, b in zip(comp, c0)], color="#55a868", label="exposed comm, axis 1")
    for k, (name, why) in enumerate(rejected.items()):
        labels.append(f"{name} (rejected)")
        ax.text(0, len(rows) + k, f" {why[:90]}", va="center", fontsize=7, color="#a33")
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("predicted step time, ms")
    ax.set_title(title or "ATP plan", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.6 / (len(labels) + 1)), ncol=3,
              frameon=False)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------------------
# Plan configs (YAML): a `model:` section and an optional `plan:` section
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

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> PlanOptions:
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(raw) - set(valid))
        if unknown:
            raise ValueError(f"unknown plan keys {unknown}; valid keys are {valid}")
        raw = dict(raw)
        for key in ("sequence_parallel", "chunks"):
            if key in raw:
                value = raw[key]
                raw[key] = tuple(value) if isinstance(value, (list, tuple)) else (value,)
        return cls(**raw)

    def kwargs(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def load_config(path: str | Path) -> tuple[TransformerSpec, PlanOptions]:
    """Read a plan config: `model:` (the transformer spec) and an optional `plan:` section."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config {path} does not exist")
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"config {path} must be a mapping with a `model:` section")
    unknown = sorted(set(raw) - {"model", "plan"})
    if unknown:
        raise ValueError(f"config {path}: unknown sections {unknown}; valid sections are ['model', 'plan']")
    if "model" not in raw:
        raise ValueError(f"config {path} has no `model:` section (keys: kind, {', '.join(f.name for f in fields(TransformerSpec))})")
    return TransformerSpec.from_dict(raw["model"] or {}), PlanOptions.from_dict(raw.get("plan") or {})
