"""The KDA stage: everything between a KDA layer's projections and its o_proj — the short conv, the
gates, the delta rule on the fp32 state and the gated output norm — in one launch per layer
(`glm5next.kernels.kda`), for decode steps and uniform verify steps filed as decodes.

Choice: "fused". Replaces `KimiDeltaAttention.mix` for those steps: the same outputs (the o_proj's
input), the same state updates; a verify step leaves the conv window and the state as they were and
fills the cache's verify scratch for the runtime's commit, as the stock module does. Padded rows touch
no state and output zeros.
"""

from __future__ import annotations

import torch

from ..config import KDA_L2_EPS
from ..forward import AttnMetadata, KdaState
from ..kernels.kda import KdaScratch, KdaWeights, kda_decode, plan_kda
from ..model.kda import KdaProjections, KimiDeltaAttention


class KdaStage:
    """`KimiDeltaAttention.mix` of decode and verify steps on the fused kernel."""

    def __init__(self, attn: KimiDeltaAttention) -> None:
        self.attn = attn
        self.weights = KdaWeights.of(attn, KDA_L2_EPS)
        self.scratch = KdaScratch()
        self.launch = plan_kda(attn.head_dim)

    @staticmethod
    def supports(attn: KimiDeltaAttention) -> bool:
        """Whether the kernel takes this layer: power-of-two head width (the kernel's tiles)."""
        d = attn.head_dim
        return d >= 16 and not d & (d - 1)

    @staticmethod
    def runs(md: AttnMetadata) -> bool:
        """Whether the stage takes this step: decode rows only (a verify filed as prefills runs stock)."""
        return md.num_prefills == 0 and md.num_decodes > 0

    def __call__(self, p: KdaProjections, md: AttnMetadata, state: KdaState) -> torch.Tensor:
        """The o_proj's input [T, H * V] of the step's projections `p`; advances (or, verifying, keeps)
        `state`."""
        rows = md.num_decodes
        q = md.num_decode_tokens // rows
        if md.num_decode_tokens != rows * q:
            raise ValueError(f"{md.num_decode_tokens} decode tokens over {rows} sequences: a verify step is uniform")
        verify = None
        if q > 1:
            if state.verify is None:
                raise RuntimeError(f"a {q}-token verify needs a cache built with verify_tokens >= {q}")
            verify = state.verify
        return kda_decode(p.q, p.k, p.v, p.b, p.f, p.g, state.conv, state.recurrent, md.state_indices[:rows],
                          self.weights, q, self.launch, verify, scratch=self.scratch)
