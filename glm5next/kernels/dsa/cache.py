"""The cache writes of a DSA decode step in one launch.

`write_cache_kernel` — grid (tokens,). Each token stores its latent `c`, indexer key and KPool gate logits
in its cache row (padding tokens, slot -1, in the scratch block's first row, as the stock module does),
and a token that completes a pool (`position % kpool == kpool - 1`) stores the pool's key: a per-channel
softmax over the pool's kpool gate rows plus the learned offsets `ape`, the probabilities rounded to the
key dtype, each product rounded to it, summed in fp32 (the stock `compress_pool`). The pool's earlier
rows come from the step's own inputs where an earlier token of the same sequence in this step holds them
(verify rows write them in this same launch), else from the cache.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def write_cache_kernel(
    c_ptr, ki_ptr, gi_ptr, pos_ptr, slot_ptr, seq_ptr, ape_ptr, lat_ptr, key_ptr, gate_ptr, pool_ptr,
    s_c, s_ki, s_gi, scratch_row, T, R, D,
    KP: tl.constexpr, RP: tl.constexpr, DP: tl.constexpr,
):
    """c [T, R], ki / gi [T, D] (row strides s_c, s_ki, s_gi; unit channel stride); positions, slots,
    sequences [T]; ape [KP, D] fp32; caches: latent [rows, R], index key and gate [rows, D], pooled keys
    [rows / KP, D] (flat views, cache dtype)."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    row = tl.where(slot < 0, scratch_row, slot)
    r = tl.arange(0, RP)
    d = tl.arange(0, DP)
    dok = d < D
    dtype = lat_ptr.dtype.element_ty
    tl.store(lat_ptr + row * R + r, tl.load(c_ptr + t * s_c + r, mask=r < R).to(dtype), mask=r < R)
    ki = tl.load(ki_ptr + t * s_ki + d, mask=dok).to(dtype)
    gi = tl.load(gi_ptr + t * s_gi + d, mask=dok).to(dtype)
    tl.store(key_ptr + row * D + d, ki, mask=dok)
    tl.store(gate_ptr + row * D + d, gi, mask=dok)
    pos = tl.load(pos_ptr + t)
    if (slot >= 0) & (pos % KP == KP - 1):
        seq = tl.load(seq_ptr + t)
        j = tl.arange(0, KP)  # the pool's rows, oldest first: positions pos - (KP - 1 - j)
        back = KP - 1 - j
        src = t - back
        mine = (src >= 0) & (src < T)
        srcc = tl.where(mine, src, 0)
        mine = mine & (tl.load(pos_ptr + srcc) == pos - back) & (tl.load(seq_ptr + srcc) == seq)
        both = dok[None, :]
        in_step_k = tl.load(ki_ptr + srcc[:, None] * s_ki + d[None, :], mask=mine[:, None] & both, other=0.0)
        in_step_g = tl.load(gi_ptr + srcc[:, None] * s_gi + d[None, :], mask=mine[:, None] & both, other=0.0)
        crow = slot - back  # blocks hold whole pools: the pool's rows are consecutive cache rows
        cached_k = tl.load(key_ptr + crow[:, None] * D + d[None, :], mask=~mine[:, None] & both, other=0.0)
        cached_g = tl.load(gate_ptr + crow[:, None] * D + d[None, :], mask=~mine[:, None] & both, other=0.0)
        keys = tl.where(mine[:, None], in_step_k.to(dtype), cached_k).to(tl.float32)
        gates = tl.where(mine[:, None], in_step_g.to(dtype), cached_g).to(tl.float32)
        logits = gates + tl.load(ape_ptr + j[:, None] * D + d[None, :], mask=both, other=0.0)
        e = tl.exp(logits - tl.max(logits, 0)[None, :])
        probs = (e / tl.sum(e, 0)[None, :]).to(dtype).to(tl.float32)
        terms = (probs * keys).to(dtype).to(tl.float32)
        pooled = tl.zeros([DP], dtype=tl.float32)
        for i in tl.static_range(KP):  # the rows in order, as the stock sum adds them
            pooled += tl.sum(tl.where((j == i)[:, None], terms, 0.0), 0)
        tl.store(pool_ptr + (slot // KP) * D + d, pooled.to(dtype), mask=dok)
