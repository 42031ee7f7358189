"""Chunked communication/compute overlap (parallel/overlap.py) changes nothing but the schedule.

On every mesh of the core tests, with and without sequence parallelism, layers with overlap_chunks k = 2, 4
and 5 (uneven chunks: 24 tokens in 5, 6 sequence-parallel tokens in 4, 3 sequences in 2) and a k above the
token count give the outputs, input gradients and every parameter gradient of the same layers with k = 1, to
1e-10 in float64: the MLP and attention pipelines, attention on one sequence (each linear chunked over tokens),
bare column-first / row-first linears, and a block stack (also keeping gathered inputs instead of re-gathering).
The tallies count k times the calls with the same total traffic (plus, under sequence parallelism, the
backward re-gather of the column-first inputs, and the unchunked replicated-gradient all-reduces).
"""

from __future__ import annotations

import copy
from fractions import Fraction

import numpy as np
import pytest
import torch
from builders import B, H, HEADS, S, Holder, layer_case
from dist_harness import get_mesh
from torch import nn

from tabfm.parallel import dense
from tabfm.parallel.comm import ALL_GATHER, ALL_REDUCE, KINDS, REDUCE_SCATTER
from tabfm.parallel.layers import ColumnFirstLinear, gather_activation, shard_activation
from tabfm.parallel.mesh import TPMesh
from tabfm.parallel.options import ParallelOptions
from tabfm.parallel.overlap import chunk_bounds
from tabfm.parallel.parallelize import block_plan, parallelize

MESHES = [(1, 1), (2, 1), (1, 2), (4, 1), (2, 2), (1, 4)]
CHUNKS = (2, 4, 5)


def _batch(kind: str) -> int:
    """Sequences per input: attention pipelines chunks of whole sequences (3: uneven; 1: chunks each linear's
    tokens instead)."""
    return {"attention_b3": 3, "attention_b1": 1}.get(kind, B)


def _build(kind: str) -> tuple[nn.Module, dict[str, str], dict]:
    """The core tests' modules (builders.layer_case), plus attention on 3 or 1 sequences and bare linears."""
    if kind in ("attention_b3", "attention_b1"):
        return Holder(dense.Attention(H, HEADS)), {"m": "attention"}, {"num_kv": 8}
    if kind == "linears":  # bare column-first then row-first linears (the "colwise" / "rowwise" styles)
        return (Holder(nn.Sequential(nn.Linear(H, 2 * H), nn.Linear(2 * H, H))),
                {"m.0": "colwise", "m.1": "rowwise"}, {})
    return layer_case(kind)


def _keep_gathered_inputs(par: nn.Module) -> nn.Module:
    """Column-first layers keep their gathered input for backward instead of re-gathering it."""
    for m in par.modules():
        if isinstance(m, ColumnFirstLinear):
            m.regather_input = False
    return par


def _run(model: nn.Module, plan, kwargs, mesh, sp: bool, k: int, x, g,
         regather: bool = True) -> dict[str, torch.Tensor]:
    par = parallelize(copy.deepcopy(model), mesh, plan, sequence_parallel=sp, overlap_chunks=k)
    if not regather:
        _keep_gathered_inputs(par)
    x = x.clone().requires_grad_()
    y = gather_activation(par.m(shard_activation(x, mesh, sp), **kwargs), mesh, sp)
    (y * g).sum().backward()
    out = {"out": y.detach(), "dx": x.grad}
    out.update({f"grad {n}": p.grad for n, p in par.named_parameters()})
    return out


LAYER_KINDS = ("mlp", "attention", "attention_ctx", "attention_b3", "attention_b1", "stack", "linears")


def _runs(kind: str) -> list[tuple[int, bool]]:
    """(chunks, re-gather inputs) of each chunked run compared with the unchunked one."""
    runs = [(k, True) for k in CHUNKS]
    if kind == "stack":
        runs += [(64, True), (4, False)]  # more chunks than tokens; gathered inputs kept, not re-gathered
    return runs


def _compared() -> set[str]:
    """The name of every comparison _overlap_errors must make: each run of each kind, each tensor."""
    return {f"{kind} k={k}{'' if regather else ' keep'} {name}" for kind in LAYER_KINDS for k, regather in _runs(kind)
            for name in ("out", "dx", *(f"grad {n}" for n, _ in _build(kind)[0].named_parameters()))}


def _overlap_errors(d0: int, d1: int, sp: bool) -> dict[str, float]:
    """Run on every rank: max |k-chunk - unchunked| over all kinds, chunk counts and tensors."""
    mesh = get_mesh(d0, d1) if d0 * d1 > 1 else TPMesh.single()
    errors = {}
    for kind in LAYER_KINDS:
        torch.manual_seed(1234)
        model, plan, kwargs = _build(kind)
        model = model.double()
        x = torch.randn(_batch(kind), S, H, dtype=torch.float64) * 3 + 0.5
        g = torch.randn(_batch(kind), S, H, dtype=torch.float64)
        want = _run(model, plan, kwargs, mesh, sp, 1, x, g)
        for k, regather in _runs(kind):
            got = _run(model, plan, kwargs, mesh, sp, k, x, g, regather)
            assert got.keys() == want.keys()
            for name, t in want.items():
                assert got[name] is not None and got[name].shape == t.shape, (kind, k, name)
                errors[f"{kind} k={k}{'' if regather else ' keep'} {name}"] = (got[name] - t).abs().max().item()
    return errors


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("d0,d1", MESHES, ids=[f"{d0}x{d1}" for d0, d1 in MESHES])
def test_overlapped_layers_equal_unchunked(ranks, d0, d1, sp):
    n = d0 * d1
    results = [_overlap_errors(d0, d1, sp)] if n == 1 else ranks(n).run(_overlap_errors, d0, d1, sp)
    compared = _compared()
    for rank, errors in enumerate(results):
        assert errors.keys() == compared
        bad = {k: v for k, v in errors.items() if not v <= 1e-10}
        assert not bad, f"rank {rank}: {bad}"


def test_chunk_bounds_cover_tokens_unevenly():
    assert chunk_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert chunk_bounds(3, 8) == [(0, 1), (1, 2), (2, 3)]           # capped at one token per chunk
    assert chunk_bounds(0, 4) == [(0, 0)]
    for n, k in [(24, 5), (7, 7), (100, 3)]:
        b = chunk_bounds(n, k)
        sizes = [hi - lo for lo, hi in b]
        assert b[0][0] == 0 and b[-1][1] == n and max(sizes) - min(sizes) <= 1
        assert all(b[i][1] == b[i + 1][0] for i in range(len(b) - 1))


def test_bad_options_are_refused_clearly(monkeypatch):
    model = Holder(dense.BlockStack(1, H, HEADS))
    with pytest.raises(ValueError, match="overlap_chunks must be a positive integer"):
        parallelize(copy.deepcopy(model), TPMesh.single(), block_plan("m"), overlap_chunks=0)
    with pytest.raises(ValueError, match="kernels must be one of auto, triton, torch"):
        parallelize(copy.deepcopy(model), TPMesh.single(), block_plan("m"), kernels="cuda")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    par = parallelize(copy.deepcopy(model), TPMesh.single(), block_plan("m"), kernels="triton")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        par.m(torch.randn(B, S, H))


def test_parallel_options_are_checked_once_and_reach_every_layer():
    options = ParallelOptions(sequence_parallel=np.True_, overlap_chunks=3, kernels="torch")  # a numpy flag too
    assert options == ParallelOptions(True, 3, "torch") and options.sequence_parallel is True
    par = parallelize(Holder(dense.BlockStack(1, H, HEADS)), TPMesh.dry_run(2, 2), block_plan("m"), options)
    layers = [m for m in par.modules() if hasattr(m, "sequence_parallel")]
    assert len(layers) == 8  # two norms, the attention and the MLP, and the two linears of each
    for m in par.modules():
        for name in ("sequence_parallel", "overlap_chunks", "kernels"):
            assert getattr(m, name, getattr(options, name)) == getattr(options, name), (m, name)
    model = Holder(dense.BlockStack(1, H, HEADS))
    with pytest.raises(TypeError, match="not both"):
        parallelize(model, TPMesh.single(), block_plan("m"), options, overlap_chunks=2)
    with pytest.raises(TypeError, match="options must be a ParallelOptions, got bool"):
        parallelize(model, TPMesh.single(), block_plan("m"), True)
    with pytest.raises(ValueError, match="sequence_parallel must be true or false, got 'yes'"):
        ParallelOptions(sequence_parallel="yes")


def test_sequence_parallel_token_count_must_divide(ranks):
    for msg in ranks(2).run(_odd_tokens_message):
        assert "divisible by d0=2" in msg


def _odd_tokens_message() -> str:
    mesh = get_mesh(2, 1)
    par = parallelize(Holder(dense.Mlp(H, 4 * H)), mesh, {"m": "mlp"}, sequence_parallel=True, overlap_chunks=2)
    try:
        par.m.fc2(torch.randn(B, 7, 4 * H // 2))
    except ValueError as e:
        return str(e)
    return ""


# ---------------------------------------------------------------------------------------------------------
# Tallies
# ---------------------------------------------------------------------------------------------------------

TB, TS = 4, 8   # sequences and tokens per sequence in the tally tests (k <= TB: attention chunks sequences)
ELEM = 8        # float64


class AttnMlp(nn.Module):
    """DESIGN 3.2's block without norms, every collective of which belongs to a chunked linear."""

    def __init__(self, heads: int = HEADS):
        super().__init__()
        self.attn = dense.Attention(H, heads)
        self.mlp = dense.Mlp(H, 4 * H)

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.mlp(x)


def _tally(mesh: TPMesh, sp: bool, k: int, heads: int = HEADS, regather: bool = True) -> dict:
    """Per phase, per axis, per kind: (calls, traffic) of one attention + MLP block with k chunks."""
    torch.manual_seed(0)
    model = AttnMlp(heads).double()
    par = parallelize(copy.deepcopy(model), mesh, {"attn": "attention", "mlp": "mlp"},
                      sequence_parallel=sp, overlap_chunks=k)
    if not regather:
        _keep_gathered_inputs(par)
    x = torch.randn(TB, TS // mesh.d0 if sp else TS, H // mesh.d1, dtype=torch.float64, requires_grad=True)
    mesh.reset_tallies()
    y = par(x)
    out = {}
    for phase in ("forward", "backward"):
        if phase == "backward":
            mesh.reset_tallies()
            y.square().sum().backward()
        out[phase] = {a: {kind: (mesh.axis(a).tally.calls.get(kind, 0),
                                 mesh.axis(a).tally.traffic.get(kind, Fraction(0))) for kind in KINDS}
                      for a in ("tp0", "tp1")}
    return out


def _expected_from_unchunked(base: dict, d0: int, d1: int, sp: bool, k: int, regather: bool = True) -> dict:
    """k x the calls of every chunked collective, the same traffic; under sequence parallelism the 2 row-first
    bias-gradient all-reduces over axis 0 are not chunked, and the backward re-gathers both column-first
    inputs (qkv, fc1) over axis 0 (unless they keep their gathered inputs)."""
    want = {phase: {a: {kind: (calls * k, traffic) for kind, (calls, traffic) in kinds.items()}
                    for a, kinds in axes.items()} for phase, axes in base.items()}
    if sp and d0 > 1:
        calls, traffic = base["backward"]["tp0"][ALL_REDUCE]
        want["backward"]["tp0"][ALL_REDUCE] = (calls, traffic)
        if regather:
            calls, traffic = want["backward"]["tp0"][ALL_GATHER]
            extra = 2 * Fraction(d0 - 1, d0) * TB * TS * (H // d1) * ELEM
            want["backward"]["tp0"][ALL_GATHER] = (calls + 2 * k, traffic + extra)
    return want


def _tallies_on_ranks(d0: int, d1: int, sp: bool, k: int) -> tuple[dict, dict]:
    mesh = get_mesh(d0, d1)
    return _tally(mesh, sp, 1), _tally(mesh, sp, k)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_chunked_tallies_on_2x2(ranks, sp):
    k = 3
    for base, got in ranks(4).run(_tallies_on_ranks, 2, 2, sp, k):
        assert got == _expected_from_unchunked(base, 2, 2, sp, k)
        # every kind of collective of the block really was chunked
        assert got["forward"]["tp1"][REDUCE_SCATTER][0] == k and got["forward"]["tp0"][ALL_REDUCE if not sp else
                                                                                        REDUCE_SCATTER][0] == 2 * k
        for phase in ("forward", "backward"):
            for a in ("tp0", "tp1"):
                assert sum(t for _, t in got[phase][a].values()) >= sum(t for _, t in base[phase][a].values()) > 0


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("d0,d1", [(2, 1), (1, 2), (4, 1), (1, 4), (2, 4), (4, 2)])
@pytest.mark.parametrize("k", [2, 4])
def test_chunked_tallies_dry_run(d0, d1, sp, k):
    """The same rule read off a dry-run mesh in one process, as the planner reads volumes."""
    heads = max(HEADS, d0 * d1)
    mesh = TPMesh.dry_run(d0, d1)
    base = _tally(mesh, sp, 1, heads)
    for regather in (True, False):
        got = _tally(mesh, sp, k, heads, regather)
        assert got == _expected_from_unchunked(base, d0, d1, sp, k, regather)
