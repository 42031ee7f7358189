"""tabfm.heap_release: the heap's holes go back to the operating system, its working set stays, and releasing
changes no prediction."""


import numpy as np
import pytest

from builders import benchmark_module, mixed_frame
from tabfm import TabFMClassifier, TabFMRegressor, heap_release

glibc = pytest.mark.skipif(heap_release.held_free_bytes() is None, reason="needs glibc on Linux")


@pytest.fixture
def fresh_baseline(monkeypatch):
    monkeypatch.setattr(heap_release, "_baseline", None)


def _holes(megabytes: int) -> list[bytearray]:
    """Allocate `megabytes` in 100 kB blocks (inside malloc's heap, under its mmap threshold), keep every tenth
    alive and free the rest: most of it is left as resident holes between the kept blocks."""
    blocks = [bytearray(100_000) for _ in range(megabytes * 10)]
    return blocks[::10]


@glibc
def test_holes_past_the_limit_are_released(fresh_baseline):
    assert not heap_release.release_free_heap(64 << 20)  # the first reading: the baseline
    kept = _holes(300)
    before = heap_release.held_free_bytes()
    assert heap_release.release_free_heap(64 << 20)
    assert heap_release.held_free_bytes() < before - (150 << 20)
    assert len(kept) == 300


@glibc
def test_growth_within_the_limit_and_no_limit_release_nothing(fresh_baseline, monkeypatch):
    assert not heap_release.release_free_heap(1 << 30)
    kept = _holes(100)
    assert not heap_release.release_free_heap(1 << 30)  # 100 MB of holes: the working set may be that large
    monkeypatch.setattr(heap_release, "FREE_HEAP_LIMIT", None)
    kept += _holes(300)
    assert not heap_release.release_free_heap()
    assert len(kept) == 400


def test_the_baseline_is_read_again_after_a_release(monkeypatch):
    readings = iter([100, 150, 500, 90, 300])
    trims = []
    monkeypatch.setattr(heap_release, "held_free_bytes", lambda: next(readings))
    monkeypatch.setattr(heap_release, "glibc", lambda: type("C", (), {"malloc_trim": lambda _, pad: trims.append(pad)})())
    monkeypatch.setattr(heap_release, "_baseline", None)
    assert [heap_release.release_free_heap(200) for _ in range(5)] == [False, False, True, False, True]
    assert trims == [0, 0]  # 500 > 100 + 200; then 90 is the new baseline and 300 > 90 + 200


@pytest.mark.parametrize("Estimator", [TabFMClassifier, TabFMRegressor])
def test_estimators_release_between_batches_and_predict_the_same(Estimator, monkeypatch):
    X, y = mixed_frame(n=200, seed=3)
    if Estimator is TabFMRegressor:
        y = np.asarray(X["x"], float) * 2 + np.arange(len(X)) % 3
    params = dict(n_estimators=2, n_jobs=1, batch_size=16, local_context_rows=48, dtype="float64")
    monkeypatch.setattr(heap_release, "FREE_HEAP_LIMIT", None)
    want = Estimator(**params).fit(X[:150], y[:150])
    want = want.predict_proba(X[150:]) if Estimator is TabFMClassifier else want.predict(X[150:])
    calls = []
    real = heap_release.release_free_heap
    monkeypatch.setattr(heap_release, "release_free_heap", lambda *a: calls.append(1) or real(0))  # release always
    est = Estimator(**params).fit(X[:150], y[:150])
    n_fit = len(calls)
    got = est.predict_proba(X[150:]) if Estimator is TabFMClassifier else est.predict(X[150:])
    assert n_fit >= 1 and len(calls) - n_fit == 4  # after each group of contexts; after each of the 4 test batches
    np.testing.assert_array_equal(got, want)


def test_benchmark_prints_both_sides(tmp_path):
    bench = benchmark_module("heap_release")
    txt = tmp_path / "h.txt"
    bench.main(["--train", "80", "--chunks", "2", "--chunk-rows", "40", "--n-estimators", "1", "--n-jobs", "1",
                "--txt", str(txt)])
    lines = txt.read_text().splitlines()
    assert [line.split()[0] for line in lines[2:4]] == ["kept", "released"]
    assert lines[-1].endswith("probabilities identical: True")
