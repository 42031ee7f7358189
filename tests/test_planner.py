"""The ATP planner and its communication matrix.

Volumes: the planner counts collectives by running the model's own layers on a dry-run mesh on the meta device;
those counts must equal the tallies of the real collectives on real gloo ranks, exactly, for every layout of 2
and 4 ranks with and without sequence parallelism (and with overlap chunks). Then: depth extrapolation is exact,
the matrix and its contention correction, the cost model's overlap, ranking and rejection, and bad input.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from dist_harness import get_mesh

from tabfm.config import load_topology
from tabfm.config_io import preset_names
from tabfm.parallel import planner
from tabfm.parallel.mesh import TPMesh
from tabfm.parallel.parallelize import parallelize
from tabfm.parallel.planner import Collective, Extrapolated, TransformerSpec, choose_layout, plan, price, trace
from tabfm.parallel.topology import (AXES, ComputeRates, HierarchicalTopology, Level, fit_alpha_beta, measure_axes,
                                     read_measured, write_measured)

SPEC = TransformerSpec(depth=2, hidden=16, heads=4, mlp_ratio=4, seq=8, batch=2)
LAYOUTS = [(2, 2, 1), (2, 1, 2), (4, 4, 1), (4, 2, 2), (4, 1, 4)]


def _real_tallies(d0: int, d1: int, sp: bool, chunks: int) -> dict:
    """Rank body: one forward + backward of SPEC's model on real gloo collectives; the tallies per phase."""
    mesh = get_mesh(d0, d1)
    torch.manual_seed(0)
    model, plan_dict, (b, s, h) = SPEC()
    par = parallelize(model.double(), mesh, plan_dict, sequence_parallel=sp, overlap_chunks=chunks)
    x = torch.randn(b, s // d0 if sp else s, h // d1, dtype=torch.float64, requires_grad=True)
    mesh.reset_tallies()
    y = par(x)
    out = {"forward": {a: mesh.axis(a).tally.snapshot() for a in AXES}}
    mesh.reset_tallies()
    y.backward(torch.ones_like(y))
    out["backward"] = {a: mesh.axis(a).tally.snapshot() for a in AXES}
    return out


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("n,d0,d1", LAYOUTS, ids=[f"{d0}x{d1}" for _, d0, d1 in LAYOUTS])
def test_planner_volumes_equal_real_collectives(ranks, n, d0, d1, sp):
    counted = trace(SPEC, d0, d1, sp, dtype=torch.float64)
    assert counted.tallies["optimizer"] == {a: {"calls": {}, "bytes": {}, "traffic": {}} for a in AXES}
    for rank, real in enumerate(ranks(n).run(_real_tallies, d0, d1, sp, 1)):
        for phase in ("forward", "backward"):
            for axis in AXES:
                want, got = real[phase][axis], counted.tallies[phase][axis]
                assert got == want, (rank, phase, axis)      # calls, bytes and Fraction ring traffic
    assert counted.volume("tp0") + counted.volume("tp1") > 0


@pytest.mark.parametrize("n,d0,d1,sp,chunks", [(4, 2, 2, True, 2), (2, 2, 1, False, 4)])
def test_planner_volumes_with_overlap_chunks(ranks, n, d0, d1, sp, chunks):
    counted = trace(SPEC, d0, d1, sp, chunks, dtype=torch.float64)
    for real in ranks(n).run(_real_tallies, d0, d1, sp, chunks):
        for phase in ("forward", "backward"):
            assert {a: counted.tallies[phase][a] for a in AXES} == real[phase]


def test_trace_is_a_timeline_of_ops_launches_and_waits():
    tr = trace(SPEC, 2, 2, False, 1)
    for phase in ("forward", "backward"):
        launched = [e for e in tr.events[phase] if isinstance(e, Collective)]
        waited = [e.collective for e in tr.events[phase] if isinstance(e, planner.Wait)]
        assert launched and waited == launched          # synchronous: each awaited before the next launches
        assert sum(1 for e in launched if e.axis == "tp0") == tr.calls("tp0") // 2
    assert tr.param_numel == sum(p.numel() for p in parallelize(SPEC()[0], TPMesh.dry_run(2, 2), SPEC()[1])
                                 .parameters())
    # Chunked: the overlap code awaits a chunk's collective after launching compute for the next one.
    tr4 = trace(SPEC, 2, 2, False, 4)
    for phase in ("forward", "backward"):
        events = tr4.events[phase]
        launch = {id(e): i for i, e in enumerate(events) if isinstance(e, Collective)}
        hidden = [e for i, e in enumerate(events) if isinstance(e, planner.Wait)
                  and any(isinstance(o, planner.Op) and o.flops > 0 for o in events[launch[id(e.collective)]:i])]
        assert len(hidden) >= 4, phase      # matmuls run between a chunk's launch and its wait


def test_depth_extrapolation_is_exact():
    topo = load_topology("nvswitch8")
    compute = planner.ComputeModel(topo.compute)
    deep = SPEC.with_depth(5)
    for d0, d1, sp, k in [(2, 4, True, 2), (8, 1, False, 1), (1, 8, False, 4)]:
        spec = TransformerSpec(depth=5, hidden=32, heads=8, mlp_ratio=4, seq=8, batch=2)
        full = trace(spec, d0, d1, sp, k, dtype=torch.bfloat16, foreach=True)
        ex = Extrapolated(trace(spec.with_depth(1), d0, d1, sp, k, dtype=torch.bfloat16, foreach=True),
                          trace(spec.with_depth(2), d0, d1, sp, k, dtype=torch.bfloat16, foreach=True), 5)
        for axis in AXES:
            assert ex.volume(axis) == full.volume(axis) and ex.calls(axis) == full.calls(axis)
        assert (ex.param_numel, ex.activation_bytes) == (full.param_numel, full.activation_bytes)
        (c_full, x_full), (c_ex, x_ex) = price(full, topo, compute), price(ex, topo, compute)
        assert c_ex == pytest.approx(c_full, rel=1e-9)
        assert all(x_ex[a] == pytest.approx(x_full[a], rel=1e-9, abs=1e-15) for a in AXES)
    assert deep.depth == 5


# ---------------------------------------------------------------------------------------------------------
# The hierarchical communication matrix
# ---------------------------------------------------------------------------------------------------------

def _machine(levels, devices, overlap=True, memory=1e12) -> HierarchicalTopology:
    return HierarchicalTopology(name="test", devices=devices, compute=ComputeRates(1e12, 1e11), memory_bytes=memory,
                                overlap=overlap, levels=levels)


def test_matrix_uses_the_lowest_shared_level():
    topo = load_topology("nvswitch8x2-ib")
    m = topo.matrix()
    assert m[3][3] is None
    assert m[0][7].bottleneck == "nvswitch" and m[0][8].bottleneck == "infiniband"
    assert m[0][7].bandwidth == pytest.approx(450e9 * 0.8) and m[9][2].bandwidth == pytest.approx(50e9 * 0.8)
    # Axis 1 = consecutive ranks: inside a node for d1 <= 8; axis 0 crosses nodes.
    assert topo.axis_cost(2, 8, "tp1").bottleneck == "nvswitch"
    assert topo.axis_cost(2, 8, "tp0").bottleneck == "infiniband"
    assert topo.axis_cost(1, 16, "tp1").bottleneck == "infiniband"
    assert topo.axis_cost(16, 1, "tp1").bandwidth == float("inf")


def test_groups_sharing_an_uplink_divide_it():
    # Pairs of ranks behind one uplink of 10 GB/s, 8 GB/s per device between pairs.
    topo = _machine([Level("pair", 2, 1e-5, 50e9, uplink=10e9), Level("node", 8, 2e-5, 8e9)], 8)
    one_d = topo.axis_cost(8, 1, "tp0")     # ring 0..7: one edge leaves each pair
    assert one_d.bandwidth == pytest.approx(8e9)
    two_d = topo.axis_cost(4, 2, "tp0")     # two groups' edges leave each pair at once
    assert two_d.bandwidth == pytest.approx(5e9) and "uplink" in two_d.bottleneck
    assert topo.axis_cost(4, 2, "tp1").bandwidth == pytest.approx(50e9)
    assert topo.axis_cost(4, 2, "tp0").alpha == pytest.approx(2e-5)


def test_fit_recovers_alpha_and_bandwidth():
    alpha, bw = 2e-4, 3e8
    pts = [(x, alpha + x / bw) for x in (1e3, 1e5, 1e6, 4e6)]
    fit = fit_alpha_beta(pts)
    assert fit.alpha == pytest.approx(alpha) and fit.bandwidth == pytest.approx(bw)
    with pytest.raises(ValueError, match="two points"):
        fit_alpha_beta(pts[:1])


def _measure(d0, d1) -> dict:
    def mesh_for(a, b):
        return get_mesh(a, b)
    return measure_axes(mesh_for, 2, sizes=(1 << 12, 1 << 16), repeats=2)


def test_measured_topology_round_trip(ranks, tmp_path):
    axes = ranks(2).run(_measure, 1, 2)[0]
    assert set(axes) == {"1x2", "2x1"} and set(axes["1x2"]) == {"tp1"} and set(axes["2x1"]) == {"tp0"}
    path = tmp_path / "topology.json"
    write_measured(path, 2, "gloo", axes, 2.0, "cpu")
    topo = read_measured(path)
    assert topo.devices == 2 and topo.compute.replay and topo.compute.slowdown == 2.0
    cost = topo.axis_cost(1, 2, "tp1", "all_reduce")
    assert cost.alpha >= 0 and cost.bandwidth > 0
    assert topo.axis_cost(2, 1, "tp1").bandwidth == float("inf")
    with pytest.raises(ValueError, match="measured meshes: 1x2, 2x1"):
        topo.axis_cost(4, 1, "tp0")
    assert json.loads(path.read_text())["world_size"] == 2


# ---------------------------------------------------------------------------------------------------------
# The cost model, ranking and rejection
# ---------------------------------------------------------------------------------------------------------

def test_overlap_hides_chunked_communication_only_where_links_run_beside_compute():
    spec = TransformerSpec(depth=2, hidden=512, heads=8, mlp_ratio=4, seq=256, batch=8)
    levels = [Level("net", 4, 1e-5, 1e10)]
    both = {}
    for overlap in (True, False):
        topo = _machine(levels, 4, overlap=overlap)
        ranked = plan(spec, topo, 4, dtype="float32", chunks=(1, 4), sequence_parallel=(False,))
        both[overlap] = {(c.layout, c.chunks): c for c in ranked if c.valid}
    on, off = both[True], both[False]
    for layout in ("4x1", "2x2"):
        assert on[(layout, 1)].exposed_seconds == pytest.approx(off[(layout, 1)].exposed_seconds)
        assert on[(layout, 4)].exposed_seconds < 0.7 * on[(layout, 1)].exposed_seconds
        assert off[(layout, 4)].exposed_seconds >= off[(layout, 1)].exposed_seconds


def test_ranking_follows_the_links():
    spec = TransformerSpec(depth=2, hidden=256, heads=8, mlp_ratio=4, seq=128, batch=8)
    fast, slow = (1e-5, 1e11), (1e-3, 1e8)
    pairs_fast = _machine([Level("pair", 2, *fast), Level("between", 4, *slow)], 4)
    pairs_slow = _machine([Level("pair", 2, *slow), Level("between", 4, *fast)], 4)
    best_fast, reason = choose_layout(spec, pairs_fast, 4, dtype="float32", chunks=(1,))
    assert (best_fast.d0, best_fast.d1) == (2, 2), reason      # the heavy axis-1 traffic stays in the pairs
    best_slow, _ = choose_layout(spec, pairs_slow, 4, dtype="float32", chunks=(1,))
    assert best_slow.d1 == 1                                    # nothing to gain from the slow pairs
    assert "2x2" in reason and "ms/step" in reason
    ranked = plan(spec, pairs_fast, 4, dtype="float32", chunks=(1, 2))
    valid = [c for c in ranked if c.valid]
    assert [c.rank for c in valid] == list(range(1, len(valid) + 1))
    assert all(a.step_seconds <= b.step_seconds for a, b in zip(valid, valid[1:]))
    # sequence parallelism over an axis of size 1 is not listed twice
    assert not any(c.sequence_parallel and c.d0 == 1 for c in ranked)


def test_flat_network_communication_per_device_falls_with_n_for_atp_not_1d():
    spec = TransformerSpec(depth=1, hidden=512, heads=64, mlp_ratio=4, seq=64, batch=2)
    best, one_d = {}, {}
    for n in (4, 16, 64):
        topo = _machine([Level("net", n, 1e-5, 1e10)], n)
        ranked = [c for c in plan(spec, topo, n, dtype="float32", chunks=(1,), sequence_parallel=(False,))
                  if c.valid]
        per_device = {c.layout: sum(c.volume.values()) for c in ranked}
        best[n], one_d[n] = min(per_device.values()), per_device[f"{n}x1"]
    assert best[4] > best[16] > best[64]
    assert one_d[4] < one_d[16] < one_d[64]


def test_rejections_say_why():
    spec = TransformerSpec(depth=1, hidden=64, heads=4, mlp_ratio=4, seq=6, batch=1)
    topo = _machine([Level("net", 4, 1e-5, 1e10)], 4)
    ranked = plan(spec, topo, 4, dtype="float32", chunks=(1, 8))
    rejected = {(c.layout, c.sequence_parallel, c.chunks): c.problems for c in ranked if not c.valid}
    assert any("tokens per sequence divisible by d0=4" in p for p in rejected[("4x1", True, 1)])
    assert any("8 chunks of 6 local tokens" in p for p in rejected[("2x2", False, 8)])
    assert ranked[0].valid and not ranked[-1].valid
    # Memory: a device too small for the weights rejects every layout, and the error lists why.
    tiny = _machine([Level("net", 4, 1e-5, 1e10)], 4, memory=1e4)
    with pytest.raises(ValueError, match=r"(?s)no layout of 4 ranks.*needs 2\d\dKB per device, more than 90% of 10KB"):
        plan(spec, tiny, 4, dtype="float32")
    assert "4x1" in planner.table(ranked) and "rejected:" in planner.table(ranked)


def test_nothing_satisfies_the_constraints_lists_what_would():
    spec = TransformerSpec(depth=1, hidden=24, heads=6, mlp_ratio=4, seq=8, batch=1)   # 6 heads
    topo = _machine([Level("net", 4, 1e-5, 1e10)], 4)
    with pytest.raises(ValueError, match=r"6 attention heads are not divisible by d0\*d1=4") as err:
        plan(spec, topo, 4, dtype="float32")
    assert "process counts whose layouts divide this model's shapes: [1, 2, 3, 6]" in str(err.value)


def test_bad_input_is_a_clear_value_error():
    with pytest.raises(ValueError, match=r"unknown topology preset 'dgx-nope'; presets: .*nvswitch8.*measure"):
        load_topology("dgx-nope")
    assert {"pcie8-nvlink-pairs", "nvswitch8", "nvswitch8x2-ib", "nvswitch8x4-ib", "flat64"} <= set(preset_names("topology"))
    with pytest.raises(ValueError, match=r"describes 8 devices, but --nproc is 4.*presets for 4 devices|"
                                         r"describes 8 devices, but --nproc is 4; use --nproc 8"):
        plan(SPEC, load_topology("nvswitch8"), 4)
    with pytest.raises(ValueError, match=r"describes 8 devices, but --nproc is 16; use --nproc 8"):
        plan(SPEC, load_topology("nvswitch8"), 16)
    with pytest.raises(ValueError, match=r"presets for 16 devices: nvswitch8x2-ib\) \(devices in .*nvswitch8.yaml\)"):
        load_topology("nvswitch8", nproc=16)
    with pytest.raises(ValueError, match="chunk counts must be positive integers"):
        plan(SPEC, load_topology("nvswitch8"), 8, chunks=(0, 2))
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        plan(SPEC, load_topology("nvswitch8"), 8, dtype="fp8")
    with pytest.raises(ValueError, match="not divisible by model.heads"):
        TransformerSpec(hidden=30, heads=4)


def test_presets_load_and_say_where_numbers_come_from():
    for name in preset_names("topology"):
        topo = load_topology(name)
        assert topo.devices in (8, 16, 32, 64) and topo.sources, name
        for d0, d1 in ((topo.devices, 1), (1, topo.devices)):
            for axis in AXES:
                cost = topo.axis_cost(d0, d1, axis)
                assert cost.bandwidth > 0


def test_cli_plan(tmp_path, capsys):
    from tabfm import _cli_plan

    parser = argparse.ArgumentParser(prog="tabfm")
    _cli_plan.add_parser(parser.add_subparsers(dest="command", required=True))
    png, config = tmp_path / "plan.png", tmp_path / "plan.yaml"
    config.write_text("model: {depth: 1, hidden: 64, heads: 8, seq: 16, batch: 2}\nplan: {chunks: [1, 2]}\n")
    args = parser.parse_args(["plan", "--config", str(config), "--nproc", "8", "--topology", "pcie8-nvlink-pairs",
                              "--png", str(png)])
    assert args.run(args) == 0
    out = capsys.readouterr().out
    assert "rank  layout" in out and "best: " in out and png.stat().st_size > 0
    args = parser.parse_args(["plan", "--config", str(config), "--nproc", "8", "--topology", "nope"])
    assert args.run(args) == 2
    assert "unknown topology preset 'nope'" in capsys.readouterr().err
    (tmp_path / "a_file").write_text("x")
    for extra, message in ((["--png", str(tmp_path / "plan.txt")], "give a file name ending in .png"),
                           (["--png", str(tmp_path / "a_file" / "p.png")], "a_file is a file, not a folder"),
                           (["--top", "0"], "--top must be a positive integer")):  # found by a hunt: tracebacks
        args = parser.parse_args(["plan", "--config", str(config), "--nproc", "8", "--topology", "nvswitch8", *extra])
        assert args.run(args) == 2 and message in capsys.readouterr().err
    config.write_text("model: {depth: 1, layers: 3}\n")
    args = parser.parse_args(["plan", "--config", str(config), "--nproc", "8", "--topology", "nvswitch8"])
    assert args.run(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"tabfm plan: unknown config key model.layers; valid keys of model: depth, hidden, heads, "
                   f"mlp_ratio, seq, batch (in {config})"]
    config.write_text("model: {kind: transformer, depth: 1, hidden: 64, heads: 8, seq: 16, batch: 2}\n")
    argv = ["plan", "--config", str(config), "--nproc", "8", "--topology", "nvswitch8", "--set", "plan.chunks=[1]"]
    args = parser.parse_args([*argv, "model.depth=3", "plan.sequence_parallel=false"])
    assert args.run(args) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert "transformer depth=3 hidden=64" in out and rows and all(r[2:4] == ["off", "1"] for r in rows)
    args = parser.parse_args([*argv, "model.heads=3"])
    assert args.run(args) == 2
    assert capsys.readouterr().err.strip() == ("tabfm plan: model.hidden=64 is not divisible by model.heads=3 "
                                               "(from --set model.heads=3)")


class _EmbedThenBlocks(torch.nn.Module):
    """Token ids -> row-split embedding -> blocks: a model whose input is ids, not an activation shape."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.blocks = SPEC()[0]

    def forward(self, ids):
        return self.blocks(self.embed(ids))


def _ids(mesh, sp, device, dtype):
    return (torch.zeros(2, 8, dtype=torch.long, device=device),)


def test_pluggable_model_source_with_an_input_function():
    """A source returns (model, plan, input function); its embedding needs values, so it traces on CPU."""
    from tabfm.parallel.parallelize import block_plan

    def source():
        return _EmbedThenBlocks(), {"embed": "embedding", **block_plan("blocks")}, _ids

    with pytest.raises(RuntimeError):
        trace(source, 2, 2, False)          # the embedding's bounds check reads values: not on meta
    tr = trace(source, 2, 2, False, device="cpu")
    assert tr.tallies["forward"]["tp0"]["calls"]["all_reduce"] == 1 + 2 * 2   # embedding + 2 per block
    ranked = plan(source, _machine([Level("net", 4, 1e-5, 1e10)], 4), 4, dtype="float32", chunks=(1,),
                  trace_device="cpu")
    assert ranked[0].valid and ranked[0].step_seconds > 0


@pytest.mark.parametrize("flags,message", [
    (["--chunks", "1,a"], "--chunks takes comma-separated chunk counts of 1 or more such as 1,2, got '1,a'"),
    (["--repeats", "0"], "--repeats 0 --warmup 2: give 1 or more repeats and 0 or more warm-up steps"),
    (["--hidden", "250"], "--depth 2 --hidden 250 --heads 8 --seq 128 --batch 8: model.hidden=250 is not divisible "
     "by model.heads=8"),
    (["--out", "{tmp}/afile/planner.txt"], "--out {tmp}/afile/planner.txt: {tmp}/afile is a file, not a folder; give "
     "a file name for the report"),
])
def test_planner_benchmark_refuses_a_bad_flag_before_measuring(monkeypatch, tmp_path, capsys, flags, message):
    """These had been a traceback in the 4 spawned ranks or (--out) after the minutes of measuring: now one line
    naming the flag before any rank starts, nothing written."""
    import sys

    from builders import benchmark_module

    bench = benchmark_module("planner")
    monkeypatch.setattr(sys, "argv", ["planner.py"])  # argparse's program name
    (tmp_path / "afile").write_text("x")
    monkeypatch.setattr(bench, "_measure", lambda *a: pytest.fail("measured before the flags were checked"))
    argv = ["--out", str(tmp_path / "planner.txt"), *(f.format(tmp=tmp_path) for f in flags)]
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert capsys.readouterr().err.splitlines()[-1] == f"planner.py: error: {message.format(tmp=tmp_path)}"
    assert [p.name for p in tmp_path.iterdir()] == ["afile"]


def test_cli_plan_refuses_a_process_count_no_layout_fits_before_measuring(tmp_path, capsys, monkeypatch):
    """Found by an audit: --nproc 6 with the measured topology started and timed 6 local ranks (2 minutes) before
    saying that no layout of 6 divides the model's shapes."""
    from tabfm import _cli_plan
    from tabfm.parallel import topology

    monkeypatch.setattr(topology, "load_or_measure", lambda n: (_ for _ in ()).throw(AssertionError("measured")))
    parser = argparse.ArgumentParser(prog="tabfm")
    _cli_plan.add_parser(parser.add_subparsers(dest="command", required=True))
    config = tmp_path / "plan.yaml"
    config.write_text("model: {depth: 1, hidden: 64, heads: 8, seq: 16, batch: 2}\n")
    args = parser.parse_args(["plan", "--config", str(config), "--nproc", "6", "--topology", "measure"])
    assert args.run(args) == 2
    assert "process counts whose layouts divide this model's shapes: [1, 2, 4, 8" in capsys.readouterr().err


def test_measuring_far_more_cpu_ranks_than_cores_is_refused_before_any_starts(tmp_path, monkeypatch):
    """Found by an audit: nothing bounded the local ranks `--topology measure` starts (a --nproc of 64 or 100,000
    on a 2-core machine would start that many torch processes)."""
    import os

    import torch.multiprocessing

    from tabfm.parallel import topology_measure

    monkeypatch.setattr(torch.multiprocessing, "start_processes",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("started")))
    monkeypatch.setattr(topology_measure.torch.cuda, "is_available", lambda: False)
    too_many = topology_measure.MAX_RANKS_PER_CORE * (os.cpu_count() or 1) + 1
    with pytest.raises(ValueError, match=f"measuring {too_many} ranks here would start {too_many} processes"):
        topology_measure.load_or_measure(too_many, tmp_path / "t.json")
