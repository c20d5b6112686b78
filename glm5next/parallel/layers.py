"""Linear layers (weights in bf16/fp32, or FP8 e4m3 with 128x128 block scales), their column- and
row-parallel forms, and the vocab-parallel embedding lookup.

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
from torch import nn

from ..checkpoint.fp8 import FP8_DTYPE, dequantize_fp8
from ..checkpoint.specs import Shard, TensorSpec, set_param
from ..kernels.linear.widen import widen_fp8
from .collectives import all_reduce, reduce_output
from .group import TensorParallel


class Linear(nn.Module):
    """`x @ W.T` without bias. An FP8 weight stays FP8 in memory beside its
    fp32 block scales `weight_scale_inv` and is dequantized per call (on CUDA in one launch,
    `kernels.linear.widen`)."""

    def __init__(self, in_features: int, out_features: int, keep_fp32: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.keep_fp32 = keep_fp32
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device="meta"), requires_grad=False)
        self.weight_scale_inv: torch.Tensor | None = None
        self.shard: Shard | None = None
        """The part of the checkpoint weight this tensor-parallel rank holds (None: all of it)."""

    @property
    def is_fp8(self) -> bool:
        """Whether the weight is stored as FP8 with block scales."""
        return self.weight.dtype == FP8_DTYPE

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as a plain `dtype` matrix [out, in]."""
        if self.is_fp8:
            if self.weight.is_cuda:
                return widen_fp8(self.weight, self.weight_scale_inv, dtype)
            return dequantize_fp8(self.weight, self.weight_scale_inv, dtype)
        if self.weight_scale_inv is not None:
            raise ValueError(f"{self!r} holds block scales beside a {self.weight.dtype} weight: an FP8 weight was "
                             "cast (e.g. by Module.to(dtype)), which drops its scales; load the model in the dtype "
                             "instead")
        return self.weight.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dense_weight(x.dtype))

    def tensor_specs(self, prefix: str) -> dict[str, TensorSpec]:
        """The checkpoint tensor `prefix.weight` (FP8 allowed)."""

        def install(t: torch.Tensor, scale: torch.Tensor | None) -> None:
            set_param(self, "weight", t)
            self.weight_scale_inv = None if scale is None else nn.Parameter(scale, requires_grad=False)

        shape = [self.out_features, self.in_features]
        if self.shard is not None:
            shape[self.shard.dim] *= self.shard.size
        return {f"{prefix}.weight": TensorSpec(tuple(shape), install, fp8_ok=not self.keep_fp32,
                                               keep_fp32=self.keep_fp32, shard=self.shard)}

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}"


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
