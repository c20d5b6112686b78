"""The sparse latent attention of a DSA decode step: absorb, attend, (merge the splits,) value-up.

`head_product_kernel` — grid (heads, output blocks): `out[t, h] = x[t, h] @ W[h]` for every token of the
step at once (each head's W block read once per BLOCK_M tokens; fp32 accumulation, padding tokens zeros).
W is 16/32-bit, or the checkpoint's FP8 with its 128 x 128 block scales (SCALED): each K step's FP8 tile
widens exactly to x's dtype, and its product times the tile's block scale joins the fp32 sum.
It makes the absorbed queries `q_lat[t, h] = q[t, h] @ W_UK[h]` [T, H, R] in the latent cache's dtype, and
the value-up `context @ W_UV[h]^T` [T, H, V] fp32 (from `W_UV^T` [H, R, V]).

`attend_kernel` — grid (tokens, head groups, splits). A token's selected rows form one list: four rows per
selected pool (in the selection's order), then its incomplete-pool tail `[kpool * floor((pos+1)/kpool),
pos]`; the pools counted by `count` come first, the tail right after them, so the list is as long as the
token needs and the splits share it evenly. Entries that are negative, invisible or past the block table
are skipped: they score the lowest finite fp32 and read the sequence's first row, so a token left with
no row at all (a reused selection whose pools it cannot see yet, and no tail) attends that row, as the
stock module's masked softmax does. Each split reads its latent rows once through the block table for
HEADS heads together (scores [HEADS, R] x [R, BLOCK_N] and context [HEADS, BLOCK_N] x [BLOCK_N, R] as
tensor-core products of the cache's dtype with fp32 accumulation) and keeps an online softmax. With one
split it writes the normalised context [T, H, R] (cache dtype) itself; with several, its unnormalised
context with its running max and sum, and `merge_splits_kernel` — grid (tokens, heads, latent blocks) — merges
them in split order (weights `exp(m_s - max) / sum`: deterministic).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..pdl import wait_previous


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b with fp32 accumulation: exact fp32 products in IEEE mode (the interpreter's fp32 tests),
    else tensor-core products of the operands' (16-bit) dtype."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def head_product_kernel(
    x_ptr, s_xt, s_xh, slot_ptr, w_ptr, scale_ptr, out_ptr, T, H, K, N,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, SCALED: tl.constexpr, IEEE: tl.constexpr,
    EARLY: tl.constexpr = False,
):
    """x [T, H, K] (row stride s_xt, head stride s_xh, unit channel stride); slots [T] (negative: padding);
    W [H, K, N] contiguous; SCALED: W FP8 and its block scales [H, cdiv(K, 128), cdiv(N, 128)] fp32
    (BLOCK_K and BLOCK_N divide 128); out [T, H, N] contiguous (its dtype: the products' rounding).
    EARLY (a programmatic-dependent launch whose inputs the kernel before it does not write): it runs beside
    that kernel and waits for it only at its end, so that whatever follows sees both done."""
    h = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)
    nok = n < N
    for m0 in range(0, T, BLOCK_M):
        t = m0 + tl.arange(0, BLOCK_M)
        tok = t < T
        live = tok & (tl.load(slot_ptr + t, mask=tok, other=-1) >= 0)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kok = k < K
            x = tl.load(x_ptr + t[:, None] * s_xt + h * s_xh + k[None, :], mask=live[:, None] & kok[None, :],
                        other=0.0)
            w = tl.load(w_ptr + (h * K + k[:, None]) * N + n[None, :], mask=kok[:, None] & nok[None, :], other=0.0)
            if SCALED:
                sc = tl.load(scale_ptr + (h * tl.cdiv(K, 128) + k0 // 128) * tl.cdiv(N, 128) + n0 // 128)
                acc += _dot(x, w.to(x.dtype), IEEE) * sc
            else:
                acc += _dot(x.to(w.dtype), w, IEEE)
        acc = tl.where(live[:, None], acc, 0.0)
        tl.store(out_ptr + (t[:, None] * H + h) * N + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=tok[:, None] & nok[None, :])
    if EARLY:
        wait_previous()


@triton.jit
def _latent_rows(sel_ptr, tab_ptr, t, seq, pos, pooled, j, live, s_sel, s_tab, n_pools, KP: tl.constexpr,
                 BS: tl.constexpr):
    """Entries j of token t's list (under `live`): the cache row each reads, as -1 - row where the entry is
    skipped (a negative, invisible or not yet whole pool, a tail position past the token: those read the
    sequence's first row, at the lowest score)."""
    in_tail = j >= pooled
    pool = tl.load(sel_ptr + t * s_sel + j // KP, mask=live & ~in_tail, other=-1)
    tok = tl.where(in_tail, (pos + 1) // KP * KP + (j - pooled), pool * KP + j % KP)
    whole_pool = (pool >= 0) & (pool < n_pools) & (pool * KP + KP - 1 <= pos)
    ok = tl.where(in_tail, tok <= pos, whole_pool)
    tok = tl.where(ok, tok, 0)
    blk = tl.load(tab_ptr + seq * s_tab + tok // BS, mask=live, other=0)
    row = (blk * BS + tok % BS).to(tl.int32)
    return tl.where(ok, row, -1 - row)


@triton.jit
def attend_kernel(
    qlat_ptr, sel_ptr, count_ptr, pos_ptr, slot_ptr, seq_ptr, tab_ptr, lat_ptr, rows_ptr, acc_ptr, ml_ptr,
    s_sel, s_tab, n_pools, H, R, scale, splits,
    KS: tl.constexpr, KP: tl.constexpr, BS: tl.constexpr, HEADS: tl.constexpr, RP: tl.constexpr,
    BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
):
    """q_lat [T, H, R]; selection [T, KS] int64 (row stride s_sel) with `count` [T] int32 leading
    entries to read; latent cache [blocks + 1, BS, R]; block tables [seqs, blocks] (row stride s_tab);
    rows [T, H / HEADS, splits, CHUNK] int32, scratch (CHUNK >= a split's share of the longest list).
    SPLIT: acc [T, H, splits, R] fp32 and ml [T, H, splits, 2] fp32 (running max, running sum); else
    acc is the context [T, H, R] (q_lat's dtype) and ml unused."""
    t = tl.program_id(0)
    hg = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        pos = tl.load(pos_ptr + t)
        seq = tl.load(seq_ptr + t)
        n_sel = tl.load(count_ptr + t)
        pooled = n_sel * KP
        length = pooled + KP - 1
        chunk = tl.cdiv(tl.cdiv(length, splits), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, length)
        # The split's latent rows, all at once (one gather of pools, one of block-table entries), into its
        # row table: a kept entry's cache row, a skipped one's as -1 - row; the loop below then waits on
        # no load to form an address.
        rows = rows_ptr + ((t * tl.num_programs(1) + hg) * splits + split) * CHUNK
        jj = lo + tl.arange(0, CHUNK)
        mine = jj < hi
        rows_tab = _latent_rows(sel_ptr, tab_ptr, t, seq, pos, pooled, jj, mine, s_sel, s_tab, n_pools, KP, BS)
        tl.store(rows + tl.arange(0, CHUNK), rows_tab, mask=mine)
        tl.debug_barrier()  # the table's stores precede every thread's reads of it
        hh = hg * HEADS + tl.arange(0, HEADS)
        hok = hh < H
        r = tl.arange(0, RP)
        rok = r < R
        q = tl.load(qlat_ptr + (t * H + hh[:, None]) * R + r[None, :], mask=hok[:, None] & rok[None, :], other=0.0)
        m_i = tl.full([HEADS], float("-inf"), tl.float32)
        l_i = tl.zeros([HEADS], dtype=tl.float32)
        acc = tl.zeros([HEADS, RP], dtype=tl.float32)
        for j0 in range(lo, hi, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            inside = j < hi
            row = tl.load(rows + (j - lo), mask=inside, other=-1)
            ok = row >= 0
            row = tl.where(ok, row, -1 - row)
            c = tl.load(lat_ptr + row.to(tl.int64)[:, None] * R + r[None, :], mask=inside[:, None] & rok[None, :],
                        other=0.0)
            s = _dot(q, tl.trans(c), IEEE) * scale
            s = tl.where(ok[None, :], s, -3.4028234663852886e38)
            s = tl.where(inside[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + _dot(p.to(c.dtype), c, IEEE)
            m_i = m_new
        if SPLIT:
            base = (t * H + hh) * splits + split
            tl.store(acc_ptr + base[:, None] * R + r[None, :], acc, mask=hok[:, None] & rok[None, :])
            tl.store(ml_ptr + base * 2, m_i, mask=hok)
            tl.store(ml_ptr + base * 2 + 1, l_i, mask=hok)
        else:
            ctx = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(acc_ptr + (t * H + hh[:, None]) * R + r[None, :], ctx.to(acc_ptr.dtype.element_ty),
                     mask=hok[:, None] & rok[None, :])


@triton.jit
def merge_splits_kernel(
    acc_ptr, ml_ptr, slot_ptr, ctx_ptr, H, R, splits, SP: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """acc [T, H, splits, R], ml [T, H, splits, 2] fp32 (from `attend_kernel`) into the context [T, H, R]
    (its dtype); grid (tokens, heads, R blocks of BLOCK_R), each program one load of its block's partials;
    padding tokens are left alone (the value-up zeroes them)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    if tl.load(slot_ptr + t) >= 0:
        sp = tl.arange(0, SP)
        spok = sp < splits
        base = (t * H + h) * splits + sp
        r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
        rok = r < R
        parts = tl.load(acc_ptr + base[:, None] * R + r[None, :], mask=spok[:, None] & rok[None, :], other=0.0)
        m = tl.load(ml_ptr + base * 2, mask=spok, other=float("-inf"))
        l = tl.load(ml_ptr + base * 2 + 1, mask=spok, other=0.0)
        top = tl.max(m, 0)
        top = tl.where(top == float("-inf"), 0.0, top)
        wgt = tl.exp(m - top)
        den = tl.sum(wgt * l, 0)
        wgt = wgt / tl.where(den > 0, den, 1.0)
        x = tl.sum(wgt[:, None] * parts, 0)  # splits summed in order
        tl.store(ctx_ptr + (t * H + h) * R + r, x.to(ctx_ptr.dtype.element_ty), mask=rok)
