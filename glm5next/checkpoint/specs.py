"""How modules declare the checkpoint tensors they hold, and which part of each a tensor-parallel rank holds.

Modules are built on the meta device; each declares, per checkpoint tensor
name, the shape it expects and how to install the loaded tensor. The loader
validates a checkpoint against these declarations and installs tensors one at
a time, so the weights are never held twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Shard:
    """Part `rank` of `size` equal parts of a checkpoint tensor along dimension `dim`."""

    dim: int
    rank: int
    size: int

    def bounds(self, full: int) -> tuple[int, int]:
        """The [start, stop) range of this part along a dimension of `full` entries."""
        step = full // self.size
        return self.rank * step, (self.rank + 1) * step

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of this part of a tensor of `shape`."""
        out = list(shape)
        out[self.dim] //= self.size
        return tuple(out)


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
