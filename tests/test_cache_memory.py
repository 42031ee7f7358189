"""A fit whose cached keys and values cannot fit in memory is refused before anything is encoded
(tabfm.cache_memory): one line saying what would fit, the estimator left as it was, and `tabfm predict` failing
with that line instead of a traceback or a killed process."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
import torch

from tabfm import cache_memory
from tabfm.cache_memory import GIB, available_bytes, check_cache_fits
from tabfm.cli import main
from tabfm.estimator import TabFMClassifier, TabFMRegressor


def _table(n: int = 600, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    X = np.random.default_rng(seed).normal(size=(n, 5))
    return X, (X[:, 0] + X[:, 1] > 0).astype(int)


def test_available_bytes_reads_this_machine():
    """On Linux MemAvailable: positive and at most the machine's memory; None for a device it cannot read."""
    got = available_bytes(torch.device("cpu"))
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    assert 0 < got <= total
    assert available_bytes(torch.device("meta")) is None


def _cgroups(tmp_path, monkeypatch, proc: str, files: dict[str, str]) -> None:
    """A fake /proc/self/cgroup and cgroup mount under tmp_path, read by tabfm.cache_memory."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cgroup").write_text(proc)
    for name, text in files.items():
        (tmp_path / "fs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fs" / name).write_text(text)
    monkeypatch.setattr(cache_memory, "PROC_CGROUP", str(tmp_path / "cgroup"))
    monkeypatch.setattr(cache_memory, "CGROUP_ROOT", str(tmp_path / "fs"))


def test_a_cgroup_limit_bounds_the_memory_available(tmp_path, monkeypatch):
    """In a container the host's MemAvailable overstates what the process may take: the room under its cgroup's
    limit (less its usage, inactive file cache not counted) is used where smaller, for cgroup v2 and v1."""
    host = cache_memory._meminfo_available()
    _cgroups(tmp_path, monkeypatch, "0::/pod/app\n", {
        "pod/app/memory.max": f"{4 * GIB}\n", "pod/app/memory.current": f"{GIB}\n",
        "pod/app/memory.stat": f"anon {GIB // 2}\ninactive_file {GIB // 4}\n"})
    assert available_bytes(torch.device("cpu")) == min(host, 4 * GIB - (GIB - GIB // 4))
    _cgroups(tmp_path / "v1", monkeypatch, "4:memory:/docker/abc\n0::/\n", {
        "memory/memory.limit_in_bytes": f"{2 * GIB}", "memory/memory.usage_in_bytes": f"{GIB}",
        "memory/memory.stat": "total_inactive_file 0\n"})  # a container's own view: its cgroup at the root
    assert available_bytes(torch.device("cpu")) == min(host, GIB)


def test_a_parents_cgroup_limit_bounds_a_child_without_one(tmp_path, monkeypatch):
    """A cgroup without a limit of its own lives within its ancestors' (a pod's limit over its containers'
    cgroups): the tightest room along the way counts."""
    _cgroups(tmp_path, monkeypatch, "0::/pod/app\n", {
        "pod/app/memory.max": "max\n", "pod/app/memory.current": f"{GIB}\n", "pod/app/memory.stat": "",
        "pod/memory.max": f"{3 * GIB}\n", "pod/memory.current": f"{2 * GIB}\n", "pod/memory.stat": "inactive_file 0\n",
        "memory.max": "max\n", "memory.current": f"{5 * GIB}\n", "memory.stat": ""})
    assert cache_memory._cgroup_room() == GIB


@pytest.mark.parametrize("proc, files", [
    ("0::/\n", {"memory.max": "max\n", "memory.current": "5\n", "memory.stat": ""}),
    ("4:memory:/a\n", {"memory/a/memory.limit_in_bytes": "9223372036854771712", "memory/a/memory.usage_in_bytes": "5",
                       "memory/a/memory.stat": ""}),
    ("0::/\n", {}),  # no cgroup files
])
def test_no_cgroup_limit_leaves_memavailable(tmp_path, monkeypatch, proc, files):
    _cgroups(tmp_path, monkeypatch, proc, files)
    assert cache_memory._cgroup_room() is None
    assert available_bytes(torch.device("cpu")) == pytest.approx(cache_memory._meminfo_available(), rel=0.05)


def test_check_cache_fits_says_what_fits():
    """Within the memory nothing is raised; past it, the members that would fit, or fewer rows where none does;
    unknown memory checks nothing."""
    check_cache_fits([GIB, GIB], 1000, torch.device("cpu"), available=2 * GIB)
    with pytest.raises(MemoryError, match=r"these 500,000 train rows would hold 4\.0 GiB of cached keys and values "
                                          r"\(4 members\), more than the 2\.5 GiB of memory available on cpu: fit on a "
                                          r"sample of at most about 312,500 rows, pass n_estimators=2 or fewer \(each "
                                          r"member holds up to 1\.0 GiB\), or pass a smaller max_features$"):
        check_cache_fits([GIB] * 4, 500_000, torch.device("cpu"), available=5 * GIB // 2)
    with pytest.raises(MemoryError, match=r"10 train rows would hold 4\.0 GiB .* the 512\.0 MiB of memory available "
                                          r"on cpu: fit on a sample of at most about 1 rows, or pass a smaller "
                                          r"max_features$"):
        check_cache_fits([3 * GIB, GIB], 10, torch.device("cpu"), available=GIB // 2)


def test_unknown_memory_is_not_checked(monkeypatch):
    monkeypatch.setattr(cache_memory, "available_bytes", lambda device: None)
    check_cache_fits([1000 * GIB], 10, torch.device("cpu"))


@pytest.mark.parametrize("Estimator", [TabFMClassifier, TabFMRegressor])
def test_fit_refused_before_encoding_and_estimator_kept(Estimator, monkeypatch):
    """With too little memory the fit raises before the local contexts' nearest-row searches and the first
    forward, and a fitted estimator keeps its old state (its predictions unchanged); with exactly the memory its
    contexts need, the fit goes through."""
    X, y = _table()
    y = y if Estimator is TabFMClassifier else X[:, 0] * 2.0
    est = Estimator(n_estimators=2).fit(X[:300], y[:300])
    before = est.predict(X[300:])
    need = sum(context.nbytes() for _, context in Estimator(n_estimators=2).fit(X, y).contexts_)

    def not_reached(*args, **kwargs):
        raise AssertionError("a context was filled or encoded")

    monkeypatch.setattr(cache_memory, "available_bytes", lambda device: need - 1)
    monkeypatch.setattr("tabfm.estimator.encode_context", not_reached)
    monkeypatch.setattr("tabfm.local_context._contexts", not_reached)
    with pytest.raises(MemoryError, match=r"these 600 train rows would hold [\d.]+ MiB .* \(2 members\), more than "
                                          r"the [\d.]+ MiB of memory available on cpu: fit on a sample of at most "
                                          r"about 599 rows, pass n_estimators=1 or fewer"):
        est.fit(X, y)
    np.testing.assert_array_equal(est.predict(X[300:]), before)
    monkeypatch.undo()
    monkeypatch.setattr(cache_memory, "available_bytes", lambda device: need)
    assert sum(context.nbytes() for _, context in Estimator(n_estimators=2).fit(X, y).contexts_) == need


def test_cli_predict_prints_the_refusal(tmp_path, monkeypatch, capsys):
    """`tabfm predict` prints the refusal as its one error line and writes nothing."""
    X, y = _table(200)
    pl.DataFrame({"a": X[:, 0], "b": X[:, 1], "y": y}).write_csv(tmp_path / "train.csv")
    pl.DataFrame({"a": X[:5, 0], "b": X[:5, 1]}).write_csv(tmp_path / "test.csv")
    monkeypatch.setattr(cache_memory, "available_bytes", lambda device: 1000)
    code = main(["predict", "--train", str(tmp_path / "train.csv"), "--target", "y", "--test",
                 str(tmp_path / "test.csv"), "-o", str(tmp_path / "out.csv"), "--task", "classification", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and not (tmp_path / "out.csv").exists()
    assert err.startswith("tabfm predict: error: these 200 train rows would hold") and err.count("\n") == 1
