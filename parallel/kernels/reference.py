"""Torch references of the chunk-epilogue kernels: the definition of what each fused kernel computes.

They are plain differentiable torch code (autograd gives their backward), they run whenever the Triton path
does not (CPU, `kernels: torch`), and the tests hold every Triton kernel, forward and backward, to them.
Each is written with exactly the operations the layers used before the kernels existed, so `kernels: auto`
on CPU keeps the layers' numerics.

Shapes: rows are every leading dimension flattened (tokens), N is the last (local, hidden-sharded) one.
    y, x, residual   [..., N]
    bias, weight     [N]
    mean, m2, rstd   [..., 1]     per-row statistics of this rank's N columns (m2: sum of squared deviations)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = {
    "gelu": F.gelu,                                               # exact erf GELU, F.gelu's default
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


def bias_act(y: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    """act(y + bias): the column-first linear's bias followed by the MLP's activation, in y's dtype (under
    autocast a bfloat16 y stays bfloat16, as nn.Linear's output does and as the fused kernel writes it)."""
    return ACTIVATIONS[activation](y if bias is None else y + bias.to(y.dtype))


def norm_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row mean and sum of squared deviations of the local columns (stable two-pass, not E[x^2]-E[x]^2)."""
    mean = x.mean(-1, keepdim=True)
    m2 = (x - mean).square().sum(-1, keepdim=True)
    return mean, m2


def add_norm_stats(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """s = x + residual (the new residual stream) and s's per-row (mean, m2)."""
    s = x + residual
    return (s, *norm_stats(s))


def normalize(x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor | None,
              bias: torch.Tensor | None) -> torch.Tensor:
    """(x - mean) * rstd * weight + bias from the (already reduced) per-row statistics."""
    y = (x - mean) * rstd
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y
