"""benchmarks/tp_layers.py's PyTorch-TP attention stands in for tabfm's Attention inside a dense Block: it takes the
keyword arguments Block passes (num_kv, attn_mask, cache) and computes the same attention. Block.forward passes
`cache=` since the in-context cache became an argument, and the benchmark's attention then failed on its first
forward."""

from __future__ import annotations

import copy

import torch
from builders import benchmark_module

from tabfm.parallel import dense


def test_torch_tp_attention_replaces_a_blocks_attention_with_the_same_outputs():
    bench = benchmark_module("tp_layers")
    torch.manual_seed(0)
    plain = dense.BlockStack(depth=2, hidden=32, heads=4)
    swapped = copy.deepcopy(plain)
    for block in swapped.blocks:
        block.attn = bench.TorchTPAttention(block.attn, head_dim=32 // 4)
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(swapped(x), plain(x), rtol=1e-5, atol=1e-6)
