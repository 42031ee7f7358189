"""In-context inference with the train rows encoded once: a Context caches what test rows need from them.

Test rows never influence train rows (tabfm.model), so everything a test row reads from the context is fixed
once the train rows are known: the cell and target statistics of the train rows, and their keys/values at every
attention over rows (tabfm.model.Context says which). The cache is an argument of the model, never state on its
layers:

    encode_context(model, batch)           TabFM.encode_context: run the train rows once, recording those
                                           (tabfm.chunked: ROW_CHUNK rows at a time past that many rows)
    predict_logits(model, context, batch)  TabFM.forward(batch, context=context): test rows only, attending to
                                           the cached keys/values

Cost per test batch: O(test rows x (train rows + columns)) instead of a forward of the whole context. On a
tensor-parallel model every rank of the mesh calls both together, and the result is the one-process result
(tests/test_inference.py).
"""

from __future__ import annotations

import torch

from tabfm.chunked import ROW_CHUNK, encode_context_chunked
from tabfm.data.encode import Batch
from tabfm.model import Context, TabFM

__all__ = ["ROW_CHUNK", "Context", "encode_context", "predict_logits"]


@torch.no_grad()
def encode_context(model: TabFM, batch: Batch, row_chunk: int | None = None) -> Context:
    """Encode the train rows of `batch` (tables of equal size, all rows train rows) once, `row_chunk` rows at a
    time (default tabfm.chunked.ROW_CHUNK) so that long contexts keep one chunk's activations, not all rows'."""
    return encode_context_chunked(model, batch, row_chunk)


@torch.no_grad()
def predict_logits(model: TabFM, context: Context, batch: Batch) -> torch.Tensor:
    """Logits [B, R, Y] of a batch whose rows are all test rows of the context's B tables."""
    return model(batch, context=context)
