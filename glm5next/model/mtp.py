"""The MTP draft layer: one plain pre-norm DSA + MoE block over [embedding | hidden]."""

from __future__ import annotations

import torch
from torch import nn

from ..checkpoint.specs import TensorSpec
from ..config import DSA, Glm5NextConfig
from ..forward import CUDAGraphMode, ForwardContext, ModelCache
from ..parallel.group import SINGLE, TensorParallel
from ..parallel.layers import Linear
from .dsa import SparseMLA
from .moe import MoE
from .norm import RMSNorm


class MtpLayer(nn.Module):
    """Checkpoint layer `num_hidden_layers`: proposes the token after next from the
    trunk's post-norm hidden state and the embedding of the next token. Under tensor parallelism
    its DSA and MoE split as the trunk's do; `eh_proj` and the norms are replicated."""

    def __init__(self, config: Glm5NextConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.layer_idx = config.mtp_layer_idx
        self.layer_kind = DSA
        self.mlp_is_moe = True
        self.prefix = f"layers.{self.layer_idx}"
        self.enorm = RMSNorm(d, eps)
        self.hnorm = RMSNorm(d, eps)
        self.eh_proj = Linear(2 * d, d)
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.self_attn = SparseMLA(config, self.layer_idx, tp)
        self.mlp = MoE(config, tp)
        self.shared_head_norm = RMSNorm(d, eps)

    def forward(
        self, embedded: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext, cache: ModelCache,
        selection: torch.Tensor | None = None, return_selection: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The draft hidden state [T, D] (post shared-head norm, fed to the trunk LM head).

        `embedded` [T, D]: embeddings of the tokens after each slot; `hidden`
        [T, D]: the trunk's post-norm hidden states at each slot. The embedding
        is zeroed at position 0. `selection` / `return_selection`: the DSA pools to attend to instead
        of the indexer's, and the pools chosen (see `SparseMLA.forward`), for draft steps that reuse
        the first draft step's selection.
        """
        md = ctx.metadata(self.self_attn.prefix)
        z = self.combine(embedded, hidden, md.positions)
        graph_safe = ctx.cudagraph_mode != CUDAGraphMode.NONE
        a = self.self_attn(self.input_layernorm(z), md, cache.dsa[self.layer_idx], selection, return_selection,
                           graph_safe)
        a, chosen = a if return_selection else (a, None)
        r = a + z
        f = self.mlp(self.post_attention_layernorm(r), graph_safe=graph_safe)
        out = self.shared_head_norm(f + r)
        return (out, chosen) if return_selection else out

    def combine(self, embedded: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The block's input [T, D]: `eh_proj` of the normalised embeddings (zeroed at position 0) and
        hidden states, each [T, D]; `positions` [T] int64."""
        first = (positions == 0).unsqueeze(-1)
        embedded = torch.where(first, torch.zeros_like(embedded), embedded)
        return self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))

    def tensor_specs(self) -> dict[str, TensorSpec]:
        """Every checkpoint tensor of the MTP layer."""
        p = self.prefix
        specs = {}
        for name in ("enorm", "hnorm", "input_layernorm", "post_attention_layernorm"):
            specs.update(getattr(self, name).tensor_specs(f"{p}.{name}"))
        specs.update(self.shared_head_norm.tensor_specs(f"{p}.shared_head.norm"))
        specs.update(self.eh_proj.tensor_specs(f"{p}.eh_proj"))
        specs.update(self.self_attn.tensor_specs(f"{p}.self_attn"))
        specs.update(self.mlp.tensor_specs(f"{p}.mlp"))
        return specs
