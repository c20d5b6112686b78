"""The DSA stage: everything between a DSA layer's projections and its o_proj — the cache writes, the
indexer's pool scores over every visible pool, the top-k pool selection, the sparse latent attention and
the value-up — for decode steps and uniform verify steps filed as decodes (each of a row's q tokens has
its own causal selection).

Choice: "sparse". Replaces `SparseMLA.attention` for those steps and returns what it returns: the values
[T, H, v] fp32 (the o_proj's input once cast) and, when asked, the selection [T, topk_pools] int64
padded with -1 — the same pools as the stock top-k (ties to the lower pool), in ascending order rather
than best first. It runs `SparseMLA.attention_on_kernels` (`glm5next.kernels.dsa`: cache writes, scores,
selection, attention, value-up) with W_UK and W_UV^T taken from kv_b_proj once, at build (the checkpoint's
FP8 bytes and block scales as they are, or widened into the model dtype where kv_b_proj is not FP8), a
scratch the captured graph keeps, and a plan per token count. Padded rows write only the scratch
block and get zero values.
"""

from __future__ import annotations

import torch

from ..forward import AttnMetadata, DsaCache
from ..kernels.dsa import DsaPlan, DsaScratch, DsaWeights, plan_dsa
from ..model.dsa import DsaProjections, SparseMLA


class DsaStage:
    """`SparseMLA.attention` of decode and verify steps on the DSA kernels."""

    def __init__(self, attn: SparseMLA, dtype: torch.dtype) -> None:
        self.attn = attn
        self.weights = DsaWeights.of(attn, dtype)
        self.scratch = DsaScratch()
        self._plans: dict[tuple[int, int], DsaPlan] = {}

    @staticmethod
    def supports(attn: SparseMLA) -> bool:
        """Whether the kernels take this layer (they pad every width to their tiles: all of them)."""
        return attn.kpool >= 1

    @staticmethod
    def runs(md: AttnMetadata) -> bool:
        """Whether the stage takes this step: decode rows only (a verify filed as prefills runs stock)."""
        return md.num_prefills == 0 and md.num_decodes > 0

    def plan(self, tokens: int, n_pools: int) -> DsaPlan:
        key = (tokens, n_pools)
        if key not in self._plans:
            dev = self.weights.w_uk.device
            sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 8
            self._plans[key] = plan_dsa(tokens, self.weights.num_heads, n_pools, self.weights.topk_pools,
                                        self.weights.kpool, sms, on_gpu=dev.type == "cuda")
        return self._plans[key]

    def __call__(self, p: DsaProjections, md: AttnMetadata, cache: DsaCache, selection: torch.Tensor | None = None,
                 return_selection: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`SparseMLA.attention(p, md, cache, selection, return_selection)` of a decode or verify step."""
        t = p.q.shape[0]
        if md.num_decode_tokens != t:
            raise ValueError(f"{t} tokens in a step of {md.num_decode_tokens} decode tokens")
        plan = self.plan(t, md.block_tables.shape[1] * cache.pooled_key.shape[1])
        return self.attn.attention_on_kernels(p, md, cache, self.weights, self.scratch, selection, return_selection,
                                              plan)
