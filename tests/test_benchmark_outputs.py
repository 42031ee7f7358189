"""Where the benchmark scripts write when given no output path: runs/benchmarks/ (tabfm.out_paths.BENCHMARK_RUNS,
which git ignores), never the curated results committed in benchmarks/results/ that README quotes. A short trial
run (`accuracy.py --tables skl_iris --folds 1`) had replaced the full run's accuracy.txt / .csv there."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from builders import benchmark_module

from tabfm.out_paths import BENCHMARK_RUNS, benchmark_output

ROOT = Path(__file__).resolve().parent.parent

DEFAULTS = {
    "accuracy": (lambda m: [m._parser().parse_args([]).out], ["."]),
    "column_stage": (lambda m: [m._parser().parse_args([]).txt], ["column_stage.txt"]),
    "inference": (lambda m: [m._parser().parse_args([]).png], ["inference_memory.png"]),
    "planner": (lambda m: [m._args([]).out], ["planner.txt"]),
    "planner_presets": (lambda m: [m._parser().parse_args([]).out, m._parser().parse_args([]).png],
                        ["planner_presets.txt", "planner_presets.png"]),
    "prior": (lambda m: [m._parser().parse_args([]).png], ["prior_tables.png"]),
}
"""Each script that writes a file without being given a path: its parsed defaults, and their names in runs/benchmarks
("." for accuracy.py's --out, a folder)."""


@pytest.mark.parametrize("script", sorted(DEFAULTS))
def test_a_benchmarks_default_outputs_lie_in_runs_benchmarks(script):
    read, names = DEFAULTS[script]
    paths = [Path(p) for p in read(benchmark_module(script))]
    assert paths == [BENCHMARK_RUNS / n for n in names] == [Path("runs", "benchmarks", n) for n in names]
    assert not any(Path("benchmarks", "results") in (p, *p.parents) for p in paths)


@pytest.mark.parametrize("flags,section,name", [
    ([], "speed_section", "inference.txt"),
    (["--long-contexts", "10000"], "long_context_section", "inference_long.txt"),
    (["--precision-compare"], "precision_section", "inference_precision.txt"),
    (["--gpu-table"], "gpu_table_section", "inference_gpu.txt"),
])
def test_inference_writes_each_modes_text_to_runs_benchmarks(monkeypatch, tmp_path, flags, section, name):
    """inference.py's --txt default is computed from the mode (the memory runs, long contexts, precision, GPU
    table): every one lies in runs/benchmarks of the working folder, nothing is written under benchmarks/."""
    bench = benchmark_module("inference")
    for s in ("speed_section", "memory_section", "long_context_section", "precision_section", "gpu_table_section"):
        monkeypatch.setattr(bench, s, lambda log, *a, s=s: log(f"{s} ran"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["inference.py", *flags])
    bench.main()
    assert f"{section} ran" in (tmp_path / benchmark_output(name)).read_text()
    assert [p.name for p in tmp_path.iterdir()] == ["runs"]


def test_an_accuracy_run_without_out_leaves_benchmarks_results_alone(monkeypatch, tmp_path, capsys):
    """The run README's status named: one table, one fold, without --out, from a working folder that holds a
    results folder as the repository does. Its files land in runs/benchmarks; the results folder is unchanged."""
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    for name in ("accuracy.txt", "accuracy.csv"):
        shutil.copy(ROOT / "benchmarks" / "results" / name, results / name)
    before = {p.name: p.read_bytes() for p in results.iterdir()}
    accuracy = benchmark_module("accuracy")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["accuracy.py", "--tables", "skl_iris", "--folds", "1", "--models", "logreg"])
    accuracy.main()
    assert {p.name: p.read_bytes() for p in results.iterdir()} == before
    written = tmp_path / "runs" / "benchmarks"
    assert sorted(p.name for p in written.iterdir()) == ["accuracy.csv", "accuracy.txt"]
    assert "--tables skl_iris --folds 1" in (written / "accuracy.txt").read_text()
    assert capsys.readouterr().out.endswith("written: runs/benchmarks/accuracy.txt, runs/benchmarks/accuracy.csv\n")


def test_an_explicit_path_into_benchmarks_results_is_still_taken(monkeypatch, tmp_path):
    """Reproducing a committed file is done by naming it, as README's commands do."""
    accuracy = benchmark_module("accuracy")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["accuracy.py", "--tables", "skl_iris", "--folds", "1", "--models", "logreg",
                                      "--out", "benchmarks/results"])
    accuracy.main()
    assert sorted(p.name for p in (tmp_path / "benchmarks" / "results").iterdir()) == ["accuracy.csv", "accuracy.txt"]
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("path", sorted(p.name for p in (ROOT / "benchmarks").glob("*.py")))
def test_no_usage_shows_an_output_into_benchmarks_results(path):
    """The usage at the top of each script shows its default output, not a committed results file as if it were
    one (an input such as `--report-only benchmarks/results/accuracy.csv` is fine)."""
    doc = ast.get_docstring(ast.parse((ROOT / "benchmarks" / path).read_text())) or ""
    assert re.findall(r"--(?:txt|png|out|csv) benchmarks/results\S*", doc) == []


def test_runs_benchmarks_is_ignored_by_git():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    probe = (BENCHMARK_RUNS / "accuracy.txt").as_posix()
    assert subprocess.run(["git", "check-ignore", "-q", probe], cwd=ROOT).returncode == 0
