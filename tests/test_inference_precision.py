"""The estimators' inference precision (tabfm.inference_precision): precision="bf16" runs the model under bfloat16
autocast with float32 weights, close to fp32; the old dtype="bfloat16" (bfloat16 weights) is refused.

Tolerance. bfloat16 keeps 8 significant bits (a rounding moves a value by up to 2^-9 of itself). The cells and the
output head run in float32 (tabfm.model), so neither the data nor the logits are rounded; what moves the
probabilities is the rounding of the activations inside, above all of the attention's queries and keys (with the
attention modules in float32 the largest difference falls 2-3x; with only the softmax in float32 it does not
move), which the attention's score magnitudes amplify. That error has no bound as tidy as one rounding, so the test
asserts the mean difference within 2^-8 and the largest within 2^-5: the largest is the tail of 60 rows' errors
and depends on the CPU's bfloat16 kernels. Measured (torch 2.13, over 12 tables of 300 and 120 train rows, 2 and
3 classes, local and global contexts): on an Intel Xeon with AMX, largest 0.0178 (0.0192 with the cells and head
under autocast), mean 0.0016; on the tables below, 0.0069 / 0.0012 one process, 0.0121 / 0.0020 on a 2x1 mesh and
0.0086 / 0.0016 on 1x2, 0.0169 / 0.0024 with one global context. An AMD EPYC without bfloat16 instructions gave
about 0.007 everywhere. The regressor's means and quantiles stay within 0.0010 / 0.0012 of the targets' standard
deviation.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from builders import benchmark_module, make_batch, tiny_model
from sklearn.datasets import make_classification, make_regression

from tabfm.estimator import TabFMClassifier, TabFMRegressor
from tabfm.inference_precision import resolve_precision, resolve_weight_dtype

MAX_ABS = 2.0 ** -5
MEAN_ABS = 2.0 ** -8
REGRESSION_ABS = 2.0 ** -8  # of the targets' deviation: a mean over the bins averages their probabilities' errors


def _data(n_train: int = 300, n_test: int = 60):
    """A two-class table of 10 numeric columns: 300 train rows, past local_context_rows=256 (local contexts)."""
    X, y = make_classification(n_samples=n_train + n_test, n_features=10, n_informative=6, random_state=0)
    return X[:n_train], y[:n_train], X[n_train:], y[n_train:]


@pytest.fixture(scope="module")
def pair():
    """(fp32 classifier, bf16 classifier, X_test), fitted alike with local contexts."""
    X, y, X_test, _ = _data()
    kwargs = dict(n_estimators=1, calibrate=False, n_jobs=1)
    return (TabFMClassifier(**kwargs, precision="fp32").fit(X, y), TabFMClassifier(**kwargs, precision="bf16").fit(X, y),
            X_test)


def test_bf16_keeps_float32_weights_and_caches_bfloat16_keys(pair):
    fp32, bf16, _ = pair
    assert bf16.precision_ == "bf16" and bf16.local_ is not None
    assert bf16.model_ is fp32.model_  # autocast never touches the weights: one shared float32 copy serves both
    assert {p.dtype for p in bf16.model_.parameters()} == {torch.float32}
    cache, ref = bf16.contexts_[0][1], fp32.contexts_[0][1]
    assert cache.caches[0].k.dtype == torch.bfloat16 and cache.cell_stats[0].dtype == torch.float32
    assert cache.nbytes() * 2 == ref.nbytes()  # half the memory


def test_bf16_probabilities_are_close_to_fp32(pair):
    fp32, bf16, X_test = pair
    a, b = fp32.predict_proba(X_test), bf16.predict_proba(X_test)
    assert b.dtype == np.float64 and np.allclose(b.sum(1), 1, atol=1e-12)  # decoded in float64
    diff = np.abs(a - b)
    assert diff.max() <= MAX_ABS and diff.mean() <= MEAN_ABS, (diff.max(), diff.mean())
    assert diff.max() > 0  # bf16 did run


def test_bf16_one_global_context_is_close_too():
    X, y, X_test, _ = _data(120, 60)
    kwargs = dict(n_estimators=1, calibrate=False, n_jobs=1, local_context_rows=None)
    a = TabFMClassifier(**kwargs).fit(X, y).predict_proba(X_test)
    b = TabFMClassifier(**kwargs, precision="bf16").fit(X, y).predict_proba(X_test)
    assert np.abs(a - b).max() <= MAX_ABS and np.abs(a - b).mean() <= MEAN_ABS


def test_bf16_predicts_the_same_classes_on_a_separable_table():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(160, 4))
    y = np.where(X[:, 0] > 0, "pos", "neg")
    X[:, 0] += np.where(X[:, 0] > 0, 1.0, -1.0)  # a margin of 2 around the boundary
    kwargs = dict(n_estimators=1, n_jobs=1)
    fp32 = TabFMClassifier(**kwargs).fit(X[:100], y[:100])
    bf16 = TabFMClassifier(**kwargs, precision="bf16").fit(X[:100], y[:100])
    assert (bf16.predict(X[100:]) == fp32.predict(X[100:])).all() and (fp32.predict(X[100:]) == y[100:]).all()


def test_bf16_regressor_is_close_to_fp32():
    X, y = make_regression(n_samples=360, n_features=6, noise=10.0, random_state=0)
    kwargs = dict(n_estimators=1, n_jobs=1)
    fp32 = TabFMRegressor(**kwargs).fit(X[:300], y[:300])
    bf16 = TabFMRegressor(**kwargs, precision="bf16").fit(X[:300], y[:300])
    assert bf16.local_ is not None and bf16.bin_points_y_.dtype == np.float64
    scale = y.std()
    # the mean of a bin distribution moves by at most the bins' spread times the probability moved
    assert np.abs(fp32.predict(X[300:]) - bf16.predict(X[300:])).max() <= REGRESSION_ABS * scale
    q = (0.1, 0.5, 0.9)
    assert np.abs(fp32.predict_quantiles(X[300:], q) - bf16.predict_quantiles(X[300:], q)).max() <= REGRESSION_ABS * scale


@pytest.mark.parametrize("task", ["classification", "regression"])
def test_bf16_leaves_the_cells_and_the_logits_in_float32(task):
    """Under bfloat16 autocast the matmuls inside round to bfloat16, but the cell tokens (the data) and the logits
    (what the probabilities are decoded from) stay float32: the head's output equals what it makes of its float32
    input outside autocast, and the tokens equal the encoder's outside autocast."""
    model = tiny_model().float().eval()
    batch = make_batch(task)
    head = model.bin_head if task == "regression" else model.class_head
    seen = {}
    head.register_forward_hook(lambda m, args, out: seen.update(h=args[0], out=out))
    model.cells.register_forward_hook(lambda m, args, out: seen.update(cells=out, cell_args=args))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(batch)
        inner = model.compress.block.attn.qkv(seen["cells"])
    assert inner.dtype == torch.bfloat16  # the matmuls inside do run in bfloat16
    assert seen["h"].dtype == seen["out"].dtype == logits.dtype == seen["cells"].dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(seen["out"], head(seen["h"]))
        assert torch.equal(seen["cells"], model.cells(*seen["cell_args"]))


def _bf16_on_mesh(d0: int, d1: int, sp: bool) -> tuple[np.ndarray, set, object]:
    """On each rank: a bf16 classifier fitted with tensor_parallel=(d0, d1) (local contexts); its probabilities,
    its parameters' dtypes and its first cached keys' dtype."""
    X, y, X_test, _ = _data()
    clf = TabFMClassifier(n_estimators=1, calibrate=False, n_jobs=1, precision="bf16", tensor_parallel=(d0, d1),
                          sequence_parallel=sp).fit(X, y)
    return (clf.predict_proba(X_test), {p.dtype for p in clf.model_.parameters()},
            clf.contexts_[0][1].caches[0].k.dtype)


@pytest.mark.parametrize("d0, d1, sp", [(2, 1, True), (1, 2, False)])
def test_bf16_under_tensor_parallelism_is_close_to_fp32_on_one_process(ranks, pair, d0, d1, sp):
    """bf16 on a 2-rank mesh: float32 shards, bfloat16 caches (the sharded linears add their bias in the output's
    dtype, as nn.Linear does under autocast; before, the float32 bias promoted every key to float32), and
    probabilities within the one-process bound of fp32 (measured on the Xeon: max 0.0121 / 0.0086, mean 0.0020 /
    0.0016; the partial sums of the sharded matmuls are rounded to bfloat16 before they are added)."""
    fp32, _, X_test = pair
    want = fp32.predict_proba(X_test)
    for proba, dtypes, key_dtype in ranks(2).run(_bf16_on_mesh, d0, d1, sp):
        assert dtypes == {torch.float32} and key_dtype == torch.bfloat16
        diff = np.abs(proba - want)
        assert diff.max() <= MAX_ABS and diff.mean() <= MEAN_ABS, (diff.max(), diff.mean())


def test_auto_is_bf16_on_cuda_only_and_bf16_needs_float32_weights():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_precision("auto", torch.float32, cpu) == "fp32"
    assert resolve_precision("auto", torch.float32, cuda) == "bf16"
    assert resolve_precision("auto", torch.float64, cuda) == "fp32"  # float64: the exact reference
    assert resolve_precision("bf16", torch.float32, cpu) == "bf16"
    with pytest.raises(ValueError, match="precision='bf16' needs dtype='float32'"):
        resolve_precision("bf16", torch.float64, cpu)
    assert TabFMClassifier().precision == "auto"


@pytest.mark.parametrize("dtype", ["bfloat16", torch.bfloat16, "float16"])
def test_bfloat16_weights_are_refused_naming_precision(dtype):
    with pytest.raises(ValueError, match="no longer supported .* precision='bf16'"):
        resolve_weight_dtype(dtype)
    X, y, _, _ = _data(20, 0)
    with pytest.raises(ValueError, match="precision='bf16'"):
        TabFMClassifier(n_estimators=1, dtype=dtype).fit(X, y)
    assert resolve_weight_dtype("float64") is torch.float64 and resolve_weight_dtype(torch.float32) is torch.float32
    with pytest.raises(ValueError, match="dtype must be one of float32, float64"):
        resolve_weight_dtype(torch.int64)


def test_gpu_table_reports_an_out_of_memory_run_a_crash_and_the_budget_and_goes_on(monkeypatch, capsys):
    import json
    import subprocess

    bench = benchmark_module("inference")
    ok = {"fit_s": 1.0, "predict_s": 0.5, "score": 0.9, "cache": 2 ** 30, "peak": 2 ** 31}
    answers = iter([
        subprocess.CompletedProcess([], 0, json.dumps({"device_name": "GPU X", "fp32": ok, "bf16": ok,
                                                       "max_dp": 0.004, "mean_dp": 0.001, "kernels": "flash"})),
        subprocess.CompletedProcess([], 0, json.dumps({"fp32": {"error": "out of memory (...)"}, "bf16": ok})),
        subprocess.CompletedProcess([], 1, "", "Traceback ...\nRuntimeError: CUDA error: an illegal memory access"),
        subprocess.TimeoutExpired([], 10),
    ])

    def fake_run(cmd, **kwargs):
        assert "--gpu-one" in cmd and kwargs["timeout"] > 0
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    log = bench.Log()
    bench.gpu_table_section(log, "cuda", 100.0, sizes=((1000, 1000, 20), (2, 2, 2), (3, 3, 3), (4, 4, 4)))
    text = "\n".join(log.lines)
    assert "device: GPU X" in text and "bf16 attention kernels: flash" in text
    assert "4.0e-03" in text and "  1.500" in text  # bf16's difference to fp32; fit + predict
    assert "fp32  out of memory" in text and "failed (exit 1): RuntimeError: CUDA error" in text
    assert "stopped after" in text and next(answers, None) is None  # every size was tried


@pytest.mark.parametrize("flags,message", [
    (["--sizes", "1000,5k"], "--sizes takes comma-separated row counts of 1 or more such as 1000,5000, got '1000,5k'"),
    (["--estimators", "0"], "--estimators takes comma-separated n_estimators of 1 or more such as 1,4, got '0'"),
    (["--repeats", "0"], "--repeats 0: give 1 or more"),
    (["--txt", "{tmp}/afile/out.txt"], "--txt {tmp}/afile/out.txt: {tmp}/afile is a file, not a folder; give a file "
     "name for the results text"),
    (["--png", "{tmp}/afile/memory.png"], "--png {tmp}/afile/memory.png: {tmp}/afile is a file, not a folder"),
])
def test_inference_benchmark_refuses_a_bad_flag_before_timing(monkeypatch, tmp_path, capsys, flags, message):
    """A count that is no number had been int()'s traceback, and --txt / --png below a file failed only after
    minutes of timing: now one line naming the flag before any, nothing written."""
    import sys

    bench = benchmark_module("inference")
    (tmp_path / "afile").write_text("x")
    for section in ("speed_section", "memory_section"):
        monkeypatch.setattr(bench, section, lambda *a: pytest.fail("timed before the flags were checked"))
    argv = ["--txt", str(tmp_path / "out.txt"), "--png", str(tmp_path / "memory.png")]
    monkeypatch.setattr(sys, "argv", ["inference.py", *argv, *(f.format(tmp=tmp_path) for f in flags)])
    with pytest.raises(SystemExit):
        bench.main()
    assert capsys.readouterr().err.splitlines()[-1] == f"inference.py: error: {message.format(tmp=tmp_path)}"
    assert [p.name for p in tmp_path.iterdir()] == ["afile"]
