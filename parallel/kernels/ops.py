"""The chunk-epilogue operations the layers call, each dispatched to its Triton kernel or its torch reference.

    kernels="auto"    Triton on CUDA tensors of at least AUTO_TRITON_MIN_ELEMENTS elements when triton imports,
                      else the torch reference (so CPU runs keep the layers' float64 numerics exactly)
    kernels="triton"  always the Triton kernel; on CPU tensors only under TRITON_INTERPRET=1 (the tests)
    kernels="torch"   always the torch reference

This is the `parallel.kernels` config switch; layers take it as their `kernels` option.
"""

from __future__ import annotations

import functools
import os

import torch

from tabfm.parallel.kernels import reference

KERNELS = ("auto", "triton", "torch")
AUTO_TRITON_MIN_ELEMENTS = 1 << 24
"""Below this size `auto` keeps the torch reference. Measured on an H200 (benchmarks/kernels_gpu.py, forward +
backward): at 8192 x 1024 elements the launch cost of the Triton path (about 0.2 ms) outweighs its saved memory
traffic (bias + activation 0.3-0.4x, bfloat16 normalize 0.5x the reference's speed); from 8192 x 4096 on every
kernel but one is 1.1-5.5x faster."""
ACTIVATIONS = tuple(reference.ACTIVATIONS)


def check_kernels(kernels: str) -> str:
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(KERNELS)}; got {kernels!r}")
    return kernels


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() not in ("", "0", "false", "off", "no")


def backend(kernels: str, x: torch.Tensor) -> str:
    """"triton" or "torch": which implementation runs on `x` under the `kernels` choice."""
    check_kernels(kernels)
    if kernels == "torch":
        return "torch"
    if kernels == "auto":
        return auto_backend(x.is_cuda, x.numel())
    if not triton_available():
        raise RuntimeError("kernels='triton' needs the triton package (pip install triton); "
                           "use kernels='auto' or 'torch' to run the torch reference")
    if not x.is_cuda and not interpreting():
        raise ValueError(f"kernels='triton' runs on CUDA tensors, not on {x.device} ones (except under "
                         "TRITON_INTERPRET=1, the Triton interpreter the tests use); use kernels='auto' or 'torch'")
    return "triton"


def auto_backend(is_cuda: bool, numel: int) -> str:
    """What kernels="auto" runs on a tensor: Triton for large CUDA tensors, the torch reference otherwise."""
    big = numel >= AUTO_TRITON_MIN_ELEMENTS
    return "triton" if is_cuda and big and triton_available() else "torch"


def _fused():
    from tabfm.parallel.kernels import fused

    return fused


def bias_act(y: torch.Tensor, bias: torch.Tensor | None, activation: str, kernels: str = "auto") -> torch.Tensor:
    """act(y + bias) in one pass (the MLP's first-linear epilogue). y [..., N], bias [N] or None."""
    if activation not in reference.ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; choose from {', '.join(ACTIVATIONS)}")
    if backend(kernels, y) == "torch":
        return reference.bias_act(y, bias, activation)
    return _fused().BiasAct.apply(y, bias, activation)


def norm_stats(x: torch.Tensor, kernels: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (mean, sum of squared deviations) of x's local columns, each [..., 1]."""
    if backend(kernels, x) == "torch":
        return reference.norm_stats(x)
    return _fused().NormStats.apply(x)


def add_norm_stats(x: torch.Tensor, residual: torch.Tensor,
                   kernels: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """s = x + residual and s's per-row (mean, m2), in one pass over x and residual."""
    if x.shape != residual.shape:
        raise ValueError(f"residual add needs equal shapes, got {tuple(x.shape)} and {tuple(residual.shape)}")
    if backend(kernels, x) == "torch":
        return reference.add_norm_stats(x, residual)
    return _fused().AddNormStats.apply(x, residual)


def normalize(x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor | None,
              bias: torch.Tensor | None, kernels: str = "auto") -> torch.Tensor:
    """(x - mean) * rstd * weight + bias, with mean / rstd [..., 1] already reduced over the hidden shards."""
    if backend(kernels, x) == "torch":
        return reference.normalize(x, mean, rstd, weight, bias)
    return _fused().Normalize.apply(x, mean, rstd, weight, bias)
