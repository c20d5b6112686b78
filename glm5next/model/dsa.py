"""The DSA layer: NoPE multi-head latent attention over the indexer-selected tokens (spec section 6).

Each step writes the tokens' latents `c`, indexer keys and KPool gate logits
into the paged caches, builds the pools its tokens complete, then lets every
token attend, in absorbed form over the latent cache, to the tokens of its
selected pools plus its incomplete-pool tail. Decode rows run with static
shapes (CUDA-graph safe); prefill rows run per sequence in query chunks.

Under tensor parallelism each rank holds a contiguous range of heads (their rows of q_b_proj and
kv_b_proj, their columns of o_proj) and the output projection's partial sums are all-reduced. The
latent `c` and the indexer keys are per token, shared by every head, so the paged caches are
replicated: every rank computes and stores the same rows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ..checkpoint.specs import TensorSpec
from ..config import Glm5NextConfig
from ..forward import AttnMetadata, DsaCache
from ..kernels.dsa import (DsaPlan, DsaScratch, DsaWeights, index_scores, plan_dsa, select_pools, sparse_attention,
                           write_cache)
from ..parallel.collectives import all_reduce
from ..parallel.group import SINGLE, TensorParallel
from ..parallel.layers import ColumnParallelLinear, Linear, RowParallelLinear
from .indexer import Indexer
from .norm import RMSNorm

PREFILL_CHUNK_ELEMS = 1 << 26
"""Budget (elements) of the per-chunk score and gathered-latent tensors of the eager prefill path."""
MAX_PREFILL_CHUNK = 256
"""Most prefill queries attended in one chunk."""


class DsaProjections(NamedTuple):
    """What a DSA layer's projections make of its input x [T, hidden]: the attention queries `q`
    [T, H, nope], the normalised latent `c` [T, kv_lora] (x's dtype), and the indexer's query `qi`
    [T, Hi, d], fp32 head weights `wi` [T, Hi], key `ki` [T, d] and KPool gate logits `gi` [T, d]."""

    q: torch.Tensor
    c: torch.Tensor
    qi: torch.Tensor
    wi: torch.Tensor
    ki: torch.Tensor
    gi: torch.Tensor


class SparseMLA(nn.Module):
    """Layer `layer_idx`'s DeepSeek-sparse-attention sublayer: MLA projections, indexer, sparse attention."""

    def __init__(self, config: Glm5NextConfig, layer_idx: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.prefix = f"layers.{layer_idx}.self_attn"
        heads_what = "num_attention_heads"
        self.num_heads = tp.split(config.num_attention_heads, heads_what)
        """This rank's heads (all of them on one process)."""
        self.nope_dim = config.qk_nope_head_dim
        self.v_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.kpool = config.index_kpool
        self.scale = config.mla_softmax_scale
        h, eps, heads = config.hidden_size, config.rms_norm_eps, config.num_attention_heads
        # The latents (q_a, kv_a and their norms) are shared by every head: replicated, so every rank
        # writes the same latent cache. The per-head up-projections split by heads, o_proj by rows.
        self.q_a_proj = Linear(h, config.q_lora_rank)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps)
        self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, heads * self.nope_dim, tp, heads_what)
        self.kv_a_proj_with_mqa = Linear(h, self.kv_lora_rank)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, heads * (self.nope_dim + self.v_dim), tp, heads_what)
        self.o_proj = RowParallelLinear(heads * self.v_dim, h, tp, heads_what)
        self.indexer = Indexer(config, tp)

    def tensor_specs(self, prefix: str) -> dict[str, TensorSpec]:
        """Every checkpoint tensor of this sublayer under `prefix` (e.g. `layers.3.self_attn`)."""
        specs: dict[str, TensorSpec] = {}
        for name in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
                     "kv_b_proj", "o_proj", "indexer"):
            specs.update(getattr(self, name).tensor_specs(f"{prefix}.{name}"))
        return specs

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 `W_UK` `[H, nope, kv_lora]` and `W_UV` `[H, v, kv_lora]`, the per-head row blocks of kv_b_proj."""
        w = self.kv_b_proj.dense_weight(torch.float32).view(self.num_heads, self.nope_dim + self.v_dim, -1)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def project(self, x: torch.Tensor) -> DsaProjections:
        """The projections of normalised inputs `x` [T, hidden] (the sublayer's first piece): the latents
        and their norms, the q_b, and the indexer's."""
        cq = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(cq)
        c = self.kv_a_layernorm(self.kv_a_proj_with_mqa(x))
        return self.projected(x, q, c, self.indexer.wq_b(cq), self.indexer.wk(x))

    def projected(self, x: torch.Tensor, q: torch.Tensor, c: torch.Tensor, qi: torch.Tensor,
                  ki: torch.Tensor) -> DsaProjections:
        """The projections of `x` [T, hidden] from the outputs of its linears and latent norms: `q` of the
        q_b [T, H * nope], `c` of the kv_a norm, `qi` of the indexer's wq_b and `ki` of its wk (before its
        key norm)."""
        qi, wi, ki, gi = self.indexer.outputs(x, qi, ki)
        return DsaProjections(q.view(x.shape[0], self.num_heads, self.nope_dim), c, qi, wi, ki, gi)

    def write_cache(self, p: DsaProjections, md: AttnMetadata, cache: DsaCache) -> None:
        """Store the step's latents, indexer keys and gate logits in their token rows (padding in the scratch
        block), then the pooled key of every pool a token of the step completes."""
        rows = cache.token_rows(md.slot_mapping)
        cache.latent.view(-1, self.kv_lora_rank).index_copy_(0, rows, p.c.to(cache.latent.dtype))
        cache.index_key.view(-1, p.ki.shape[-1]).index_copy_(0, rows, p.ki.to(cache.index_key.dtype))
        cache.index_gate.view(-1, p.gi.shape[-1]).index_copy_(0, rows, p.gi.to(cache.index_gate.dtype))
        self.indexer.write_pools(md.positions, md.slot_mapping, cache)

    def attention(
        self,
        p: DsaProjections,
        md: AttnMetadata,
        cache: DsaCache,
        selection: torch.Tensor | None = None,
        return_selection: bool = False,
        graph_safe: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The attention's values `[T, H, v]` fp32 (heads outermost in memory, as the W_UV product leaves
        them), the o_proj's input once cast, of the step's projections `p`; writes the caches and pools.
        `selection` / `return_selection` as in `forward`: the second result is the selection, or None.
        Eager steps over a 16-bit cache on a GPU (prefill, mixed steps) run on the DSA kernels
        (`attention_on_kernels`); the others run the PyTorch form below."""
        if not graph_safe and self.runs_kernels(cache):
            return self.attention_on_kernels(p, md, cache, DsaWeights.of(self, cache.latent.dtype), DsaScratch(),
                                             selection, return_selection)
        t = p.q.shape[0]
        dev = p.q.device
        self.write_cache(p, md, cache)

        w_uk, w_uv = self.absorbed_weights()
        q_lat = torch.einsum("thn,hnr->thr", p.q.float(), w_uk)
        ctx = torch.full((t, self.num_heads, self.kv_lora_rank), float("nan"), device=dev)
        chosen = None
        if return_selection:
            chosen = torch.full((t, self.indexer.topk_pools), -1, dtype=torch.int64, device=dev)

        def attend_rows(a: int, b: int, tables: torch.Tensor) -> None:
            given = None if selection is None else selection[a:b]
            ctx[a:b], sel = self.attend(q_lat[a:b], p.qi[a:b], p.wi[a:b], md.positions[a:b], tables, cache, given)
            if chosen is not None:
                chosen[a:b, : sel.shape[1]] = sel[:, : chosen.shape[1]]

        nd = md.num_decode_tokens
        if nd:
            attend_rows(0, nd, md.block_tables[md.token_to_seq[:nd]])
        for s in range(md.num_decodes, md.num_seqs):
            a, b = md.query_start_loc_cpu[s], md.query_start_loc_cpu[s + 1]
            if a == b:
                continue
            seq_len = md.context_lens_cpu[s] + (b - a)
            tables = md.block_tables[s : s + 1, : -(-seq_len // cache.block_size)]
            step = self._prefill_chunk(tables.shape[1] * cache.block_size)
            for lo in range(a, b, step):
                hi = min(b, lo + step)
                attend_rows(lo, hi, tables)
        return torch.einsum("thr,hvr->thv", ctx, w_uv), chosen

    @staticmethod
    def runs_kernels(cache: DsaCache) -> bool:
        """Whether an eager step's attention runs on the DSA kernels: a 16-bit cache on a GPU (an fp32 one
        keeps the fp32 PyTorch form, the reference of the exactness tests)."""
        return cache.latent.is_cuda and cache.latent.dtype in (torch.bfloat16, torch.float16)

    def attention_on_kernels(self, p: DsaProjections, md: AttnMetadata, cache: DsaCache, w: DsaWeights,
                             scratch: DsaScratch, selection: torch.Tensor | None = None,
                             return_selection: bool = False,
                             plan: DsaPlan | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`attention` on `glm5next.kernels.dsa`: the cache writes, the pool scores of every visible pool
        (summed over the ranks' indexer heads), the top-k selection (ties to the lower pool; ascending
        rather than best first) and the sparse latent attention with the value-up, every row with its own
        position, sequence and causal selection. `w`: the layer's weights as the kernels read them;
        `scratch`: where the launches keep their buffers (a captured step passes one it keeps); `plan`:
        the launches' tiles (planned for the step's tokens without it). Padded rows get zero values."""
        t, dev = p.q.shape[0], p.q.device
        write_cache(p.c, p.ki, p.gi, md.positions, md.slot_mapping, md.token_to_seq, w.ape, cache.latent,
                    cache.index_key, cache.index_gate, cache.pooled_key)
        tables = md.block_tables
        n_pools = tables.shape[1] * cache.pooled_key.shape[1]
        values = torch.empty(t, w.num_heads, self.v_dim, dtype=torch.float32, device=dev)
        sel = scratch.get("sel", (t, w.topk_pools), torch.int64, dev) if selection is None else selection
        # Without a plan (eager steps), rows in pieces whose pool scores stay within the prefill budget, each
        # planned for its rows; with one (a decode or verify step), one piece of every row.
        piece = t if plan is not None else max(1, PREFILL_CHUNK_ELEMS // n_pools)
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 8
        for a in range(0, t, piece):
            b = min(t, a + piece)
            n = b - a
            pos, slots, seqs = md.positions[a:b], md.slot_mapping[a:b], md.token_to_seq[a:b]
            tiles = plan or plan_dsa(n, w.num_heads, n_pools, w.topk_pools, w.kpool, sms, on_gpu=dev.type == "cuda")
            if selection is None:
                scores = scratch.get("scores", (n, n_pools), torch.float32, dev)
                index_scores(p.qi[a:b], p.wi[a:b], pos, slots, seqs, tables, cache.pooled_key, w.kpool,
                             w.index_scale, tiles, scores)
                # Each rank scored with its own indexer heads: every rank ranks the same full sum.
                scores = all_reduce(scores, self.indexer.tp)
                count = scratch.get("count", (n,), torch.int32, dev)
                select_pools(scores, pos, slots, w.kpool, w.topk_pools, tiles, sel[a:b], count, scratch)
            else:
                count = scratch.get("count_given", (n,), torch.int32, dev).fill_(selection.shape[1])
            sparse_attention(p.q[a:b], sel[a:b], count, pos, slots, seqs, tables, cache.latent, w, tiles,
                             out=values[a:b], scratch=scratch)
        chosen = None
        if return_selection:
            if selection is None:
                chosen = sel.clone()
            else:
                chosen = torch.full((t, w.topk_pools), -1, dtype=torch.int64, device=dev)
                chosen[:, : selection.shape[1]] = selection[:, : w.topk_pools]
        return values, chosen

    def output(self, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The sublayer output [T, hidden] `dtype` of the attention's values [T, H, v]: cast, then o_proj."""
        return self.o_proj(values.to(dtype).reshape(values.shape[0], self.num_heads * self.v_dim))

    def forward(
        self,
        x: torch.Tensor,
        md: AttnMetadata,
        cache: DsaCache,
        selection: torch.Tensor | None = None,
        return_selection: bool = False,
        graph_safe: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The sublayer output `[T, hidden]` (x's dtype) for normalised inputs `x` `[T, hidden]`:
        `output(attention(project(x)))`.

        `selection`: optional `[T, K]` int64 pools per token (-1 = none) to attend to instead of running
        the indexer's top-k, e.g. an earlier step's selection reused by an MTP draft step (spec section 8,
        `index_share_for_mtp_iteration`); caches and pools are still written. With `return_selection`
        the result is `(output, selection)`, the selection `[T, index_topk / index_kpool]` int64 padded
        with -1. `graph_safe`: the step is being captured or replayed (static shapes; see `attention`).
        """
        values, chosen = self.attention(self.project(x), md, cache, selection, return_selection, graph_safe)
        out = self.output(values, x.dtype)
        return (out, chosen) if return_selection else out

    def _prefill_chunk(self, context: int) -> int:
        """Queries per prefill chunk for a context of `context` cached rows."""
        ix = self.indexer
        selected = min(ix.topk_pools * self.kpool, context) + self.kpool - 1
        per_query = ix.n_heads * (context // self.kpool) + selected * (self.kv_lora_rank + self.num_heads)
        return max(1, min(MAX_PREFILL_CHUNK, PREFILL_CHUNK_ELEMS // per_query))

    def attend(
        self,
        q_lat: torch.Tensor,
        qi: torch.Tensor,
        wi: torch.Tensor,
        positions: torch.Tensor,
        tables: torch.Tensor,
        cache: DsaCache,
        selection: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention context `[T, H, kv_lora]` fp32 (before W_UV) and the selected pools `[T, K]` int64.

        `q_lat`: `[T, H, kv_lora]` fp32 absorbed queries; `qi`: `[T, Hi, d]` indexer queries; `wi`:
        `[T, Hi]` fp32 head weights; `positions`: `[T]` int64; `tables`: `[T, blocks]` int64, each
        token's block table (its sequence's row; fixed width at decode), or `[1, blocks]` shared by
        all. Selects among the `blocks * block_size / kpool` pools of the table (or takes the visible
        pools of `selection`), adds the incomplete tail `[kpool * floor((p+1)/kpool), p]` and attends
        over those latents. Static shapes, no host syncs.
        """
        kp, bs = self.kpool, cache.block_size
        per_block = bs // kp
        n_pools = tables.shape[1] * per_block
        dev = positions.device
        pool = torch.arange(n_pools, device=dev)
        pos = positions[:, None]
        visible = pool[None] * kp + (kp - 1) <= pos
        if selection is None:
            pool_rows = tables.repeat_interleave(per_block, dim=1) * per_block + pool % per_block
            pool_keys = cache.pooled_key.view(-1, cache.pooled_key.shape[-1])[pool_rows]
            selection = self.indexer.select(qi, wi, pool_keys, visible, min(self.indexer.topk_pools, n_pools))
        sel_ok = (selection >= 0) & (selection < n_pools) & visible.gather(1, selection.clamp(0, n_pools - 1))

        r = torch.arange(kp, device=dev)
        sel_tok = (selection.clamp_min(0)[:, :, None] * kp + r).flatten(1)
        sel_ok = sel_ok[:, :, None].expand(-1, -1, kp).flatten(1)
        tail = (positions[:, None] + 1) // kp * kp + r[: kp - 1]
        tok = torch.cat([sel_tok, tail], dim=1)
        ok = torch.cat([sel_ok, tail <= pos], dim=1)
        tok = torch.where(ok, tok, torch.zeros_like(tok))
        block = tables.expand(tok.shape[0], -1).gather(1, (tok // bs).clamp_max(tables.shape[1] - 1))
        lat = cache.latent.view(-1, self.kv_lora_rank)[block * bs + tok % bs].float()

        scores = torch.matmul(q_lat, lat.transpose(1, 2)) * self.scale
        scores = scores.masked_fill(~ok[:, None, :], torch.finfo(torch.float32).min)
        probs = torch.softmax(scores, dim=-1)
        return torch.matmul(probs, lat), selection
