"""Plain one-device transformer pieces: what tabfm.model is built from, and what `tabfm.parallel`'s plans swap.

The model is written with these and `nn.LayerNorm` / `nn.Embedding`, so the very same model runs on one device,
and `tabfm.parallel.parallelize(model, mesh, plan)` turns it into the tensor-parallel one with the same parameter
names (tabfm.parallel.dense re-exports this module for the parallel package). Nothing here knows about meshes.

Shapes: x [B..., S, H]; attention keys/values are the first `num_kv` tokens of the sequence (train rows first, then
test rows, so test rows attend to train rows only). q, k, v [B..., nh, S, dh].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu}


class Mlp(nn.Module):
    """h -> ffn -> h with an elementwise activation."""

    def __init__(self, hidden: int, ffn: int, activation: str = "gelu", bias: bool = True):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; choose from {sorted(ACTIVATIONS)}")
        self.activation = activation
        self.fc1 = nn.Linear(hidden, ffn, bias=bias)
        self.fc2 = nn.Linear(ffn, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(ACTIVATIONS[self.activation](self.fc1(x)))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_kv: int | None,
           attn_mask: torch.Tensor | None) -> torch.Tensor:
    """Scaled dot-product attention of q [B..., nh, S, dh] over the first `num_kv` keys/values.

    attn_mask: boolean [B..., S, num_kv] (True = may attend) or None; it is shared by all heads.
    """
    if num_kv is not None:
        k, v = k[..., :num_kv, :], v[..., :num_kv, :]
    mask = None if attn_mask is None else attn_mask.unsqueeze(-3)
    lead = q.shape[:-3]
    if len(lead) > 1:
        # PyTorch's fused CPU kernel (which never builds the [S, num_kv] score matrix) takes 4-D inputs only.
        if mask is not None:
            mask = mask.expand(*lead, *mask.shape[-3:]).flatten(0, len(lead) - 1)
        q, k, v = (t.flatten(0, len(lead) - 1) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).unflatten(0, lead)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class KVCache:
    """Keys and values of a context prefix at one attention layer, recorded once and reused (in-context inference).

    Passed to the layer as its `cache` argument. While `recording`, the layer stores the keys/values of its first
    `num_kv` tokens (the train rows) and attends as usual. Afterwards, every call attends to the stored keys/values
    instead of its own prefix: a batch of test rows then costs O(test rows x train rows) instead of a forward of
    the whole context. Each rank of a tensor-parallel mesh stores its own heads.
    """

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.recording = True

    def __call__(self, k: torch.Tensor, v: torch.Tensor, num_kv: int | None) -> tuple[torch.Tensor, torch.Tensor,
                                                                                     int | None]:
        """(keys, values, num_kv) this call attends with."""
        if self.recording:
            n = k.shape[-2] if num_kv is None else num_kv
            self.k, self.v = k[..., :n, :].detach().clone(), v[..., :n, :].detach().clone()
            return k, v, num_kv
        if self.k is None:
            raise RuntimeError("KVCache used before anything was recorded into it")
        return self.k, self.v, None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v) if t is not None)


class CrossKeys(KVCache):
    """Keys and values of one set of tokens handed to a later call of the same block on other tokens, gradients
    kept: cross-attention through the block's own layers (so a tensor-parallel block shards these keys like any).

    The first call (the key tokens) records the keys/values of its first `num_kv` tokens. Its own attention is not
    wanted, so its tokens attend to the first key alone (linear cost) and the caller drops that call's output.
    Every later call attends to the recorded keys/values.
    """

    def __call__(self, k: torch.Tensor, v: torch.Tensor, num_kv: int | None) -> tuple[torch.Tensor, torch.Tensor,
                                                                                     int | None]:
        if not self.recording:
            return super().__call__(k, v, num_kv)
        n = k.shape[-2] if num_kv is None else num_kv
        self.k, self.v, self.recording = k[..., :n, :], v[..., :n, :], False
        return k[..., :1, :], v[..., :1, :], None


class Attention(nn.Module):
    """Multi-head self-attention with a fused [q | k | v] projection, or query-to-context attention when
    `num_kv` restricts keys and values to a prefix of the sequence (or `cache` holds a recorded prefix)."""

    def __init__(self, hidden: int, heads: int, bias: bool = True):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden size {hidden} is not divisible by {heads} heads")
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.proj = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor, num_kv: int | None = None, attn_mask: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).movedim(-3, 0).transpose(-3, -2).unbind(0)
        if cache is not None:
            k, v, num_kv = cache(k, v, num_kv)
        ctx = attend(q, k, v, num_kv, attn_mask)           # [B..., nh, S, dh]
        return self.proj(ctx.transpose(-3, -2).flatten(-2))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, hidden: int, heads: int, mlp_ratio: int = 4, bias: bool = True, eps: float = 1e-5):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden, eps=eps)
        self.attn = Attention(hidden, heads, bias=bias)
        self.norm2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = Mlp(hidden, mlp_ratio * hidden, bias=bias)

    def forward(self, x: torch.Tensor, num_kv: int | None = None, attn_mask: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        h = self.attn(self.norm1(x), num_kv=num_kv, attn_mask=attn_mask, cache=cache)
        x, normed = self.add_norm(h, x)
        return x + self.mlp(normed)

    def add_norm(self, h: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(s, norm2(s)) with s = x + h: the residual add and the second norm (a parallel block fuses them)."""
        x = x + h
        return x, self.norm2(x)


class BlockStack(nn.Module):
    """A stack of blocks sharing one attention pattern; `caches` holds one KVCache per block, or is None."""

    def __init__(self, depth: int, hidden: int, heads: int, mlp_ratio: int = 4, bias: bool = True):
        super().__init__()
        self.blocks = nn.ModuleList(Block(hidden, heads, mlp_ratio, bias) for _ in range(depth))

    def forward(self, x: torch.Tensor, num_kv: int | None = None, attn_mask: torch.Tensor | None = None,
                caches: Sequence[KVCache] | None = None) -> torch.Tensor:
        if caches is not None and len(caches) != len(self.blocks):
            raise ValueError(f"{len(caches)} caches for {len(self.blocks)} blocks: give one per block")
        for i, block in enumerate(self.blocks):
            x = block(x, num_kv=num_kv, attn_mask=attn_mask, cache=None if caches is None else caches[i])
        return x
