"""Linear layers whose weight is stored in bf16/fp32, or FP8 e4m3 with 128x128 block scales."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.group import Shard
from .params import FP8_DTYPE, TensorSpec, dequantize_fp8, set_param


class Linear(nn.Module):
    """`x @ W.T` without bias. An FP8 weight stays FP8 in memory beside its
    fp32 block scales `weight_scale_inv` and is dequantized per call."""

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
            return dequantize_fp8(self.weight, self.weight_scale_inv, dtype)
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
