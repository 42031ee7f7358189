"""The axial in-context transformer for tables (DESIGN 4), written for one device with plain modules.

A table is a context of labelled train rows followed by unlabelled test rows; its cells are the tokens.
Each stage is named after the table axis it mixes (TabICL style):

    CellEncoder      each cell on its own: normalised value (train-row statistics) or hashed category, + column id
    ColumnAttention  down each column, across rows: every cell attends to the train-row cells of its column
                     (or, with column_attention="inducing", to M learned summaries of them: tabfm.column_stage)
    RowAttention     across the columns of each row: every cell attends to the real cells of its row
    RowCompression   K learned CLS tokens read each row's cells -> one vector per row
    ICLearning       in-context transformer over row vectors: train rows carry their label; all rows attend to
                     the train rows only
    heads            classification logits (up to max_classes) or a binned distribution of the normalised target

Test rows never see one another: normalisation statistics come from train rows, and every attention over rows
takes its keys/values from the train rows only (blocks.Attention's `num_kv` prefix plus a mask for tables of the
batch with fewer train rows). tests/test_model.py perturbs test rows and checks nothing else moves. So the train
rows can be encoded once (`TabFM.encode_context` -> a Context holding their statistics and, at every attention over
rows, their keys/values) and test rows predicted later against it (`forward(batch, context=...)`).

Shapes: B tables, R rows (train rows first, then test rows, then padding), C feature columns, E cell width,
K CLS tokens per row, D = K*E row width, T = the most train rows of a table in the batch, Y = outputs.
    values, missing, cat_codes  [B, R, C]
    x  cells                    [B, R, C, E]
       down a column            [B, C, R, E]      sequence = rows, keys = the first T rows (masked per table)
       across a row             [B, R, C, E]      sequence = columns, keys = the real columns
       row compression          [B, R, C+K, E] -> [B, R, K*E] = [B, R, D]
    h  row vectors              [B, R, D]         sequence = rows, keys = the first T rows (masked per table)
    logits                      [B, R, Y]         Y = max_classes, or num_bins for regression

This file is one-device code. tabfm.parallel_model.parallelize_model turns it into the tensor-parallel model from
outside: inside each stage's blocks the activation becomes [..., S(/d0), E/d1] (or D/d1), everything outside the
blocks stays replicated, and the parameter names stay these.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tabfm.blocks import Block, BlockStack, KVCache
from tabfm.column_stage import InducingColumnAttention
from tabfm.config_io import from_dict, load_preset, preset_dir
from tabfm.data.encode import Batch

TargetStats = tuple[torch.Tensor, torch.Tensor]
"""(mean, std) [B, 1] of each table's regression targets over its train rows."""

COLUMN_STAGES = ("full", "inducing")
"""ModelConfig.column_attention: the column stages."""

CONFIG_DIR = preset_dir("model")
"""The size presets: configs/model of a source checkout, or the copy an installed wheel ships in tabfm/configs."""


def outside_autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """A region that computes in the weights' dtype even inside torch.autocast (devices without autocast, such as
    the planner's meta device, need nothing)."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


@dataclass(frozen=True)
class ModelConfig:
    """Constructor arguments of TabFM; checkpoints carry them so the model can be rebuilt (STYLE 10)."""

    PRESETS = "model"
    """Configs may name a size preset, configs/model/<name>.yaml (tabfm.config_io)."""
    KIND = "tabfm"
    """Its tag among the models a plan config may name (tabfm.config.PlanConfig)."""

    embed_dim: int = 32
    """E: width of a cell token (CellEncoder, ColumnAttention, RowAttention, RowCompression)."""
    axial_num_blocks: int = 2
    """Axial blocks: each is one ColumnAttention block then one RowAttention block."""
    axial_heads: int = 4
    """Attention heads of the axial and row-compression blocks (must divide d0*d1 when tensor-parallel)."""
    axial_mlp_ratio: int = 2
    """MLP width of the axial and row-compression blocks, in multiples of E."""
    row_num_cls: int = 4
    """K: CLS tokens per row in RowCompression; the row vector has D = K*E features."""
    icl_num_blocks: int = 4
    """Blocks of the in-context transformer over rows (where the depth lives)."""
    icl_heads: int = 4
    """Attention heads of the in-context transformer."""
    icl_mlp_ratio: int = 2
    """MLP width of the in-context blocks, in multiples of D."""
    max_columns: int = 100
    """Most feature columns a table may have (one fixed random identity vector per column index)."""
    column_id_dim: int = 16
    """Width of the fixed random column-identity vectors, projected to E by a learned linear map."""
    cat_vocab: int = 256
    """Shared embedding table of categorical cells: (column, code) is hashed into slots 1..cat_vocab-1; slot 0
    is a missing category."""
    max_classes: int = 10
    """Classes of the classification head; a table may use any 2..max_classes of them."""
    num_bins: int = 64
    """Bins of the regression head's distribution over the normalised target."""
    bin_range: float = 4.0
    """The regression bins cover [-bin_range, bin_range] standard deviations of the train targets."""
    value_clip: float = 10.0
    """Normalised numeric values (and regression targets fed as labels) are clipped to +-value_clip."""
    column_attention: str = "full"
    """The column stage of each axial block: "full" (ColumnAttention: every cell attends to the train cells of its
    column, O(rows x train rows)) or "inducing" (tabfm.column_stage: through num_inducing learned tokens, linear in
    rows)."""
    num_inducing: int = 32
    """M: inducing tokens per column when column_attention is "inducing" (unused by "full")."""

    def __post_init__(self) -> None:
        if self.column_attention not in COLUMN_STAGES:
            raise ValueError(f"model.column_attention must be one of {', '.join(COLUMN_STAGES)}, "
                             f"got {self.column_attention!r}")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "str":
                continue
            if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"model.{f.name} must be a positive number, got {value!r}")
            if f.type == "int" and not isinstance(value, int):
                raise ValueError(f"model.{f.name} must be an integer, got {value!r}")
        if self.embed_dim % self.axial_heads:
            raise ValueError(f"model.embed_dim={self.embed_dim} is not divisible by axial_heads={self.axial_heads}")
        if self.icl_dim % self.icl_heads:
            raise ValueError(f"the row width D = row_num_cls * embed_dim = {self.icl_dim} is not divisible by "
                             f"icl_heads={self.icl_heads}")
        if self.cat_vocab < 2 or self.max_classes < 2 or self.num_bins < 2:
            raise ValueError("model.cat_vocab, max_classes and num_bins must each be at least 2")

    @property
    def icl_dim(self) -> int:
        """D: width of a row vector (K CLS outputs of width E, concatenated)."""
        return self.row_num_cls * self.embed_dim

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        """Build from a mapping (`preset: name` starts from a preset); ConfigError, a ValueError naming the key, on
        unknown keys (listing the valid ones) and bad values."""
        return from_dict(cls, d)

    @classmethod
    def load(cls, name_or_path: str | Path) -> ModelConfig:
        """A size preset by name (tiny, small, base, large: configs/model/<name>.yaml) or a YAML file."""
        return load_preset(cls, name_or_path)

    def to_dict(self) -> dict:
        """The constructor arguments as a plain mapping (what checkpoints carry). A full-attention model leaves the
        column-stage settings out, so its checkpoints are what they were before the option and older ones compare
        equal to it."""
        d = dataclasses.asdict(self)
        if self.column_attention == "full":
            del d["column_attention"], d["num_inducing"]
        return d


# ---------------------------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------------------------

def train_rows(n_train: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[B, R] bool: True on the train rows of each table."""
    return torch.arange(num_rows, device=n_train.device) < n_train[:, None]


@dataclass(frozen=True)
class KeyRows:
    """The rows every attention over rows takes its keys/values from: the first `count` rows, of which the
    first n_train[b] are real in table b. `mask` [B, count] is None when every table has `count` train rows,
    so attention runs without a mask (and may use a fused kernel that never builds the score matrix)."""

    count: int
    mask: torch.Tensor | None

    @classmethod
    def of(cls, n_train: torch.Tensor, count: int, fewest: int | None) -> KeyRows:
        """fewest: the fewest train rows of a table as a Python int (Batch.train_bounds[0], so no tensor is read
        here), or None when unknown (the meta device): then the mask is kept."""
        mask = None if fewest is not None and fewest >= count else train_rows(n_train, count)
        return cls(count, mask)

    def mask_for(self, leading: int) -> torch.Tensor | None:
        """The mask as [B, 1, ..., 1, count] with `leading` dims before the key dim (for broadcasting)."""
        if self.mask is None:
            return None
        return self.mask.reshape(self.mask.shape[0], *([1] * (leading - 1)), self.mask.shape[1])


def train_stats(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-10) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and standard deviation of x [B, R, ...] over rows (dim 1), weighting each row by `weight` (0/1)."""
    n = weight.sum(1, keepdim=True).clamp_min(1)
    mean = (x * weight).sum(1, keepdim=True) / n
    var = ((x - mean).square() * weight).sum(1, keepdim=True) / n
    return mean, (var + eps).sqrt()


class CellEncoder(nn.Module):
    """One token per cell: numeric -> linear(normalised value, missing flag); categorical -> embedding of its
    (column, code) hashed into a shared table; plus a projected fixed random identity vector per column index.
    Numeric values are normalised per column with the mean and deviation of the table's train rows only."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.value_proj = nn.Linear(2, cfg.embed_dim)
        self.cat_embed = nn.Embedding(cfg.cat_vocab, cfg.embed_dim)
        ids = torch.randn(cfg.max_columns, cfg.column_id_dim, generator=torch.Generator().manual_seed(0))
        self.register_buffer("column_ids", ids)  # fixed, not learned: breaks the symmetry between columns
        self.column_proj = nn.Linear(cfg.column_id_dim, cfg.embed_dim)

    def category_slots(self, cat_codes: torch.Tensor) -> torch.Tensor:
        """[B, R, C] codes -> slots of the shared table: 0 for a missing category, else hash(column, code)."""
        col = torch.arange(cat_codes.shape[-1], device=cat_codes.device)
        h = (cat_codes * 1_000_003 + col * 7_919) % (self.cfg.cat_vocab - 1) + 1
        return torch.where(cat_codes < 0, 0, h)

    def stats(self, values: torch.Tensor, missing: torch.Tensor, n_train: torch.Tensor) -> tuple[torch.Tensor,
                                                                                             torch.Tensor]:
        """Mean and deviation [B, 1, C] of each numeric column over the observed cells of the train rows."""
        dtype = self.value_proj.weight.dtype
        weight = train_rows(n_train, values.shape[1])[:, :, None].to(dtype) * (~missing).to(dtype)
        return train_stats(values.to(dtype), weight)

    def forward(self, values: torch.Tensor, missing: torch.Tensor, cat_codes: torch.Tensor, is_cat: torch.Tensor,
                stats: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """stats: (mean, std) of `stats`, from these rows or from a context encoded earlier."""
        C = values.shape[-1]
        if C > self.cfg.max_columns:
            raise ValueError(f"the table has {C} columns but the model takes at most max_columns="
                             f"{self.cfg.max_columns}; drop columns or use a model with more")
        with outside_autocast(values.device):
            return self._embed(values, missing, cat_codes, is_cat, stats)

    def _embed(self, values: torch.Tensor, missing: torch.Tensor, cat_codes: torch.Tensor, is_cat: torch.Tensor,
               stats: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """forward's tokens in the weights' dtype, outside autocast: the cells are the data, and bfloat16's 8
        significant bits would round each normalised value by up to 2^-9 of itself before the model sees it."""
        C = values.shape[-1]
        dtype = self.value_proj.weight.dtype
        values, observed = values.to(dtype), (~missing).to(dtype)
        mean, std = stats                                                        # [B, 1, C]
        z = ((values - mean) / std).clamp(-self.cfg.value_clip, self.cfg.value_clip) * observed
        numeric = self.value_proj(torch.stack([z, 1 - observed], dim=-1))       # [B, R, C, E]
        categorical = self.cat_embed(self.category_slots(cat_codes))            # [B, R, C, E]
        x = torch.where(is_cat[:, None, :, None], categorical, numeric)
        return x + self.column_proj(self.column_ids[:C])


class ColumnAttention(nn.Module):
    """Attention down each column, across rows: every cell attends to the cells of its column in the train
    rows (keys/values = the first T rows, masked per table), then an MLP."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.block = Block(cfg.embed_dim, cfg.axial_heads, cfg.axial_mlp_ratio)

    def forward(self, x: torch.Tensor, kv: KeyRows, cache: KVCache | None = None) -> torch.Tensor:
        # x [B, R, C, E]
        cols = x.transpose(1, 2)                                                 # [B, C, R, E]
        cols = self.block(cols, num_kv=kv.count, attn_mask=kv.mask_for(3), cache=cache)
        return cols.transpose(1, 2)


class RowAttention(nn.Module):
    """Attention across the columns of each row: every cell attends to the real (not padding) cells of its
    row, then an MLP."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.block = Block(cfg.embed_dim, cfg.axial_heads, cfg.axial_mlp_ratio)

    def forward(self, x: torch.Tensor, col_pad: torch.Tensor) -> torch.Tensor:
        return self.block(x, num_kv=None, attn_mask=~col_pad[:, None, None, :])  # [B, R, C, E]


class AxialBlock(nn.Module):
    """Down the columns, then across the rows. cache: what test rows read at the column stage (the train rows'
    keys/values; with inducing column attention, its summaries' keys/values)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.column: nn.Module = ColumnAttention(cfg) if cfg.column_attention == "full" else InducingColumnAttention(
            cfg.embed_dim, cfg.axial_heads, cfg.axial_mlp_ratio, cfg.num_inducing)
        self.row = RowAttention(cfg)

    def forward(self, x: torch.Tensor, kv: KeyRows, col_pad: torch.Tensor,
                cache: KVCache | None = None) -> torch.Tensor:
        return self.row(self.column(x, kv, cache), col_pad)


class RowCompression(nn.Module):
    """K learned CLS tokens are appended to each row's cells and attend to the real cells (keys = the first C
    tokens); their K outputs, concatenated, are the row's vector [B, R, K*E]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cls = nn.Parameter(nn.init.normal_(torch.empty(cfg.row_num_cls, cfg.embed_dim), std=0.02))
        self.block = Block(cfg.embed_dim, cfg.axial_heads, cfg.axial_mlp_ratio)

    def forward(self, x: torch.Tensor, col_pad: torch.Tensor) -> torch.Tensor:
        B, R, C, E = x.shape
        seq = torch.cat([x, self.cls.expand(B, R, -1, -1)], dim=2)             # [B, R, C+K, E]
        out = self.block(seq, num_kv=C, attn_mask=~col_pad[:, None, None, :])
        return out[:, :, C:, :].flatten(-2)                                     # [B, R, K*E]


class ICLearning(nn.Module):
    """In-context transformer over row vectors: train rows get their label's embedding added (a class
    embedding, or a linear map of the normalised regression target); every row attends to the train rows only.
    caches: the train rows' keys/values, one per block."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.class_embed = nn.Embedding(cfg.max_classes, cfg.icl_dim)
        self.target_proj = nn.Linear(1, cfg.icl_dim)
        self.blocks = BlockStack(cfg.icl_num_blocks, cfg.icl_dim, cfg.icl_heads, cfg.icl_mlp_ratio)
        self.out_norm = nn.LayerNorm(cfg.icl_dim)

    def forward(self, h: torch.Tensor, label_embedding: torch.Tensor | None, kv: KeyRows,
                caches: list[KVCache] | None = None) -> torch.Tensor:
        # h, label_embedding [B, R, D] (zero on test and padding rows; None when all rows are test rows).
        h = h if label_embedding is None else h + label_embedding
        h = self.blocks(h, num_kv=kv.count, attn_mask=kv.mask_for(2), caches=caches)
        return self.out_norm(h)


# ---------------------------------------------------------------------------------------------------------
# The encoded context of in-context inference
# ---------------------------------------------------------------------------------------------------------

@dataclass
class Context:
    """Train rows of B tables, encoded once (TabFM.encode_context): all a batch of their test rows needs.

    Test rows never influence train rows, so what a test row reads from them is fixed once they are known:
        cell_stats     mean / deviation of each numeric column over the train rows       [B, 1, C]
        target_stats   mean / deviation of the regression target (regression only)      [B, 1]
        caches         keys / values of the train rows at every attention over rows, in forward order: the
                       column stage of each axial block (with inducing column attention: the keys / values of its
                       M summaries of the train rows, [B, C, heads, M, dh]), then each in-context block (this
                       rank's heads when tensor-parallel)
    """

    task: str
    n_train: int
    num_columns: int
    n_classes: torch.Tensor
    """[B] classes of each table (0 for regression)."""
    cell_stats: tuple[torch.Tensor, torch.Tensor]
    target_stats: TargetStats | None
    caches: list[KVCache]

    @property
    def key_rows(self) -> KeyRows:
        """Every table of a context has all n_train rows: attention needs no mask."""
        return KeyRows(self.n_train, None)

    @property
    def num_tables(self) -> int:
        return int(self.n_classes.shape[0])

    def nbytes(self) -> int:
        """Memory held by the cached keys/values (this rank's share)."""
        return sum(c.nbytes() for c in self.caches)

    def select(self, tables: torch.Tensor) -> Context:
        """The context of some of its tables (indices [b] into its B tables), caches included: every cached tensor
        holds the tables in its first dimension and is copied once."""
        def take(t: torch.Tensor) -> torch.Tensor:
            return torch.index_select(t, 0, tables.to(t.device))

        caches = []
        for cache in self.caches:
            part = KVCache()
            part.k, part.v = take(cache.k), take(cache.v)
            part.recording = False
            caches.append(part)
        target_stats = None if self.target_stats is None else tuple(take(t) for t in self.target_stats)
        return Context(task=self.task, n_train=self.n_train, num_columns=self.num_columns,
                       n_classes=take(self.n_classes), cell_stats=tuple(take(t) for t in self.cell_stats),
                       target_stats=target_stats, caches=caches)

    def check_batch(self, batch: Batch) -> None:
        """Raise ValueError unless `batch` holds test rows of this context's tables (same tables, columns, task)."""
        B, _, C = batch.values.shape
        if B != self.num_tables or C != self.num_columns:
            raise ValueError(f"the test batch has {B} tables x {C} columns but the context was encoded from "
                             f"{self.num_tables} tables x {self.num_columns} columns")
        if batch.task != self.task:
            raise ValueError(f"a {batch.task} batch cannot be predicted from a {self.task} context")


# ---------------------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------------------

def _float32_head(head: nn.Linear, h: torch.Tensor) -> torch.Tensor:
    """The output head outside autocast, in its weights' dtype: under bfloat16 autocast the logits would be
    rounded to bfloat16 (8 significant bits, a spacing of 2^-5 at |z| in [4, 8)), moving probabilities by up to
    2^-7 for the price of the smallest matmul in the model."""
    with outside_autocast(h.device):
        return head(h.to(head.weight.dtype))


class TabFM(nn.Module):
    """Cells -> axial blocks -> row compression -> in-context transformer -> classification or regression head.

    forward(batch) gives logits [B, R, Y] for every row (only test rows are meaningful);
    loss(batch) is the cross-entropy over the test rows (padding ignored);
    encode_context(train batch) -> Context, then forward(test batch, context=context): the same test-row logits
    with the train rows run once.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.cells = CellEncoder(cfg)
        self.axial = nn.ModuleList(AxialBlock(cfg) for _ in range(cfg.axial_num_blocks))
        self.compress = RowCompression(cfg)
        self.icl = ICLearning(cfg)
        self.class_head = nn.Linear(cfg.icl_dim, cfg.max_classes)
        self.bin_head = nn.Linear(cfg.icl_dim, cfg.num_bins)

    # -- targets -------------------------------------------------------------------------------------------

    def target_stats(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and deviation [B, 1] of each table's regression targets over its train rows."""
        dtype = self.bin_head.weight.dtype
        weight = train_rows(batch.n_train, batch.labels.shape[1]).to(dtype)
        return train_stats(batch.labels.to(dtype), weight)

    def bin_edges(self) -> torch.Tensor:
        """[num_bins + 1] edges of the regression bins over the normalised target."""
        w = self.bin_head.weight
        return torch.linspace(-self.config.bin_range, self.config.bin_range, self.config.num_bins + 1,
                              dtype=w.dtype, device=w.device)

    def _label_embedding(self, batch: Batch, train: torch.Tensor) -> torch.Tensor:
        if batch.task == "classification":
            most = batch.most_classes  # a Python int read when the batch was built (None on the meta device)
            if most is not None and most > self.config.max_classes:
                raise ValueError(f"a table has {most} classes; the model takes at most "
                                 f"max_classes={self.config.max_classes}")
            emb = self.icl.class_embed(batch.labels.clamp(0, self.config.max_classes - 1))
        elif batch.task == "regression":
            mean, std = self.target_stats(batch)
            z = ((batch.labels.to(mean.dtype) - mean) / std).clamp(-self.config.value_clip, self.config.value_clip)
            emb = self.icl.target_proj(z.unsqueeze(-1))
        else:
            raise ValueError(f"unknown task {batch.task!r}; use 'classification' or 'regression'")
        return emb * train.unsqueeze(-1).to(emb.dtype)

    # -- forward -------------------------------------------------------------------------------------------

    def forward(self, batch: Batch, max_train: int | None = None, context: Context | None = None) -> torch.Tensor:
        """max_train: the most train rows of a table in the batch, when the caller knows it without reading
        n_train (the planner traces the model on the meta device, where tensors hold no values).
        context: train rows encoded earlier (encode_context); then every row of `batch` is a test row, its cells
        are normalised with the context's statistics and the attentions over rows read the context's cached
        keys/values."""
        if context is None:
            return self._run(batch, *self._train_inputs(batch, max_train), caches=None)
        context.check_batch(batch)
        return self._run(batch, context.key_rows, context.cell_stats, None, context.caches)

    @torch.no_grad()
    def encode_context(self, batch: Batch) -> Context:
        """Encode the train rows of `batch` (tables of equal size, all rows train rows) once: their statistics and
        their keys/values at every attention over rows."""
        n_train = batch.values.shape[1]
        if bool(batch.row_pad.any()) or int(batch.n_train.min()) != n_train or int(batch.n_train.max()) != n_train:
            raise ValueError("encode_context takes a batch of train rows only: every table with the same number of "
                             "rows, all of them train rows (n_train == rows, no row padding)")
        kv, stats, labels = self._train_inputs(batch, None)
        caches = [KVCache() for _ in range(len(self.axial) + len(self.icl.blocks.blocks))]
        self._run(batch, kv, stats, labels, caches)
        for cache in caches:
            cache.recording = False
        return Context(task=batch.task, n_train=n_train, num_columns=batch.values.shape[2],
                       n_classes=batch.n_classes.clone(), cell_stats=stats,
                       target_stats=self.target_stats(batch) if batch.task == "regression" else None, caches=caches)

    def _train_inputs(self, batch: Batch, max_train: int | None) -> tuple[KeyRows, tuple[torch.Tensor, torch.Tensor],
                                                                           torch.Tensor]:
        """What the rows read from the batch's own train rows: key rows, cell statistics, label embeddings."""
        n_train, fewest = batch.n_train, None
        if max_train is None:
            if batch.train_bounds is None:
                raise ValueError("the batch's n_train holds no values (meta device): pass forward(batch, max_train=)")
            fewest, max_train = batch.train_bounds  # Python ints read when the batch was built: no graph break
            if fewest < 1:
                raise ValueError("every table needs at least one train row (n_train >= 1)")
        kv = KeyRows.of(n_train, max_train, fewest)
        stats = self.cells.stats(batch.values, batch.missing, n_train)
        return kv, stats, self._label_embedding(batch, train_rows(n_train, batch.values.shape[1]))

    def _run(self, batch: Batch, kv: KeyRows, stats: tuple[torch.Tensor, torch.Tensor],
             labels: torch.Tensor | None, caches: list[KVCache] | None) -> torch.Tensor:
        """The stages, top to bottom; caches (recording or recorded): one per attention over rows, or None."""
        A = len(self.axial)
        x = self.cells(batch.values, batch.missing, batch.cat_codes, batch.is_cat, stats)  # [B, R, C, E]
        for i, block in enumerate(self.axial):
            x = block(x, kv, batch.col_pad, None if caches is None else caches[i])
        h = self.compress(x, batch.col_pad)                                      # [B, R, D]
        h = self.icl(h, labels, kv, None if caches is None else caches[A:])
        if batch.task == "regression":
            return _float32_head(self.bin_head, h)                               # [B, R, num_bins]
        logits = _float32_head(self.class_head, h)                               # [B, R, max_classes]
        unused = torch.arange(self.config.max_classes, device=h.device) >= batch.n_classes[:, None, None]
        return logits.masked_fill(unused, torch.finfo(logits.dtype).min)

    def test_mask(self, batch: Batch) -> torch.Tensor:
        """[B, R] bool: the rows the loss and the predictions are about (test rows, not padding)."""
        return ~train_rows(batch.n_train, batch.labels.shape[1]) & ~batch.row_pad

    def loss(self, batch: Batch, logits: torch.Tensor | None = None) -> torch.Tensor:
        """Mean cross-entropy over the test rows: class labels, or the bin of the normalised target."""
        logits = self(batch) if logits is None else logits
        test = self.test_mask(batch)
        if batch.task == "regression":
            mean, std = self.target_stats(batch)
            z = ((batch.labels.to(mean.dtype) - mean) / std).clamp(-self.config.bin_range, self.config.bin_range)
            target = torch.bucketize(z, self.bin_edges()[1:-1]).clamp(0, self.config.num_bins - 1)
        else:
            target = batch.labels.long()
        return F.cross_entropy(logits[test], target[test])

    @torch.no_grad()
    def predict(self, batch: Batch) -> torch.Tensor:
        """[B, R]: the predicted class, or the mean of the predicted target distribution (in target units)."""
        logits = self(batch)
        if batch.task == "classification":
            return logits.argmax(-1)
        return self.regression_mean(batch, logits)

    def regression_mean(self, batch: Batch | TargetStats, logits: torch.Tensor) -> torch.Tensor:
        """Mean of the binned distribution [B, R], mapped back to target units with the train-row statistics
        (of the batch, or given as (mean, std) [B, 1], e.g. a Context's)."""
        edges = self.bin_edges().to(logits.dtype)
        centers = (edges[:-1] + edges[1:]) / 2
        mean, std = self.target_stats(batch) if isinstance(batch, Batch) else batch
        return (logits.softmax(-1) @ centers) * std.to(logits.dtype) + mean.to(logits.dtype)

    def regression_quantiles(self, batch: Batch | TargetStats, logits: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Quantiles q [Q] of the binned distribution [B, R, Q] in target units (uniform density inside a bin)."""
        edges = self.bin_edges()
        cdf = torch.cat([torch.zeros_like(logits[..., :1]), logits.softmax(-1).cumsum(-1)], -1)  # [B, R, n+1]
        q = q.to(cdf).expand(*cdf.shape[:-1], -1).contiguous()
        k = torch.searchsorted(cdf, q).clamp(1, self.config.num_bins)       # the bin whose CDF span holds q
        lo, hi = cdf.gather(-1, k - 1), cdf.gather(-1, k)
        frac = ((q - lo) / (hi - lo).clamp_min(1e-12)).clamp(0, 1)
        z = edges[k - 1] + frac * (edges[k] - edges[k - 1])
        mean, std = self.target_stats(batch) if isinstance(batch, Batch) else batch
        return z * std[..., None] + mean[..., None]


def build_model(cfg: ModelConfig | str, seed: int = 0) -> TabFM:
    """A freshly initialised model, the same on every rank for a given seed."""
    cfg = ModelConfig.load(cfg) if isinstance(cfg, str) else cfg
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TabFM(cfg)
