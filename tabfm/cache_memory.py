"""Refusing a fit whose cached keys and values cannot fit in memory, before anything is encoded.

Why: an estimator keeps the keys and values of every context's train rows (tabfm.model.Context), about 28 KiB per
train row per member at 20 columns on a CPU in float32, so the default's 4 members hold about 11 GiB at 100,000 train
rows and 110 GiB at a million. Past the machine's memory the operating system kills the process (a notebook's
kernel dies, a script ends without a traceback) after minutes of preprocessing and encoding. The contexts are
drawn before any is encoded, so their caches' bytes are known exactly (tabfm.forward_sizes.context_cache_bytes)
and a fit that cannot hold them is refused there, with what would fit.
"""

from __future__ import annotations

import numpy as np
import torch

from tabfm.forward_sizes import context_cache_bytes
from tabfm.model import ModelConfig

GIB = 1 << 30
MEMINFO = "/proc/meminfo"


def _size(n: int) -> str:
    """Bytes as GiB, or as MiB under one GiB."""
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / (1 << 20):.1f} MiB"


def available_bytes(device: torch.device) -> int | None:
    """Memory a fit may still take on `device`: Linux's MemAvailable on a CPU (free memory plus what the kernel can
    reclaim without swapping), the free device memory plus what PyTorch's caching allocator holds unused on CUDA;
    None where it is not known (another OS, another accelerator): nothing is checked there."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    if device.type != "cpu":
        return None
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_cache_fits(member_bytes: list[int], train_rows: int, device: torch.device,
                     available: int | None = None) -> None:
    """Raise MemoryError, saying what would fit, when the members' caches (member_bytes: each member's, in bytes)
    need more than the memory `available` on `device` (default: available_bytes(device))."""
    available = available_bytes(device) if available is None else available
    need = sum(member_bytes)
    if available is None or need <= available:
        return
    largest = max(member_bytes)
    fitting = available // largest if largest else 0
    rows = train_rows * available // need  # the caches grow in proportion to the rows
    members = f", pass n_estimators={fitting} or fewer (each member holds up to {_size(largest)})" if fitting else ""
    raise MemoryError(f"these {train_rows:,} train rows would hold {_size(need)} of cached keys and values "
                      f"({len(member_bytes)} members), more than the {_size(available)} of memory available on "
                      f"{device}: fit on a sample of at most about {rows:,} rows{members}, or pass a smaller "
                      "max_features")


def check_contexts(config: ModelConfig, rows: int, context_members: np.ndarray, widths: np.ndarray,
                   element_size: int, train_rows: int, device: torch.device) -> None:
    """check_cache_fits for an estimator's drawn contexts: each of `rows` train rows, context_members [U] the
    member of each, widths [M] the columns each member shows. Skipped under torch.distributed: the ranks of one
    machine share its memory and read it at different moments, so one might refuse while the others go on into
    collectives that would then wait for it forever."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return
    member_bytes = [0] * len(widths)
    for m in context_members:
        member_bytes[m] += context_cache_bytes(config, rows, int(widths[m]), element_size)
    check_cache_fits(member_bytes, train_rows, device)
