"""Hand freed heap memory back to the operating system between the estimators' forwards (glibc only).

Why: glibc's malloc keeps memory that Python, numpy and torch free inside its heaps (the main one and one per
thread), to reuse it; it returns only what sits at a heap's top. The estimators' forwards allocate blocks of many
sizes between longer-lived arrays, so holes accumulate: a default TabFMClassifier predicting 10,000-row chunks
against a 1,000-row table grew from 1.0 to 4.8 GiB of resident memory over 60,000 rows while under 0.3 GiB was
in use (no object leaked: `malloc_trim` brought it back to 0.8 GiB). So after each test batch and each group of
encoded contexts, where the resident memory not in use has grown more than FREE_HEAP_LIMIT bytes past the
forwards' own working set (release_free_heap), `malloc_trim(0)` releases it; the same run then stays at 0.8-1.0
GiB, about as fast (`benchmarks/heap_release.py`).

Hand-written (a few lines of ctypes): PyTorch and numpy expose no such call, and no maintained library wraps
glibc's two functions. Elsewhere (macOS, musl, Windows) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import threading

FREE_HEAP_LIMIT = 256 << 20
"""Growth of the resident memory not in use above which release_free_heap() trims the heaps (None: never)."""


class _MallInfo2(ctypes.Structure):
    """glibc's struct mallinfo2 (2.33+): the heaps' statistics in size_t fields."""

    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@functools.cache
def glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc with mallinfo2, malloc_trim and mallopt, else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def resident_bytes() -> int | None:
    """The process's resident set now (Linux's /proc/self/statm), or None where there is no such file."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def held_free_bytes() -> int | None:
    """Resident bytes that are not in use by malloc's callers: the process's resident set minus what malloc has
    handed out (heaps and mmapped blocks). It includes the libraries' code and data, which do not change between
    forwards, so only its growth means anything. None off glibc on Linux."""
    libc = glibc()
    resident = resident_bytes()
    if libc is None or resident is None:
        return None
    info = libc.mallinfo2()
    return resident - int(info.uordblks) - int(info.hblkhd)


def release_free_heap(limit: int | None = None) -> bool:
    """Return the heaps' free memory to the operating system when the resident memory not in use has grown by more
    than `limit` bytes (default FREE_HEAP_LIMIT, read at call time) since the first call after the last release;
    whether it did.

    That first reading holds the forwards' own working set: memory freed by one forward and reused by the next,
    which a release would only hand back to be faulted in again (releasing after every step cost a 1,000-row fit
    10%). What grows past it is the heap's holes. (glibc's own count of free bytes, mallinfo2's fordblks, cannot
    tell: it still counts the pages malloc_trim gave back.)"""
    global _baseline
    limit = FREE_HEAP_LIMIT if limit is None else limit
    held = held_free_bytes()
    if held is None or limit is None:
        return False
    with _lock:
        if _baseline is None:
            _baseline = held
        if held <= _baseline + limit:
            return False
        glibc().malloc_trim(0)
        _baseline = None
    return True


_baseline: int | None = None
"""held_free_bytes() at the first call after the last release (None: not yet read)."""
_lock = threading.Lock()
