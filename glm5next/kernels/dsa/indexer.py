"""The indexer's launches of a DSA decode step: pool scores, then the top-k pool selection (a launch per
level: one at 8K tokens of context, two at 128K, three at 1M).

`index_scores_kernel` — grid (tokens, splits). A token sees the pools whose last position is at or before
its own (`kpool * p + kpool - 1 <= position`); its visible pools are cut into tiles of BLOCK_P, and the
splits take the tiles in turn (tile b goes to split b mod splits), so every split has work at any context.
Per tile: the pooled keys are gathered through the token's block table, the per-head dots come from one
product [heads, d] x [d, BLOCK_P], and the score of pool p is `sum_h w_h * relu(scale * q_h . K_p)`, the
stock formula with the same rounding points. Scores of invisible pools are not written.

`select_pools_kernel` — the top min(K, visible) pools of a token's scores, without a sort, in one to a
few launches whose count the host fixes from the block table's width (`select_levels`), so a captured
graph replays them all. Each program loads its entries once into registers, turns the scores into
order-preserving unsigned 32-bit keys (as the stock `top_pools` orders them, -0.0 read as +0.0), finds the K-th
largest key bit by bit over the register block (32 counts; four 8-bit histogram passes took 15 % longer at 8K
tokens of context, 21 % at 128K and 64 tokens), then keeps every key above it and, of the keys equal to it, the
lowest positions first (`_top`, shared by every level).
  - Chunk level, grid (tokens, chunks): chunk c takes the visible pools [c * C, (c + 1) * C) and writes
    its local top min(K, its pools) — pool index and key, ascending, -1 after them up to W = min(C, K) —
    into a candidates buffer [T, chunks * W]. Chunks are contiguous and each writes ascending, so the
    candidates run in ascending pool order: "lower position first" is still the stock "lower pool first",
    and the top K of a token (under that order) lies in the union of its chunks' top K.
  - A candidates level takes the buffer as its entries, in chunks of C again while they exceed one
    (a 1M-token table: 64 chunks, then 8, then the final one; 128K: 8, then the final one).
  - Final level, grid (tokens,): the entries of one register block (the scores themselves when the
    visible pools fit one chunk, e.g. 8K tokens of context: one launch in all), the kept pools written in
    ascending order, then -1 up to K, and the count of kept pools beside them.
Tokens that see at most K pools keep all of them. Padding tokens (slot -1) see no pools.

`indexer_inputs_kernel` — before the cache writes: the token's fp32 head weights (`weights_proj`, times
the head-weight scale) and KPool gate logits, both products of the sublayer's input against one weight
[heads + gate width, hidden] prepared at load (the head rows widened to fp32 as the stock path widens
them, the gate rows rounded to the model dtype as it rounds them: every product is exact in fp32), and the
indexer key's LayerNorm. Grid (channel blocks + 1, splits): program (c, s) stores its split's partial
products of channel block c, then takes a ticket of the block's counter; the program drawing the last
ticket resets the counter (a captured graph replays the launch) and sums the partials in split order
(deterministic). The extra column's first program normalises the keys.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..pdl import launch_dependents


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
def _top(key, ok, K: tl.constexpr):
    """Of the keys under `ok` (uint32, a register block in ascending pool order), the top min(K, count)
    with the lower position first among equal keys: the mask of the kept lanes, each kept lane's rank
    among them (its slot in the ascending output) and how many are kept.

    The K-th largest key `tau` is built from its top bit down: a bit stays set where at least K keys are
    at or above the prefix with it (a compare and a sum of the block each). Where exactly K keys are at or
    above the prefix, those are the top K and the search stops (tie-free scores: about half of the 32
    bits); else, after the last bit, `need` is how many keys equal to `tau` are kept. With at most K keys
    every key is kept."""
    n = tl.sum(ok.to(tl.int32), 0)
    k = tl.minimum(n, K)
    take = ok
    if n > K:
        kv = tl.where(ok, key, 0)  # a lane outside counts as key 0, below every candidate (each has a bit set)
        one = tl.full([], 1, tl.uint32)
        tau = tl.full([], 0, tl.uint32)
        b = 0
        exact = 0
        while (b < 32) & (exact == 0):
            cand = tau | (one << (31 - b).to(tl.uint32))
            cnt = tl.sum((kv >= cand).to(tl.int32), 0)
            if cnt >= k:
                tau = cand
            exact = (cnt == k).to(tl.int32)
            b += 1
        if exact != 0:
            take = ok & (key >= tau)
        else:
            above = ok & (key > tau)
            need = k - tl.sum(above.to(tl.int32), 0)
            eq = (ok & (key == tau)).to(tl.int32)
            rank = tl.cumsum(eq, 0) - eq  # lower positions first among equal keys
            take = above | ((eq != 0) & (rank < need))
    at = tl.cumsum(take.to(tl.int32), 0) - 1
    return take, at, k


@triton.jit
def select_pools_kernel(
    src_ptr, src_key_ptr, pos_ptr, slot_ptr, dst_ptr, dst_key_ptr, count_ptr, s_src, s_dst, n_src,
    K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr, W: tl.constexpr, WB: tl.constexpr, KB: tl.constexpr,
    FROM_SCORES: tl.constexpr, FINAL: tl.constexpr, PDL: tl.constexpr = False,
):
    """One level of the selection; program (t, c) takes entries [c * BLOCK, (c + 1) * BLOCK) of token t.
    PDL: the launch after it (the absorb, which reads nothing this writes) may start at once, on the SMs
    this level leaves idle.

    FROM_SCORES: the entries are the scores [T, n_src] fp32 at `src_ptr` (row stride s_src, n_src the
    block table's pools), those of the token's visible pools only; else the candidates of the level
    before, pools int32 at `src_ptr` (-1: none) and their ordered 32-bit keys int32 at `src_key_ptr`,
    [T, n_src] each (row stride s_src). FINAL (one program per token): the selection [T, K] int64 at
    `dst_ptr` (row stride s_dst), the kept pools ascending then -1, and count [T] int32; else the chunk's
    top min(K, its entries) into [T, chunks * W] int32 at `dst_ptr` (pools, -1 after them) and
    `dst_key_ptr` (keys), W = min(BLOCK, K) slots a chunk (row stride s_dst)."""
    if PDL:
        launch_dependents()
    t = tl.program_id(0)
    c = tl.program_id(1)
    i = c * BLOCK + tl.arange(0, BLOCK)
    if FROM_SCORES:
        ok = i < _visible_pools(pos_ptr, slot_ptr, t, n_src, KP)
        s = tl.load(src_ptr + t * s_src + i, mask=ok, other=0.0) + 0.0  # -0.0 reads as +0.0
        bits = s.to(tl.int32, bitcast=True)
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # signed order of the scores
        pool = i
    else:
        pool = tl.load(src_ptr + t * s_src + i, mask=i < n_src, other=-1)
        ok = pool >= 0
        ordered = tl.load(src_key_ptr + t * s_src + i, mask=ok, other=0)
    key = (ordered ^ -2147483648).to(tl.uint32, bitcast=True)  # larger score, larger key (unsigned)
    take, at, kept = _top(key, ok, K)
    if FINAL:
        row = dst_ptr + t * s_dst
        tl.store(row + at, pool.to(tl.int64), mask=take)
        j = tl.arange(0, KB)
        tl.store(row + j, tl.full([KB], -1, tl.int64), mask=(j >= kept) & (j < K))
        tl.store(count_ptr + t, kept)
    else:
        at = at + (t * s_dst + c * W)
        tl.store(dst_ptr + at, pool.to(tl.int32), mask=take)
        tl.store(dst_key_ptr + at, ordered, mask=take)
        j = tl.arange(0, WB)
        tl.store(dst_ptr + t * s_dst + c * W + j, tl.full([WB], -1, tl.int32), mask=(j >= kept) & (j < W))


@triton.jit
def indexer_inputs_kernel(
    x_ptr, w_ptr, ki_ptr, lnw_ptr, lnb_ptr, part_ptr, ticket_ptr, wi_ptr, gi_ptr, ko_ptr,
    T, K, s_x, s_ki, s_wi, s_gi, s_ko, scale, eps,
    HI: tl.constexpr, G: tl.constexpr, D: tl.constexpr, S: tl.constexpr, NCB: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, DP: tl.constexpr,
    IEEE: tl.constexpr,
):
    """x [T, K] (row stride s_x), the weight [HI + G, K] (contiguous), raw keys ki [T, D] (row stride
    s_ki), the key norm's weight and bias [D]; partials [S, T, HI + G] fp32 and tickets [NCB] int32 (zero
    between launches); outputs: head weights wi [T, HI] fp32, gate logits gi [T, G] and keys ko [T, D]
    (row strides s_wi, s_gi, s_ko; unit channel strides). A split is BLOCK_K channels of K, one load.
    IEEE: fp32 products on the FMA units; else x and the weight share a 16-bit type, whose products the
    tensor cores form exactly in fp32."""
    c = tl.program_id(0)
    s = tl.program_id(1)
    C: tl.constexpr = HI + G
    if c == NCB:
        if s == 0:  # the key norm: statistics and affine map in fp32
            d = tl.arange(0, DP)
            dok = d < D
            lw = tl.load(lnw_ptr + d, mask=dok, other=0.0).to(tl.float32)
            lb = tl.load(lnb_ptr + d, mask=dok, other=0.0).to(tl.float32)
            for t0 in range(0, T, BLOCK_T):
                t = t0 + tl.arange(0, BLOCK_T)
                m = (t < T)[:, None] & dok[None, :]
                v = tl.load(ki_ptr + t[:, None] * s_ki + d[None, :], mask=m, other=0.0).to(tl.float32)
                mean = tl.sum(v, 1) / D
                xc = tl.where(m, v - mean[:, None], 0.0)
                var = tl.sum(xc * xc, 1) / D
                y = xc * (1.0 / tl.sqrt_rn(var + eps))[:, None] * lw[None, :] + lb[None, :]
                tl.store(ko_ptr + t[:, None] * s_ko + d[None, :], y.to(ko_ptr.dtype.element_ty), mask=m)
    else:
        ch = c * BLOCK_C + tl.arange(0, BLOCK_C)
        cok = ch < C
        k = s * BLOCK_K + tl.arange(0, BLOCK_K)
        kok = k < K
        wv = tl.load(w_ptr + ch[:, None] * K + k[None, :], mask=cok[:, None] & kok[None, :], other=0.0)
        for t0 in range(0, T, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            tok = t < T
            xv = tl.load(x_ptr + t[:, None] * s_x + k[None, :], mask=tok[:, None] & kok[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(xv.to(tl.float32), tl.trans(wv.to(tl.float32)), input_precision="ieee")
            else:
                acc = tl.dot(xv, tl.trans(wv))
            tl.store(part_ptr + (s * T + t[:, None]) * C + ch[None, :], acc, mask=tok[:, None] & cok[None, :])
        tl.debug_barrier()  # every thread's stores precede the ticket's release
        ticket = tl.atomic_add(ticket_ptr + c, 1, sem="acq_rel")
        if ticket == S - 1:
            tl.store(ticket_ptr + c, 0)
            for t0 in range(0, T, BLOCK_T):
                t = t0 + tl.arange(0, BLOCK_T)
                m = (t < T)[:, None] & cok[None, :]
                tot = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
                for j in tl.static_range(S):  # split order; unrolled, so every load is in flight at once
                    tot += tl.load(part_ptr + (j * T + t[:, None]) * C + ch[None, :], mask=m, other=0.0,
                                   cache_modifier=".cg")
                head = ch < HI
                tl.store(wi_ptr + t[:, None] * s_wi + ch[None, :], tot * scale, mask=m & head[None, :])
                gch = tl.where(head, 0, ch - HI)
                tl.store(gi_ptr + t[:, None] * s_gi + gch[None, :], tot.to(gi_ptr.dtype.element_ty),
                         mask=m & ~head[None, :])
