"""DSA decode and verify: the indexer's pool scores and top-k selection, and the sparse latent attention
with its value-up, between a DSA layer's projections (and cache writes) and its o_proj.

Launches with static grids and no host sync (see `indexer` and `attention`): scores, selection (one
launch per level, their count fixed by the block table's width), absorbed queries, split attention,
combine and value-up. Under tensor parallelism the caller sums the scores over the ranks between the
scores and the selection. Each launcher has a plain fp32 twin in `reference`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from ...checkpoint.fp8 import FP8_DTYPE, dequantize_fp8
from .. import pdl as _pdl
from .attention import attend_kernel, head_product_kernel, merge_splits_kernel
from .cache import write_cache_kernel
from .indexer import index_scores_kernel, indexer_inputs_kernel, select_pools_kernel
from .reference import (dsa_decode_reference, index_scores_reference, indexer_inputs_reference,
                        select_pools_reference, sparse_attention_reference)

__all__ = ["DsaPlan", "DsaScratch", "DsaWeights", "IndexerInputWeights", "dsa_decode", "dsa_decode_reference", "index_scores",
           "index_scores_reference", "indexer_inputs", "indexer_inputs_reference", "keeps_fp8", "plan_dsa", "select_levels", "select_pools", "select_pools_reference",
           "sparse_attention", "sparse_attention_reference", "write_cache"]


def keeps_fp8(nope: int, v: int) -> bool:
    """Whether an FP8 kv_b_proj stays FP8 as `W_UK` / `W_UV^T`: each head's nope rows and v rows start on its
    128-row scale blocks."""
    return nope % 128 == 0 and v % 128 == 0


@dataclass(frozen=True)
class DsaWeights:
    """One DSA layer's attention constants as the kernels read them, prepared once: `W_UK` [H, nope, R]
    and `W_UV^T` [H, R, v] (contiguous; in the model dtype, or the checkpoint's FP8 with their 128 x 128
    block scales), the softmax scales, the pool sizes and the pools' position embedding."""

    w_uk: torch.Tensor
    w_uv_t: torch.Tensor
    kpool: int
    topk_pools: int
    scale: float
    """The MLA softmax scale."""
    index_scale: float
    """The indexer's dot scale (inside its ReLU)."""
    ape: torch.Tensor | None = None
    """The KPool compression's position embedding [kpool, d] fp32 (what `write_cache` pools keys with)."""
    w_uk_scale: torch.Tensor | None = None
    """FP8 `w_uk`'s block scales [H, cdiv(nope, 128), cdiv(R, 128)] fp32 (None: `w_uk` is not FP8)."""
    w_uv_t_scale: torch.Tensor | None = None
    """FP8 `w_uv_t`'s block scales [H, cdiv(R, 128), cdiv(v, 128)] fp32."""

    def __post_init__(self) -> None:
        for w, s in ((self.w_uk, self.w_uk_scale), (self.w_uv_t, self.w_uv_t_scale)):
            if (w.dtype == FP8_DTYPE) != (s is not None):
                raise ValueError("DSA weights: FP8 W_UK / W_UV^T need their block scales, other dtypes none")
            if s is not None and (s.dtype != torch.float32 or not s.is_contiguous()
                                  or s.shape != (w.shape[0], -(-w.shape[1] // 128), -(-w.shape[2] // 128))):
                raise ValueError(f"DSA weights: block scales {tuple(s.shape)} {s.dtype} for a weight "
                                 f"{tuple(w.shape)} (want [H, cdiv(K, 128), cdiv(N, 128)] fp32, contiguous)")

    @property
    def num_heads(self) -> int:
        return self.w_uk.shape[0]

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`W_UK` and `W_UV^T` in fp32 (FP8 ones times their block scales): what the references read."""
        return tuple(w.float() if s is None else dequantize_fp8(w, s, torch.float32)
                     for w, s in ((self.w_uk, self.w_uk_scale), (self.w_uv_t, self.w_uv_t_scale)))

    @classmethod
    def of(cls, attn, dtype: torch.dtype) -> "DsaWeights":
        """The constants of a `glm5next.model.dsa.SparseMLA` (this rank's heads). An FP8 kv_b_proj whose
        per-head row blocks (nope, then v rows) start on its 128-row scale blocks stays FP8: each head's
        `W_UK` is its nope rows with their scales, `W_UV^T` its v rows transposed (bytes and scale grid);
        any other kv_b_proj is widened to `dtype` once."""
        h, nope, v = attn.num_heads, attn.nope_dim, attn.v_dim
        proj = attn.kv_b_proj
        common = (attn.kpool, attn.indexer.topk_pools, float(attn.scale), float(attn.indexer.softmax_scale),
                  attn.indexer.index_kpool_compress_ape.float().contiguous())
        if proj.is_fp8 and keeps_fp8(nope, v):
            w = proj.weight.view(h, nope + v, -1)
            s = proj.weight_scale_inv.float().view(h, (nope + v) // 128, -1)
            return cls(w[:, :nope].contiguous(), w[:, nope:].transpose(1, 2).contiguous(), *common,
                       w_uk_scale=s[:, : nope // 128].contiguous(),
                       w_uv_t_scale=s[:, nope // 128:].transpose(1, 2).contiguous())
        w_uk, w_uv = attn.absorbed_weights()
        return cls(w_uk.to(dtype).contiguous(), w_uv.transpose(1, 2).to(dtype).contiguous(), *common)


@dataclass(frozen=True)
class IndexerInputWeights:
    """One indexer's per-token inputs as `indexer_inputs` reads them, prepared once: `weight` [heads + gate
    width, hidden], this rank's `weights_proj` rows widened to fp32 (as the stock path multiplies them) and
    the KPool gate rounded to the model dtype (as it rounds it), stored in the model dtype where that holds
    every row exactly (a bf16 checkpoint), else in fp32; the head-weight scale; the key norm."""

    weight: torch.Tensor
    heads: int
    scale: float
    norm_weight: torch.Tensor
    norm_bias: torch.Tensor
    eps: float

    @property
    def gate_width(self) -> int:
        return self.weight.shape[0] - self.heads

    @classmethod
    def of(cls, indexer, dtype: torch.dtype) -> "IndexerInputWeights":
        """The inputs' constants of a `glm5next.model.indexer.Indexer` in a model of dtype `dtype`."""
        heads = indexer.weights_proj.dense_weight(torch.float32)
        gate = indexer.index_kpool_compress_gate.to(dtype).float()
        both = torch.cat([heads, gate]).contiguous()
        narrow = both.to(dtype)
        weight = narrow if torch.equal(narrow.float(), both) else both
        return cls(weight, heads.shape[0], float(indexer.head_weight_scale), indexer.k_norm.weight,
                   indexer.k_norm.bias, float(indexer.k_norm.eps))


@dataclass(frozen=True)
class DsaPlan:
    """The launches' tiles and splits."""

    score_splits: int
    block_p: int
    select_chunk: int
    """Pools (then candidates) a program of the selection takes at once, one register block (a power of two)."""
    heads_per_program: int
    kv_splits: int
    block_n: int
    block_m: int
    block_k: int
    block_r: int
    block_v: int
    up_block_k: int
    """Latent columns per step of the value-up's product."""
    merge_block_r: int
    """Latent columns per program of the split merge (a [splits, merge_block_r] tile)."""
    num_warps: int = 4
    select_warps: int = 4
    """Warps of the selection's launches (a GPU block of 4096 keys wants 8)."""
    attend_warps: int = 8
    """Warps of the attention launch, whose [heads, R] context and [block_n, R] latent tile are its largest."""

    def describe(self) -> dict:
        return dict(self.__dict__)


def _fp32_products(*operands: torch.Tensor) -> bool:
    """Whether a launch multiplies in fp32 (IEEE): always off the GPU (the interpreter's 16-bit tensor-core
    products are wrong; widened first they are exact, as on the GPU), else unless its operands share one
    16-bit type."""
    dtypes = {t.dtype for t in operands}
    return operands[0].device.type != "cuda" or not (dtypes <= {torch.bfloat16} or dtypes <= {torch.float16})


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(max(1, n)))


def plan_dsa(tokens: int, heads: int, n_pools: int, topk_pools: int, kpool: int, sms: int, on_gpu: bool = True,
             **overrides) -> DsaPlan:
    """Tiles and splits for `tokens` tokens of `heads` heads over block tables of `n_pools` pools, on a
    GPU of `sms` SMs: the pool tiles of a token spread over enough programs to fill the GPU at one
    token; the selection in chunks of at most 4096 pools. The attention from the H100's plans
    (bench/results/2026-12-06-h100-dsa-attention-splits.log): up to 4 tokens, 16 heads a program (4 warps)
    and two programs an SM; above, all 64 heads a program (8 warps, one program an SM: its registers and
    shared memory hold one); splits of at least 64 selected rows. At 8K context: 42 / 56 / 92 / 207 us at
    1 / 4 / 16 / 64 tokens against 47 / 56 / 96 / 289 for the plan before. With the row-table attend (s48,
    H100, bench/results/2026-12-07-h100-dsa-plans-s48.json), 64 selected rows an iteration above 16 tokens:
    151.6 against 161.0 us at 64 tokens, 75.3 against 75.1 at 16 (32 rows kept there and below)."""
    block_p = 64
    score_splits = max(1, min(-(-2 * sms // tokens), -(-n_pools // block_p)))
    heads_per_program = _pow2(heads)
    per_sm = 2
    if on_gpu and tokens > 4:
        heads_per_program, per_sm = min(heads_per_program, 64), 1
    elif on_gpu:
        heads_per_program = min(heads_per_program, 16)
    heads_per_program = overrides.pop("heads_per_program", heads_per_program)
    groups = -(-heads // heads_per_program)
    most = max(1, -(-(topk_pools * kpool + kpool - 1) // 64))
    kv_splits = max(1, min(most, round(per_sm * sms / (tokens * groups))))
    # The selection's chunk: 4096 pools on a GPU (128K tokens of context: 8 chunks, then one program per
    # token over their 8 x K candidates), 2048 for tables of 4097-65536 pools at up to 8 tokens (H100,
    # 2026-12-07, bench/results/2026-12-07-h100-dsa-select-s44-1.json: 36.9 / 37.8 against 42.4 / 42.1 us at
    # 1 / 8 tokens over 32772 pools, 88.9 against 78.4 at 64; wider tables, two more levels, unmeasured), no
    # wider than the table; 16 in the interpreter, so the small test tables take several chunks and levels.
    narrow = 4096 < n_pools <= 65536 and tokens <= 8
    select_chunk = min((2048 if narrow else 4096) if on_gpu else 16, _pow2(n_pools))
    p = dict(score_splits=score_splits, block_p=block_p, select_chunk=select_chunk,
             select_warps=8 if on_gpu and select_chunk >= 2048 else 4,
             heads_per_program=heads_per_program, kv_splits=kv_splits,
             block_n=(64 if tokens > 16 else 32) if on_gpu else 64,
             attend_warps=8 if heads_per_program >= 64 else 4,
             block_m=min(64, _pow2(tokens)), block_k=64 if on_gpu else 32, block_r=128 if on_gpu else 64,
             block_v=32, up_block_k=64, merge_block_r=128 if on_gpu else 64)
    p.update(overrides)
    return DsaPlan(**p)


class DsaScratch:
    """Per-shape scratch of the launches (scores, the selection's candidates, selection, its counts,
    absorbed queries, split partials). A captured graph keeps using the tensors it was captured with."""

    def __init__(self) -> None:
        self._by_key: dict[tuple, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device, zero: bool = False) -> torch.Tensor:
        """The tensor `name` of this shape (allocated on first use; zeroed then if `zero`)."""
        key = (name, shape, dtype, str(device))
        if key not in self._by_key:
            self._by_key[key] = (torch.zeros if zero else torch.empty)(shape, dtype=dtype, device=device)
        return self._by_key[key]


def _check_tokens(positions, slots, token_to_seq, tokens: int) -> None:
    for name, t in (("positions", positions), ("slots", slots), ("token_to_seq", token_to_seq)):
        if t.shape != (tokens,) or not t.is_contiguous():
            raise ValueError(f"{name} must be [{tokens}] contiguous, got {tuple(t.shape)}")


def _pools_of(block_tables: torch.Tensor, pooled_key: torch.Tensor) -> tuple[int, int]:
    """Pools per cache block and pools a block table holds."""
    if block_tables.stride(1) != 1:
        raise ValueError("block tables need unit column stride")
    return pooled_key.shape[1], block_tables.shape[1] * pooled_key.shape[1]


def write_cache(c: torch.Tensor, ki: torch.Tensor, gi: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                token_to_seq: torch.Tensor, ape: torch.Tensor, latent: torch.Tensor, index_key: torch.Tensor,
                index_gate: torch.Tensor, pooled_key: torch.Tensor) -> None:
    """Store the step's latents c [T, R], indexer keys ki and gate logits gi [T, d] in their token rows
    (padding in the scratch block's first row), and the pooled key of every pool a token completes,
    `compress_pool` of its kpool rows with `ape` [kpool, d] fp32. Caches [blocks + 1, rows, width]
    (contiguous; the last block is the scratch block)."""
    t, r = c.shape
    kp, d = ape.shape
    _check_tokens(positions, slots, token_to_seq, t)
    for name, x, width in (("c", c, r), ("ki", ki, d), ("gi", gi, d)):
        if x.shape != (t, width) or x.stride(1) != 1:
            raise ValueError(f"{name} must be [{t}, {width}] with unit channel stride, got {tuple(x.shape)}")
    caches = (latent, index_key, index_gate, pooled_key)
    if not all(x.is_contiguous() for x in caches) or latent.shape[2] != r or pooled_key.shape[2] != d:
        raise ValueError("the DSA caches must be contiguous with the step's widths")
    if t:
        scratch_row = (latent.shape[0] - 1) * latent.shape[1]
        write_cache_kernel[(t,)](
            c, ki, gi, positions, slots, token_to_seq, ape, latent, index_key, index_gate, pooled_key,
            c.stride(0), ki.stride(0), gi.stride(0), scratch_row, t, r, d,
            KP=kp, RP=_pow2(r), DP=_pow2(d), num_warps=4)


def indexer_inputs(x: torch.Tensor, ki: torch.Tensor, w: IndexerInputWeights, scratch: DsaScratch,
                   out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The indexer's fp32 head weights [T, heads] (scale included), gate logits [T, gate width] in x's
    dtype and normalised keys [T, d] in ki's dtype, of the sublayer's input `x` [T, hidden] and the raw
    keys `ki` [T, d] (wk's output), in one launch (`indexer_inputs_kernel`); into `out` if given."""
    t, k = x.shape
    d = ki.shape[1]
    c = w.weight.shape[0]
    if w.weight.shape[1] != k or ki.shape[0] != t or x.stride(1) != 1 or ki.stride(1) != 1:
        raise ValueError(f"indexer inputs: x {tuple(x.shape)} and keys {tuple(ki.shape)} (unit channel "
                         f"strides) against a weight {tuple(w.weight.shape)}")
    dev = x.device
    if out is None:
        out = (torch.empty(t, w.heads, dtype=torch.float32, device=dev),
               torch.empty(t, w.gate_width, dtype=x.dtype, device=dev), torch.empty(t, d, dtype=ki.dtype, device=dev))
    wi, gi, ko = out
    if t == 0:
        return wi, gi, ko
    on_gpu = dev.type == "cuda"
    block_c = 16
    ncb = triton.cdiv(c, block_c)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if on_gpu else 4
    # Splits of one load each, enough that the channel blocks fill the GPU twice at one token (hidden 4096
    # on 132 SMs: 16 splits of 256 channels).
    block_k = max(16, triton.next_power_of_2(triton.cdiv(k, max(1, 2 * sms // ncb))))
    splits = triton.cdiv(k, block_k)
    part = scratch.get("inputs_part", (splits, t, c), torch.float32, dev)
    tickets = scratch.get("inputs_tickets", (ncb,), torch.int32, dev, zero=True)
    indexer_inputs_kernel[(ncb + 1, splits)](
        x, w.weight, ki, w.norm_weight, w.norm_bias, part, tickets, wi, gi, ko,
        t, k, x.stride(0), ki.stride(0), wi.stride(0), gi.stride(0), ko.stride(0), w.scale, w.eps,
        HI=w.heads, G=w.gate_width, D=d, S=splits, NCB=ncb, BLOCK_T=_pow2(min(t, 64)), BLOCK_C=block_c,
        BLOCK_K=block_k, DP=_pow2(d), IEEE=_fp32_products(x, w.weight), num_warps=4)
    return wi, gi, ko


def index_scores(qi: torch.Tensor, wi: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 token_to_seq: torch.Tensor, block_tables: torch.Tensor, pooled_key: torch.Tensor, kpool: int,
                 scale: float, plan: DsaPlan, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pool scores [T, n_pools] fp32 `sum_h wi[t, h] * relu(scale * qi[t, h] . K_p)` of every pool token t
    sees (`kpool * p + kpool - 1 <= positions[t]`); the other entries are left as they were.

    qi [T, Hi, d] (unit channel stride); wi [T, Hi] fp32; positions, slots (-1: padding, sees nothing),
    token_to_seq [T] int64; block_tables [seqs, blocks] int64; pooled_key [blocks + 1, block_size /
    kpool, d]. n_pools = blocks * block_size / kpool."""
    t, hi, d = qi.shape
    _check_tokens(positions, slots, token_to_seq, t)
    if qi.stride(2) != 1 or wi.shape != (t, hi) or wi.stride(1) != 1 or pooled_key.shape[2] != d:
        raise ValueError(f"indexer inputs: qi {tuple(qi.shape)} {qi.stride()}, wi {tuple(wi.shape)}, pooled keys "
                         f"{tuple(pooled_key.shape)}")
    if not pooled_key.is_contiguous():
        raise ValueError("the pooled-key cache must be contiguous")
    per_block, n_pools = _pools_of(block_tables, pooled_key)
    out = torch.empty(t, n_pools, dtype=torch.float32, device=qi.device) if out is None else out
    if out.shape != (t, n_pools) or out.stride(1) != 1 or out.dtype != torch.float32:
        raise ValueError(f"scores must be [{t}, {n_pools}] fp32 with unit column stride")
    index_scores_kernel[(t, plan.score_splits)](
        qi, wi, positions, slots, token_to_seq, block_tables, pooled_key, out,
        qi.stride(0), qi.stride(1), wi.stride(0), block_tables.stride(0), out.stride(0), n_pools, hi, d, scale,
        plan.score_splits, KP=kpool, PER_BLOCK=per_block, HP=_pow2(hi), DP=_pow2(d), BLOCK_P=plan.block_p,
        IEEE=_fp32_products(pooled_key), num_warps=plan.num_warps)
    return out


def select_levels(n_pools: int, k: int, chunk: int) -> list[tuple[int, int, int]]:
    """The selection's launches over block tables of `n_pools` pools: per level (entries a token has,
    chunks, block). Levels cut their entries into chunks of `chunk` and keep min(chunk, k) candidates of
    each, until the entries fit one program (the final level: one chunk, block the next power of two of
    its entries). Where a level would not leave fewer entries (a chunk of at most k, or little above it),
    the final level takes them all at once instead."""
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"the selection's chunk must be a power of two, got {chunk}")
    levels, n = [], n_pools
    while n > chunk and -(-n // chunk) * min(chunk, k) < n:
        chunks = -(-n // chunk)
        levels.append((n, chunks, chunk))
        n = chunks * min(chunk, k)
    return levels + [(n, 1, _pow2(n))]


def select_pools(scores: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, kpool: int, k: int,
                 plan: DsaPlan, out: torch.Tensor | None = None, count: torch.Tensor | None = None,
                 scratch: DsaScratch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-min(k, visible) pools of each token's scores [T, n_pools] (ties: the lower pool first),
    ascending, padded with -1: [T, k] int64; and how many each token kept [T] int32. The candidates of
    the levels before the final one (`select_levels`) go to `scratch` (new tensors without it)."""
    t, n_pools = scores.shape
    if scores.stride(1) != 1 or positions.shape != (t,) or slots.shape != (t,):
        raise ValueError("scores need unit column stride and one position and slot per row")
    out = torch.empty(t, k, dtype=torch.int64, device=scores.device) if out is None else out
    count = torch.empty(t, dtype=torch.int32, device=scores.device) if count is None else count
    if out.shape != (t, k) or out.stride(1) != 1 or count.shape != (t,):
        raise ValueError(f"selection must be [{t}, {k}] with unit column stride and counts [{t}]")
    levels = select_levels(n_pools, k, plan.select_chunk)
    src, src_key, s_src = scores, scores, scores.stride(0)
    for level, (n, chunks, block) in enumerate(levels):
        final = level == len(levels) - 1
        w = min(block, k)
        if final:
            dst, dst_key, s_dst = out, out, out.stride(0)
        else:
            shape = (2, t, chunks * w)
            cand = (scratch.get(f"select_{level}", shape, torch.int32, scores.device) if scratch is not None
                    else torch.empty(shape, dtype=torch.int32, device=scores.device))
            dst, dst_key, s_dst = cand[0], cand[1], chunks * w
        select_pools_kernel[(t, chunks)](
            src, src_key, positions, slots, dst, dst_key, count, s_src, s_dst, n, K=k, KP=kpool, BLOCK=block, W=w,
            WB=triton.next_power_of_2(w), KB=triton.next_power_of_2(k), FROM_SCORES=level == 0, FINAL=final,
            PDL=final and _pdl.enabled(scores.device), num_warps=plan.select_warps)
        src, src_key, s_src = dst, dst_key, s_dst
    return out, count


def sparse_attention(q: torch.Tensor, selection: torch.Tensor, count: torch.Tensor, positions: torch.Tensor,
                     slots: torch.Tensor, token_to_seq: torch.Tensor, block_tables: torch.Tensor,
                     latent: torch.Tensor, w: DsaWeights, plan: DsaPlan, out: torch.Tensor | None = None,
                     scratch: DsaScratch | None = None) -> torch.Tensor:
    """The attention's values [T, H, v] fp32 (the o_proj's input once cast): per token and head, the
    absorbed query `q @ W_UK[h]` against the latents of the token's selected rows (the first `count[t]`
    pools of `selection[t]` that are whole, visible and in its block table, four rows each, then its
    incomplete-pool tail), softmax with `w.scale`, context `@ W_UV[h]^T`. Padding tokens get zeros.

    q [T, H, nope] (unit channel stride); selection [T, K] int64; count [T] int32; latent [blocks + 1,
    block_size, R] (contiguous)."""
    t, h, n = q.shape
    _check_tokens(positions, slots, token_to_seq, t)
    r, v = w.w_uk.shape[2], w.w_uv_t.shape[2]
    if q.stride(2) != 1 or w.w_uk.shape[:2] != (h, n) or w.w_uv_t.shape[:2] != (h, r) or latent.shape[2] != r:
        raise ValueError(f"attention inputs: q {tuple(q.shape)} {q.stride()}, W_UK {tuple(w.w_uk.shape)}, "
                         f"W_UV^T {tuple(w.w_uv_t.shape)}, latents {tuple(latent.shape)}")
    if not latent.is_contiguous() or selection.stride(1) != 1 or count.shape != (t,):
        raise ValueError("the latent cache must be contiguous, the selection unit-strided, one count per token")
    bs = latent.shape[1]
    n_pools = block_tables.shape[1] * bs // w.kpool
    scratch = scratch or DsaScratch()
    dev = q.device
    splits = plan.kv_splits
    ieee = _fp32_products(latent)
    qlat = scratch.get("qlat", (t, h, r), latent.dtype, dev)
    scaled = w.w_uk_scale is not None, w.w_uv_t_scale is not None
    tiles = (plan.block_k, plan.block_r) * scaled[0] + (plan.up_block_k, plan.block_v) * scaled[1]
    if any(128 % b for b in tiles):
        raise ValueError(f"FP8 W_UK / W_UV^T need tiles that divide their 128 x 128 scale blocks, got {plan}")
    # The absorb reads nothing the selection writes: a programmatic dependent of it, it runs beside the
    # selection's last level (a program a token) on the SMs that level leaves idle.
    early = {"EARLY": True, "launch_pdl": True} if _pdl.enabled(dev) else {}
    head_product_kernel[(h, triton.cdiv(r, plan.block_r))](  # absorb: q @ W_UK
        q, q.stride(0), q.stride(1), slots, w.w_uk, w.w_uk_scale, qlat, t, h, n, r,
        BLOCK_M=plan.block_m, BLOCK_K=plan.block_k, BLOCK_N=plan.block_r, SCALED=scaled[0], IEEE=ieee,
        num_warps=plan.num_warps, **early)
    ctx = scratch.get("ctx", (t, h, r), latent.dtype, dev)
    if splits > 1:
        acc = scratch.get("acc", (t, h, splits, r), torch.float32, dev)
        ml = scratch.get("ml", (t, h, splits, 2), torch.float32, dev)
    else:
        acc, ml = ctx, ctx
    hp = plan.heads_per_program
    groups = triton.cdiv(h, hp)
    ks = selection.shape[1]
    chunk = _pow2(triton.cdiv(triton.cdiv(ks * w.kpool + w.kpool - 1, splits), plan.block_n) * plan.block_n)
    rows = scratch.get("rows", (t, groups, splits, chunk), torch.int32, dev)
    attend_kernel[(t, groups, splits)](
        qlat, selection, count, positions, slots, token_to_seq, block_tables, latent, rows, acc, ml,
        selection.stride(0), block_tables.stride(0), n_pools, h, r, w.scale, splits,
        KS=ks, KP=w.kpool, BS=bs, HEADS=hp, RP=_pow2(r), BLOCK_N=plan.block_n, CHUNK=chunk, SPLIT=splits > 1,
        IEEE=ieee, num_warps=plan.attend_warps)
    if splits > 1:
        merge_splits_kernel[(t, h, triton.cdiv(r, plan.merge_block_r))](
            acc, ml, slots, ctx, h, r, splits, SP=triton.next_power_of_2(splits), BLOCK_R=plan.merge_block_r,
            num_warps=plan.num_warps)
    out = torch.empty(t, h, v, dtype=torch.float32, device=dev) if out is None else out
    if out.shape != (t, h, v) or not out.is_contiguous():
        raise ValueError(f"values must be [{t}, {h}, {v}] contiguous")
    head_product_kernel[(h, triton.cdiv(v, plan.block_v))](  # value-up: context @ W_UV^T
        ctx, h * r, r, slots, w.w_uv_t, w.w_uv_t_scale, out, t, h, r, v, BLOCK_M=min(64, plan.block_m),
        BLOCK_K=plan.up_block_k, BLOCK_N=plan.block_v, SCALED=scaled[1], IEEE=ieee, num_warps=plan.num_warps)
    return out


def dsa_decode(q: torch.Tensor, qi: torch.Tensor, wi: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               token_to_seq: torch.Tensor, block_tables: torch.Tensor, latent: torch.Tensor,
               pooled_key: torch.Tensor, w: DsaWeights, plan: DsaPlan, selection: torch.Tensor | None = None,
               scratch: DsaScratch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The values [T, H, v] fp32 and the selection [T, K] int64 of one step over caches already holding its
    tokens: scores, top-k, attention (one process; see `glm5next.specialized_decode.dsa` for the stage).
    With `selection` given, no scores: its pools are attended (each entry checked) and returned."""
    scratch = scratch or DsaScratch()
    t = q.shape[0]
    if selection is None:
        per_block = pooled_key.shape[1]
        scores = scratch.get("scores", (t, block_tables.shape[1] * per_block), torch.float32, q.device)
        index_scores(qi, wi, positions, slots, token_to_seq, block_tables, pooled_key, w.kpool, w.index_scale, plan,
                     scores)
        selection, count = select_pools(scores, positions, slots, w.kpool, w.topk_pools, plan,
                                        scratch.get("sel", (t, w.topk_pools), torch.int64, q.device),
                                        scratch.get("count", (t,), torch.int32, q.device), scratch)
    else:
        count = scratch.get("count_given", (t,), torch.int32, q.device).fill_(selection.shape[1])
    return sparse_attention(q, selection, count, positions, slots, token_to_seq, block_tables, latent, w, plan,
                            scratch=scratch), selection
