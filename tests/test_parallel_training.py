"""10 float32 AdamW steps of a small block stack on a 2x2 mesh give the one-process losses (rel. error <= 1e-4)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from dist_harness import get_mesh

from tabfm.parallel import dense
from tabfm.parallel.layers import gather_activation, shard_activation
from tabfm.parallel.mesh import TPMesh
from tabfm.parallel.parallelize import block_plan, parallelize

STEPS, B, S, H, HEADS = 10, 4, 16, 32, 4


@functools.cache
def _reference() -> tuple[float, ...]:
    """The one-process losses (once per session: both layouts compare with them)."""
    return tuple(_losses(1, 1, False))


def _losses(d0: int, d1: int, sp: bool) -> list[float]:
    mesh = get_mesh(d0, d1) if d0 * d1 > 1 else TPMesh.single()
    torch.manual_seed(0)
    model = torch.nn.Sequential(dense.BlockStack(2, H, HEADS))
    model = parallelize(copy.deepcopy(model), mesh, block_plan("0"), sequence_parallel=sp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    data = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(B, S, H, generator=data)
        target = torch.randn(B, S, H, generator=data)
        y = gather_activation(model[0](shard_activation(x, mesh, sp), num_kv=12), mesh, sp)
        loss = torch.nn.functional.mse_loss(y, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_adamw_losses_on_2x2_equal_one_process(ranks, sp):
    reference = torch.tensor(_reference())
    assert reference[-1] < reference[0]  # it trains
    for rank, losses in enumerate(ranks(4).run(_losses, 2, 2, sp)):
        rel = ((torch.tensor(losses) - reference).abs() / reference.abs()).max().item()
        assert rel <= 1e-4, (rank, rel)
