"""The Triton chunk-epilogue kernels equal their torch references, forward and backward (parallel/kernels).

Triton runs here in its CPU interpreter, which must be switched on (TRITON_INTERPRET=1) before triton compiles
anything, so the kernel checks run in one subprocess (this file run as a script) and the other test modules
never see the variable. Shapes include sizes that are not multiples of the blocks (several row and column
blocks, masked edges, a row wider than one block) and a 3-d tensor; float32, error relative to the reference's
largest magnitude <= 1e-5 (float64: 1e-12). The layers' wiring (MLP epilogue, sharded LayerNorm) is checked the
same way, `kernels="triton"` against `kernels="torch"`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tabfm.parallel.kernels import ops

SHAPES = [(37, 50), (130, 200), (3, 7, 33), (19, 600), (1, 1)]
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1.0)).item()


def _compare(name: str, fn_triton, fn_torch, inputs: list[torch.Tensor], out: dict, dtype,
             params: tuple[list, list] = ([], [])) -> None:
    """Forward outputs, and the gradients of every input (and of `params`, each side's parameters) under a
    random cotangent."""
    torch.manual_seed(0)
    results = []
    for fn, ps in zip((fn_triton, fn_torch), params, strict=True):
        leaves = [t.detach().clone().requires_grad_() for t in inputs] + list(ps)
        y = fn(*leaves[:len(inputs)])
        ys = y if isinstance(y, tuple) else (y,)
        results.append((ys, leaves))
    (ys_a, leaves_a), (ys_b, leaves_b) = results
    cot = [torch.randn_like(y) for y in ys_b]
    grads_a = torch.autograd.grad(ys_a, leaves_a, cot)
    grads_b = torch.autograd.grad(ys_b, leaves_b, cot)
    for i, (a, b) in enumerate(zip(ys_a, ys_b, strict=True)):
        out[f"{name} out{i}"] = (_err(a, b), TOL[dtype])
    for i, (a, b) in enumerate(zip(grads_a, grads_b, strict=True)):
        out[f"{name} grad{i}"] = (_err(a, b), TOL[dtype])


def _interpreter_checks() -> dict[str, tuple[float, float]]:
    """Runs in the TRITON_INTERPRET=1 subprocess: {check: (error, tolerance)}."""
    from torch import nn

    from tabfm.parallel import dense
    from tabfm.parallel.kernels import reference
    from tabfm.parallel.layers import ParallelLayerNorm, ParallelMlp
    from tabfm.parallel.mesh import TPMesh

    out: dict[str, tuple[float, float]] = {}
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        shapes = SHAPES if dtype == torch.float32 else SHAPES[:2]
        for shape in shapes:
            def rnd(*s, scale=1.0, shift=0.0):
                return torch.randn(*s, generator=gen, dtype=dtype) * scale + shift

            n = shape[-1]
            tag = f"{dtype} {shape}"
            for act in ops.ACTIVATIONS:
                _compare(f"bias_act {act} {tag}", lambda y, b, a=act: ops.bias_act(y, b, a, "triton"),
                         lambda y, b, a=act: reference.bias_act(y, b, a), [rnd(*shape, scale=2), rnd(n)], out, dtype)
            _compare(f"bias_act no-bias {tag}", lambda y: ops.bias_act(y, None, "gelu", "triton"),
                     lambda y: reference.bias_act(y, None, "gelu"), [rnd(*shape, scale=2)], out, dtype)
            x = rnd(*shape, scale=3, shift=5)   # an offset, where a one-pass variance would lose digits
            _compare(f"norm_stats {tag}", lambda t: ops.norm_stats(t, "triton"), reference.norm_stats, [x], out, dtype)
            _compare(f"add_norm_stats {tag}", lambda a, b: ops.add_norm_stats(a, b, "triton"),
                     reference.add_norm_stats, [x, rnd(*shape)], out, dtype)
            mean, m2 = reference.norm_stats(x)
            rstd = torch.rsqrt(m2 / n + 1e-5)
            _compare(f"normalize {tag}", lambda *a: ops.normalize(*a, "triton"), reference.normalize,
                     [x, mean, rstd, rnd(n), rnd(n)], out, dtype)
            _compare(f"normalize no-affine {tag}", lambda a, b, c: ops.normalize(a, b, c, None, None, "triton"),
                     lambda a, b, c: reference.normalize(a, b, c, None, None), [x, mean, rstd], out, dtype)

    # The layers' wiring: the same layer with kernels="triton" and kernels="torch" (a dry-run (1, 2) mesh
    # exercises the sharded-norm path in one process; both see the same stand-in collective values).
    torch.manual_seed(1)
    mlp = dense.Mlp(24, 72)
    x = torch.randn(2, 9, 24)
    fast, ref = ParallelMlp(mlp, TPMesh.single(), kernels="triton"), ParallelMlp(mlp, TPMesh.single(), kernels="torch")
    _compare("ParallelMlp kernels", fast, ref, [x], out, torch.float32,
             params=(list(fast.parameters()), list(ref.parameters())))
    chunked = ParallelMlp(mlp, TPMesh.single(), kernels="triton", overlap_chunks=3)   # the epilogue per chunk
    _compare("ParallelMlp kernels overlapped", chunked, ref, [x], out, torch.float32,
             params=(list(chunked.parameters()), list(ref.parameters())))
    norm = nn.LayerNorm(24)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    fast = ParallelLayerNorm(norm, TPMesh.dry_run(1, 2), kernels="triton")
    ref = ParallelLayerNorm(norm, TPMesh.dry_run(1, 2), kernels="torch")
    params = (list(fast.parameters()), list(ref.parameters()))
    _compare("ParallelLayerNorm kernels", fast, ref, [torch.randn(2, 9, 12) + 3], out, torch.float32, params)
    _compare("ParallelLayerNorm residual kernels", fast.forward_residual, ref.forward_residual,
             [torch.randn(2, 9, 12), torch.randn(2, 9, 12)], out, torch.float32, params)
    # "auto" picks the reference on CPU tensors even under the interpreter.
    out["auto on cpu is torch"] = (float(ops.backend("auto", x) != "torch"), 0.0)
    return out


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, tuple[float, float]]:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"interpreter checks failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kernel", ["bias_act", "norm_stats", "add_norm_stats", "normalize", "Parallel", "auto"])
def test_triton_kernels_equal_references(interpreter_results, kernel):
    checks = {k: v for k, v in interpreter_results.items() if k.startswith(kernel)}
    assert checks, f"no checks ran for {kernel}"
    bad = {k: err for k, (err, tol) in checks.items() if not err <= tol}
    assert not bad, bad


def test_dispatch(monkeypatch):
    x = torch.randn(3, 4)
    assert ops.backend("torch", x) == "torch" and ops.backend("auto", x) == "torch"
    with pytest.raises(ValueError, match="kernels must be one of auto, triton, torch; got 'cuda'"):
        ops.backend("cuda", x)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if ops.triton_available():
        with pytest.raises(ValueError, match="not on cpu ones .*TRITON_INTERPRET=1"):
            ops.bias_act(x, None, "gelu", kernels="triton")
    with pytest.raises(ValueError, match="unknown activation 'tanh'"):
        ops.bias_act(x, None, "tanh")


def test_auto_runs_triton_only_on_large_cuda_tensors(monkeypatch):
    monkeypatch.setattr(ops, "triton_available", lambda: True)
    big = ops.AUTO_TRITON_MIN_ELEMENTS
    assert ops.auto_backend(True, big) == "triton"
    assert ops.auto_backend(True, big - 1) == "torch"  # launch cost outweighs the saved traffic
    assert ops.auto_backend(False, 100 * big) == "torch"
    monkeypatch.setattr(ops, "triton_available", lambda: False)
    assert ops.auto_backend(True, 100 * big) == "torch"


def test_auto_on_cpu_keeps_reference_numerics():
    """kernels="auto" on CPU is the torch reference: the exact ops the layers used before the kernels."""
    torch.manual_seed(0)
    y, b = torch.randn(5, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    assert torch.equal(ops.bias_act(y, b, "gelu"), torch.nn.functional.gelu(y + b))
    mean, m2 = ops.norm_stats(y)
    assert torch.equal(mean, y.mean(-1, keepdim=True))
    assert torch.equal(m2, (y - mean).square().sum(-1, keepdim=True))


if __name__ == "__main__":
    print(json.dumps(_interpreter_checks()))
