"""Collectives per axis per block equal the cost model of DESIGN 3.3 exactly: calls, and bytes of ring traffic.

Per transformer block (attention + MLP), ring traffic per device in elements, forward and again backward:
    axis 1: (d1-1)/d1 * 12/d0 * bsh        axis 0: (d0-1)/d0 * 4/d1 * bsh
Under sequence parallelism the axis-0 all-reduces become all-gather + reduce-scatter pairs of the same volume,
and the row-first biases' gradients are summed over axis 0 (2 all-reduces of h/d1). Each LayerNorm adds one
all-gather over axis 1 of 2 numbers per local token forward (a reduce-scatter backward), plus, under sequence
parallelism, the all-reduce of its weight and bias gradients over axis 0.
"""

from __future__ import annotations

import copy
from fractions import Fraction

import pytest
import torch
from dist_harness import get_mesh
from torch import nn

from tabfm.parallel import dense
from tabfm.parallel.comm import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER
from tabfm.parallel.parallelize import block_plan, parallelize

B, S, H, HEADS = 2, 8, 16, 4
ELEM = 8  # float64


class AttnMlp(nn.Module):
    """DESIGN 3.2's block without norms: the unit the formulas describe."""

    def __init__(self):
        super().__init__()
        self.attn = dense.Attention(H, HEADS)
        self.mlp = dense.Mlp(H, 4 * H)

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.mlp(x)


def _tallies(kind: str, d0: int, d1: int, sp: bool) -> dict:
    mesh = get_mesh(d0, d1)
    torch.manual_seed(0)
    if kind == "attn_mlp":
        model, plan = AttnMlp().double(), {"attn": "attention", "mlp": "mlp"}
    else:
        model, plan = dense.BlockStack(2, H, HEADS).double(), block_plan()
    par = parallelize(copy.deepcopy(model), mesh, plan, sequence_parallel=sp)
    s_local = S // d0 if sp else S
    tok = slice(mesh.i * s_local, (mesh.i + 1) * s_local) if sp else slice(None)
    x = torch.randn(B, S, H, dtype=torch.float64)[:, tok, mesh.j * H // d1:(mesh.j + 1) * H // d1]
    x.requires_grad_()
    mesh.reset_tallies()
    y = par(x)
    forward = {a: mesh.axis(a).tally.snapshot() for a in ("tp0", "tp1")}
    mesh.reset_tallies()
    y.square().sum().backward()
    backward = {a: mesh.axis(a).tally.snapshot() for a in ("tp0", "tp1")}
    return {"forward": forward, "backward": backward}


def _expected(kind: str, d0: int, d1: int, sp: bool) -> dict:
    bsh = B * S * H
    blocks = 1 if kind == "attn_mlp" else 2
    norms = 0 if kind == "attn_mlp" else 2
    out = {}
    for phase in ("forward", "backward"):
        a1 = Fraction(d1 - 1, d1) * Fraction(12, d0) * bsh
        a0 = Fraction(d0 - 1, d0) * Fraction(4, d1) * bsh
        calls1 = 3 if d1 > 1 else 0
        calls0 = (4 if sp else 2) if d0 > 1 else 0
        tokens = B * S // d0 if sp else B * S
        a1 += norms * (d1 - 1) * 2 * tokens
        calls1 += norms if d1 > 1 else 0
        if phase == "backward" and sp and d0 > 1:
            replicated_grads = 2 + 2 * norms            # row-first biases, norm weights and biases
            a0 += replicated_grads * 2 * Fraction(d0 - 1, d0) * Fraction(H, d1)
            calls0 += replicated_grads
        out[phase] = {"tp1": (blocks * calls1, blocks * a1 * ELEM), "tp0": (blocks * calls0, blocks * a0 * ELEM)}
    return out


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("kind", ["attn_mlp", "stack"])
@pytest.mark.parametrize("n,d0,d1", [(2, 2, 1), (2, 1, 2), (4, 4, 1), (4, 2, 2), (4, 1, 4)])
def test_tallies_match_cost_model(ranks, n, d0, d1, kind, sp):
    want = _expected(kind, d0, d1, sp)
    for rank, got in enumerate(ranks(n).run(_tallies, kind, d0, d1, sp)):
        for phase in ("forward", "backward"):
            for axis in ("tp0", "tp1"):
                tally = got[phase][axis]
                calls = sum(tally["calls"].values())
                traffic = sum(tally["traffic"].values(), Fraction(0))
                assert (calls, traffic) == want[phase][axis], (rank, phase, axis, tally)


def test_design_block_kinds_without_sequence_parallelism(ranks):
    """Which collectives run, not only how much: DESIGN 3.2's sequence on a 2x2 mesh."""
    got = ranks(4).run(_tallies, "attn_mlp", 2, 2, False)[0]
    assert got["forward"]["tp1"]["calls"] == {REDUCE_SCATTER: 1, ALL_GATHER: 1, ALL_REDUCE: 1}
    assert got["forward"]["tp0"]["calls"] == {ALL_REDUCE: 2}
    assert got["backward"]["tp1"]["calls"] == {ALL_GATHER: 1, REDUCE_SCATTER: 1, ALL_REDUCE: 1}
    assert got["backward"]["tp0"]["calls"] == {ALL_REDUCE: 2}


def test_flat_network_volume_shrinks_with_n():
    """The paper's trend from the same formula: the best mesh's volume falls like 1/sqrt(N); 1D's does not."""
    def per_device(d0, d1):
        return Fraction(d1 - 1, d1) * Fraction(12, d0) + Fraction(d0 - 1, d0) * Fraction(4, d1)

    best = {n: min(per_device(d0, n // d0) for d0 in range(1, n + 1) if n % d0 == 0) for n in (4, 16, 64)}
    one_d = {n: per_device(n, 1) for n in (4, 16, 64)}
    assert best[4] > best[16] > best[64]
    assert one_d[4] < one_d[16] < one_d[64]


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("d0,d1", [(2, 1), (1, 2), (4, 1), (2, 2), (1, 4), (2, 4)])
def test_dry_run_mesh_counts_the_real_collectives(ranks, d0, d1, sp):
    """A dry-run mesh in one process tallies what the real ranks do (the planner reads volumes this way)."""
    from tabfm.parallel.mesh import TPMesh

    torch.manual_seed(0)
    model = dense.BlockStack(2, H, max(HEADS, d0 * d1)).double()
    mesh = TPMesh.dry_run(d0, d1)
    par = parallelize(copy.deepcopy(model), mesh, block_plan(), sequence_parallel=sp)
    x = torch.randn(B, S // d0 if sp else S, H // d1, dtype=torch.float64, requires_grad=True)
    y = par(x)
    got = {a: (mesh.axis(a).tally.total_calls, mesh.axis(a).tally.total_traffic) for a in ("tp0", "tp1")}
    mesh.reset_tallies()
    y.square().sum().backward()
    got_bwd = {a: (mesh.axis(a).tally.total_calls, mesh.axis(a).tally.total_traffic) for a in ("tp0", "tp1")}
    want = _expected("stack", d0, d1, sp)
    assert got == want["forward"] and got_bwd == want["backward"]
