"""Triton kernels for the chunk epilogues, forward and backward, as autograd Functions.

Imported only when the Triton path is chosen (see `ops.backend`): on CUDA tensors, or on CPU tensors under
`TRITON_INTERPRET=1` (the interpreter the tests use; it must be set before this module is imported). Each
kernel equals its torch reference in `reference.py`; the tests hold it to that forward and backward.

Every tensor is viewed as rows x N (rows = all leading dimensions, N = the last one) and must be contiguous
(the wrappers make it so). Arithmetic is in float32 (float64 for float64 tensors), stores in the tensor's dtype.
    bias_act        out = act(y + b)                      backward: dz = dout * act'(y + b); db = sum_rows dz
    norm_stats      (s = x + r), mean, m2 of s per row    backward: ds + dmean / N + 2 (s - mean) dm2
    normalize       (x - mean) * rstd * w + b             backward: dx, dmean, drstd per row; dw, db per column
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ACT_CODES = {"gelu": 0, "gelu_tanh": 1, "relu": 2, "silu": 3}
_TILE = 4096  # elements per program tile


def _compute_dtype(t: torch.Tensor):
    return tl.float64 if t.dtype == torch.float64 else tl.float32


def _tiles(m: int, n: int, max_n: int) -> tuple[int, int]:
    block_n = min(triton.next_power_of_2(max(n, 1)), max_n)
    block_m = max(1, min(triton.next_power_of_2(max(m, 1)), _TILE // block_n))
    return block_m, block_n


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A contiguous rows x N view of t."""
    return t.contiguous().view(-1, t.shape[-1]) if t.dim() else t.contiguous().view(1, 1)


# -------------------------------------------------------------------------------------------------------
# bias + activation
# -------------------------------------------------------------------------------------------------------

@triton.jit
def _act(z, ACT: tl.constexpr):
    if ACT == 0:    # exact GELU: z * Phi(z)
        out = 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))
    elif ACT == 1:  # tanh GELU (tanh(u) = 2 sigmoid(2u) - 1)
        u = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        out = 0.5 * z * (2.0 * tl.sigmoid(2.0 * u))
    elif ACT == 2:  # relu
        out = tl.where(z > 0, z, 0.0)
    else:           # silu
        out = z * tl.sigmoid(z)
    return out


@triton.jit
def _act_grad(z, ACT: tl.constexpr):
    if ACT == 0:
        cdf = 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476))
        d = cdf + z * tl.exp(-0.5 * z * z) * 0.3989422804014327
    elif ACT == 1:
        u = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        t = 2.0 * tl.sigmoid(2.0 * u) - 1.0
        d = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * z * z)
    elif ACT == 2:
        d = tl.where(z > 0, 1.0, 0.0)
    else:
        s = tl.sigmoid(z)
        d = s * (1.0 + z * (1.0 - s))
    return d


@triton.jit
def _biased_tile(y_ptr, b_ptr, M, N, HAS_BIAS: tl.constexpr, COMPUTE: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """This program's tile of y + bias (z), with its offsets and mask: the shared start of both passes."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    z = tl.load(y_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
    if HAS_BIAS:
        z += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(COMPUTE)[None, :]
    return z, offs, mask


@triton.jit
def _bias_act_fwd(y_ptr, b_ptr, out_ptr, M, N, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, COMPUTE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    z, offs, mask = _biased_tile(y_ptr, b_ptr, M, N, HAS_BIAS, COMPUTE, BLOCK_M, BLOCK_N)
    tl.store(out_ptr + offs, _act(z, ACT).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bias_act_bwd(y_ptr, b_ptr, dout_ptr, dz_ptr, M, N, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
                  COMPUTE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    z, offs, mask = _biased_tile(y_ptr, b_ptr, M, N, HAS_BIAS, COMPUTE, BLOCK_M, BLOCK_N)
    dout = tl.load(dout_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
    tl.store(dz_ptr + offs, (dout * _act_grad(z, ACT)).to(dz_ptr.dtype.element_ty), mask=mask)


class BiasAct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, bias, activation):
        y2 = _rows(y)
        m, n = y2.shape
        out = torch.empty_like(y2)
        bm, bn = _tiles(m, n, 128)
        b = y2 if bias is None else bias.contiguous()
        _bias_act_fwd[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            y2, b, out, m, n, HAS_BIAS=bias is not None, ACT=ACT_CODES[activation], COMPUTE=_compute_dtype(y2),
            BLOCK_M=bm, BLOCK_N=bn)
        ctx.save_for_backward(y2, bias)
        ctx.activation, ctx.shape = activation, y.shape
        return out.view(y.shape)

    @staticmethod
    def backward(ctx, dout):
        y2, bias = ctx.saved_tensors
        m, n = y2.shape
        dz = torch.empty_like(y2)
        bm, bn = _tiles(m, n, 128)
        _bias_act_bwd[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            y2, y2 if bias is None else bias, _rows(dout), dz, m, n, HAS_BIAS=bias is not None,
            ACT=ACT_CODES[ctx.activation], COMPUTE=_compute_dtype(y2), BLOCK_M=bm, BLOCK_N=bn)
        dbias = None
        if bias is not None and ctx.needs_input_grad[1]:
            dbias = dz.sum(0, dtype=torch.float64 if dz.dtype == torch.float64 else torch.float32).to(bias.dtype)
        return dz.view(ctx.shape), dbias, None


# -------------------------------------------------------------------------------------------------------
# (residual add +) LayerNorm partial statistics
# -------------------------------------------------------------------------------------------------------

@triton.jit
def _load_sum(x_ptr, r_ptr, offs, mask, HAS_RES: tl.constexpr, COMPUTE: tl.constexpr):
    v = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_RES:  # round the sum to the stored dtype, as the reference's `x + residual` does
        v = v + tl.load(r_ptr + offs, mask=mask, other=0.0)
    return v.to(COMPUTE)


@triton.jit
def _stats_fwd(x_ptr, r_ptr, s_ptr, mean_ptr, m2_ptr, M, N, HAS_RES: tl.constexpr, COMPUTE: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    base = rows.to(tl.int64)[:, None] * N
    total = tl.zeros([BLOCK_M], dtype=COMPUTE)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = rmask[:, None] & (cols[None, :] < N)
        v = _load_sum(x_ptr, r_ptr, base + cols[None, :], mask, HAS_RES, COMPUTE)
        if HAS_RES:
            tl.store(s_ptr + base + cols[None, :], v.to(s_ptr.dtype.element_ty), mask=mask)
        total += tl.sum(v, axis=1)
    mean = total / N
    m2 = tl.zeros([BLOCK_M], dtype=COMPUTE)
    for start in range(0, N, BLOCK_N):   # second pass: sum of squared deviations (stable)
        cols = start + tl.arange(0, BLOCK_N)
        mask = rmask[:, None] & (cols[None, :] < N)
        v = _load_sum(x_ptr, r_ptr, base + cols[None, :], mask, HAS_RES, COMPUTE)
        d = tl.where(mask, v - mean[:, None], 0.0)
        m2 += tl.sum(d * d, axis=1)
    tl.store(mean_ptr + rows, mean.to(mean_ptr.dtype.element_ty), mask=rmask)
    tl.store(m2_ptr + rows, m2.to(m2_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _stats_bwd(s_ptr, mean_ptr, dmean_ptr, dm2_ptr, ds_ptr, dx_ptr, M, N, HAS_DS: tl.constexpr,
               COMPUTE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < M
    mask = rmask[:, None] & (cols[None, :] < N)
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    s = tl.load(s_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
    mean = tl.load(mean_ptr + rows, mask=rmask, other=0.0).to(COMPUTE)
    dmean = tl.load(dmean_ptr + rows, mask=rmask, other=0.0).to(COMPUTE)
    dm2 = tl.load(dm2_ptr + rows, mask=rmask, other=0.0).to(COMPUTE)
    dx = dmean[:, None] / N + 2.0 * (s - mean[:, None]) * dm2[:, None]
    if HAS_DS:
        dx += tl.load(ds_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _stats(x: torch.Tensor, residual: torch.Tensor | None):
    x2 = _rows(x)
    m, n = x2.shape
    r2 = None if residual is None else _rows(residual)
    s2 = x2 if r2 is None else torch.empty_like(x2)
    mean = x2.new_empty(m)
    m2 = x2.new_empty(m)
    bm, bn = _tiles(m, n, 512)
    _stats_fwd[(triton.cdiv(m, bm),)](x2, x2 if r2 is None else r2, s2, mean, m2, m, n, HAS_RES=r2 is not None,
                                      COMPUTE=_compute_dtype(x2), BLOCK_M=bm, BLOCK_N=bn)
    return s2, mean, m2


def _stats_backward(s2, mean, dmean, dm2, ds):
    m, n = s2.shape
    dmean = torch.zeros_like(mean) if dmean is None else dmean.contiguous().view(-1)
    dm2 = torch.zeros_like(mean) if dm2 is None else dm2.contiguous().view(-1)
    dx = torch.empty_like(s2)
    bm, bn = _tiles(m, n, 128)
    _stats_bwd[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        s2, mean, dmean, dm2, s2 if ds is None else _rows(ds), dx, m, n, HAS_DS=ds is not None,
        COMPUTE=_compute_dtype(s2), BLOCK_M=bm, BLOCK_N=bn)
    return dx


class NormStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x2, mean, m2 = _stats(x, None)
        ctx.save_for_backward(x2, mean)
        ctx.shape = x.shape
        stat_shape = (*x.shape[:-1], 1)
        return mean.view(stat_shape), m2.view(stat_shape)

    @staticmethod
    def backward(ctx, dmean, dm2):
        x2, mean = ctx.saved_tensors
        return _stats_backward(x2, mean, dmean, dm2, None).view(ctx.shape)


class AddNormStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual):
        s2, mean, m2 = _stats(x, residual)
        ctx.save_for_backward(s2, mean)
        ctx.shape = x.shape
        stat_shape = (*x.shape[:-1], 1)
        return s2.view(x.shape), mean.view(stat_shape), m2.view(stat_shape)

    @staticmethod
    def backward(ctx, ds, dmean, dm2):
        s2, mean = ctx.saved_tensors
        dx = _stats_backward(s2, mean, dmean, dm2, ds).view(ctx.shape)
        return dx, dx


# -------------------------------------------------------------------------------------------------------
# normalise + affine from the reduced statistics
# -------------------------------------------------------------------------------------------------------

@triton.jit
def _norm_fwd(x_ptr, mean_ptr, rstd_ptr, w_ptr, b_ptr, y_ptr, M, N, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
              COMPUTE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask, cmask = rows < M, cols < N
    mask = rmask[:, None] & cmask[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(COMPUTE)
    mean = tl.load(mean_ptr + rows, mask=rmask, other=0.0).to(COMPUTE)
    rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0).to(COMPUTE)
    y = (x - mean[:, None]) * rstd[:, None]
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=cmask, other=0.0).to(COMPUTE)[None, :]
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=cmask, other=0.0).to(COMPUTE)[None, :]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd(x_ptr, mean_ptr, rstd_ptr, w_ptr, dy_ptr, dx_ptr, dmean_ptr, drstd_ptr, dw_part_ptr, db_part_ptr,
              M, N, HAS_W: tl.constexpr, COMPUTE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per block of rows: dx elementwise, dmean / drstd summed along its rows, and this block's
    partial column sums of dw / db (summed over blocks by the caller; no atomics, so results are repeatable)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    base = rows.to(tl.int64)[:, None] * N
    mean = tl.load(mean_ptr + rows, mask=rmask, other=0.0).to(COMPUTE)
    rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0).to(COMPUTE)
    sum_g = tl.zeros([BLOCK_M], dtype=COMPUTE)
    sum_gx = tl.zeros([BLOCK_M], dtype=COMPUTE)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        cmask = cols < N
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(x_ptr + base + cols[None, :], mask=mask, other=0.0).to(COMPUTE)
        xc = tl.where(mask, x - mean[:, None], 0.0)
        dy = tl.load(dy_ptr + base + cols[None, :], mask=mask, other=0.0).to(COMPUTE)
        g = dy
        if HAS_W:
            g = dy * tl.load(w_ptr + cols, mask=cmask, other=0.0).to(COMPUTE)[None, :]
        tl.store(dx_ptr + base + cols[None, :], (g * rstd[:, None]).to(dx_ptr.dtype.element_ty), mask=mask)
        sum_g += tl.sum(g, axis=1)
        sum_gx += tl.sum(g * xc, axis=1)
        part = pid.to(tl.int64) * N + cols
        tl.store(dw_part_ptr + part, tl.sum(dy * xc * rstd[:, None], axis=0), mask=cmask)
        tl.store(db_part_ptr + part, tl.sum(dy, axis=0), mask=cmask)
    tl.store(dmean_ptr + rows, (-sum_g * rstd).to(dmean_ptr.dtype.element_ty), mask=rmask)
    tl.store(drstd_ptr + rows, sum_gx.to(drstd_ptr.dtype.element_ty), mask=rmask)


class Normalize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mean, rstd, weight, bias):
        x2 = _rows(x)
        m, n = x2.shape
        mean1, rstd1 = mean.contiguous().view(-1), rstd.contiguous().view(-1)
        y = torch.empty_like(x2)
        bm, bn = _tiles(m, n, 128)
        _norm_fwd[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            x2, mean1, rstd1, x2 if weight is None else weight.contiguous(), x2 if bias is None else bias.contiguous(),
            y, m, n, HAS_W=weight is not None, HAS_B=bias is not None, COMPUTE=_compute_dtype(x2),
            BLOCK_M=bm, BLOCK_N=bn)
        ctx.save_for_backward(x2, mean1, rstd1, weight)
        ctx.has_bias, ctx.shape, ctx.stat_shape = bias is not None, x.shape, mean.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, mean1, rstd1, weight = ctx.saved_tensors
        m, n = x2.shape
        bm, bn = _tiles(m, n, 512)
        blocks = triton.cdiv(m, bm)
        acc = torch.float64 if x2.dtype == torch.float64 else torch.float32
        dx = torch.empty_like(x2)
        dmean, drstd = torch.empty_like(mean1), torch.empty_like(rstd1)
        dw_part = x2.new_empty((blocks, n), dtype=acc)
        db_part = x2.new_empty((blocks, n), dtype=acc)
        _norm_bwd[(blocks,)](x2, mean1, rstd1, x2 if weight is None else weight, _rows(dy), dx, dmean, drstd,
                             dw_part, db_part, m, n, HAS_W=weight is not None, COMPUTE=_compute_dtype(x2),
                             BLOCK_M=bm, BLOCK_N=bn)
        dw = None if weight is None else dw_part.sum(0).to(weight.dtype)
        db = db_part.sum(0).to(x2.dtype) if ctx.has_bias else None
        return dx.view(ctx.shape), dmean.view(ctx.stat_shape), drstd.view(ctx.stat_shape), dw, db
