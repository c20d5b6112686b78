"""RMSNorm as the checkpoint uses it everywhere: fp32 statistics, then x weight."""

from __future__ import annotations

import torch
from torch import nn

from ..checkpoint.specs import TensorSpec, set_param


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * cast(x * rsqrt(mean(x^2) + eps))`, statistics in fp32, output in x's dtype."""
    x32 = x.float()
    y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * y).to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension with a learned weight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, device="meta"), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def tensor_specs(self, prefix: str) -> dict[str, TensorSpec]:
        """The checkpoint tensor `prefix.weight`."""
        return {f"{prefix}.weight": TensorSpec((self.dim,), lambda t, s: set_param(self, "weight", t))}
