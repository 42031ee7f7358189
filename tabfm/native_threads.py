"""Limits on the native thread pools (BLAS, OpenMP) through one threadpoolctl controller.

Why: `threadpoolctl.threadpool_limits` finds the loaded libraries anew on every call, walking every shared object
the process has loaded (hundreds with torch): about 4 ms a call on a 2-core VM, three to four calls per predict,
so a one-row predict of a loaded estimator spent 15 of its 60 ms there. A controller, once made, limits the
libraries it found; it is made again when Python has imported modules since (a new module may have loaded a new
library), so a limit never misses one.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

_cache: dict[str, Any] = {"modules": -1, "controller": None}
_lock = threading.Lock()


def _controller() -> Any:
    from threadpoolctl import ThreadpoolController

    with _lock:
        if _cache["modules"] != len(sys.modules):
            _cache["controller"] = ThreadpoolController()
            _cache["modules"] = len(sys.modules)
        return _cache["controller"]


def limit_threads(limits: int, user_api: str) -> Any:
    """The native libraries of `user_api` ("blas" or "openmp") at `limits` threads until the returned limiter's
    restore_original_limits() (or the end of its `with` block), as threadpoolctl.threadpool_limits."""
    return _controller().limit(limits=limits, user_api=user_api)
