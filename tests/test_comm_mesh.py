"""Each collective and its dual on 2 and 4 ranks; the mesh's rank order and checks."""

from __future__ import annotations

import pytest
import torch
from dist_harness import get_mesh

from tabfm.parallel import comm
from tabfm.parallel.mesh import LayoutError, ParallelDims, TPMesh


def _collectives(d0: int, d1: int) -> dict:
    mesh = get_mesh(d0, d1)
    axis = mesh.axis1 if d1 > 1 else mesh.axis0
    n, r = axis.size, axis.index
    base = torch.arange(6.0, dtype=torch.float64).reshape(2, 3)
    x = (base + 10 * r).requires_grad_()
    out = {}
    y = comm.reduce_from(x, axis)
    out["reduce_from"] = torch.equal(y, sum(base + 10 * k for k in range(n)))
    y.backward(torch.ones_like(y))
    out["reduce_from_grad"] = torch.equal(x.grad, torch.ones_like(x))
    x.grad = None
    y = comm.copy_to(x, axis)
    y.backward(torch.full_like(y, float(r + 1)))
    out["copy_to_grad"] = torch.equal(x.grad, torch.full_like(x, float(sum(range(1, n + 1)))))
    x.grad = None
    y = comm.gather(x, 1, axis)
    out["gather"] = torch.equal(y, torch.cat([base + 10 * k for k in range(n)], 1))
    y.backward(torch.ones_like(y))
    out["gather_grad_rs"] = torch.equal(x.grad, torch.full_like(x, float(n)))
    x.grad = None
    z = torch.arange(4.0 * n, dtype=torch.float64).reshape(2, 2 * n).requires_grad_()
    y = comm.scatter_reduce(z, 1, axis)
    out["scatter_reduce"] = torch.equal(y, n * z.detach()[:, 2 * r:2 * r + 2])
    y.backward(torch.full_like(y, float(r)))
    out["scatter_reduce_grad_ag"] = torch.equal(
        z.grad, torch.cat([torch.full((2, 2), float(k), dtype=torch.float64) for k in range(n)], 1))
    h = comm.all_reduce_async(x.detach(), axis)
    out["async"] = torch.equal(h.wait(), sum(base + 10 * k for k in range(n)))
    tally = axis.tally.snapshot()
    out["tally_calls"] = tally["calls"]
    return out


@pytest.mark.parametrize("n,d0,d1", [(2, 1, 2), (2, 2, 1), (4, 1, 4), (4, 4, 1)])
def test_collectives_and_their_duals(ranks, n, d0, d1):
    for result in ranks(n).run(_collectives, d0, d1):
        calls = result.pop("tally_calls")
        assert all(result.values()), result
        assert calls == {"all_reduce": 3, "all_gather": 2, "reduce_scatter": 2}


def _coords(d0: int, d1: int) -> tuple:
    import torch.distributed as dist

    mesh = get_mesh(d0, d1)
    peers1 = [None] * d1
    dist.all_gather_object(peers1, dist.get_rank(), group=mesh.axis1.group)
    return dist.get_rank(), mesh.i, mesh.j, peers1


def test_rank_order_is_row_major_axis1_consecutive(ranks):
    for rank, i, j, peers1 in ranks(4).run(_coords, 2, 2):
        assert (i, j) == divmod(rank, 2)
        assert peers1 == [2 * i, 2 * i + 1]


def test_single_mesh_needs_no_process_group():
    mesh = ParallelDims().build()
    assert isinstance(mesh, TPMesh) and mesh.tp == 1 and mesh.tp_rank == 0
    x = torch.randn(3, 4)
    assert comm.all_reduce(x, mesh.axis0) is x
    assert mesh.axis0.tally.total_calls == 0


def test_parallel_dims_checks(monkeypatch):
    dims = ParallelDims(d0=2, d1=2, dp=2)
    assert dims.world_size == 8 and dims.coordinates(5) == (1, 0, 1)
    with pytest.raises(LayoutError, match=r"needs 8 processes but 4 were started"):
        dims.check_world_size(4)
    with pytest.raises(LayoutError, match="positive integer"):
        ParallelDims(d0=0)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(LayoutError, match="launch with `torchrun --nproc-per-node 2`"):
        ParallelDims(d0=2).build()
    monkeypatch.setenv("LOCAL_RANK", "0")  # already under torchrun: what is missing is the process group
    with pytest.raises(LayoutError, match=r"initialized; call torch.distributed.init_process_group\(\) first"):
        ParallelDims(d0=2).build()
