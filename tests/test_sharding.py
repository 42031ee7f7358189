"""Shard a full state dict to every layout and gather it back, bit-exactly; bad shard sets are refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tabfm.parallel import dense
from tabfm.parallel.mesh import factorizations
from tabfm.parallel.parallelize import block_plan, full_shard_specs
from tabfm.parallel.sharding import ShardSpec, gather_state_dict, shard_state_dict, shard_tensor, unshard_tensor


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(24, 24)
        self.stack = dense.BlockStack(2, 24, 12)
        self.head = nn.Linear(24, 3)  # outside the parallel region: replicated


PLAN = {"embed": "embedding", **block_plan("stack")}


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6, 12])
def test_shard_then_gather_is_bit_exact_for_every_layout(n):
    torch.manual_seed(0)
    model = Model()
    full = model.state_dict()
    specs = full_shard_specs(model, PLAN)
    assert "stack.blocks.0.attn.qkv.weight" in specs and "head.weight" not in specs
    for d0, d1 in factorizations(n):
        shards = {(i, j): shard_state_dict(full, specs, d0, d1, i, j) for i in range(d0) for j in range(d1)}
        local = shards[(d0 - 1, d1 - 1)]["stack.blocks.1.mlp.fc1.weight"]
        assert local.shape == (96 // d0, 24 // d1)
        back = gather_state_dict(shards, specs, d0, d1)
        assert back.keys() == full.keys()
        for name in full:
            assert torch.equal(back[name], full[name]), (d0, d1, name)


def test_qkv_shards_hold_whole_heads():
    # 4 heads of size 2, hidden 8: rank t of N=4 must hold q, k, v rows of head t only.
    heads, dh = 4, 2
    rows = torch.arange(3 * heads * dh).unsqueeze(1).float()  # row r of [q | k | v]
    spec = ShardSpec(("tp", None), qkv_heads=heads)
    for t in range(4):
        local = shard_tensor(rows, spec, 2, 2, t // 2, t % 2).squeeze(1).long().tolist()
        want = [c * heads * dh + t * dh + r for c in range(3) for r in range(dh)]
        assert local == want


def test_missing_or_mismatched_shards_are_refused():
    spec = ShardSpec(("tp0", None))
    full = torch.randn(4, 3)
    shards = {(0, 0): shard_tensor(full, spec, 2, 1, 0, 0)}
    with pytest.raises(ValueError, match=r"missing shards for mesh coordinates \[\(1, 0\)\]"):
        unshard_tensor(shards, spec, 2, 1)
    with pytest.raises(ValueError, match="not divisible"):
        shard_tensor(torch.randn(5, 3), spec, 2, 1, 0, 0)
    with pytest.raises(ValueError, match="different tensors"):
        gather_state_dict({(0, 0): {"a": full}, (1, 0): {"b": full}}, {}, 2, 1)
    with pytest.raises(ValueError, match="has 2 dims but its shard spec describes 1"):
        shard_tensor(full, ShardSpec(("tp0",)), 2, 1, 0, 0)
    with pytest.raises(ValueError, match="unknown placement"):
        ShardSpec(("tp2",))


def test_factorizations_of_a_huge_process_count_come_at_once():
    """Found by an audit: the divisor loop ran up to n, so `--nproc 1000000000` took 161 s to be refused."""
    import time

    for n in (1, 7, 12, 36, 97, 360):
        assert factorizations(n) == [(d, n // d) for d in range(1, n + 1) if n % d == 0]
    start = time.perf_counter()
    pairs = factorizations(10**9)
    assert time.perf_counter() - start < 1.0 and len(pairs) == 100 and all(a * b == 10**9 for a, b in pairs)
