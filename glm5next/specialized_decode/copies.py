"""fp16 copies of a step's activations, written by the kernel that produces them.

FP8 projections at up to 32 rows multiply in fp16: every program of such a launch converts its bf16
activation tiles to fp16 at every K step. Where the kernel before it writes an fp16 copy of its
output as well (the fused boundary's `x16`, the gate|up's `out16`), the projection reads that copy
instead (`x16`), with the same result. The boundary stage files its copy here; the projection routes
and MLP stages look up the input they were called with.
"""

from __future__ import annotations

import torch


def _version(x: torch.Tensor) -> int | None:
    return None if x.is_inference() else x._version  # inference tensors keep no version counter


class Fp16Copies:
    """The fp16 copy of the latest activation filed, found again by the tensor it copies: the same
    storage, offset, shape and strides (and, outside inference mode, not modified in place since)."""

    def __init__(self) -> None:
        self._x: torch.Tensor | None = None
        self._x16: torch.Tensor | None = None
        self._version: int | None = None

    def put(self, x: torch.Tensor, x16: torch.Tensor) -> None:
        """File `x16` as the fp16 copy of `x` (holding `x`, so its storage is not reused while filed)."""
        self._x, self._x16, self._version = x, x16, _version(x)

    def get(self, x: torch.Tensor) -> torch.Tensor | None:
        """The fp16 copy of `x`, or None."""
        t = self._x
        if t is None or x.dtype != t.dtype or x.device != t.device or x.shape != t.shape:
            return None
        if x.data_ptr() != t.data_ptr() or x.stride() != t.stride() or _version(x) != self._version:
            return None
        return self._x16

    def clear(self) -> None:
        self._x = self._x16 = self._version = None
