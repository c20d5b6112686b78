"""The dense MLP stage (layers 0-2, and the shared expert of MoE layers): gate and up streamed
together with the clamped SwiGLU in one kernel, then the down projection."""

from __future__ import annotations

import torch

from ..model.mlp import MLP
from ..model.params import FP8_DTYPE


class DenseMlpStage:
    """`MLP.forward` on the skinny kernels."""

    def __init__(self, mlp: MLP) -> None:
        self.mlp = mlp

    @staticmethod
    def supports(mlp: MLP) -> bool:
        """FP8 block-scaled, BF16 or fp32 weights of one storage type."""
        dtypes = {getattr(mlp, n).weight.dtype for n in ("gate_proj", "up_proj", "down_proj")}
        return len(dtypes) == 1 and dtypes.pop() in (torch.bfloat16, torch.float32, FP8_DTYPE)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from ..kernels.linear import gate_up_swiglu, skinny_linear

        m = self.mlp
        h = gate_up_swiglu(x, m.gate_proj.weight, m.gate_proj.weight_scale_inv, m.up_proj.weight,
                           m.up_proj.weight_scale_inv, m.swiglu_limit)
        return skinny_linear(h, m.down_proj.weight, m.down_proj.weight_scale_inv)
