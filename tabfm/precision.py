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
from torch.nn.attention import SDPBackend, sdpa_kernel

from tabfm.config import OptimConfig
from tabfm.parallel.layers import ColumnFirstLinear, RowFirstLinear

LINEAR_TYPES = (nn.Linear, ColumnFirstLinear, RowFirstLinear)
"""Modules whose `weight` is a matrix that takes weight decay (plain, and their tensor-parallel shards)."""


BF16_ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""The fused attention kernels bfloat16 autocast may use on CUDA: cuDNN's is left out. It builds an execution plan
for every new shape (tens to hundreds of milliseconds each), and here nearly every call has a new one: a
pretraining batch's rows, features and train rows (the keys of the in-context stage) change with each step, an
estimator's local contexts and predict chunks with each call. On an H200 with cuDNN allowed, a model step on one
fixed batch took 105 ms and a real run's step (new shapes each time, loader wait 0.1%) 3x the fixed batch's, and
bf16 predict at 10k x 10k x 100 took 12.2 s against fp32's 1.1 s. Flash and memory-efficient attention need no
plan. The backward uses the kernel its forward chose, so this holds for training too."""


def autocast(precision: str, device: torch.device | str) -> contextlib.AbstractContextManager:
    """The context forward and loss run in: for bf16, bfloat16 autocast (and on CUDA, attention kept to
    BF16_ATTENTION_BACKENDS); nothing otherwise. Backward runs outside it, as PyTorch recommends."""
    if precision != "bf16":
        return contextlib.nullcontext()
    return _bf16_autocast(torch.device(device).type)


@contextlib.contextmanager
def _bf16_autocast(device_type: str) -> Iterator[None]:
    """bf16's context, entered by the `with` statement (not when it is made)."""
    with torch.autocast(device_type, dtype=torch.bfloat16):
        if device_type != "cuda":
            yield
            return
        with sdpa_kernel(BF16_ATTENTION_BACKENDS):
            yield


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
