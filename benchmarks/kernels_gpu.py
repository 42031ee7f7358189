"""Triton chunk-epilogue kernels on a CUDA GPU: correctness against the torch references, and speed.

    python benchmarks/kernels_gpu.py [--rows 8192,32768] [--width 1024,4096] [--no-layers]

For each kernel (bias + activation, (residual +) LayerNorm statistics, normalise + affine), shape and dtype it
checks the Triton forward and backward against the torch reference (float32: relative error <= 1e-5, bfloat16:
<= 2e-2) and prints the time of forward + backward of each and the speed ratio (reference / Triton; > 1 means
Triton is faster). With more than one GPU it also runs the overlapped layers (overlap_chunks 1 vs 4) under NCCL
on every mesh of min(4, GPUs) ranks, checks they agree, and prints their step times. Without a CUDA GPU it
says so and exits 0 (on CPU the kernels are checked by tests/test_kernels.py under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import torch

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1.0)).item()


def _time_ms(fn, reps: int = 20) -> float:
    from triton.testing import do_bench

    return do_bench(fn, rep=reps * 5)


def _cases(rows: int, width: int, dtype: torch.dtype):
    from tabfm.parallel.kernels import ops, reference

    dev = "cuda"

    def rnd(*s, scale=1.0, shift=0.0):
        return (torch.randn(*s, device=dev) * scale + shift).to(dtype)

    x, r, b, w = rnd(rows, width, scale=3, shift=2), rnd(rows, width), rnd(width), rnd(width)
    mean, m2 = reference.norm_stats(x.float())
    mean, rstd = mean.to(dtype), torch.rsqrt(m2 / width + 1e-5).to(dtype)
    yield ("bias+gelu", lambda k: (lambda y, bb: ops.bias_act(y, bb, "gelu", k)), [x, b])
    yield ("bias+silu", lambda k: (lambda y, bb: ops.bias_act(y, bb, "silu", k)), [x, b])
    yield ("norm stats", lambda k: (lambda t: ops.norm_stats(t, k)), [x])
    yield ("residual+stats", lambda k: (lambda t, rr: ops.add_norm_stats(t, rr, k)), [x, r])
    yield ("normalize", lambda k: (lambda *a: ops.normalize(*a, kernels=k)), [x, mean, rstd, w, b])


def check_kernels(rows_list, widths) -> bool:
    ok = True
    print(f"{'kernel':16} {'rows x width':>14} {'dtype':>9} {'fwd err':>9} {'bwd err':>9} "
          f"{'torch ms':>9} {'triton ms':>10} {'speed-up':>9}")
    for dtype in (torch.float32, torch.bfloat16):
        for rows in rows_list:
            for width in widths:
                for name, make, inputs in _cases(rows, width, dtype):
                    outs, grads, times = {}, {}, {}
                    for impl in ("triton", "torch"):
                        fn = make(impl)
                        leaves = [t.detach().clone().requires_grad_() for t in inputs]
                        y = fn(*leaves)
                        ys = y if isinstance(y, tuple) else (y,)
                        torch.manual_seed(0)
                        cot = [torch.randn_like(t) for t in ys]
                        outs[impl] = ys
                        grads[impl] = torch.autograd.grad(ys, leaves, cot)

                        def run(fn=fn, cot=cot):
                            ls = [t.detach().requires_grad_() for t in inputs]
                            yy = fn(*ls)
                            torch.autograd.grad(yy if isinstance(yy, tuple) else (yy,), ls, cot)

                        times[impl] = _time_ms(run)
                    fwd = max(_err(a, b) for a, b in zip(outs["triton"], outs["torch"], strict=True))
                    bwd = max(_err(a, b) for a, b in zip(grads["triton"], grads["torch"], strict=True))
                    good = fwd <= TOL[dtype] and bwd <= TOL[dtype]
                    ok &= good
                    print(f"{name:16} {f'{rows}x{width}':>14} {str(dtype)[6:]:>9} {fwd:>9.1e} {bwd:>9.1e} "
                          f"{times['torch']:>9.3f} {times['triton']:>10.3f} {times['torch'] / times['triton']:>8.2f}x"
                          + ("" if good else "   MISMATCH"), flush=True)
    return ok


def _layers_worker(rank: int, world: int, port: int, results) -> None:
    import copy
    import time

    import torch.distributed as dist

    from tabfm.parallel import dense
    from tabfm.parallel.layers import gather_activation, shard_activation
    from tabfm.parallel.mesh import ParallelDims, factorizations
    from tabfm.parallel.parallelize import block_plan, parallelize
    from tabfm.parallel.process_group import init_process_group

    init_process_group("cuda", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")  # GPU `rank`
    out = []
    try:
        for d0, d1 in factorizations(world):
            mesh = ParallelDims(d0=d0, d1=d1).build("cuda")
            for sp in (False, True):
                torch.manual_seed(0)
                plain = torch.nn.Sequential(dense.BlockStack(2, 1024, 16)).cuda()
                x = torch.randn(16, 512, 1024, device="cuda")
                g = torch.randn_like(x)
                res = {}
                for k in (1, 4):
                    par = parallelize(copy.deepcopy(plain), mesh, block_plan("0"), sequence_parallel=sp,
                                      overlap_chunks=k)
                    xin = x.clone().requires_grad_()
                    y = gather_activation(par[0](shard_activation(xin, mesh, sp)), mesh, sp)
                    (y * g).sum().backward()
                    local = shard_activation(x, mesh, sp).detach()
                    gl = shard_activation(g, mesh, sp)
                    times = []
                    for i in range(8):
                        torch.cuda.synchronize()
                        dist.barrier()
                        t = time.perf_counter()
                        par[0](local).backward(gl)
                        torch.cuda.synchronize()
                        if i >= 3:
                            times.append(time.perf_counter() - t)
                    res[k] = (y.detach(), xin.grad, sorted(times)[len(times) // 2])
                err = max(_err(res[4][0], res[1][0]), _err(res[4][1], res[1][1]))
                out.append((f"{d0}x{d1}" + (" +sp" if sp else ""), err, res[1][2], res[4][2]))
    finally:
        dist.destroy_process_group()
    if rank == 0:
        results.put(out)


def check_layers() -> bool:
    import multiprocessing as mp

    world = min(4, torch.cuda.device_count())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_layers_worker, args=(r, world, port, results)) for r in range(world)]
    for p in procs:
        p.start()
    rows = results.get(timeout=1800)
    for p in procs:
        p.join()
    print(f"\noverlapped layers under NCCL on {world} GPUs (2 blocks, hidden 1024, 16 x 512 tokens, float32):")
    print(f"  {'layout':10} {'k=4 vs k=1 err':>15} {'k=1 step ms':>12} {'k=4 step ms':>12} {'ratio':>6}")
    ok = True
    for name, err, t1, t4 in rows:
        good = err <= 1e-4
        ok &= good
        print(f"  {name:10} {err:>15.1e} {t1 * 1e3:>12.2f} {t4 * 1e3:>12.2f} {t4 / t1:>6.2f}"
              + ("" if good else "   MISMATCH"))
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="8192,32768")
    ap.add_argument("--width", default="1024,4096")
    ap.add_argument("--no-layers", action="store_true", help="skip the multi-GPU overlapped-layer check")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU on this machine: nothing to measure. The Triton kernels are checked against their "
              "torch references on CPU by tests/test_kernels.py (TRITON_INTERPRET=1).")
        return 0
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET to benchmark the compiled kernels")
        return 1
    try:
        import triton  # noqa: F401
    except ImportError:
        print("triton is not installed: pip install triton")
        return 1
    print(f"GPU: {torch.cuda.get_device_name()} x {torch.cuda.device_count()}, torch {torch.__version__}")
    ok = check_kernels([int(v) for v in args.rows.split(",")], [int(v) for v in args.width.split(",")])
    if torch.cuda.device_count() > 1 and not args.no_layers:
        ok &= check_layers()
    print("\nall checks passed" if ok else "\nSOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
