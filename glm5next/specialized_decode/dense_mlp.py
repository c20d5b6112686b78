"""The dense MLP stage (layers 0-2, and the shared expert of MoE layers): gate and up streamed
together with the clamped SwiGLU in one kernel, then the down projection.

Choices: "fused"; "fused-overlap", the same with both launches programmatic dependents: the gate|up
lets the down start only once its own products are done, and the down prefetches its weights while
the gate|up's last programs finish; the gate|up also pulls its leading weight tiles into L2 while the
boundary before it (which then releases it only after its partial products) finishes. (An MoE layer
runs its shared expert first, before the router and the routed experts, so it too follows the
boundary.)"""

from __future__ import annotations

import torch

from ..checkpoint.fp8 import FP8_DTYPE
from ..kernels import linear as linear_kernels
from ..model.mlp import MLP
from .copies import Fp16Copies


class DenseMlpStage:
    """`MLP.forward` on the skinny kernels. Where the gate|up or the down reads fp16 copies
    (`glm5next.kernels.linear.reads_x16`), the gate|up takes the copy of its input that `copies` holds
    (the boundary's), and writes one of its output for the down."""

    def __init__(self, mlp: MLP, copies: Fp16Copies | None = None) -> None:
        self.mlp = mlp
        self.copies = copies

    @staticmethod
    def supports(mlp: MLP) -> bool:
        """FP8 block-scaled, BF16 or fp32 weights of one storage type."""
        dtypes = {getattr(mlp, n).weight.dtype for n in ("gate_proj", "up_proj", "down_proj")}
        return len(dtypes) == 1 and dtypes.pop() in (torch.bfloat16, torch.float32, FP8_DTYPE)

    def reads_x16(self, tokens: int, dtype: torch.dtype) -> bool:
        """Whether the gate|up reads an fp16 copy of its input at this token count."""
        return linear_kernels.reads_x16(tokens, [self.mlp.gate_proj.weight], dtype, gated=True)

    def __call__(self, x: torch.Tensor, overlap: bool = False) -> torch.Tensor:
        """The MLP of `x` (`overlap`: the "fused-overlap" launches)."""
        m = self.mlp
        x16 = None if self.copies is None else self.copies.get(x)
        h16 = None
        if linear_kernels.reads_x16(x.shape[0], [m.down_proj.weight], x.dtype):  # the gate|up writes the down's copy
            h16 = torch.empty(x.shape[0], m.down_proj.weight.shape[1], dtype=torch.float16, device=x.device)
        h = linear_kernels.gate_up_swiglu(x, m.gate_proj.weight, m.gate_proj.weight_scale_inv, m.up_proj.weight,
                                          m.up_proj.weight_scale_inv, m.swiglu_limit, x16=x16, out16=h16,
                                          pdl="late" if overlap else None)
        return linear_kernels.skinny_linear(h, m.down_proj.weight, m.down_proj.weight_scale_inv, x16=h16,
                                            pdl=True if overlap else None)
