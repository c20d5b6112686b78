"""Column- and row-parallel linear layers, and the vocab-parallel embedding lookup.

A column-parallel layer holds a contiguous slice of the output rows of its checkpoint weight
(this rank's heads, or its slice of an MLP width); its output is this rank's share and needs no
communication. A row-parallel layer holds the matching slice of the input columns; its output is
a partial sum over the ranks, all-reduced in `forward` unless the caller sums several such
outputs first and reduces once (the MoE). FP8 weights shard on 128x128 scale-block boundaries:
the loader slices their block scales with them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model.linear import Linear
from .collectives import all_reduce, reduce_output
from .group import TensorParallel


class ColumnParallelLinear(Linear):
    """`x @ W[rows of this rank].T`: output features split over the ranks, named `what` in errors."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel, what: str) -> None:
        super().__init__(in_features, tp.split(out_features, what))
        self.shard = tp.shard(0)


class RowParallelLinear(Linear):
    """`x[:, columns of this rank] @ W[:, columns of this rank].T`, summed over the ranks
    (when `reduce`): input features split over the ranks, named `what` in errors."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel, what: str, reduce: bool = True) -> None:
        super().__init__(tp.split(in_features, what), out_features)
        self.shard = tp.shard(1)
        self.tp = tp
        self.reduce = reduce
        """Whether `forward` all-reduces its partial output (False: the caller reduces a sum)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return reduce_output(y, self.tp) if self.reduce else y


def vocab_parallel_embedding(input_ids: torch.Tensor, weight: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Embeddings [T, D] of `input_ids` [T] from this rank's contiguous rows `weight` [vocab / tp, D]
    of the table: each rank looks up the ids in its range and zeroes the rest, and the sum over the
    ranks is every token's embedding (exact: one term is non-zero)."""
    if tp.size == 1:
        return F.embedding(input_ids, weight)
    rows = weight.shape[0]
    local = input_ids - tp.rank * rows
    inside = (local >= 0) & (local < rows)
    found = F.embedding(local.clamp(0, rows - 1), weight)
    return all_reduce(torch.where(inside[:, None], found, torch.zeros_like(found)), tp)
