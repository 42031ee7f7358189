"""Shared fixtures: long-lived pools of 2 and 4 gloo ranks (rebuilt if a test breaks one)."""

from __future__ import annotations

import pytest
from dist_harness import RankPool

_POOLS: dict[int, RankPool] = {}


def _pool(world_size: int) -> RankPool:
    pool = _POOLS.get(world_size)
    if pool is None or pool.broken:
        pool = _POOLS[world_size] = RankPool(world_size)
    return pool


@pytest.fixture
def ranks():
    """ranks(n) -> a live RankPool of n gloo processes."""
    return _pool


def pytest_sessionfinish(session, exitstatus):
    for pool in _POOLS.values():
        pool.close()
