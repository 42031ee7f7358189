"""Table threads (tabfm.table_threads): the estimators' forwards spread over CPU threads give the predictions of
one thread running the same forwards in sequence, each worker runs with one intra-op thread, and nothing runs
threaded where it must not (an accelerator, a tensor-parallel mesh, n_jobs=1); the CPU work between forwards runs
on one torch and one BLAS thread (host_work)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from builders import estimator_outputs, estimator_table, mixed_frame, side_by_side_rows, speed_up_matches

import tabfm.estimator as estimator_module
from tabfm.estimator import TabFMClassifier, TabFMRegressor
from tabfm.table_threads import host_work, map_tables, sequential_tables, table_workers


def test_map_tables_keeps_order_and_runs_each_item_with_one_intra_op_thread():
    seen = []

    def work(i):
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        return i * i

    before = torch.get_num_threads()
    assert map_tables(work, list(range(12)), workers=2) == [i * i for i in range(12)]
    assert {n for _, n in seen} == {1}
    assert all(name.startswith("tabfm-tables") for name, _ in seen)
    assert torch.get_num_threads() == before  # the caller's threads untouched


def test_map_tables_with_one_worker_runs_in_the_calling_thread():
    names = map_tables(lambda _: threading.current_thread().name, [0, 1, 2], workers=1)
    assert names == [threading.current_thread().name] * 3


@pytest.mark.parametrize("workers", [1, 2])
def test_map_tables_calls_done_on_the_calling_thread_in_the_items_order(workers):
    """done(item) steps a progress bar: on the calling thread (no lock), once per item, in order, each after
    its result exists."""
    results, calls = {}, []

    def work(i):
        time.sleep(0.01 * (i % 3))  # finishing out of order on two threads
        results[i] = i * i
        return i * i

    def done(i):
        calls.append((i, threading.current_thread().name, i in results))

    assert map_tables(work, list(range(9)), workers=workers, done=done) == [i * i for i in range(9)]
    assert calls == [(i, threading.current_thread().name, True) for i in range(9)]


def test_map_tables_raises_what_a_worker_raised_and_drops_the_items_not_started():
    started = []

    def work(i):
        started.append(i)
        if i == 0:
            raise ValueError("table 0 is bad")
        time.sleep(0.02)
        return i

    with pytest.raises(ValueError, match="table 0 is bad"):
        map_tables(work, list(range(200)), workers=2)
    time.sleep(0.1)  # nothing runs on after the raise
    assert 0 in started and len(started) < 50


def test_workers_follow_the_intra_op_threads_on_cpu_only():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        assert table_workers("cpu") == 3
        assert table_workers(torch.device("cpu"), sharded=True) == 1  # collectives need one order on every rank
        assert table_workers("meta") == 1
        with sequential_tables():
            assert table_workers("cpu") == 1
            # per thread: another thread still spreads its tables
            other = []
            t = threading.Thread(target=lambda: other.append(table_workers("cpu")))
            t.start()
            t.join()
            assert other == [3]
        assert table_workers("cpu") == 3
    finally:
        torch.set_num_threads(before)


def _forward_threads(monkeypatch) -> list[str]:
    """Names of the threads the estimator's context encodings and test forwards run on."""
    names: list[str] = []
    for name in ("encode_context", "predict_logits"):
        real = getattr(estimator_module, name)

        def recorded(*args, _real=real, **kwargs):
            names.append(threading.current_thread().name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(estimator_module, name, recorded)
    return names


@pytest.mark.parametrize("local_context_rows", [48, None])
@pytest.mark.parametrize("Estimator", [TabFMClassifier, TabFMRegressor])
def test_threaded_predictions_equal_sequential_ones(Estimator, local_context_rows, monkeypatch):
    """float64: every member's outputs, through calibration (the classifier's probe is a second fit and predict),
    local or global contexts, equal the sequential forwards' to 1e-12; the threaded fit really used 2 threads."""
    X, y = estimator_table(Estimator)
    X_test = X.iloc[:90]
    params = dict(n_estimators=3, dtype="float64", n_jobs=2, local_context_rows=local_context_rows, random_state=0)
    with sequential_tables():
        want = Estimator(**params).fit(X, y)
        want_out = estimator_outputs(want, X_test)
    names = _forward_threads(monkeypatch)
    got = Estimator(**params).fit(X, y)
    got_out = estimator_outputs(got, X_test)
    assert len({n for n in names if n.startswith("tabfm-tables")}) == 2
    assert not [n for n in names if not n.startswith("tabfm-tables")]
    np.testing.assert_allclose(got_out, want_out, rtol=0, atol=1e-12)
    if Estimator is TabFMClassifier:
        assert got.temperature_ == pytest.approx(want.temperature_, abs=1e-9)


def test_float32_threaded_predictions_are_within_rounding_of_sequential_ones():
    X, y = mixed_frame(n=240, seed=4)
    params = dict(n_estimators=2, n_jobs=2, local_context_rows=48, random_state=0)
    with sequential_tables():
        want = TabFMClassifier(**params).fit(X, y).predict_proba(X)
    got = TabFMClassifier(**params).fit(X, y).predict_proba(X)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_one_job_runs_every_forward_in_the_calling_thread(monkeypatch):
    X, y = mixed_frame(n=200, seed=5)
    names = _forward_threads(monkeypatch)
    TabFMClassifier(n_estimators=2, n_jobs=1, local_context_rows=48).fit(X, y).predict_proba(X.iloc[:20])
    assert names and set(names) == {threading.current_thread().name}


def test_benchmark_prints_both_sides_and_their_ratio(tmp_path):
    rows = side_by_side_rows("table_threads", ["--sizes", "150x40", "--repeats", "1", "--n-jobs", "2", "--settings",
                                               "classifier-1-member,regressor"], tmp_path / "t.txt")
    assert [r[0] for r in rows] == ["classifier-1-member", "regressor"]
    for _, seq, thr, speed_up, diff in rows:
        assert speed_up_matches(seq, thr, speed_up)
        assert diff < 1e-4


def _native_threads(user_api: str) -> int:
    """The most threads any loaded library of `user_api` ("blas" or "openmp") would use now."""
    from threadpoolctl import threadpool_info

    return max((p["num_threads"] for p in threadpool_info() if p["user_api"] == user_api), default=1)


def _blas_threads() -> int:
    return _native_threads("blas")


def test_host_work_runs_on_one_thread_and_restores_the_counts_even_on_an_error():
    from tabfm.table_threads import HOST_WORK_ROWS

    original = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        before = torch.get_num_threads(), _blas_threads()
        with host_work(HOST_WORK_ROWS):
            assert (torch.get_num_threads(), _blas_threads()) == (1, 1)
        with pytest.raises(RuntimeError, match="inside"):
            with host_work(100):
                raise RuntimeError("inside")
        assert (torch.get_num_threads(), _blas_threads()) == before
        with host_work(HOST_WORK_ROWS + 1):  # large tables: k-means and searches big enough for a team of threads
            assert (torch.get_num_threads(), _blas_threads()) == before
    finally:
        torch.set_num_threads(original)


def test_overlapping_host_work_in_two_threads_restores_the_blas_threads():
    """Found by a review: each block restored the BLAS count it saw on entry, a process-wide count, so two
    threads' overlapping blocks left it at 1 for good."""
    before = _blas_threads()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def a():
        with host_work(10):
            a_in.set()
            b_in.wait(5)
        a_out.set()

    def b():
        a_in.wait(5)
        with host_work(10):
            b_in.set()
            a_out.wait(5)

    threads = [threading.Thread(target=f) for f in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert _blas_threads() == before


@pytest.mark.parametrize("Estimator", [TabFMClassifier, TabFMRegressor])
def test_the_estimators_cpu_work_between_forwards_runs_on_one_thread(Estimator, monkeypatch):
    """The local contexts' k-means and searches and the linear models are small ops that a team of threads only
    slows on a busy machine (fit 1.8-2.2 s against 2.8-5.0 s at 1,000 x 1,000 x 20): they run on one thread, and
    the forwards still on as many table threads as n_jobs gives."""
    import tabfm.linear_base as linear_base
    import tabfm.local_context as local_context

    seen: dict[str, set] = {}

    def recorded(owner, name):
        real = getattr(owner, name)

        def run(*args, **kwargs):
            seen.setdefault(name, set()).add((torch.get_num_threads(), _blas_threads()))
            return real(*args, **kwargs)
        monkeypatch.setattr(owner, name, run)

    for owner, name in ((local_context.LocalContexts, "fit"), (local_context.LocalContexts, "routes"),
                        (linear_base.LogisticModel, "fit_design"), (linear_base.LogisticModel, "predict_proba"),
                        (linear_base.LinearBase, "fit"), (linear_base.LinearBase, "predict")):
        recorded(owner, name)
    workers = []
    real_map = estimator_module.map_tables
    monkeypatch.setattr(estimator_module, "map_tables",
                        lambda fn, items, w, *done: workers.append(w) or real_map(fn, items, w, *done))
    X, y = estimator_table(Estimator, 300)
    Estimator(n_estimators=4, local_context_rows=64, n_jobs=2).fit(X, y).predict(X[:50])
    assert {"fit", "routes"} <= set(seen) and ({"fit_design", "predict_proba"} <= set(seen)
                                                if Estimator is TabFMClassifier else {"predict"} <= set(seen))
    assert all(counts == {(1, 1)} for counts in seen.values()), seen
    assert workers and set(workers) == {2}


@pytest.mark.parametrize("Estimator", [TabFMClassifier, TabFMRegressor])
def test_the_trees_predict_on_one_thread(Estimator, monkeypatch):
    """Predicting a tree is one OpenMP parallel region: on a team of 2 beside busy processes 1,000 rows took 1.3 s
    of a predict, on one thread 8 ms. The regressor's trees here get no weight from the held rows, so they are set."""
    import tabfm.tree_base as tree_base

    X, y = estimator_table(Estimator, 300)
    est = Estimator(n_estimators=1, local_context_rows=64, n_jobs=2).fit(X, y)
    if Estimator is TabFMRegressor:
        est.tree_model_ = tree_base.fit_trees(est.train_cells_, est.target_scale_.forward(y), None, 0)
        est.tree_weight_ = 0.5
    assert est.tree_model_ is not None and est.tree_weight_ > 0
    seen = []
    real = tree_base.HistGradientBoostingClassifier if Estimator is TabFMClassifier else \
        tree_base.HistGradientBoostingRegressor
    name = "predict_proba" if Estimator is TabFMClassifier else "predict"
    method = getattr(real, name)
    monkeypatch.setattr(real, name, lambda self, X: seen.append(_native_threads("openmp")) or method(self, X))
    estimator_outputs(est, X[:50])
    assert seen == [1]




def test_host_threads_benchmark_prints_both_sides_and_their_ratio(tmp_path):
    rows = side_by_side_rows("host_threads", ["--sizes", "150x40", "--repeats", "1", "--n-jobs", "2", "--settings",
                                              "classifier-1-member"], tmp_path / "h.txt")
    assert [r[0] for r in rows] == ["classifier-1-member"]
    for _, every, one, speed_up, diff in rows:
        assert speed_up_matches(every, one, speed_up)
        assert diff < 1e-6  # the host work's results do not depend on its thread count here
    assert "0 busy process(es) beside" in (tmp_path / "h.txt").read_text().splitlines()[0]


def test_busy_processes_spin_for_the_block_and_stop_after_it_even_on_an_error():
    import multiprocessing

    from builders import benchmark_module

    busy = benchmark_module("host_threads").busy_processes
    before = {p.pid for p in multiprocessing.active_children()}  # other tests' workers (a forkserver) may live on
    started = []
    with pytest.raises(RuntimeError, match="inside"):
        with busy(2):
            started = [p for p in multiprocessing.active_children() if p.pid not in before and p.is_alive()]
            assert len(started) == 2
            raise RuntimeError("inside")
    assert not any(p.is_alive() for p in started)
    assert {p.pid for p in multiprocessing.active_children()} <= before
