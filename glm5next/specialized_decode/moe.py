"""The MoE stage: router, routed experts and the shared expert of one MoE layer in five or six launches
(`glm5next.kernels.moe`), each expert's FP8 weights read once per step for all the rows routed to it; at
2-4 tokens the shared expert's two launches run beside the routing on the stage's second stream.

Choice: "grouped" (weights widened to 16 bits in registers against the bf16 activations, the stock
numerics). Replaces the stock `MoE` module, shared expert included; the output is this rank's share
under tensor parallelism (every rank routes alike: the router is replicated), as the stock module's
before its all-reduce.
"""

from __future__ import annotations

import torch

from ..config import ROUTER_NORM_EPS
from ..kernels.moe import MAX_TOKENS, ExpertWeights, MoePlan, moe_forward, plan_moe
from ..model.moe import MoE


class MoeStage:
    """`MoE.forward` (before its all-reduce) on the grouped kernels, for steps of up to 64 tokens."""

    def __init__(self, moe: MoE) -> None:
        self.moe = moe
        self.weights = ExpertWeights.of(moe)
        self.weights.shared_offsets()  # refuses now what the kernels could not address
        self.top_k = moe.gate.top_k
        self.scale = moe.gate.routed_scaling_factor
        self.norm = moe.gate.norm_topk_prob
        self.limit = moe.experts.swiglu_limit
        self._plans: dict[int, MoePlan] = {}
        self._side: torch.cuda.Stream | None = None
        """The second stream of plans with the shared expert beside the routing."""

    @staticmethod
    def supports(moe: MoE) -> bool:
        """Whether the kernels take this module: one shared expert of a routed expert's shape, every
        expert in one storage type (FP8 with block scales, or 16/32-bit)."""
        try:
            ExpertWeights.of(moe).shared_offsets()
        except (ValueError, AttributeError):
            return False
        return True

    def plan(self, tokens: int) -> MoePlan:
        """The launch plan at this token count."""
        if tokens not in self._plans:
            self._plans[tokens] = plan_moe(tokens, self.weights.router.shape[1], self.weights.gate.device)
        return self._plans[tokens]

    def __call__(self, x: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
        """The MoE output [T, D] of `x` [T, D] (rows whose `slots` entry is negative are padding: 0)."""
        if x.shape[0] > MAX_TOKENS:
            raise ValueError(f"the MoE stage runs steps of at most {MAX_TOKENS} tokens, got {x.shape[0]}")
        plan = self.plan(x.shape[0])
        side = None
        if plan.shared_side and x.is_cuda:
            if self._side is None:
                self._side = torch.cuda.Stream(x.device)
            side = self._side
        return moe_forward(x, self.weights, self.top_k, self.scale, self.norm, ROUTER_NORM_EPS, self.limit, plan,
                           slots, side=side)
