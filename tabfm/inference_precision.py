"""The estimators' inference precision, the PyTorch way: float32 weights, torch.autocast for bfloat16 compute.

    precision  "fp32"  the model computes in its weights' dtype (float32, or float64 with dtype="float64")
               "bf16"  torch.autocast(device, bfloat16) around each context encoding and each predict forward:
                       matmuls and attention (PyTorch's fused scaled_dot_product_attention kernels) run in
                       bfloat16, the weights stay float32 (tabfm.precision.autocast, as in pretraining); the cached
                       keys/values are kept as autocast makes them, bfloat16, half float32's memory
               "auto"  bf16 on CUDA, fp32 elsewhere: on CPU fp32 keeps predictions exact where bf16 would cost
                       accuracy for a speed-up that depends on the CPU's bfloat16 support

The cell encoder and the output heads run in float32 even under autocast (tabfm.model): the data and the logits
are never rounded to bfloat16. Whatever the precision, the logits are decoded in float64
(tabfm.estimator._TabFMBase._context_outputs): the softmax, temperature, blend, and the regressor's mixture means
and quantiles never see bfloat16.

dtype="bfloat16" (and "float16") once cast the weights themselves, with no float32 master copy: refused, naming
precision="bf16".
"""

from __future__ import annotations

import torch

PRECISIONS = ("auto", "fp32", "bf16")
"""The estimators' `precision` values."""

WEIGHT_DTYPES = {"float32": torch.float32, "float64": torch.float64}
"""The estimators' `dtype` values: the dtype of the weights (bfloat16 compute is `precision`, not a dtype)."""

_REFUSED_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_weight_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The weights' torch dtype from a name or a torch.dtype; bfloat16 / float16 refused, naming precision."""
    for name, value in _REFUSED_DTYPES.items():
        if dtype == name or dtype == value:
            raise ValueError(f"dtype={dtype!r} is no longer supported (it cast the weights themselves, with no "
                             "float32 copy): use dtype='float32' with precision='bf16' (float32 weights, bfloat16 "
                             "compute under torch.autocast)")
    if isinstance(dtype, str) and dtype in WEIGHT_DTYPES:
        return WEIGHT_DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and dtype in WEIGHT_DTYPES.values():
        return dtype
    raise ValueError(f"dtype must be one of {', '.join(WEIGHT_DTYPES)} (or its torch.dtype), got {dtype!r}; "
                     "bfloat16 compute is precision='bf16'")


def resolve_precision(precision: str, dtype: torch.dtype, device: torch.device) -> str:
    """"fp32" or "bf16" for an estimator's `precision` on `device` with weights of `dtype` ("auto": bf16 on CUDA
    with float32 weights, fp32 otherwise). bf16 needs float32 weights: float64 runs are the exact reference."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(map(repr, PRECISIONS))}, got {precision!r}")
    if precision == "auto":
        return "bf16" if device.type == "cuda" and dtype == torch.float32 else "fp32"
    if precision == "bf16" and dtype != torch.float32:
        raise ValueError(f"precision='bf16' needs dtype='float32' (autocast computes from float32 weights), got "
                         f"dtype={str(dtype).removeprefix('torch.')!r}; use precision='fp32' for float64")
    return precision

