"""The DSA stage: everything between a DSA layer's projections and its o_proj — the cache writes, the
indexer's pool scores over every visible pool, the top-k pool selection, the sparse latent attention and
the value-up — for decode steps and uniform verify steps filed as decodes (each of a row's q tokens has
its own causal selection).

Choice: "sparse". Replaces `SparseMLA.attention` for those steps and returns what it returns: the values
[T, H, v] fp32 (the o_proj's input once cast) and, when asked, the selection [T, topk_pools] int64
padded with -1 — the same pools as the stock top-k (ties to the lower pool), in ascending order rather
than best first. The scores, selection and attention run on `glm5next.kernels.dsa`; the cache writes
(latent, indexer key and gate, the pooled key of each pool a token completes) are still the stock
module's `write_cache`, called here first. W_UK and W_UV^T are widened from kv_b_proj once, at build,
into the model dtype. Padded rows write only the scratch block and get zero values.
"""

from __future__ import annotations

import torch

from ..forward import AttnMetadata, DsaCache
from ..kernels.dsa import (DsaPlan, DsaScratch, DsaWeights, index_scores, plan_dsa, select_pools, sparse_attention,
                           write_cache)
from ..model.dsa import DsaProjections, SparseMLA
from ..parallel.collectives import all_reduce


class DsaStage:
    """`SparseMLA.attention` of decode and verify steps on the DSA kernels."""

    def __init__(self, attn: SparseMLA, dtype: torch.dtype) -> None:
        self.attn = attn
        self.weights = DsaWeights.of(attn, dtype)
        self.ape = attn.indexer.index_kpool_compress_ape.float().contiguous()
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
        t, dev, w = p.q.shape[0], p.q.device, self.weights
        if md.num_decode_tokens != t:
            raise ValueError(f"{t} tokens in a step of {md.num_decode_tokens} decode tokens")
        write_cache(p.c, p.ki, p.gi, md.positions, md.slot_mapping, md.token_to_seq, self.ape, cache.latent,
                    cache.index_key, cache.index_gate, cache.pooled_key)
        tables, seqs, pos, slots = md.block_tables, md.token_to_seq, md.positions, md.slot_mapping
        n_pools = tables.shape[1] * cache.pooled_key.shape[1]
        plan = self.plan(t, n_pools)
        if selection is None:
            scores = self.scratch.get("scores", (t, n_pools), torch.float32, dev)
            index_scores(p.qi, p.wi, pos, slots, seqs, tables, cache.pooled_key, w.kpool, w.index_scale, plan, scores)
            # Each rank scored with its own indexer heads: every rank ranks the same full sum.
            scores = all_reduce(scores, self.attn.indexer.tp)
            sel, count = select_pools(scores, pos, slots, w.kpool, w.topk_pools, plan,
                                      self.scratch.get("sel", (t, w.topk_pools), torch.int64, dev),
                                      self.scratch.get("count", (t,), torch.int32, dev), self.scratch)
        else:
            sel = selection
            count = self.scratch.get("count_given", (t,), torch.int32, dev).fill_(selection.shape[1])
        values = sparse_attention(p.q, sel, count, pos, slots, seqs, tables, cache.latent, w, plan,
                                  scratch=self.scratch)
        chosen = None
        if return_selection:
            if selection is None:
                chosen = sel.clone()
            else:
                chosen = torch.full((t, w.topk_pools), -1, dtype=torch.int64, device=dev)
                chosen[:, : selection.shape[1]] = selection[:, : w.topk_pools]
        return values, chosen
