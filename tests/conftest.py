"""Shared fixtures: long-lived pools of 2 and 4 gloo ranks (rebuilt if a test breaks one; one set per
pytest-xdist worker: README's test command runs `-n 2`)."""

from __future__ import annotations

import os

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


def _xdist_controller(config: pytest.Config) -> bool:
    """True in the process that only hands tests to xdist workers (it runs none itself)."""
    return bool(getattr(config.option, "numprocesses", None)) and "PYTEST_XDIST_WORKER" not in os.environ


def pytest_configure(config):
    """The rank pools' fork server starts before the tests are collected: its imports (torch, the layers, the
    trainer, the estimators: ~3 s of CPU) run on the other core while this process collects, instead of
    holding up the first test that builds a pool. Under xdist each worker takes an equal share of the cores for
    torch's threads, so that N workers do not start N x cores OpenMP threads."""
    if _xdist_controller(config):
        return
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    start_forkserver()


def pytest_sessionfinish(session, exitstatus):
    for pool in _POOLS.values():
        pool.close()
