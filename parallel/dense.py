"""The plain one-device pieces the parallel package swaps and tests against, re-exported from tabfm.blocks.

They live with the model (tabfm/blocks.py), which imports nothing from `tabfm.parallel`; this is the one place
where the parallel package reads from tabfm, and it reads only these plain modules (tests/test_imports.py).
"""

from tabfm.blocks import ACTIVATIONS, Attention, Block, BlockStack, KVCache, Mlp, attend

__all__ = ["ACTIVATIONS", "Attention", "Block", "BlockStack", "KVCache", "Mlp", "attend"]
