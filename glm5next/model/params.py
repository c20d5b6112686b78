"""How model modules declare the checkpoint tensors they hold.

Modules are built on the meta device; each declares, per checkpoint tensor
name, the shape it expects and how to install the loaded tensor. The loader
validates a checkpoint against these declarations and installs tensors one at
a time, so the weights are never held twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..parallel.group import Shard

FP8_DTYPE = torch.float8_e4m3fn
"""Storage dtype of FP8 block-quantized weights."""
FP8_BLOCK = 128
"""Side of the square weight block that shares one FP8 scale."""


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor a module expects."""

    shape: tuple[int, ...]
    install: Callable[[torch.Tensor, torch.Tensor | None], None]
    """Installs the loaded tensor (and its FP8 block scales, if it is FP8)."""
    fp8_ok: bool = False
    """Whether the checkpoint may store it as FP8 e4m3 with a `_scale_inv` sibling."""
    keep_fp32: bool = False
    """Whether it stays fp32 in a bf16 model (mixers, router, gates, conv)."""
    shard: Shard | None = None
    """The part of the tensor this tensor-parallel rank holds (None: all of it). `shape` is the
    checkpoint's full shape; `install` receives the part (and the matching part of the FP8 scales)."""

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of what `install` receives."""
        return self.shard.local_shape(self.shape) if self.shard is not None else tuple(self.shape)


def scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the block-scale grid of an FP8 weight of `shape` (last two dims blocked)."""
    *lead, rows, cols = shape
    return (*lead, -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`weight` [..., out, in] FP8 times its block scales [..., ceil(out/128), ceil(in/128)], as `dtype`."""
    rows, cols = weight.shape[-2:]
    s = scale_inv.float().repeat_interleave(FP8_BLOCK, dim=-2).repeat_interleave(FP8_BLOCK, dim=-1)
    s = s[..., :rows, :cols]
    return (weight.float() * s).to(dtype)


def set_param(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """Replace `module.name` with a frozen parameter holding `value`."""
    setattr(module, name, torch.nn.Parameter(value, requires_grad=False))


def install_random(
    specs: dict[str, TensorSpec],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int = 0,
    std: float = 0.05,
) -> None:
    """Install seeded normal(0, std) tensors for every spec (tests of single modules).

    Tensors that stay fp32 in a bf16 model are installed as fp32.
    """
    g = torch.Generator().manual_seed(seed)
    for name in sorted(specs):
        spec = specs[name]
        t = torch.randn(spec.local_shape, generator=g) * std
        spec.install(t.to(device=device, dtype=torch.float32 if spec.keep_fp32 else dtype), None)
