"""The clamped SwiGLU MLP of the dense layers and the shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint.specs import TensorSpec
from ..parallel.collectives import reduce_output
from ..parallel.group import SINGLE, TensorParallel
from ..parallel.layers import ColumnParallelLinear, RowParallelLinear


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """`silu(min(gate, limit)) * clamp(up, -limit, limit)`."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class MLP(nn.Module):
    """`down(swiglu(gate(x), up(x)))` with the checkpoint's clamp limit.

    Under tensor parallelism the width splits over the ranks (gate/up by rows, down by columns) and
    the output is all-reduced, unless `reduce` is False (the shared expert: the MoE reduces once).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, swiglu_limit: float, tp: TensorParallel = SINGLE,
                 what: str = "intermediate_size", reduce: bool = True) -> None:
        super().__init__()
        self.swiglu_limit = swiglu_limit
        self.tp = tp
        self.reduce = reduce
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, tp, what)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, tp, what)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp, what, reduce=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.swiglu_limit))
        return reduce_output(y, self.tp) if self.reduce else y

    def tensor_specs(self, prefix: str) -> dict[str, TensorSpec]:
        """The gate, up and down projection weights under `prefix`."""
        specs = {}
        for name in ("gate_proj", "up_proj", "down_proj"):
            specs.update(getattr(self, name).tensor_specs(f"{prefix}.{name}"))
        return specs
