"""Our ATP block stack against PyTorch's own tensor parallelism, side by side in one run.

For 2 and 4 gloo ranks: forward + backward step time (median of repeated runs) of an MLP + attention block
stack, ours on every (d0, d1) layout and PyTorch's `torch.distributed.tensor.parallel` (ColwiseParallel /
RowwiseParallel, i.e. Megatron 1D) on the same shapes and the same weights, and the ratio ours / PyTorch on
the same 1D layout (N, 1). The two implementations' outputs are checked against each other first.

    python benchmarks/tp_layers.py [--hidden 256 --heads 8 --tokens 128 --batch 8 --depth 2 --repeats 15]
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn


class TorchTPAttention(nn.Module):
    """The same attention with separate q, k, v projections, as PyTorch's TP (torchtitan style) expects."""

    def __init__(self, attn, head_dim: int):
        super().__init__()
        h = attn.proj.in_features
        self.head_dim = head_dim
        self.wq, self.wk, self.wv = (nn.Linear(h, h) for _ in range(3))
        with torch.no_grad():
            for k, lin in enumerate((self.wq, self.wk, self.wv)):
                lin.weight.copy_(attn.qkv.weight[k * h:(k + 1) * h])
                lin.bias.copy_(attn.qkv.bias[k * h:(k + 1) * h])
        self.proj = copy.deepcopy(attn.proj)

    def forward(self, x, num_kv=None, attn_mask=None, cache=None):
        # tabfm's Block passes its attention these three; the benchmark's stack has no context split, mask or cache
        if num_kv is not None or attn_mask is not None or cache is not None:
            raise NotImplementedError("TorchTPAttention is plain self-attention: no num_kv, attn_mask or cache")

        def heads(t):
            return t.unflatten(-1, (-1, self.head_dim)).transpose(-3, -2)

        ctx = F.scaled_dot_product_attention(heads(self.wq(x)), heads(self.wk(x)), heads(self.wv(x)))
        return self.proj(ctx.transpose(-3, -2).flatten(-2))


def torch_tp_model(plain, heads: int, mesh_1d):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = copy.deepcopy(plain)
    for block in model.blocks:
        block.attn = TorchTPAttention(block.attn, block.attn.proj.in_features // heads)
        parallelize_module(block, mesh_1d, {
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
            "attn.proj": RowwiseParallel(), "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel(),
        })
    return model


def _time(step, repeats: int) -> float:
    for _ in range(3):
        step()
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def worker(rank: int, world: int, port: int, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh

    from tabfm.parallel import dense
    from tabfm.parallel.layers import gather_activation, shard_activation
    from tabfm.parallel.mesh import ParallelDims, factorizations
    from tabfm.parallel.parallelize import block_plan, parallelize
    from tabfm.parallel.process_group import init_process_group

    init_process_group("cpu", rank=rank, world_size=world)  # rendezvous at MASTER_ADDR/PORT

    torch.manual_seed(0)
    plain = dense.BlockStack(args.depth, args.hidden, args.heads)
    x = torch.randn(args.batch, args.tokens, args.hidden)
    out = {}

    theirs = torch_tp_model(plain, args.heads, init_device_mesh("cpu", (world,)))
    y_theirs = theirs(x)

    def torch_step():
        theirs(x).square().mean().backward()

    for d0, d1 in factorizations(world)[::-1]:  # (N, 1) first: the 1D layout
        mesh = ParallelDims(d0, d1).build("cpu")
        ours = parallelize(copy.deepcopy(torch.nn.Sequential(plain)), mesh, block_plan("0"))[0]
        if (d0, d1) == (world, 1):
            y_ours = gather_activation(ours(shard_activation(x, mesh)), mesh)
            out["max |ours - torch|"] = (y_ours - y_theirs).abs().max().item()

        def our_step(ours=ours, mesh=mesh):
            ours(shard_activation(x, mesh)).square().sum().div(x.numel()).backward()

        # Interleave the two so both see the same machine load.
        ours_t, torch_t = [], []
        for _ in range(3):
            ours_t.append(_time(our_step, args.repeats))
            torch_t.append(_time(torch_step, args.repeats))
        out[(d0, d1)] = (statistics.median(ours_t), statistics.median(torch_t))
    if rank == 0:
        results.put(out)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, gloo on CPU, "
          f"1 thread per rank; real links (no emulation)")
    print(f"block stack: depth {args.depth}, hidden {args.hidden}, heads {args.heads}, "
          f"batch {args.batch} x {args.tokens} tokens, float32, forward + backward, median of "
          f"3 x {args.repeats} steps")
    print(f"{'ranks':>5} {'layout':>7} {'ours ms':>9} {'torch TP 1D ms':>15} {'ours/torch':>11}")
    ctx = mp.get_context("spawn")
    for world in args.ranks:
        results = ctx.SimpleQueue()
        port = 29500 + world + int(time.time()) % 1000
        mp.start_processes(worker, args=(world, port, args, results), nprocs=world, start_method="spawn")
        out = results.get()
        diff = out.pop("max |ours - torch|")
        for (d0, d1), (ours, theirs) in out.items():
            ratio = f"{ours / theirs:.2f}x" if (d0, d1) == (world, 1) else f"({ours / theirs:.2f}x)"
            print(f"{world:>5} {f'{d0}x{d1}':>7} {ours * 1e3:>9.1f} {theirs * 1e3:>15.1f} {ratio:>11}")
        print(f"{'':>5} outputs of ours (1D) and PyTorch TP agree to {diff:.1e}")
    print("ratio: ours on that layout / PyTorch TP on the 1D layout (N, 1); parenthesised rows are 2D layouts "
          "compared with PyTorch's 1D")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
