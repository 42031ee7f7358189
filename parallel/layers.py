"""ATP layers: the column-first / row-first linear, MLP, attention, LayerNorm and embedding on a (d0, d1) mesh.

Shape legend (mesh (d0, d1), N = d0 * d1, rank at (i, j); "/d1" = this rank's block j of that dimension):
    block input / output   x  [B..., S, H/d1]          replicated over axis 0
      with sequence par.   x  [B..., S/d0, H/d1]       tokens block i
    column-first linear    W  [out/d0, in/d1]          forward all-reduce over axis 1, dX all-reduce axis 0
    row-first linear       W  [out/d1, in/d0]          forward all-reduce over axis 0, dX all-reduce axis 1
    attention              qkv [B..., S, 3 * H/N]      reduce-scatter over axis 1: heads/N whole heads each
                           ctx [B..., S, H/d0]         all-gathered over axis 1 before the row-first output
    MLP                    fc1 column-first [B..., S, F/d0], fc2 row-first back to [B..., S, H/d1]

Weights use nn.Linear's [out, in] convention. Every layer is built from its plain module (`from_dense`), so
the full matrices are the same whatever the layout, and `shard_specs()` says how each parameter is cut, for the
checkpoint code. Megatron's 1D tensor parallelism is the mesh (N, 1).

Two options tune how a layer runs, never what it computes:
    overlap_chunks  k > 1 pipelines a layer over k chunks of its tokens (of its sequences, for attention), so
                    each chunk's collectives overlap other chunks' compute (overlap.py, DESIGN 3.4); k = 1 is
                    the plain code below
    kernels         "auto" | "triton" | "torch": the fused epilogues (MLP bias + activation, LayerNorm
                    statistics and normalisation) in Triton or in their torch reference (kernels/ops.py)
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tabfm.parallel import dense, overlap
from tabfm.parallel.comm import copy_to, gather, reduce_from, scatter, scatter_reduce
from tabfm.parallel.kernels import ops
from tabfm.parallel.mesh import TPMesh
from tabfm.parallel.sharding import ShardSpec, shard_tensor

TOKENS = -2  # the token (sequence) dimension of every activation
HIDDEN = -1
_LOW_PRECISION = (torch.bfloat16, torch.float16)  # activations whose norm statistics are float32 all the same


def _local(full: torch.Tensor, spec: ShardSpec, mesh: TPMesh) -> nn.Parameter:
    return nn.Parameter(shard_tensor(full.detach(), spec, mesh.d0, mesh.d1, mesh.i, mesh.j))


def _check_tokens(x: torch.Tensor, mesh: TPMesh, what: str) -> None:
    if x.shape[TOKENS] % mesh.d0:
        raise ValueError(
            f"{what}: sequence parallelism needs the token count ({x.shape[TOKENS]}) divisible by d0={mesh.d0}; "
            "pad the sequence"
        )


class ColumnFirstLinear(nn.Module):
    """Y = X A with A's input rows split over axis 1 and output columns over axis 0 (DESIGN 3.1).

    scatter_output: reduce-scatter the partial output over axis 1 along features instead of all-reducing it
    (attention QKV: each rank keeps only its heads). qkv_heads: the output is a fused [q | k | v] projection,
    reordered so that the scattered chunks are whole heads. overlap_chunks: see the module docstring.
    regather_input (overlap_chunks > 1 with sequence parallelism): keep only the local input for backward and
    all-gather it again there, overlapped with the dX matmul, instead of keeping the gathered one.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, mesh: TPMesh, *,
                 sequence_parallel: bool = False, scatter_output: bool = False, qkv_heads: int | None = None,
                 overlap_chunks: int = 1, regather_input: bool = True):
        super().__init__()
        self.mesh, self.sequence_parallel, self.scatter_output = mesh, sequence_parallel, scatter_output
        self.overlap_chunks, self.regather_input = overlap.check_chunks(overlap_chunks), regather_input
        self.out_features, self.in_features = weight.shape
        self._specs = self.specs(scatter_output, qkv_heads, bias is not None)
        self.weight = _local(weight, self._specs["weight"], mesh)
        self.bias = None if bias is None else _local(bias, self._specs["bias"], mesh)

    @staticmethod
    def specs(scatter_output: bool = False, qkv_heads: int | None = None, bias: bool = True) -> dict[str, ShardSpec]:
        out = {"weight": ShardSpec(("tp0", "tp1"), qkv_heads=qkv_heads)}
        if bias:
            out["bias"] = ShardSpec(("tp" if scatter_output else "tp0",), qkv_heads=qkv_heads)
        return out

    @classmethod
    def from_dense(cls, linear: nn.Linear, mesh: TPMesh, **kwargs) -> ColumnFirstLinear:
        return cls(linear.weight, linear.bias, mesh, **kwargs)

    def shard_specs(self) -> dict[str, ShardSpec]:
        return dict(self._specs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.project(x)
        # The bias in the output's dtype, as nn.Linear adds it under autocast (bfloat16 out, not float32)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The reduced output without the bias (for a fused bias epilogue)."""
        if self.overlap_chunks > 1:
            return overlap.column_first(x, self.weight, self.mesh, self.overlap_chunks,
                                        sequence_parallel=self.sequence_parallel, scatter_output=self.scatter_output,
                                        regather_input=self.regather_input)
        axis0, axis1 = self.mesh.axis0, self.mesh.axis1
        if self.sequence_parallel:
            x = gather(x, TOKENS, axis0)          # [B..., S, in/d1]; backward reduce-scatters dX
        else:
            x = copy_to(x, axis0)                 # backward all-reduces the partial dX over axis 0
        y = F.linear(x, self.weight)              # [B..., S, out/d0], partial over axis 1
        return scatter_reduce(y, HIDDEN, axis1) if self.scatter_output else reduce_from(y, axis1, inplace=True)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, mesh={self.mesh}, "
                f"sequence_parallel={self.sequence_parallel}, scatter_output={self.scatter_output}, "
                f"overlap_chunks={self.overlap_chunks}")


class RowFirstLinear(nn.Module):
    """Y = X A with A's input rows split over axis 0 and output columns over axis 1 (DESIGN 3.1).

    input_gathered: the input came from an all-gather over axis 1 whose backward already reduce-scatters the
    partial dX, so no all-reduce of dX is added here (attention's output projection). `forward(x,
    gather_input=True)` does that all-gather here instead (chunked with the matmul when overlap_chunks > 1).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, mesh: TPMesh, *,
                 sequence_parallel: bool = False, input_gathered: bool = False, overlap_chunks: int = 1):
        super().__init__()
        self.mesh, self.sequence_parallel, self.input_gathered = mesh, sequence_parallel, input_gathered
        self.overlap_chunks = overlap.check_chunks(overlap_chunks)
        self.out_features, self.in_features = weight.shape
        self._specs = self.specs(bias is not None)
        self.weight = _local(weight, self._specs["weight"], mesh)
        self.bias = None if bias is None else _local(bias, self._specs["bias"], mesh)

    @staticmethod
    def specs(bias: bool = True) -> dict[str, ShardSpec]:
        out = {"weight": ShardSpec(("tp1", "tp0"))}
        if bias:
            out["bias"] = ShardSpec(("tp1",))
        return out

    @classmethod
    def from_dense(cls, linear: nn.Linear, mesh: TPMesh, **kwargs) -> RowFirstLinear:
        return cls(linear.weight, linear.bias, mesh, **kwargs)

    def shard_specs(self) -> dict[str, ShardSpec]:
        return dict(self._specs)

    def forward(self, x: torch.Tensor, gather_input: bool = False) -> torch.Tensor:
        """gather_input: x is [B..., S, in/N], still split over axis 1 along features; gather it first."""
        axis0, axis1 = self.mesh.axis0, self.mesh.axis1
        if self.overlap_chunks > 1:
            if self.sequence_parallel:
                _check_tokens(x, self.mesh, "row-first linear")
            y = overlap.row_first(x, self.weight, self.mesh, self.overlap_chunks,
                                  sequence_parallel=self.sequence_parallel, gather_input=gather_input,
                                  reduce_dx=not self.input_gathered)
        else:
            if gather_input:
                x = gather(x, HIDDEN, axis1)      # [B..., S, in/d0]; backward reduce-scatters dX
            elif not self.input_gathered:
                x = copy_to(x, axis1)             # backward all-reduces the partial dX over axis 1
            y = F.linear(x, self.weight)          # [B..., S, out/d1], partial over axis 0
            if self.sequence_parallel:
                _check_tokens(y, self.mesh, "row-first linear")
                y = scatter_reduce(y, TOKENS, axis0)  # [B..., S/d0, out/d1]
            else:
                y = reduce_from(y, axis0, inplace=True)
        return self.add_bias(y)

    def add_bias(self, y: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return y
        # Under sequence parallelism each rank sees only its tokens: the bias gradient is partial over axis 0.
        # Added in the output's dtype, as nn.Linear adds it under autocast.
        bias = copy_to(self.bias, self.mesh.axis0) if self.sequence_parallel else self.bias
        return y + bias.to(y.dtype)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, mesh={self.mesh}, "
                f"sequence_parallel={self.sequence_parallel}, input_gathered={self.input_gathered}, "
                f"overlap_chunks={self.overlap_chunks}")


class ParallelMlp(nn.Module):
    """fc1 column-first, activation, fc2 row-first: [B..., S, H/d1] in and out, so blocks chain as they are.
    fc1's bias and the activation run as one fused epilogue (`kernels`). With overlap_chunks > 1 the whole
    MLP is pipelined over chunks of tokens (overlap.mlp)."""

    def __init__(self, mlp: dense.Mlp, mesh: TPMesh, sequence_parallel: bool = False, overlap_chunks: int = 1,
                 kernels: str = "auto"):
        super().__init__()
        problems = self.layout_problems(mlp, mesh.d0, mesh.d1)
        if problems:
            raise ValueError("; ".join(problems))
        self.activation, self.kernels = mlp.activation, ops.check_kernels(kernels)
        self.mesh, self.sequence_parallel = mesh, sequence_parallel
        self.overlap_chunks = overlap.check_chunks(overlap_chunks)
        self.fc1 = ColumnFirstLinear.from_dense(mlp.fc1, mesh, sequence_parallel=sequence_parallel,
                                                overlap_chunks=overlap_chunks)
        self.fc2 = RowFirstLinear.from_dense(mlp.fc2, mesh, sequence_parallel=sequence_parallel,
                                             overlap_chunks=overlap_chunks)

    @staticmethod
    def layout_problems(mlp: dense.Mlp, d0: int, d1: int) -> list[str]:
        h, f = mlp.fc1.in_features, mlp.fc1.out_features
        return _divisibility({"hidden size": h}, 1, d1) + _divisibility({"MLP width": f}, d0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.overlap_chunks > 1:
            y = overlap.mlp(x, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.mesh, self.overlap_chunks,
                            activation=self.activation, kernels=self.kernels,
                            sequence_parallel=self.sequence_parallel, regather_input=self.fc1.regather_input)
            return self.fc2.add_bias(y)
        h = ops.bias_act(self.fc1.project(x), self.fc1.bias, self.activation, kernels=self.kernels)  # [B..., S, F/d0]
        return self.fc2(h)


class ParallelAttention(nn.Module):
    """Heads split over all N ranks: QKV column-first with a reduce-scatter over axis 1, attention on this
    rank's heads/N heads with no redundant work, context all-gathered over axis 1, output row-first. With
    overlap_chunks > 1 the whole layer is pipelined over chunks of sequences (overlap.attention), or, for a
    single sequence, each linear over chunks of tokens."""

    def __init__(self, attn: dense.Attention, mesh: TPMesh, sequence_parallel: bool = False, overlap_chunks: int = 1):
        super().__init__()
        problems = self.layout_problems(attn, mesh.d0, mesh.d1)
        if problems:
            raise ValueError("; ".join(problems))
        self.mesh, self.sequence_parallel = mesh, sequence_parallel
        self.overlap_chunks = overlap.check_chunks(overlap_chunks)
        self.heads, self.local_heads = attn.heads, attn.heads // mesh.tp
        self.qkv = ColumnFirstLinear.from_dense(attn.qkv, mesh, sequence_parallel=sequence_parallel,
                                                scatter_output=True, qkv_heads=attn.heads,
                                                overlap_chunks=overlap_chunks)
        self.proj = RowFirstLinear.from_dense(attn.proj, mesh, sequence_parallel=sequence_parallel,
                                              input_gathered=True, overlap_chunks=overlap_chunks)

    @staticmethod
    def layout_problems(attn: dense.Attention, d0: int, d1: int) -> list[str]:
        out = _divisibility({"hidden size": attn.proj.in_features}, d0, d1)
        if attn.heads % (d0 * d1):
            out.append(f"{attn.heads} attention heads are not divisible by d0*d1={d0 * d1}")
        return out

    def forward(self, x: torch.Tensor, num_kv: int | None = None, attn_mask: torch.Tensor | None = None,
                cache: dense.KVCache | None = None) -> torch.Tensor:
        """cache: keys/values of a context prefix, this rank's heads (see dense.KVCache)."""
        if self.overlap_chunks > 1 and cache is None:
            y = overlap.attention(x, self.qkv.weight, self.qkv.bias, self.proj.weight, self.mesh, self.overlap_chunks,
                                  local_heads=self.local_heads, num_kv=num_kv, attn_mask=attn_mask,
                                  sequence_parallel=self.sequence_parallel, regather_input=self.qkv.regather_input)
            if y is not None:
                return self.proj.add_bias(y)
        qkv = self.qkv(x)                                           # [B..., S, 3 * H/N]
        q, k, v = qkv.unflatten(-1, (3, self.local_heads, -1)).movedim(-3, 0).transpose(-3, -2).unbind(0)
        if cache is not None:
            k, v, num_kv = cache(k, v, num_kv)
        ctx = dense.attend(q, k, v, num_kv, attn_mask)              # [B..., H/N heads, S, dh]
        # [B..., S, H/N], all-gathered over axis 1 to [B..., S, H/d0] inside proj (chunk by chunk if overlapped)
        return self.proj(ctx.transpose(-3, -2).flatten(-2), gather_input=True)  # [B..., S(/d0), H/d1]


class ParallelLayerNorm(nn.Module):
    """LayerNorm of hidden-sharded activations [B..., S, H/d1].

    Each rank reduces its own slice to (mean, sum of squared deviations) per token; one all-gather over
    axis 1 of those 2 numbers per token lets every rank combine them exactly (Chan et al.), which is stable
    where E[x^2] - E[x]^2 is not. Weight and bias are cut like the activations (block j over axis 1) and
    replicated over axis 0; under sequence parallelism their gradients are partial over axis 0 and summed there.
    With the hidden size sharded, the local statistics (optionally fused with the residual add:
    `forward_residual`) and the normalisation run as fused kernels (`kernels`); unsharded, F.layer_norm.
    """

    def __init__(self, norm: nn.LayerNorm, mesh: TPMesh, sequence_parallel: bool = False, kernels: str = "auto"):
        super().__init__()
        if len(norm.normalized_shape) != 1:
            raise ValueError("ParallelLayerNorm normalises over the last dimension only")
        self.mesh, self.sequence_parallel, self.eps = mesh, sequence_parallel, norm.eps
        self.kernels = ops.check_kernels(kernels)
        self.hidden = norm.normalized_shape[0]
        problems = _divisibility({"norm width": self.hidden}, 1, mesh.d1)
        if problems:
            raise ValueError("; ".join(problems))
        spec = ShardSpec(("tp1",))
        self.weight = None if norm.weight is None else _local(norm.weight, spec, mesh)
        self.bias = None if norm.bias is None else _local(norm.bias, spec, mesh)

    def shard_specs(self) -> dict[str, ShardSpec]:
        return {name: ShardSpec(("tp1",)) for name, p in (("weight", self.weight), ("bias", self.bias)) if p is not None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_residual(x, None)[1]

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(s, norm(s)) with s = x + residual (s = x when residual is None); with the hidden size sharded,
        the add is fused into the statistics pass."""
        axis0, axis1 = self.mesh.axis0, self.mesh.axis1
        # Under sequence parallelism each rank sees only its tokens: parameter gradients are partial over axis 0.
        weight = copy_to(self.weight, axis0) if self.sequence_parallel and self.weight is not None else self.weight
        bias = copy_to(self.bias, axis0) if self.sequence_parallel and self.bias is not None else self.bias
        if axis1.size == 1:  # the whole hidden vector is here: PyTorch's fused kernel
            s = x if residual is None else x + residual
            return s, F.layer_norm(s, (self.hidden,), weight, bias, self.eps)
        dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
        if dtype in _LOW_PRECISION:  # bfloat16 activations (autocast): statistics and their all-gather in float32
            x, residual = x.float(), None if residual is None else residual.float()
        if residual is None:
            s, (mean, m2) = x, ops.norm_stats(x, kernels=self.kernels)        # [B..., S, 1] each, local columns
        else:
            s, mean, m2 = ops.add_norm_stats(x, residual, kernels=self.kernels)
        n_local = x.shape[HIDDEN]
        stats = gather(torch.cat([mean, m2], HIDDEN).unsqueeze(-2), -2, axis1)  # [B..., S, d1, 2]
        means, m2s = stats.unbind(-1)
        mean = means.mean(HIDDEN, keepdim=True)
        m2 = m2s.sum(HIDDEN, keepdim=True) + n_local * (means - mean).square().sum(HIDDEN, keepdim=True)
        rstd = torch.rsqrt(m2 / (n_local * axis1.size) + self.eps)
        y = ops.normalize(s, mean, rstd, weight, bias, kernels=self.kernels)
        if dtype not in _LOW_PRECISION:
            return s, y
        out = functools.reduce(torch.promote_types, [p.dtype for p in (weight, bias) if p is not None], dtype)
        return s.to(dtype), y.to(out)  # the dtypes of the low-precision computation, float32 statistics inside


class ParallelBlock(dense.Block):
    """A dense.Block whose second norm is a ParallelLayerNorm: the residual add is fused into the norm's statistics
    pass (`forward_residual`). It adopts the block's own (already swapped) modules, so parameter names stay."""

    def __init__(self, block: dense.Block):
        nn.Module.__init__(self)  # not dense.Block.__init__: the modules are the block's, not new ones
        self.norm1, self.attn, self.norm2, self.mlp = block.norm1, block.attn, block.norm2, block.mlp
        if not isinstance(self.norm2, ParallelLayerNorm):
            raise TypeError(f"ParallelBlock needs a ParallelLayerNorm as norm2, got {type(self.norm2).__name__}")

    def add_norm(self, h: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.norm2.forward_residual(h, x)


class VocabEmbedding(nn.Module):
    """Embedding table [V, H] cut by vocabulary rows over axis 0 and hidden columns over axis 1.

    Each rank looks up the ids in its row block (zeros elsewhere); an all-reduce over axis 0 (a reduce-scatter
    along tokens under sequence parallelism) assembles [B..., S(/d0), H/d1]. Ids must be replicated.
    """

    def __init__(self, embedding: nn.Embedding, mesh: TPMesh, sequence_parallel: bool = False):
        super().__init__()
        problems = self.layout_problems(embedding, mesh.d0, mesh.d1)
        if problems:
            raise ValueError("; ".join(problems))
        self.mesh, self.sequence_parallel = mesh, sequence_parallel
        self.num_embeddings, self.embedding_dim = embedding.weight.shape
        self.rows = self.num_embeddings // mesh.d0
        self.weight = _local(embedding.weight, ShardSpec(("tp0", "tp1")), mesh)

    @staticmethod
    def layout_problems(embedding: nn.Embedding, d0: int, d1: int) -> list[str]:
        v, h = embedding.weight.shape
        return _divisibility({"embedding rows": v}, d0, 1) + _divisibility({"embedding width": h}, 1, d1)

    def shard_specs(self) -> dict[str, ShardSpec]:
        return {"weight": ShardSpec(("tp0", "tp1"))}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise IndexError(f"embedding ids must lie in [0, {self.num_embeddings}); got "
                             f"[{int(ids.min())}, {int(ids.max())}]")
        lo = self.mesh.i * self.rows
        inside = (ids >= lo) & (ids < lo + self.rows)
        y = F.embedding((ids - lo).clamp(0, self.rows - 1), self.weight) * inside.unsqueeze(-1)
        if self.sequence_parallel:
            _check_tokens(y, self.mesh, "embedding")
            return scatter_reduce(y, TOKENS, self.mesh.axis0)
        return reduce_from(y, self.mesh.axis0, inplace=True)


def shard_activation(x: torch.Tensor, mesh: TPMesh, sequence_parallel: bool = False) -> torch.Tensor:
    """Replicated [B..., S, H] -> this rank's block input [B..., S(/d0), H/d1] (enter the parallel region)."""
    x = scatter(x, HIDDEN, mesh.axis1)
    if sequence_parallel:
        _check_tokens(x, mesh, "shard_activation")
        x = scatter(x, TOKENS, mesh.axis0)
    return x


def gather_activation(x: torch.Tensor, mesh: TPMesh, sequence_parallel: bool = False) -> torch.Tensor:
    """Block output [B..., S(/d0), H/d1] -> replicated [B..., S, H] (leave the parallel region)."""
    if sequence_parallel:
        x = gather(x, TOKENS, mesh.axis0, grad_is_partial=False)
    return gather(x, HIDDEN, mesh.axis1, grad_is_partial=False)


def _divisibility(sizes: dict[str, int], d0: int, d1: int) -> list[str]:
    out = []
    for what, n in sizes.items():
        for name, d in (("d0", d0), ("d1", d1)):
            if n % d:
                out.append(f"{what} {n} is not divisible by {name}={d}")
    return out
