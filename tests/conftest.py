"""Shared fixtures: long-lived pools of 2 and 4 gloo ranks (rebuilt if a test breaks one)."""

from __future__ import annotations

import pytest
from dist_harness import RankPool, start_forkserver

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


def pytest_configure(config):
    """The rank pools' fork server starts before the tests are collected: its imports (torch, the layers, the
    trainer, the estimators: ~3 s of CPU) run on the other core while this process collects, instead of
    holding up the first test that builds a pool."""
    start_forkserver()


def pytest_sessionfinish(session, exitstatus):
    for pool in _POOLS.values():
        pool.close()
