"""The indexer's two launches of a DSA decode step: pool scores, then the top-k pool selection.

`index_scores_kernel` — grid (tokens, splits). A token sees the pools whose last position is at or before
its own (`kpool * p + kpool - 1 <= position`); its visible pools are cut into tiles of BLOCK_P, and the
splits take the tiles in turn (tile b goes to split b mod splits), so every split has work at any context.
Per tile: the pooled keys are gathered through the token's block table, the per-head dots come from one
product [heads, d] x [d, BLOCK_P], and the score of pool p is `sum_h w_h * relu(scale * q_h . K_p)`, the
stock formula with the same rounding points. Scores of invisible pools are not written.

`select_pools_kernel` — grid (tokens,). The top min(K, visible) pools of a token's scores, without a sort:
each score becomes an order-preserving 32-bit key (as the stock `top_pools` makes it, -0.0 read as +0.0),
four 8-bit radix passes narrow the K-th largest key down from its top byte (a histogram per pass of the
keys that share the digits found so far), then one pass keeps every key above it and, of the keys equal
to it, the lowest pool indices first: the stock tie rule. The pools are written in ascending order, then
-1 up to K; the count of kept pools goes beside them. Tokens that see at most K pools keep all of them.
Padding tokens (slot -1) see no pools.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _visible_pools(pos_ptr, slot_ptr, t, n_pools, KP: tl.constexpr):
    """The pools token t sees (0 for padding), at most the `n_pools` its block table holds."""
    pos = tl.load(pos_ptr + t)
    slot = tl.load(slot_ptr + t)
    n = tl.minimum((pos + 1) // KP, n_pools)
    return tl.where(slot < 0, 0, n).to(tl.int32)


@triton.jit
def index_scores_kernel(
    qi_ptr, wi_ptr, pos_ptr, slot_ptr, seq_ptr, tab_ptr, pk_ptr, score_ptr,
    s_qt, s_qh, s_wt, s_tab, s_score, n_pools, HI, D, scale, splits,
    KP: tl.constexpr, PER_BLOCK: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr, BLOCK_P: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Indexer queries qi [T, HI, D] (row stride s_qt, head stride s_qh, unit channel stride), fp32 head
    weights wi [T, HI] (row stride s_wt, scale included); positions, slots, sequence of each token [T];
    block tables [seqs, blocks] (row stride s_tab); pooled keys [blocks + 1, PER_BLOCK, D]; scores
    [T, n_pools] fp32 (row stride s_score)."""
    t = tl.program_id(0)
    split = tl.program_id(1)
    nvis = _visible_pools(pos_ptr, slot_ptr, t, n_pools, KP)
    h = tl.arange(0, HP)
    dd = tl.arange(0, DP)
    dok = dd < D
    q = tl.load(qi_ptr + t * s_qt + h[:, None] * s_qh + dd[None, :], mask=(h < HI)[:, None] & dok[None, :], other=0.0)
    w = tl.load(wi_ptr + t * s_wt + h, mask=h < HI, other=0.0).to(tl.float32)
    seq = tl.load(seq_ptr + t)
    tiles = tl.cdiv(nvis, BLOCK_P)
    for b in range(split, tiles, splits):
        p = b * BLOCK_P + tl.arange(0, BLOCK_P)
        ok = p < nvis
        blk = tl.load(tab_ptr + seq * s_tab + p // PER_BLOCK, mask=ok, other=0)
        row = blk * PER_BLOCK + p % PER_BLOCK
        k = tl.load(pk_ptr + row[:, None] * D + dd[None, :], mask=ok[:, None] & dok[None, :], other=0.0)
        if IEEE:
            dots = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            dots = tl.dot(q.to(k.dtype), tl.trans(k))
        dots = tl.maximum(dots * scale, 0.0)
        tl.store(score_ptr + t * s_score + p, tl.sum(w[:, None] * dots, 0), mask=ok)


@triton.jit
def _keys(score_ptr, i, ok):
    """Order-preserving keys in [0, 2^32) (int64) of the scores at `i`: larger score, larger key."""
    s = tl.load(score_ptr + i, mask=ok, other=0.0) + 0.0  # -0.0 reads as +0.0
    bits = s.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return ordered.to(tl.int64) + 2147483648


@triton.jit
def select_pools_kernel(
    score_ptr, pos_ptr, slot_ptr, sel_ptr, count_ptr, s_score, s_sel, n_pools,
    K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr,
):
    """Scores [T, n_pools] fp32 (row stride s_score); selection [T, K] int64 (row stride s_sel): the kept
    pools ascending, then -1; count [T] int32: how many were kept."""
    t = tl.program_id(0)
    nvis = _visible_pools(pos_ptr, slot_ptr, t, n_pools, KP)
    row = score_ptr + t * s_score
    k = tl.minimum(nvis, K)
    digits = tl.arange(0, 256)
    # The K-th largest key `tau`, and how many keys equal to it are kept (`need`). With at most K
    # visible pools every key is kept: tau below every key.
    tau = tl.full([], -1, tl.int64)
    need = tl.full([], 0, tl.int32)
    if nvis > K:
        prefix = tl.full([], 0, tl.int64)
        need = k
        for rnd in tl.static_range(4):
            shift = 24 - 8 * rnd
            hist = tl.zeros([256], dtype=tl.int32)
            for c in range(0, nvis, BLOCK):
                i = c + tl.arange(0, BLOCK)
                ok = i < nvis
                key = _keys(row, i, ok)
                same = ok & ((key >> (shift + 8)) == prefix)
                hist += tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=same)
            at_least = tl.sum(hist, 0) - (tl.cumsum(hist, 0) - hist)  # keys with digit >= d
            pick = tl.max(tl.where(at_least >= need, digits, -1), 0)
            above = tl.sum(tl.where(digits > pick, hist, 0), 0)
            need = need - above
            prefix = prefix * 256 + pick
        tau = prefix
    base = tl.full([], 0, tl.int32)
    equal_seen = tl.full([], 0, tl.int32)
    for c in range(0, nvis, BLOCK):
        i = c + tl.arange(0, BLOCK)
        ok = i < nvis
        key = _keys(row, i, ok)
        eq = (ok & (key == tau)).to(tl.int32)
        rank = equal_seen + tl.cumsum(eq, 0) - eq  # lower pools first among equal keys
        take = (ok & (key > tau)) | ((eq != 0) & (rank < need))
        at = base + tl.cumsum(take.to(tl.int32), 0) - 1
        tl.store(sel_ptr + t * s_sel + at, i.to(tl.int64), mask=take)
        base += tl.sum(take.to(tl.int32), 0)
        equal_seen += tl.sum(eq, 0)
    for c in range(0, K, BLOCK):
        j = c + tl.arange(0, BLOCK)
        tl.store(sel_ptr + t * s_sel + j, tl.full([BLOCK], -1, tl.int64), mask=(j >= base) & (j < K))
    tl.store(count_ptr + t, base)
