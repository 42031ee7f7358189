"""Limits on the native thread pools (BLAS, OpenMP) through one threadpoolctl controller.

Why: `threadpoolctl.threadpool_limits` finds the loaded libraries anew on every call, walking every shared object
the process has loaded (hundreds with torch): about 4 ms a call on a 2-core VM, three to four calls per predict,
so a one-row predict of a loaded estimator spent 15 of its 60 ms there. A controller, once made, limits the
libraries it found; it is made again when Python has imported modules since (a new module may have loaded a new
library: a library opened without an import is not seen until the next import).

The BLAS thread count is the process's, so blocks of several threads share one limit (shared_limit): a limit per
block, each restoring on exit what it saw on entry, left the count at 1 for good when two threads' blocks
overlapped without nesting.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
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


_shared: dict[str, dict[str, Any]] = {}
_shared_lock = threading.Lock()


def _shared_set(state: dict[str, Any], limits: int, user_api: str) -> None:
    """Set the count through the current controller; a limiter of a controller not seen before is kept, since it
    alone knows the original counts of libraries loaded since the first block opened."""
    controller = _controller()
    limiter = controller.limit(limits=limits, user_api=user_api)
    if controller is not state["controller"]:
        state["controller"] = controller
        state["limiters"].append(limiter)


@contextlib.contextmanager
def shared_limit(limits: int, user_api: str) -> Iterator[None]:
    """`user_api`'s threads at the smallest limit of the blocks open in any thread, and back to what they were
    before the first once the last closes: for a process-wide count (BLAS), where overlapping blocks of several
    threads must not restore each other's limits. A library loaded while blocks are open is restored too (the
    limiters of each new controller are undone newest first, so each library ends at the count the first limiter
    that knew it saw)."""
    with _shared_lock:
        state = _shared.setdefault(user_api, {"open": [], "limiters": [], "controller": None})
        _shared_set(state, min([*state["open"], limits]), user_api)
        state["open"].append(limits)
    try:
        yield
    finally:
        with _shared_lock:
            state["open"].remove(limits)
            if state["open"]:
                _shared_set(state, min(state["open"]), user_api)
            else:
                for limiter in reversed(state["limiters"]):
                    limiter.restore_original_limits()
                state["limiters"], state["controller"] = [], None
