"""tabfm.native_threads: one threadpoolctl controller, made again only after new imports."""

import sys
import types

import numpy as np
import sklearn.ensemble
from threadpoolctl import threadpool_info

from tabfm import native_threads

LOADED = (np.__name__, sklearn.ensemble.__name__)
"""Imported for the libraries they load: a BLAS, and an OpenMP runtime."""


def _counts(user_api: str) -> set[int]:
    return {pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == user_api}


def test_limits_apply_and_restore():
    before = _counts("blas")
    assert before and _counts("openmp")
    with native_threads.limit_threads(1, "blas"):
        assert _counts("blas") == {1}
    assert _counts("blas") == before
    limiter = native_threads.limit_threads(1, "openmp")
    assert _counts("openmp") == {1}
    limiter.restore_original_limits()


def test_the_controller_is_kept_until_python_imports_a_module(monkeypatch):
    first = native_threads._controller()
    assert native_threads._controller() is first  # no library search per call
    monkeypatch.setitem(sys.modules, "tabfm_test_new_module", types.ModuleType("tabfm_test_new_module"))
    again = native_threads._controller()
    assert again is not first and native_threads._controller() is again


def _overlap(enter, n_a, n_b):
    """Blocks A then B entered, then A left, then B: overlapping without nesting, as two threads' calls may (run
    here in one thread, in that order: OpenBLAS applies a count set from another thread only in some builds)."""
    a, b = enter(n_a), enter(n_b)
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    b.__exit__(None, None, None)


def test_overlapping_blocks_restore_the_process_blas_count():
    """A helper's finding: two threads predicting at once with n_jobs=1, overlapping without nesting, left BLAS at
    one thread for good (each call restored on exit what it saw on entry)."""
    from tabfm.validation import torch_threads

    before = _counts("blas")
    with native_threads.limit_threads(3, "blas"):
        _overlap(torch_threads, 1, 2)
        assert _counts("blas") == {3}
        _overlap(lambda n: native_threads.shared_limit(n, "blas"), 2, 1)
        assert _counts("blas") == {3}
    assert _counts("blas") == before


def test_the_smallest_open_limit_holds():
    with native_threads.limit_threads(3, "blas"):
        with native_threads.shared_limit(1, "blas"):
            with native_threads.shared_limit(2, "blas"):
                assert _counts("blas") == {1}  # not the last block's 2
            assert _counts("blas") == {1}
        assert _counts("blas") == {3}


def test_a_library_loaded_inside_open_blocks_is_restored_too(monkeypatch):
    """A reviewer's finding: the first block's limiter knew only the libraries loaded then, so one loaded while
    blocks were open stayed at their limit. Here a later controller stands in for one that found a new library."""
    calls = []

    class Limiter:
        def __init__(self, name):
            self.name = name

        def restore_original_limits(self):
            calls.append(self.name)

    class Controller:
        def __init__(self, name):
            self.name = name

        def limit(self, limits, user_api):
            return Limiter(self.name)

    current = {"c": Controller("first")}
    monkeypatch.setattr(native_threads, "_controller", lambda: current["c"])
    monkeypatch.setitem(native_threads._shared, "test_api", {"open": [], "limiters": [], "controller": None})
    outer = native_threads.shared_limit(1, "test_api")
    outer.__enter__()
    with native_threads.shared_limit(2, "test_api"):
        pass  # the same controller: its limiter is not kept
    current["c"] = Controller("after-import")  # an import since: a new controller
    with native_threads.shared_limit(2, "test_api"):
        pass
    outer.__exit__(None, None, None)
    assert calls == ["after-import", "first"]  # newest first, each library back to its first-seen count
