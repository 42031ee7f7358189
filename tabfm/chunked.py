"""Encoding a long context in chunks of rows: the same Context as TabFM.encode_context at bounded activation memory.

TabFM.encode_context runs every stage on all R train rows at once, so each block's temporaries (the normed input,
[q | k | v], the attention output, the MLP's hidden layer) are [B, R, C, E]-sized, several times over. Only the
attentions over rows mix rows, and there every row reads the same keys/values, those of all R rows. So each such
attention runs in two passes over chunks of rows:

    1. the keys/values of every chunk, written into the KVCache's [..., R, dh] tensors (the cache kept anyway)
    2. every chunk's queries attend to the whole cache, then the row-independent rest (MLP; RowAttention and
       RowCompression across each row's columns), written back in place

Peak memory is then the cells x [B, R, C, E] once, the caches, and one chunk's temporaries, instead of a dozen
[B, R, C, E] tensors. The result equals TabFM.encode_context up to the order of floating-point sums (1e-10 in
float64, tests/test_inference.py). Contexts of at most ROW_CHUNK rows, and tensor-parallel models (whose layers
shard rows and widths themselves), take TabFM.encode_context unchanged. Here the last in-context block stops at its
keys/values: what TabFM.encode_context does after them (that block's attention and MLP, and the head, on every
train row) is never read. In one chunk this path costs as much as it saves (each attention's keys/values are made
twice, for the cache and in the block: 46-57 ms against 46 ms for 3 contexts of 256 rows x 20 columns), so it
is taken only where the rows need chunks.

Shapes: B tables, R rows (all train rows), C columns, E cell width, D row width, nh heads, dh head width.
    x      [B, R, C, E]        cells, overwritten block by block
    cache  [B, C, nh, R, dh]   keys / values down each column (axial blocks; [B, C, nh, M, dh], those of the M
                               summaries, with inducing column attention);  [B, nh, R, dh] (in-context blocks)
    h      [B, R, D]           row vectors
"""

from __future__ import annotations

import torch
from torch import nn

from tabfm.blocks import Block, KVCache
from tabfm.column_stage import InducingColumnAttention
from tabfm.data.encode import Batch
from tabfm.model import Context, TabFM

ROW_CHUNK = 2048
"""Rows per chunk when encoding a context; contexts of at most this many rows are encoded in one pass."""


def is_plain(model: nn.Module) -> bool:
    """Whether the model is the one-device one: tensor parallelism swaps its layers for tabfm.parallel's (without
    importing tabfm.parallel, which the one-device model never does: tests/test_imports.py)."""
    return all(type(m).__module__.startswith(("torch.nn.", "tabfm.")) and not type(m).__module__.startswith(
        "tabfm.parallel") for m in model.modules())


def row_chunks(rows: int, chunk: int) -> list[slice]:
    """Consecutive slices of at most `chunk` rows covering 0..rows."""
    if chunk < 1:
        raise ValueError(f"the row chunk must be a positive number of rows, got {chunk}")
    return [slice(a, min(a + chunk, rows)) for a in range(0, rows, chunk)]


def keys_values(block: Block, seq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [B..., nh, S, dh] of block's attention for the tokens seq [B..., S, H] (as Attention makes
    them)."""
    attn = block.attn
    qkv = attn.qkv(block.norm1(seq)).unflatten(-1, (3, attn.heads, -1)).movedim(-3, 0).transpose(-3, -2)
    return qkv[1], qkv[2]


def record_cache(block: Block, seq: torch.Tensor, chunks: list[slice]) -> KVCache:
    """A recorded KVCache of the keys/values of every token of seq [B..., R, H] (the row dim second to last),
    filled chunk by chunk."""
    cache = KVCache()
    for i, rows in enumerate(chunks):
        k, v = keys_values(block, seq[..., rows, :])
        if i == 0:
            shape = (*k.shape[:-2], seq.shape[-2], k.shape[-1])
            cache.k, cache.v = k.new_empty(shape), v.new_empty(shape)
        cache.k[..., rows, :], cache.v[..., rows, :] = k, v
    cache.recording = False
    return cache


def column_cache(column: nn.Module, x: torch.Tensor, chunks: list[slice]) -> KVCache:
    """The Context's cache of an axial block's column stage, from the train cells x [B, R, C, E]: the keys/values of
    every row (full attention), or those of the M summaries, computed from the rows' keys/values at `summarise`
    recorded chunk by chunk (inducing column attention, tabfm.column_stage)."""
    cols = x.transpose(1, 2)                                                     # [B, C, R, E]
    if not isinstance(column, InducingColumnAttention):
        return record_cache(column.block, cols, chunks)
    h = column.summaries(record_cache(column.summarise, cols, chunks), None)   # [B, C, M, E]
    cache = KVCache()
    column.read(h, cache=cache)
    cache.recording = False
    return cache


@torch.no_grad()
def encode_context_chunked(model: TabFM, batch: Batch, row_chunk: int | None = None) -> Context:
    """TabFM.encode_context(batch) computed `row_chunk` rows (default ROW_CHUNK, read at call time) at a time
    (module docstring), without running the last in-context block past its keys/values (its outputs for the train
    rows feed nothing a test row reads); the model's own encode_context for a tensor-parallel model or a context
    of at most `row_chunk` rows."""
    B, R, C = batch.values.shape
    chunks = row_chunks(R, ROW_CHUNK if row_chunk is None else row_chunk)
    if len(chunks) == 1 or not is_plain(model):
        return model.encode_context(batch)
    if bool(batch.row_pad.any()) or int(batch.n_train.min()) != R or int(batch.n_train.max()) != R:
        return model.encode_context(batch)  # raises its one-line error about what a context batch must be
    kv, stats, labels = model._train_inputs(batch, None)
    x = None
    for rows in chunks:
        cells = model.cells(batch.values[:, rows], batch.missing[:, rows], batch.cat_codes[:, rows], batch.is_cat,
                            stats)
        if x is None:
            x = cells.new_empty(B, R, C, cells.shape[-1])
        x[:, rows] = cells
    caches = []
    for axial in model.axial:
        caches.append(column_cache(axial.column, x, chunks))
        for rows in chunks:
            x[:, rows] = axial(x[:, rows], kv, batch.col_pad, caches[-1])
    h = torch.cat([model.compress(x[:, rows], batch.col_pad) for rows in chunks], dim=1)  # [B, R, D]
    del x
    h = h + labels
    *inner, last = model.icl.blocks.blocks
    for block in inner:
        caches.append(record_cache(block, h, chunks))
        for rows in chunks:
            h[:, rows] = block(h[:, rows], num_kv=kv.count, attn_mask=None, cache=caches[-1])
    caches.append(record_cache(last, h, chunks))  # its outputs for the train rows feed nothing a test row reads
    return Context(task=batch.task, n_train=R, num_columns=C, n_classes=batch.n_classes.clone(), cell_stats=stats,
                   target_stats=model.target_stats(batch) if batch.task == "regression" else None, caches=caches)
