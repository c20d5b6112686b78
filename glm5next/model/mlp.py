"""The clamped SwiGLU MLP of the dense layers and the shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import Linear
from .params import TensorSpec
from .routing import route_of


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """`silu(min(gate, limit)) * clamp(up, -limit, limit)`."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class MLP(nn.Module):
    """`down(swiglu(gate(x), up(x)))` with the checkpoint's clamp limit."""

    def __init__(self, hidden_size: int, intermediate_size: int, swiglu_limit: float) -> None:
        super().__init__()
        self.swiglu_limit = swiglu_limit
        self.gate_proj = Linear(hidden_size, intermediate_size)
        self.up_proj = Linear(hidden_size, intermediate_size)
        self.down_proj = Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        route = route_of(self)
        if route is not None:
            return route(x)
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.swiglu_limit))

    def tensor_specs(self, prefix: str) -> dict[str, TensorSpec]:
        """The gate, up and down projection weights under `prefix`."""
        specs = {}
        for name in ("gate_proj", "up_proj", "down_proj"):
            specs.update(getattr(self, name).tensor_specs(f"{prefix}.{name}"))
        return specs
