"""Emulated links (DESIGN 3.5): a collective on an emulated axis takes at least the modelled time, async ones hide
the wait behind compute, and nothing is emulated unless asked for."""

from __future__ import annotations

import time
from fractions import Fraction

import pytest
import torch
from dist_harness import get_mesh

from tabfm.parallel import comm
from tabfm.parallel.emulate import Link, describe, emulate
from tabfm.parallel.mesh import TPMesh
from tabfm.parallel.topology import ComputeRates, HierarchicalTopology, Level, MeasuredTopology, AxisCost, emulated

ALPHA, BW = 0.03, 2e8          # 30 ms per collective, 200 MB/s of ring traffic
NUMEL = 1 << 20                # 4 MB float32 tensor


def test_link_model_and_validation():
    link = Link(0.01, 1e6)
    assert link.seconds(Fraction(5 * 10**5)) == pytest.approx(0.51)
    for bad in ((-1.0, 1e6), (0.0, 0.0), (0.0, -5.0)):
        with pytest.raises(ValueError, match="alpha >= 0 and bandwidth > 0"):
            Link(*bad)


def test_off_by_default():
    mesh = TPMesh.dry_run(2, 2)
    assert all(mesh.axis(a).delay is None for a in ("tp0", "tp1", "dp"))
    assert describe(mesh) == "real links (no emulation)"
    emulate(mesh, {"tp1": Link(0.001, 1e9)})
    assert "EMULATED" in describe(mesh) and "tp1" in describe(mesh) and "tp0" not in describe(mesh)
    emulate(mesh, {"tp1": None})
    assert describe(mesh) == "real links (no emulation)"


def test_dry_run_collective_waits_the_modelled_time():
    mesh = emulate(TPMesh.dry_run(1, 4), {"tp1": Link(0.02, 1e8)})
    x = torch.zeros(NUMEL // 4)
    start = time.perf_counter()
    comm.all_reduce(x, mesh.axis1)
    took = time.perf_counter() - start
    modelled = 0.02 + 2 * 3 / 4 * x.numel() * 4 / 1e8
    assert took >= modelled and took < modelled + 0.05


def _timed(d0: int, d1: int, emulated_axis: str | None, overlap: float) -> dict:
    """Rank body: time an all-reduce (and an all-gather) on axis 1, optionally emulated, and an async one
    overlapped with `overlap` seconds of (sleeping) compute."""
    mesh = get_mesh(d0, d1)
    axis = mesh.axis1
    link = Link(ALPHA, BW)
    if emulated_axis:
        emulate(mesh, {emulated_axis: link})
    try:
        x = torch.ones(NUMEL)
        comm.all_reduce(x, axis)                    # warm-up
        torch.distributed.barrier()
        t0 = time.perf_counter()
        y = comm.all_reduce(x, axis)
        t_ar = time.perf_counter() - t0
        torch.distributed.barrier()
        t0 = time.perf_counter()
        comm.all_gather(x[: NUMEL // axis.size], 0, axis)
        t_ag = time.perf_counter() - t0
        torch.distributed.barrier()
        t0 = time.perf_counter()
        handle = comm.all_reduce_async(x, axis)
        time.sleep(overlap)
        handle.wait()
        t_async = time.perf_counter() - t0
    finally:
        emulate(mesh, {"tp0": None, "tp1": None})
    n = axis.size
    return {"ar": t_ar, "ag": t_ag, "async": t_async, "ok": bool(torch.all(y == n)),
            "model_ar": link.seconds(2 * (n - 1) / n * NUMEL * 4),
            "model_ag": link.seconds((n - 1) / n * NUMEL * 4)}


def test_collective_on_emulated_axis_takes_at_least_the_modelled_time(ranks):
    for r in ranks(2).run(_timed, 1, 2, "tp1", 0.0):
        assert r["ok"], "emulation must not change results"
        assert r["ar"] >= r["model_ar"], r
        assert r["ag"] >= r["model_ag"], r
        assert r["ar"] < r["model_ar"] + 0.25, r   # it waits the rest of the modelled time, not more


def test_async_collective_hides_the_wait_behind_compute(ranks):
    # The modelled all-reduce takes ~51 ms; 60 ms of compute launched after it should cover almost all of it.
    for r in ranks(2).run(_timed, 1, 2, "tp1", 0.06):
        assert r["async"] >= r["model_ar"]
        assert r["async"] < r["model_ar"] + 0.06 * 0.6, r


def test_emulating_the_other_axis_leaves_this_one_alone(ranks):
    real = ranks(2).run(_timed, 1, 2, "tp0", 0.0)
    for r in real:
        assert r["ar"] < r["model_ar"], "axis 1 should run at the real (fast) speed when only axis 0 is emulated"


def test_emulated_topology_links_follow_the_hierarchy():
    fast, slow = (1e-4, 1e9), (1e-3, 1e8)
    real = MeasuredTopology(name="real", devices=4, compute=ComputeRates(1e9, 1e9), memory_bytes=1e9,
                            axes={m: {"tp0": AxisCost(1e-5, 1e10), "tp1": AxisCost(1e-5, 1e10)}
                                  for m in ("4x1", "2x2", "1x4")})
    topo = emulated("pairs", [Level("pair", 2, *fast), Level("between", 4, *slow)], real)
    links = topo.links(2, 2)
    assert (links["tp1"].alpha, links["tp1"].bandwidth) == fast      # consecutive ranks: the pairs
    assert (links["tp0"].alpha, links["tp0"].bandwidth) == slow      # strided ranks: between pairs
    assert topo.links(4, 1)["tp1"] is None and topo.links(4, 1)["tp0"].bandwidth == slow[1]
    # Each collective costs the slower of the emulated and the real link.
    cost = topo.axis_cost(2, 2, "tp1")
    assert cost.seconds(1e6) == pytest.approx(max(1e-4 + 1e6 / 1e9, 1e-5 + 1e6 / 1e10))
    assert isinstance(topo.emulated, HierarchicalTopology)
