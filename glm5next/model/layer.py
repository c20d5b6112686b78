"""One decoder layer: mHC around an attention sublayer (KDA or DSA) and an FFN sublayer."""

from __future__ import annotations

import torch
from torch import nn

from ..checkpoint.specs import TensorSpec
from ..config import DSA, KDA, Glm5NextConfig
from ..forward import CUDAGraphMode, ForwardContext, ModelCache
from ..parallel.group import SINGLE, TensorParallel
from .dsa import SparseMLA
from .kda import KimiDeltaAttention
from .mhc import HyperConnection, hc_post
from .mlp import MLP
from .moe import MoE
from .norm import RMSNorm


class DecoderLayer(nn.Module):
    """Layer `layer_idx` of the trunk. Under tensor parallelism both sublayers return outputs already
    all-reduced over the ranks, so the mHC mixers and norms run replicated on identical values."""

    def __init__(self, config: Glm5NextConfig, layer_idx: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_kind = config.layer_kinds[layer_idx]
        self.mlp_is_moe = config.moe_layers[layer_idx]
        self.prefix = f"layers.{layer_idx}"
        if self.layer_kind == KDA:
            self.self_attn = KimiDeltaAttention(config, layer_idx, tp)
        else:
            self.self_attn = SparseMLA(config, layer_idx, tp)
        if self.mlp_is_moe:
            self.mlp = MoE(config, tp)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size, config.swiglu_limit, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)

    def attention(self, x: torch.Tensor, ctx: ForwardContext, cache: ModelCache) -> torch.Tensor:
        """The attention sublayer's output [T, D] for its normalised input `x` [T, D]."""
        md = ctx.metadata(self.self_attn.prefix)
        if self.layer_kind == DSA:
            return self.self_attn(x, md, cache.dsa[self.layer_idx],
                                  graph_safe=ctx.cudagraph_mode != CUDAGraphMode.NONE)
        return self.self_attn(x, md, cache.kda[self.layer_idx])

    def ffn(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The FFN sublayer's output [T, D] for its normalised input `x` [T, D]."""
        if self.mlp_is_moe:
            return self.mlp(x, graph_safe=ctx.cudagraph_mode != CUDAGraphMode.NONE)
        return self.mlp(x)

    def forward(self, streams: torch.Tensor, ctx: ForwardContext, cache: ModelCache) -> torch.Tensor:
        """The streams [T, n, D] after this layer."""
        x, post, comb = self.attn_hc.pre(streams)
        streams = hc_post(self.attention(self.input_layernorm(x), ctx, cache), streams, post, comb)
        x, post, comb = self.ffn_hc.pre(streams)
        return hc_post(self.ffn(self.post_attention_layernorm(x), ctx), streams, post, comb)

    def tensor_specs(self) -> dict[str, TensorSpec]:
        """Every checkpoint tensor of this layer."""
        p = self.prefix
        return {
            **self.input_layernorm.tensor_specs(f"{p}.input_layernorm"),
            **self.post_attention_layernorm.tensor_specs(f"{p}.post_attention_layernorm"),
            **self.attn_hc.tensor_specs(f"{p}.hc_attn"),
            **self.ffn_hc.tensor_specs(f"{p}.hc_ffn"),
            **self.self_attn.tensor_specs(f"{p}.self_attn"),
            **self.mlp.tensor_specs(f"{p}.mlp"),
        }
