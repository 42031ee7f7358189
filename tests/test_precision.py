"""Training precision (train.precision fp32 | tf32 | bf16) and AdamW's weight-decay groups.

bf16 is autocast around forward and loss: the parameters, gradients and AdamW state stay float32 and the losses
stay within bfloat16 tolerance of float32's, on one process and on 2x2 (sequence parallel) and 4x1 meshes. The
tensor-parallel LayerNorm gathers its statistics in float32 even from bfloat16 activations. train.dtype bfloat16
(bfloat16 parameters, no master weights) is refused. Weight decay applies to linear weight matrices only, the same
parameters on every layout.
"""

from __future__ import annotations

import copy
import gc
import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from builders import benchmark_module
from dist_harness import get_mesh
from safetensors.torch import load_file
from torch import nn

from tabfm import checkpoint as ckpt
from tabfm.config import load_config
from tabfm.data.loader import make_loader
from tabfm.estimator import TabFMClassifier
from tabfm.model import build_model
from tabfm.parallel_model import parallelize_model
from tabfm.parallel import comm
from tabfm.parallel.layers import ParallelLayerNorm
from tabfm.precision import autocast, make_optimizer, matmul_precision, param_groups
from tabfm.pretrain import lr_at, main, train, train_step

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "pretrain" / "tiny.yaml"
BF16_RTOL = 1e-2  # a few bfloat16 ulps (2**-8 relative) of the loss after a few steps
SMALL_TABLES = ("data.batch_size=2", "data.table.max_rows=40", "train.progress=false")


def _steps(d0: int, d1: int, sp: bool, precision: str, chunks: int = 1, steps: int = 3) -> dict:
    """`steps` optimizer steps of the tiny model on a d0 x d1 mesh (1x1: this process) at `precision`, with
    `chunks` overlapped chunks per layer; the losses and the dtypes of everything the optimizer holds."""
    cfg = load_config(TINY, [*SMALL_TABLES, f"train.precision={precision}", "optim.grad_clip=0.1"])
    mesh = get_mesh(d0, d1)
    model = parallelize_model(build_model(cfg.model, seed=0), mesh, sequence_parallel=sp, overlap_chunks=chunks)
    optimizer = make_optimizer(model, cfg.optim)
    losses, loss_dtypes = [], set()
    for step, batch in enumerate(make_loader(cfg.data, num_steps=steps)):
        loss, _ = train_step(model, optimizer, batch, mesh, lr_at(step, cfg.optim, steps), cfg.optim, precision)
        losses.append(loss.item())
        loss_dtypes.add(str(loss.dtype))
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        "losses": losses, "loss_dtypes": loss_dtypes,
        "params": {str(p.dtype) for p in model.parameters()},
        "grads": {str(p.grad.dtype) for p in model.parameters() if p.grad is not None},
        "state": {(k, str(v.dtype)) for s in optimizer.state.values() for k, v in s.items() if k != "step"},
        "state_count": len(optimizer.state),
        "decay": sorted(names[id(p)] for p in optimizer.param_groups[0]["params"]),
        "wd": [g["weight_decay"] for g in optimizer.param_groups],
    }


def _rel_err(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def _assert_float32_master(run: dict, n_params: int) -> None:
    assert run["params"] == run["grads"] == {"torch.float32"}
    assert run["state"] == {("exp_avg", "torch.float32"), ("exp_avg_sq", "torch.float32")}
    assert run["state_count"] == n_params and run["loss_dtypes"] == {"torch.float32"}


@pytest.fixture(scope="module")
def fp32_reference() -> dict:
    return _steps(1, 1, False, "fp32")


def test_bf16_on_one_process_keeps_float32_master_weights(fp32_reference):
    run = _steps(1, 1, False, "bf16")
    _assert_float32_master(run, len(list(build_model("tiny").parameters())))
    err = _rel_err(run["losses"], fp32_reference["losses"])
    assert 0 < err <= BF16_RTOL, (run["losses"], fp32_reference["losses"])  # bfloat16 did run, and closely


def _sdpa_flags() -> dict[str, bool]:
    b = torch.backends.cuda
    return {"cudnn": b.cudnn_sdp_enabled(), "flash": b.flash_sdp_enabled(), "efficient": b.mem_efficient_sdp_enabled(),
            "math": b.math_sdp_enabled()}


def _estimator_autocast(precision: str, device: torch.device):
    """The context a fitted estimator's forwards run in (its precision_ and device_ as fit resolves them)."""
    est = TabFMClassifier()
    est.precision_, est.device_ = precision, device
    return est._autocast()


@pytest.mark.filterwarnings("ignore:CUDA is not available")  # autocast("cuda") on a CPU-only build
@pytest.mark.parametrize("context", [autocast, _estimator_autocast])
def test_bf16_on_cuda_keeps_attention_off_cudnn_and_restores_the_flags(context):
    """cuDNN attention plans each new shape; under bf16 on CUDA only flash / efficient / math may run, and the
    process's own choice comes back afterwards. fp32, and bf16 on CPU, leave the backends alone."""
    before = _sdpa_flags()
    assert before["cudnn"], "PyTorch's default allows cuDNN attention: nothing to check otherwise"
    with context("bf16", torch.device("cuda")):
        assert _sdpa_flags() == {"cudnn": False, "flash": True, "efficient": True, "math": True}
    assert _sdpa_flags() == before
    for precision, device in (("bf16", "cpu"), ("fp32", "cuda"), ("fp32", "cpu")):
        with context(precision, torch.device(device)):
            assert _sdpa_flags() == before
    made = context("bf16", torch.device("cpu"))
    assert not torch.is_autocast_enabled("cpu")  # entered by `with`, not when made
    with made:
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and torch.is_autocast_enabled("cpu")
    assert not torch.is_autocast_enabled("cpu")


def test_tf32_on_cpu_is_fp32(fp32_reference):
    """No TF32 on a CPU: the same losses to the bit, and the global matmul setting is left alone."""
    before = torch.get_float32_matmul_precision()
    with matmul_precision("tf32", "cpu"):
        assert torch.get_float32_matmul_precision() == before
        assert _steps(1, 1, False, "tf32")["losses"] == fp32_reference["losses"]


@pytest.mark.parametrize("d0,d1,sp,chunks", [(2, 2, True, 1), (4, 1, False, 1), (2, 2, True, 2)])
def test_bf16_under_tensor_parallelism(ranks, fp32_reference, d0, d1, sp, chunks):
    """chunks 2: the overlapped layers' backward (a custom autograd Function) runs its matmuls under autocast."""
    n_params = len(list(build_model("tiny").parameters()))
    for run in ranks(4).run(_steps, d0, d1, sp, "bf16", chunks):
        _assert_float32_master(run, n_params)
        err = _rel_err(run["losses"], fp32_reference["losses"])
        assert 0 < err <= BF16_RTOL, (d0, d1, run["losses"], fp32_reference["losses"])
        # sharded parameters keep their names and their group: the same decay set as one process
        assert run["decay"] == fp32_reference["decay"] and run["wd"] == fp32_reference["wd"]


@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("d0, d1", [(1, 2), (2, 1)])
def test_sharded_layers_keep_autocast_activations_in_bfloat16(d0, d1, chunks):
    """Under autocast a sharded attention and MLP give bfloat16 out, as their dense modules do (nn.Linear adds
    its bias in bfloat16): a float32 bias added to the bfloat16 matmul output used to promote every activation
    after a sharded linear back to float32. Dry-run meshes: the collectives keep shapes and dtypes."""
    from tabfm.parallel import dense
    from tabfm.parallel.layers import ParallelAttention, ParallelMlp
    from tabfm.parallel.mesh import TPMesh

    torch.manual_seed(0)
    attn, mlp = dense.Attention(16, 4), dense.Mlp(16, 32)
    mesh = TPMesh.dry_run(d0, d1)
    sharded = (ParallelAttention(attn, mesh, overlap_chunks=chunks),
               ParallelMlp(mlp, mesh, overlap_chunks=chunks, kernels="torch"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = {m(torch.randn(4, 6, 16)).dtype for m in (attn, mlp)}
        got = {m(torch.randn(4, 6, 16 // d1)).dtype for m in sharded}
    assert want == got == {torch.bfloat16}


def _norm_stats_under_autocast(d0: int, d1: int) -> dict:
    """A tensor-parallel LayerNorm fed bfloat16 activations under autocast: the dtypes its collectives carry,
    and its output against float32 F.layer_norm of the same (bfloat16-rounded) input."""
    mesh = get_mesh(d0, d1)
    torch.manual_seed(0)
    dense = nn.LayerNorm(16)
    with torch.no_grad():
        dense.weight.normal_()
        dense.bias.normal_()
    full = (torch.randn(3, 5, 16) * 4 + 100).bfloat16()  # a large mean: bfloat16 statistics would lose it
    norm = ParallelLayerNorm(dense, mesh)
    local = full.chunk(d1, -1)[mesh.j]
    seen = []

    def observe(launch, x, *args, **kwargs):
        seen.append(str(x.dtype))
        return launch(x, *args, **kwargs)

    with comm.observing(observe), torch.autocast("cpu", dtype=torch.bfloat16):
        out = norm(local)
        s, fused = norm.forward_residual(local, local)  # the residual add fused into the statistics
    expect = F.layer_norm(full.float(), (16,), dense.weight, dense.bias).chunk(d1, -1)[mesh.j]
    # bfloat16 parameters without autocast (bfloat16 inference) still get bfloat16 out
    half = ParallelLayerNorm(copy.deepcopy(dense).bfloat16(), mesh)
    s_half, y_half = half.forward_residual(local, local)
    return {"gathered": seen, "err": (out.float() - expect).abs().max().item(),
            "fused_err": (fused.float() - expect).abs().max().item(),
            "dtypes": [str(t.dtype) for t in (out, s, fused, s_half, y_half)]}


def test_parallel_norm_statistics_stay_float32_under_autocast(ranks):
    for r in ranks(4).run(_norm_stats_under_autocast, 2, 2):
        assert r["gathered"] == ["torch.float32"] * 2  # one all-gather of (mean, m2) per token per call, axis 1
        assert r["err"] <= 1e-4 and r["fused_err"] <= 1e-4  # x + x has the same normalisation as x
        assert r["dtypes"] == ["torch.float32", "torch.bfloat16", "torch.float32", "torch.bfloat16", "torch.bfloat16"]


def test_bf16_run_through_the_config_saves_float32_state(tmp_path):
    """train.precision: bf16 in a run: the checkpoint's weights and AdamW moments are float32."""
    cfg = load_config(TINY, [*SMALL_TABLES, f"train.out_dir={tmp_path}", "train.steps=2", "train.precision=bf16"])
    records = train(cfg)
    assert len(records) == 2
    step_dir = tmp_path / "checkpoints" / "step_0000002"
    ckpt.verify_checkpoint(step_dir)
    tensors = {}
    for f in step_dir.glob("*.safetensors"):
        tensors.update(load_file(f))
    moments = {k: v for k, v in tensors.items() if k.endswith(("/exp_avg", "/exp_avg_sq"))}
    weights = {k: v for k, v in tensors.items() if k.startswith("model/") and v.is_floating_point()}
    assert moments and weights
    assert {v.dtype for v in (*moments.values(), *weights.values())} == {torch.float32}


# ---------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------

def test_bfloat16_parameters_are_refused_with_the_replacement(capsys, tmp_path):
    with pytest.raises(ValueError, match=r"train.dtype=bfloat16 .* train.precision: bf16"):
        load_config(TINY, ["train.dtype=bfloat16"])
    assert main(["--config", str(TINY), "--set", "train.dtype=bfloat16", f"train.out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("config error: train.dtype=bfloat16") and "train.precision: bf16" in err
    assert len(err.splitlines()) == 1 and not any(tmp_path.iterdir())
    with pytest.raises(ValueError, match="train.precision='fp16'; use fp32, tf32, bf16"):
        load_config(TINY, ["train.precision=fp16"])
    with pytest.raises(ValueError, match="train.precision=bf16 needs train.dtype=float32"):
        load_config(TINY, ["train.precision=bf16", "train.dtype=float64"])


def test_shipped_recipes_load_and_large_uses_bf16_autocast():
    for path in sorted((ROOT / "configs" / "pretrain").glob("*.yaml")):
        cfg = load_config(path)
        assert cfg.train.dtype == "float32", path
    large = load_config(ROOT / "configs" / "pretrain" / "large.yaml")
    assert large.train.precision == "bf16" and large.train.compute_dtype == "bfloat16"
    assert load_config(TINY).train.compute_dtype == "float32"


# ---------------------------------------------------------------------------------------------------------
# Weight decay
# ---------------------------------------------------------------------------------------------------------

def test_weight_decay_only_on_linear_weight_matrices():
    model = build_model("tiny")
    groups = param_groups(model, 0.05)
    assert [g["weight_decay"] for g in groups] == [0.05, 0.0]
    names = {id(p): n for n, p in model.named_parameters()}
    decay = {names[id(p)] for p in groups[0]["params"]}
    rest = {names[id(p)] for p in groups[1]["params"]}
    assert decay | rest == set(names.values()) and not decay & rest
    linear = {f"{m}.weight" for m, mod in model.named_modules() if isinstance(mod, nn.Linear)}
    assert decay == linear
    # matrices that are not linear weights: the embeddings and the CLS tokens
    for name in ("cells.cat_embed.weight", "icl.class_embed.weight", "compress.cls"):
        assert name in rest and model.get_parameter(name).ndim == 2
    assert all(n.endswith(".bias") or "norm" in n or n in ("cells.cat_embed.weight", "icl.class_embed.weight",
                                                             "compress.cls") for n in rest)
    assert {"axial.0.column.block.attn.qkv.weight", "icl.blocks.blocks.0.mlp.fc2.weight",
            "class_head.weight"} <= decay
    optimizer = make_optimizer(model, load_config(TINY, ["optim.weight_decay=0.05"]).optim)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.05, 0.0]


def test_no_decay_parameters_do_not_shrink():
    """With zero gradients, an AdamW step moves only the decayed weights (by lr * wd * w)."""
    model = build_model("tiny")
    optimizer = make_optimizer(model, load_config(TINY, ["optim.weight_decay=0.5", "optim.lr=0.1"]).optim)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    decay = {id(p) for p in optimizer.param_groups[0]["params"]}
    for n, p in model.named_parameters():
        expect = before[n] * (1 - 0.1 * 0.5) if id(p) in decay else before[n]
        torch.testing.assert_close(p.detach(), expect)


# ---------------------------------------------------------------------------------------------------------
# benchmarks/gpu_pretrain.py, its CPU smoke path
# ---------------------------------------------------------------------------------------------------------

def test_gpu_benchmark_smoke_prints_a_row_per_precision(capsys, monkeypatch):
    bench = benchmark_module("gpu_pretrain")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the shared 2-core machine: more threads only contend
    # The benchmark's free() runs gc.collect() between measurements (12 times): over the whole test session's
    # objects that is ~0.2-0.3 s each. Frozen, those are not scanned again; what the benchmark makes is.
    gc.freeze()
    try:  # the eager compile backend: dynamo traces the model, no C++ compiler runs
        assert bench.main(["--cpu-smoke", "--compile-backend", "eager", "--no-explain", "--loader-workers", "0"]) == 0
    finally:
        gc.unfreeze()
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| tiny |")]
    assert [r[2].strip() for r in rows] == ["fp32", "tf32", "bf16", "bf16+compile"], out
    for r in rows:  # cells/s is the batch's cells over the step time; no peak is known for a CPU
        step_ms, cells, tables_rows_features = float(r[3]), float(r[4]), r[1].split(" x ")
        assert cells == pytest.approx(math.prod(map(int, tables_rows_features)) / (step_ms / 1e3), rel=0.02), r
        assert r[7].strip() == "n/a", r
    gflops = {float(r[5]) for r in rows}
    assert len(gflops) == 1 and gflops.pop() > 0  # one model, one batch: the same FLOPs at every precision
    assert "| 2 x 32 x 4 | 0 |" in out  # the loader row
    e2e = [line for line in out.splitlines() if line.startswith("| 2 x 32 x 4 |") and "%" in line]
    assert len(e2e) == 1 and "| CPU kernels |" in e2e[0] and "failed" not in out
    assert bench.peak_tflops("NVIDIA H200", "bf16") == 989.5 and bench.peak_tflops("NVIDIA H100 PCIe", "tf32") == 378
    assert bench.peak_tflops("NVIDIA A100-SXM4-80GB", "fp32") == 19.5 and bench.peak_tflops(None, "bf16") is None
    args = bench.build_parser().parse_args(["--cpu-smoke", "--compile-backend", "eager", "--loader-workers", "0"])
    bench.resolve(args)
    labels = [label for label, *_ in bench.e2e_settings("cuda", "bf16", ["cudnn", "compile", "eager"], "inductor")]
    assert labels == ["flash / efficient (tabfm)", "flash / efficient + compile (inductor)",
                      "cuDNN allowed (PyTorch's choice)"]  # compiled before cuDNN, whatever order was asked
    assert [c for *_, c in bench.e2e_settings("cuda", "bf16", ["eager", "compile"], "inductor")] == [False, True]
    assert len(bench.e2e_settings("cuda", "fp32", ["eager", "cudnn"], "inductor")) == 1  # cuDNN: bf16 only
    assert [label for label, *_ in bench.e2e_settings("cpu", "fp32", ["compile"], "eager")] == ["CPU kernels"]
    r = bench.e2e_run(args, torch.device("cpu"), 4, compile=True)  # the GPU's compiled end-to-end row
    assert r["median_ms"] > 0 and 0 <= r["wait"] <= r["total"]
    with warnings.catch_warnings():  # autocast("cuda") on a CPU-only build warns and does nothing else
        warnings.filterwarnings("ignore", "CUDA is not available")
        with bench.cudnn_attention_allowed(), autocast("bf16", torch.device("cuda")):  # the e2e comparison row
            assert _sdpa_flags()["cudnn"]
        with autocast("bf16", torch.device("cuda")):  # and tabfm's own setting is back afterwards
            assert not _sdpa_flags()["cudnn"]


@pytest.mark.parametrize("flags,message", [
    (["--steps", "0"], "--steps 0: give 1 or more"),
    (["--features", "4", "0"], "--features 0: give 1 or more"),
    (["--loader-workers", "-1"], "--loader-workers -1: give 0 or more"),
    (["--e2e-steps", "0"], "--e2e-steps 0: give 1 or more"),
])
def test_gpu_benchmark_refuses_a_count_it_cannot_time(monkeypatch, flags, message):
    """--steps 0 had printed 'failed: StatisticsError: no median for empty data' in every row and exited 0, as if
    it had measured: now one line naming the flag, before the header or any section."""
    bench = benchmark_module("gpu_pretrain")
    monkeypatch.setattr(bench, "header", lambda *a: pytest.fail("ran before the flags were checked"))
    with pytest.raises(SystemExit) as e:
        bench.main(["--cpu-smoke", *flags])
    assert str(e.value) == message
