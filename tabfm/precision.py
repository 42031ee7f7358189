"""Training precision and the optimizer's parameter groups, done the way PyTorch training code does them.

    precision  fp32   float32 everywhere
               tf32   float32 tensors, TensorFloat-32 matmuls on CUDA (torch.set_float32_matmul_precision("high")
                      while training); on CPU there is no TF32 and nothing changes
               bf16   torch.autocast(device, bfloat16) around forward and loss: matmuls and attention run in
                      bfloat16, reductions (cross-entropy, norm statistics) stay float32; parameters, gradients and
                      AdamW state stay float32 (the master weights), so no loss scaling is needed
    groups     AdamW decays the weight matrices of linear layers only; norms, biases, embeddings and learned
               tokens (RowCompression's CLS) get weight_decay 0, as in nanoGPT and Megatron

Parameters are float32 (float64 for the equivalence tests): `train.dtype`; compute precision: `train.precision`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from tabfm.config import OptimConfig
from tabfm.parallel.layers import ColumnFirstLinear, RowFirstLinear

LINEAR_TYPES = (nn.Linear, ColumnFirstLinear, RowFirstLinear)
"""Modules whose `weight` is a matrix that takes weight decay (plain, and their tensor-parallel shards)."""


def autocast(precision: str, device: torch.device | str) -> contextlib.AbstractContextManager:
    """The context forward and loss run in: bfloat16 autocast for bf16, nothing otherwise (backward runs
    outside it, as PyTorch recommends)."""
    if precision == "bf16":
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@contextlib.contextmanager
def matmul_precision(precision: str, device: torch.device | str) -> Iterator[None]:
    """Within the block, float32 matmuls on CUDA use TF32 when precision is tf32 (and IEEE float32 otherwise);
    the previous setting comes back afterwards. On CPU it changes nothing (there is no TF32 there)."""
    if torch.device(device).type != "cuda":
        yield
        return
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if precision == "tf32" else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def decays(module: nn.Module, name: str, param: nn.Parameter) -> bool:
    """Whether `param` (called `name` in `module`) takes weight decay: the weight matrix of a linear layer.
    Decided by module type, not by ndim alone: embeddings and learned tokens are matrices too."""
    return isinstance(module, LINEAR_TYPES) and name == "weight" and param.ndim >= 2


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: the linear weight matrices with `weight_decay`, every other parameter with 0. The order
    of parameters follows model.parameters(), so every rank of a mesh builds the same groups."""
    decay, no_decay, seen = [], [], set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            (decay if decays(module, name, p) else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def make_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over the model's (float32 or float64) parameters, weight decay on linear weight matrices only."""
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             eps=cfg.eps)
