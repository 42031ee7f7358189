"""Run a function on N gloo ranks and get every rank's result, or every rank's failure, back.

A `RankPool` keeps N processes alive for the whole test session, each with its gloo process group initialised
once. They are forked from one fork server that imported torch and the parallel layers already (PRELOAD): a
fresh interpreter per rank, as `spawn` starts, costs seconds of CPU per process for the imports alone.
`pool.run(fn, ...)` sends `fn` (a module-level, picklable function) to every rank and returns the list of results
in rank order; `pool.submit(fn, ...)` sends it and returns at once, so that this process can work meanwhile
(`.wait()` gives the list; `.beside(work)` runs `work` here meanwhile and gives (its result, the list)).
If any rank raises, the error names the ranks and shows each traceback; a rank that hangs (a collective that
the others never join) is reported after `timeout` seconds and the pool is rebuilt for the next test.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

_MESHES: dict[tuple[int, int, int], Any] = {}  # per worker process: meshes built so far (group creation is costly)


FAILED_GRACE = 30.0
"""Seconds the other ranks get to answer once one rank has raised."""


class RankFailure(AssertionError):
    """One or more ranks raised or hung."""


def get_mesh(d0: int, d1: int, dp: int = 1):
    """This worker's mesh of the given shape, built once per process (all ranks must ask in the same order)."""
    from tabfm.parallel.mesh import ParallelDims

    key = (d0, d1, dp)
    if key not in _MESHES:
        _MESHES[key] = ParallelDims(d0=d0, d1=d1, dp=dp).build("cpu")
    mesh = _MESHES[key]
    mesh.reset_tallies()
    return mesh


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, tasks: mp.Queue, results: mp.Queue) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from tabfm.parallel.process_group import init_process_group

    init_process_group("cpu", rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}")
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - the traceback travels back to the test
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "tabfm.parallel.layers", "tabfm.parallel.parallelize",
           "tabfm.model", "tabfm.parallel.planner", "tabfm.pretrain", "tabfm.estimator"]
"""Imported once by the fork server the ranks are forked from, instead of by every rank (torch's import costs
seconds of CPU per process on this machine; a 2- and a 4-rank pool start 6). Beyond torch and the layers, the
ranks of the suite import torch._dynamo (the planner's trace), the trainer and the estimators (scikit-learn, scipy,
pandas): about 2 s of CPU more per rank, once here instead."""


def _start_forkserver() -> None:
    """Start the fork server with one compute thread per library, as each rank asks (OMP_NUM_THREADS=1 in
    `_worker`): the BLAS libraries of numpy and scipy size their thread pools when the fork server imports them,
    before any rank sets the variable. Only the fork server's environment changes, not this process's."""
    from multiprocessing import forkserver

    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["OMP_NUM_THREADS"]


def _context(method: str) -> Any:
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
        _start_forkserver()
    return ctx


def start_forkserver() -> None:
    """Start the fork server (and its PRELOAD imports) now, without waiting for it: conftest does this before
    collection, so that the imports run beside it rather than when the first pool is built."""
    _context("forkserver")


class Pending:
    """A task sent to every rank of a pool (RankPool.submit); wait() blocks for the results, once."""

    def __init__(self, pool: "RankPool", name: str):
        self._pool, self._name, self._done = pool, name, False

    def wait(self) -> list[Any]:
        if self._done:
            raise RuntimeError(f"{self._name}: its results were taken already")
        self._done = True
        return self._pool._collect(self._name)

    def beside(self, work: Callable[[], Any]) -> tuple[Any, list[Any]]:
        """(work(), the ranks' results): `work` runs in this process while the ranks compute (e.g. the
        one-process reference), then the results are waited for, even when `work` raised, so that the pool is
        free for the next test."""
        try:
            here = work()
        finally:
            results = self.wait()
        return here, results


class RankPool:
    def __init__(self, world_size: int, timeout: float = 300.0, method: str = "forkserver"):
        self.world_size, self.timeout = world_size, timeout
        ctx = _context(method)
        port = _free_port()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, self._tasks[r], self._results), daemon=True)
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self.broken = False
        self._pending: Pending | None = None

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        return self.submit(fn, *args, **kwargs).wait()

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> "Pending":
        """Send `fn` to every rank and return at once; `.wait()` gives what `run` gives. This process works on
        meanwhile (e.g. a one-process reference while the ranks compute). One task at a time: a task submitted
        earlier and never waited for is waited for first (its results dropped)."""
        if self._pending is not None:
            try:
                self._pending.wait()
            except RankFailure:
                if self.broken:
                    raise
        if self.broken:
            raise RankFailure("the rank pool broke in an earlier test")
        for q in self._tasks:
            q.put((fn, args, kwargs))
        self._pending = Pending(self, fn.__name__)
        return self._pending

    def _collect(self, name: str) -> list[Any]:
        self._pending = None
        out: dict[int, tuple[bool, Any]] = {}
        while len(out) < self.world_size:
            # Once a rank has failed, the others are most likely stuck in a collective it never joins: give them
            # FAILED_GRACE seconds, not the whole timeout, before the pool is declared broken (the test fails
            # either way, with every traceback that came back).
            failing = any(not ok_ for ok_, _ in out.values())
            try:
                rank, ok, value = self._results.get(timeout=min(self.timeout, FAILED_GRACE) if failing
                                                    else self.timeout)
            except queue.Empty:
                self.broken = True
                self.close()
                silent = sorted(set(range(self.world_size)) - set(out))
                failed = {r: v for r, (ok_, v) in out.items() if not ok_}
                detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in failed.items())
                waited = min(self.timeout, FAILED_GRACE) if failing else self.timeout
                raise RankFailure(f"{name}: ranks {silent} gave no answer within {waited:.0f}s "
                                  f"(a collective the others never joined?){detail}") from None
            out[rank] = (ok, value)
        failed = {r: v for r, (ok, v) in sorted(out.items()) if not ok}
        if failed:
            detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in failed.items())
            raise RankFailure(f"{name} failed on ranks {sorted(failed)}:{detail}")
        return [out[r][1] for r in range(self.world_size)]

    def close(self) -> None:
        for q, p in zip(self._tasks, self._procs):
            if p.is_alive():
                try:
                    q.put(None)
                except Exception:  # noqa: BLE001
                    pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
