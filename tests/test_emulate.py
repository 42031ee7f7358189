"""Emulated links (DESIGN 3.5): a link waits out the rest of the modelled time (on a fake clock), an emulated axis
charges each collective its ring traffic from its launch (so async ones hide the wait behind compute), and nothing
is emulated unless asked for. How close real waits come to the model is benchmarks/overlap.py's to measure."""

from __future__ import annotations

import time
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch
from dist_harness import get_mesh

from tabfm.parallel import comm
from tabfm.parallel import emulate as emulate_module
from tabfm.parallel.emulate import Link, describe, emulate
from tabfm.parallel.mesh import TPMesh
from tabfm.parallel.topology import ComputeRates, HierarchicalTopology, Level, MeasuredTopology, AxisCost, emulated

NUMEL = 1 << 16                # float32 elements of the collectives' tensors


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


def test_a_link_sleeps_the_rest_of_the_modelled_time(monkeypatch):
    """Link's arithmetic on a fake clock: it waits until alpha + traffic / bandwidth after the start, no more, and
    not at all when the collective (or the compute overlapped with it) already took longer."""
    slept: list[float] = []
    monkeypatch.setattr(emulate_module, "time", SimpleNamespace(perf_counter=lambda: 10.25, sleep=slept.append))
    link = Link(0.5, 1e3)                             # 0.5 s + 1 ms per byte
    link("all_reduce", Fraction(250), started=10.0)   # modelled 0.75 s, 0.25 s gone: 0.5 s left
    link("all_gather", Fraction(250), started=9.0)    # 1.25 s gone already
    assert slept == [pytest.approx(0.5, abs=1e-12)]


def test_dry_run_collective_waits_the_modelled_time():
    mesh = emulate(TPMesh.dry_run(1, 4), {"tp1": Link(0.02, 1e8)})
    x = torch.zeros(NUMEL // 4)
    start = time.perf_counter()
    comm.all_reduce(x, mesh.axis1)
    took = time.perf_counter() - start
    assert took >= 0.02 + 2 * 3 / 4 * x.numel() * 4 / 1e8  # ring traffic of an all-reduce over 4 ranks


def _delays(emulated_axis: str, overlap: float) -> dict:
    """Rank body on a 1x2 mesh: an all-reduce, an all-gather and an async all-reduce overlapped with `overlap`
    seconds of (sleeping) compute on axis 1, with a recording hook in place of a link on `emulated_axis`."""
    mesh = get_mesh(1, 2)
    calls = []
    mesh.axis(emulated_axis).delay = lambda kind, traffic, started: calls.append(
        (kind, traffic, time.perf_counter() - started))
    try:
        x = torch.ones(NUMEL)
        y = comm.all_reduce(x, mesh.axis1)
        comm.all_gather(x[: NUMEL // 2], 0, mesh.axis1)
        handle = comm.all_reduce_async(x, mesh.axis1)
        time.sleep(overlap)
        handle.wait()
    finally:
        emulate(mesh, {"tp0": None, "tp1": None})
    return {"calls": calls, "ok": bool(torch.all(y == 2))}


def test_an_emulated_axis_is_charged_each_collective_from_its_launch(ranks):
    """What a link is asked to wait for, on real ranks: each collective's kind and ring traffic per device (an
    all-reduce moves 2(n-1)/n of the tensor, an all-gather (n-1)/n of the gathered one), timed from its launch, so
    compute between an async launch and its wait counts toward the modelled time (and hides it)."""
    for r in ranks(2).run(_delays, "tp1", 0.06):
        assert r["ok"], "emulation must not change results"
        assert [(kind, traffic) for kind, traffic, _ in r["calls"]] == [
            ("all_reduce", NUMEL * 4), ("all_gather", NUMEL * 4 // 2), ("all_reduce", NUMEL * 4)]
        assert r["calls"][2][2] >= 0.06, r["calls"]


def test_emulating_the_other_axis_leaves_this_one_alone(ranks):
    for r in ranks(2).run(_delays, "tp0", 0.0):
        assert r["ok"] and r["calls"] == []


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
