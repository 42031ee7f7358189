"""ParallelOptions: how the ATP layers run on their mesh: sequence parallelism, overlapped chunks, fused kernels.

The three travel together from where a user sets them (a run config's `parallel` section, an estimator's
`sequence_parallel`, a command-line flag) to the layers that use them. They are checked once, when the
ParallelOptions is made, and then handed on whole: `parallelize(model, mesh, plan, options)`,
`tabfm.parallel_model.parallelize_model(model, mesh, options)`, `tabfm.checkpoint.load_model(path, mesh, options)`.

    sequence_parallel  every style, and the regions (which pad the sequence to a multiple of d0)
    overlap_chunks     mlp, attention, colwise, rowwise (overlap.py)
    kernels            mlp, norm (kernels/ops.py)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tabfm.parallel.kernels.ops import check_kernels
from tabfm.parallel.overlap import check_chunks


@dataclass(frozen=True)
class ParallelOptions:
    """The run options of a parallelized model, valid by construction (a bad value raises ValueError here)."""

    sequence_parallel: bool = False
    """Shard each region's tokens over mesh axis 0 as well as the hidden size over both axes (DESIGN 3.2)."""
    overlap_chunks: int = 1
    """k > 1 pipelines each tensor-parallel linear over k chunks so its collectives overlap compute (DESIGN 3.4)."""
    kernels: str = "auto"
    """Fused chunk epilogues: "auto" (Triton on large CUDA tensors, the torch reference elsewhere), "triton" or
    "torch" (kernels/ops.py)."""

    def __post_init__(self) -> None:
        if self.sequence_parallel not in (True, False):
            raise ValueError(f"sequence_parallel must be true or false, got {self.sequence_parallel!r}")
        object.__setattr__(self, "sequence_parallel", bool(self.sequence_parallel))  # numpy / 0-1 flags as bool
        check_chunks(self.overlap_chunks)
        check_kernels(self.kernels)

    @classmethod
    def of(cls, options: ParallelOptions | None = None, **fields: Any) -> ParallelOptions:
        """`options` as given, or one made from its fields given as keywords (`sequence_parallel=True`), so callers
        may write either; giving both is refused, and so is anything that is not a ParallelOptions."""
        if options is None:
            return cls(**fields)
        if not isinstance(options, ParallelOptions):
            raise TypeError(f"options must be a ParallelOptions, got {type(options).__name__} {options!r}; "
                            "pass sequence_parallel=... by keyword, or ParallelOptions(sequence_parallel=...)")
        if fields:
            raise TypeError(f"give either a ParallelOptions or its fields, not both (got {sorted(fields)} too)")
        return options

    @classmethod
    def from_config(cls, parallel: Any) -> ParallelOptions:
        """The options of a run config's `parallel` section (tabfm.config.ParallelConfig)."""
        return cls(parallel.sequence_parallel, parallel.overlap_chunks, parallel.kernels)

    def pick(self, names: tuple[str, ...]) -> dict[str, Any]:
        """The named fields as keyword arguments (what one layer type takes)."""
        return {name: getattr(self, name) for name in names}
