"""tabfm.native_threads: one threadpoolctl controller, made again only after new imports."""

import sys
import types

import numpy as np  # noqa: F401  (loads a BLAS)
import sklearn.ensemble  # noqa: F401  (loads an OpenMP runtime)
from threadpoolctl import threadpool_info

from tabfm import native_threads


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
