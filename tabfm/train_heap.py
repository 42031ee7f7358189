"""Keep a CPU pretraining process's large freed blocks in malloc's heap for the next step (glibc only).

Why: glibc maps every block above its mmap threshold (at most 32 MiB by default) fresh and unmaps it on free, and
hands a heap's free top back to the operating system past its trim threshold, so each op of a training step that
writes a large tensor (activations, their gradients, AdamW's temporaries: tens to hundreds of MiB per op at 8
tables of 1,000 rows) page-faults all of it in anew. On a 2-core VM a step of small_wide at 8 tables of 512 rows x
64 features took 12.5 s, 4.5 s of it in the kernel; with blocks of up to HEAP_MMAP_THRESHOLD served from the heap
and up to HEAP_TRIM_THRESHOLD of free top kept, 6.2 s and none, for a higher peak (5.0 GiB instead of 2.7: the
heap keeps what it freed). `benchmarks/train_heap.py` measures it side by side.

The thresholds belong to the process. `tabfm pretrain` (pretrain.main, one process per rank) owns its process, so it
sets them; the estimators, which run inside their users' processes, keep forwards under the default threshold
instead (tabfm.forward_sizes). A user's own setting wins: with malloc thresholds in GLIBC_TUNABLES or
MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ in the environment nothing changes.

Hand-written (two mallopt calls through ctypes): neither PyTorch nor any maintained library exposes them.
"""

from __future__ import annotations

import os

from tabfm.heap_release import glibc

HEAP_MMAP_THRESHOLD = 512 << 20
"""Blocks up to this size come from the heap (and are reused) instead of being mapped and unmapped each time."""
HEAP_TRIM_THRESHOLD = 1 << 30
"""Free memory at a heap's top up to this size stays mapped for the next step."""

_M_TRIM_THRESHOLD = -1  # glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def user_set_thresholds(environ: dict[str, str] | None = None) -> bool:
    """Whether the environment already sets malloc's mmap or trim threshold (then it is left alone)."""
    environ = os.environ if environ is None else environ
    tunables = environ.get("GLIBC_TUNABLES", "")
    return (any(name in environ for name in _USER_SETTINGS)
            or "malloc.mmap_threshold" in tunables or "malloc.trim_threshold" in tunables)


def keep_large_blocks_in_heap() -> bool:
    """Raise this process's mmap and trim thresholds to HEAP_MMAP_THRESHOLD and HEAP_TRIM_THRESHOLD; whether
    they were set (False off glibc, when the user set them, or when glibc refused)."""
    libc = glibc()
    if libc is None or user_set_thresholds():
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD)
                and libc.mallopt(_M_TRIM_THRESHOLD, HEAP_TRIM_THRESHOLD))
