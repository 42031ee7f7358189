"""Attention down each column at a cost linear in rows: through M learned inducing tokens, an ISAB (Lee et al. 2019,
Set Transformer; TabICL's column embedding). ModelConfig.column_attention = "inducing" picks it over the full stage.

The full ColumnAttention (tabfm.model) lets every cell attend to the train cells of its column: O(R x T) per column.
InducingColumnAttention runs two plain Blocks instead:

    summarise  the M inducing tokens attend to the train cells of the column (keys = the first T rows, masked per
               table) -> H, M summaries per column                                                   O(M x T)
    read       every cell, train or test, attends to its column's M summaries (keys = H only)          O(R x M)

Test rows are never keys, so a test row moves nothing but itself (as in the full stage). H depends on the train rows
only, so a Context caches the keys/values of H at `read`: test rows then cost O(test rows x M) in this stage.

Both blocks are plain Blocks, so tabfm.parallel_model's plan makes them tensor-parallel regions like every other
stage. `summarise` is called twice: on the train cells, only to record their keys/values (blocks.CrossKeys; that
call's outputs are dropped: the price of computing the keys with the block's own, possibly sharded, layers), then on
the inducing tokens, which attend to them.

Shapes: B tables, R rows, T train rows (the most of a table in the batch), C columns, E cell width, M inducing tokens.
    x     [B, R, C, E]    cells
    cols  [B, C, R, E]    down each column
    h     [B, C, M, E]    the summaries of each column
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from tabfm.blocks import Block, CrossKeys, KVCache


class KeyRowsLike(Protocol):
    """What the stage reads of tabfm.model.KeyRows: the number of key rows and their per-table mask."""

    count: int

    def mask_for(self, leading: int) -> torch.Tensor | None: ...


class InducingColumnAttention(nn.Module):
    """Attention down each column through M inducing tokens (module docstring). cache: the keys/values of the
    column's summaries at `read`, recorded by encode_context; once recorded, only `read` runs."""

    def __init__(self, embed_dim: int, heads: int, mlp_ratio: int, num_inducing: int):
        super().__init__()
        self.inducing = nn.Parameter(nn.init.normal_(torch.empty(num_inducing, embed_dim), std=0.02))
        self.summarise = Block(embed_dim, heads, mlp_ratio)
        self.read = Block(embed_dim, heads, mlp_ratio)

    def summaries(self, keys: KVCache, mask: torch.Tensor | None) -> torch.Tensor:
        """h [B, C, M, E]: the inducing tokens attend to the train cells whose keys/values `keys` holds at `summarise`
        ([B, C, heads, T, dh]); mask [B, 1, 1, T] (True on each table's train rows) or None."""
        B, C = keys.k.shape[:2]
        return self.summarise(self.inducing.expand(B, C, -1, -1), attn_mask=mask, cache=keys)

    def forward(self, x: torch.Tensor, kv: KeyRowsLike, cache: KVCache | None = None) -> torch.Tensor:
        cols = x.transpose(1, 2)                                                 # [B, C, R, E]
        if cache is not None and not cache.recording:  # test rows against a Context: the summaries' keys are cached
            return self.read(cols, cache=cache).transpose(1, 2)
        keys = CrossKeys()
        self.summarise(cols[:, :, :kv.count], num_kv=kv.count, cache=keys)    # records the train cells' keys only
        h = self.summaries(keys, kv.mask_for(3))                                 # [B, C, M, E]
        M = h.shape[2]
        out = self.read(torch.cat([h, cols], dim=2), num_kv=M, cache=cache)    # [B, C, M+R, E]
        return out[:, :, M:].transpose(1, 2)                                     # [B, R, C, E]
