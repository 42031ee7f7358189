"""ATP layers on 1, 2 and 4 gloo ranks against the one-process dense reference, in float64.

For each mesh and with/without sequence parallelism: outputs, input gradients and every parameter gradient
of the MLP, attention (self and query-to-context), LayerNorm, embedding and a 2-block stack must equal the
plain modules' to 1e-10, and each rank's parameters must be exactly the shard of the full ones.
"""

from __future__ import annotations

import copy

import pytest
import torch
from builders import B, H, S, Holder, layer_case
from dist_harness import get_mesh
from torch import nn

from tabfm.parallel import dense
from tabfm.parallel.layers import gather_activation, shard_activation
from tabfm.parallel.mesh import TPMesh
from tabfm.parallel.parallelize import block_plan, parallelize, shard_specs
from tabfm.parallel.sharding import ShardSpec, shard_tensor

V = 16  # embedding rows
MESHES = {1: [(1, 1)], 2: [(2, 1), (1, 2)], 4: [(4, 1), (2, 2), (1, 4)]}
CASES = [(n, d0, d1) for n, meshes in MESHES.items() for d0, d1 in meshes]


def _max_errors(kind: str, d0: int, d1: int, sp: bool) -> dict[str, float]:
    """Run on every rank: dense reference and ATP module on the same seeded weights and input."""
    mesh = get_mesh(d0, d1) if d0 * d1 > 1 else TPMesh.single()
    torch.manual_seed(1234)
    model, plan, kwargs = layer_case(kind)
    model = model.double()
    x = torch.randn(B, S, H, dtype=torch.float64) * 3 + 0.5
    g = torch.randn(B, S, H, dtype=torch.float64)

    x_ref = x.clone().requires_grad_()
    y_ref = model.m(x_ref, **kwargs)
    (y_ref * g).sum().backward()
    full_grads = {n: p.grad for n, p in model.named_parameters()}
    full_params = {n: p.detach().clone() for n, p in model.named_parameters()}

    par = parallelize(copy.deepcopy(model), mesh, plan, sequence_parallel=sp)
    par.zero_grad()
    x_par = x.clone().requires_grad_()
    y_par = gather_activation(par.m(shard_activation(x_par, mesh, sp), **kwargs), mesh, sp)
    (y_par * g).sum().backward()

    specs = shard_specs(par)
    errors = {"out": (y_par - y_ref).abs().max().item(), "dx": (x_par.grad - x_ref.grad).abs().max().item()}
    for name, p in par.named_parameters():
        spec = specs.get(name, ShardSpec((None,) * p.dim()))
        want_grad = shard_tensor(full_grads[name], spec, d0, d1, mesh.i, mesh.j)
        want_param = shard_tensor(full_params[name], spec, d0, d1, mesh.i, mesh.j)
        assert p.shape == want_grad.shape, (name, p.shape, want_grad.shape)
        assert torch.equal(p.detach(), want_param), f"{name}: local parameter is not the exact shard"
        errors[f"grad {name}"] = (p.grad - want_grad).abs().max().item()
    return errors


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("kind", ["mlp", "attention", "attention_ctx", "norm", "stack"])
@pytest.mark.parametrize("n,d0,d1", CASES, ids=[f"{d0}x{d1}" for _, d0, d1 in CASES])
def test_matches_dense_reference(ranks, n, d0, d1, kind, sp):
    results = [_max_errors(kind, d0, d1, sp)] if n == 1 else ranks(n).run(_max_errors, kind, d0, d1, sp)
    compared = {"out", "dx", *(f"grad {name}" for name, _ in layer_case(kind)[0].named_parameters())}
    for rank, errors in enumerate(results):
        assert errors.keys() == compared  # the plain model's parameter names, every one compared
        bad = {k: v for k, v in errors.items() if not v <= 1e-10}
        assert not bad, f"rank {rank}: {bad}"


def _embedding_errors(d0: int, d1: int, sp: bool) -> dict[str, float]:
    mesh = get_mesh(d0, d1)
    torch.manual_seed(7)
    model = Holder(nn.Embedding(V, H)).double()
    ids = torch.randint(0, V, (B, S))
    g = torch.randn(B, S, H, dtype=torch.float64)
    y_ref = model.m(ids)
    (y_ref * g).sum().backward()
    par = parallelize(copy.deepcopy(model), mesh, {"m": "embedding"}, sequence_parallel=sp)
    par.zero_grad()
    y = gather_activation(par.m(ids), mesh, sp)
    (y * g).sum().backward()
    want = shard_tensor(model.m.weight.grad, ShardSpec(("tp0", "tp1")), d0, d1, mesh.i, mesh.j)
    return {"out": (y - y_ref).abs().max().item(), "grad": (par.m.weight.grad - want).abs().max().item()}


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("d0,d1", [(4, 1), (2, 2), (1, 4)])
def test_row_split_embedding(ranks, d0, d1, sp):
    for errors in ranks(4).run(_embedding_errors, d0, d1, sp):
        assert max(errors.values()) <= 1e-10, errors


def _norm_float32_error(d1: int) -> float:
    """A float32 LayerNorm of values with a large offset: E[x^2] - E[x]^2 would lose every digit here."""
    mesh = get_mesh(1, d1)
    torch.manual_seed(3)
    model = Holder(nn.LayerNorm(64))
    x = 1e4 + torch.randn(8, 16, 64)
    ref = nn.functional.layer_norm(x.double(), (64,))
    par = parallelize(copy.deepcopy(model), mesh, {"m": "norm"})
    y = gather_activation(par.m(shard_activation(x, mesh)), mesh)
    return (y.double() - ref).abs().max().item()


@pytest.mark.parametrize("n", [2, 4])
def test_layer_norm_is_numerically_stable(ranks, n):
    for err in ranks(n).run(_norm_float32_error, n):
        assert err < 2e-3, err


def _layout_error_message(d0: int, d1: int) -> str:
    mesh = get_mesh(d0, d1)
    model = Holder(dense.BlockStack(1, 24, 6))
    try:
        parallelize(model, mesh, block_plan("m"))
    except ValueError as e:
        return str(e)
    return ""


def test_layout_that_does_not_divide_heads_is_refused_with_alternatives(ranks):
    # 6 heads, hidden 24: on 4 ranks no layout divides the heads.
    for msg in ranks(4).run(_layout_error_message, 2, 2):
        assert "6 attention heads are not divisible by d0*d1=4" in msg
        assert "that fit: none" in msg


def test_layout_check_lists_valid_layouts():
    from tabfm.parallel.parallelize import check_layout, valid_layouts
    from tabfm.parallel.mesh import LayoutError

    model = Holder(dense.BlockStack(1, 32, 4, mlp_ratio=1))
    # MLP width 32 and hidden 32 divide everything; 4 heads allow N in {1, 2, 4}: all factorisations.
    assert valid_layouts(model, block_plan("m"), 4) == [(1, 4), (2, 2), (4, 1)]
    model = Holder(dense.BlockStack(1, 12, 2, mlp_ratio=1))  # hidden 12 on 8 ranks: heads 2 don't divide 8
    with pytest.raises(LayoutError, match=r"layout 2x4 does not fit the model: .*heads"):
        check_layout(model, block_plan("m"), 2, 4)
    # A vocabulary of 6 rows splits over d0 in {1, 2} but not 4: only the layouts with d0 <= 2 are offered.
    model = Holder(nn.Embedding(6, 8))
    with pytest.raises(LayoutError, match=r"embedding rows 6 is not divisible by d0=4 \(m\)\. .*fit: 1x4, 2x2$"):
        check_layout(model, {"m": "embedding"}, 4, 1)
