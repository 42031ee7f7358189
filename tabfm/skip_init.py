"""Building a model for its names and shapes only, with every random initialiser skipped.

The launcher's layout checks (`layout.shape_model`) and the checkpoint reader's check of a file against its config
(`checkpoint_inspect.meta_model`) build the model only to read its parameters' names and shapes. Initialising it
there costs more than the values are worth: on the meta device, `normal_` and `randn` run PyTorch's Python
reference kernels, whose first call imports torch._dynamo (1.1-1.3 s on the 2-core VM, 13 s once on a loaded one),
in every process that fits an estimator or reads a checkpoint.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode


class SkipInit(TorchFunctionMode):
    """torch.nn.init.*, Tensor.normal_/uniform_ as no-ops and torch.randn/rand as torch.empty, inside the block.
    Model code must do no other arithmetic on parameters at construction (initialise through torch.nn.init), or the
    meta device reaches the Python kernels all the same (tests/test_skip_init.py)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init" or func in (torch.Tensor.normal_,
                                                                            torch.Tensor.uniform_):
            return args[0] if args else kwargs["tensor"]
        if func in (torch.randn, torch.rand):
            return torch.empty(*args, **{k: v for k, v in kwargs.items() if k != "generator"})
        return func(*args, **kwargs)
