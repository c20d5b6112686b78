"""The Triton kernel of the fused mHC boundary (one launch per boundary).

Grid (NC, NT): program (c, tb) owns a block of BT tokens and a chunk of the hidden size. It
writes its chunk of the new streams (the previous sublayer's hc_post, cast to the model dtype)
and the partial mixer products of those cast values against `fn` plus their partial sum of
squares into a workspace row `part[t, c, :]` (slot a*n + b of the (2+n) x n mixer outputs; slot
(2+n)*n holds the sum of squares). It then takes a ticket from the token block's counter; the
program that draws the last ticket resets the counter (so a CUDA graph can replay the launch)
and finishes the block: it reduces the partials, computes pre/post/comb (Sinkhorn on registers
for n = 4), collapses the new streams (hot in L2; read with .cg, past the incoherent L1) with
the pre weights and applies the RMSNorm, in registers when a row fits in one FIN tile.

MODE 0: boundary; MODE 1: first layer (the streams are n copies of `out`); MODE 2: last layer
(the mean of the new streams, then the final RMSNorm: only the sum-of-squares slot is used).
A boundary may leave its comb pending (ITERS = 1: the finisher stores it after the first Sinkhorn
iteration) for the next one to finish (ITERS_IN: the remaining iterations, run by every chunk
program while its first loads are in flight), with the same values as the finisher's. Sinkhorn's
chain of dependent normalisations then leaves the finisher but enters every chunk program; the H200
tuner of 2026-12-04 measured that faster only at 16 and 32 tokens.
With PDL the launch is a programmatic dependent: each program prefetches its chunk of the mixer into
L2 and then waits for the previous kernel before its first read of an activation. It lets the next
kernel start as it begins, or with RELEASE_LATE once its partial products are stored (the finisher,
a latency-bound chain on one program per token block, then runs beside the next kernel's prefetch).
The kernel is compiled without floating-point contraction:
every sum and product rounds as written and the fused multiply-adds of the hot loops are explicit
(tl.fma), so each compiled form (plain, programmatic, late release, deferred Sinkhorn) gives the same
bits; with contraction on, ptxas fuses the remaining pairs differently in each.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..pdl import launch_dependents as _launch_dependents
from ..pdl import prefetch_l2 as _prefetch_l2
from ..pdl import wait_previous as _wait_previous


@triton.jit
def _unit4(a0, a1, a2, a3, eps, RCP: tl.constexpr):
    # One reciprocal per row, then four products (instead of four divisions). RCP: the hardware's
    # approximate reciprocal (rcp.approx, within 1 ulp) instead of the default division's sequence, the
    # whole normalisation in one assembly block whose sums and products carry explicit rounding (.rn), so
    # ptxas cannot contract them into FMAs: the result is the same in every kernel that inlines it (a
    # contraction chosen per compiled kernel made a programmatic launch differ from a plain one).
    if RCP:
        e = tl.zeros_like(a0) + eps
        r0, r1, r2, r3 = tl.inline_asm_elementwise(
            "{ .reg .f32 u, v; add.rn.f32 u, $4, $5; add.rn.f32 v, $6, $7; add.rn.f32 u, u, v; "
            "add.rn.f32 u, u, $8; rcp.approx.ftz.f32 u, u; "
            "mul.rn.f32 $0, $4, u; mul.rn.f32 $1, $5, u; mul.rn.f32 $2, $6, u; mul.rn.f32 $3, $7, u; }",
            "=f,=f,=f,=f,f,f,f,f,f", [a0, a1, a2, a3, e], dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
            is_pure=True, pack=1)
        return r0, r1, r2, r3
    t = (a0 + a1) + (a2 + a3) + eps
    r = 1.0 / t
    return a0 * r, a1 * r, a2 * r, a3 * r


@triton.jit
def _iterate4(cs, hc_eps, ITERS: tl.constexpr, RCP: tl.constexpr):
    """ITERS Sinkhorn iterations (row, then column normalisation) of n = 4 on per-token values held in
    registers: `cs` is the tuple (c00, c01, ..., c33) of [BT] vectors; returns the same tuple."""
    c00, c01, c02, c03 = cs[0], cs[1], cs[2], cs[3]
    c10, c11, c12, c13 = cs[4], cs[5], cs[6], cs[7]
    c20, c21, c22, c23 = cs[8], cs[9], cs[10], cs[11]
    c30, c31, c32, c33 = cs[12], cs[13], cs[14], cs[15]
    for _ in range(ITERS):
        c00, c01, c02, c03 = _unit4(c00, c01, c02, c03, hc_eps, RCP)
        c10, c11, c12, c13 = _unit4(c10, c11, c12, c13, hc_eps, RCP)
        c20, c21, c22, c23 = _unit4(c20, c21, c22, c23, hc_eps, RCP)
        c30, c31, c32, c33 = _unit4(c30, c31, c32, c33, hc_eps, RCP)
        c00, c10, c20, c30 = _unit4(c00, c10, c20, c30, hc_eps, RCP)
        c01, c11, c21, c31 = _unit4(c01, c11, c21, c31, hc_eps, RCP)
        c02, c12, c22, c32 = _unit4(c02, c12, c22, c32, hc_eps, RCP)
        c03, c13, c23, c33 = _unit4(c03, c13, c23, c33, hc_eps, RCP)
    return (c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33)


@triton.jit
def _sinkhorn4(cm, tok, tmask, kk, new_comb_ptr, hc_eps, ITERS: tl.constexpr, RCP: tl.constexpr):
    """The remaining ITERS - 1 Sinkhorn iterations of n = 4 in registers (no cross-lane reductions
    inside the loop), then the store of comb [T, 4, 4]. `cm` [BT, 32] holds c[i, j] at slot 8 + 4i + j."""
    cs = ()
    for q in tl.static_range(16):
        cs = cs + (tl.sum(tl.where(kk[None, :] == 8 + q, cm, 0.0), axis=1),)
    cs = _iterate4(cs, hc_eps, ITERS - 1, RCP)
    for q in tl.static_range(16):
        tl.store(new_comb_ptr + tok * 16 + q, cs[q], mask=tmask)


@triton.jit
def _comb(comb_ptr, tok, tmask, N: tl.constexpr):
    """The tuple of comb[t, i, j] ([BT] vectors, index i * N + j) that hc_post applies."""
    cs = ()
    for q in tl.static_range(N * N):
        cs = cs + (tl.load(comb_ptr + tok * (N * N) + q, mask=tmask, other=0.0),)
    return cs


@triton.jit
def _iterate_tiles(cm, hc_eps, ITERS: tl.constexpr):
    """ITERS Sinkhorn iterations (row, then column normalisation) on [BT, rows, N] tiles (rows past
    the comb's are zero and stay so): the interpreter's form."""
    for _ in range(ITERS):
        cm = cm / (tl.sum(cm, axis=2)[:, :, None] + hc_eps)
        cm = cm / (tl.sum(cm, axis=1)[:, None, :] + hc_eps)
    return cm


@triton.jit
def _pending_comb(comb_ptr, tok, tmask, hc_eps, N: tl.constexpr, ITERS_IN: tl.constexpr):
    """The tuple of `_comb` for a pending comb (one Sinkhorn iteration done) in tile form: the
    remaining ITERS_IN iterations on a [BT, N, N] tile, then the N * N values."""
    i = tl.arange(0, N)
    q = i[None, :, None] * N + i[None, None, :]
    cm = tl.load(comb_ptr + tok[:, None, None] * (N * N) + q, mask=tmask[:, None, None], other=0.0)
    cm = _iterate_tiles(cm, hc_eps, ITERS_IN)
    cs = ()
    for k in tl.static_range(N * N):
        cs = cs + (tl.sum(tl.sum(tl.where(q == k, cm, 0.0), axis=2), axis=1),)
    return cs


@triton.jit
def _mhc_finish(
    tok, tmask, kk,
    fn_ptr, base_ptr, scale_ptr, w_ptr, new_streams_ptr, new_post_ptr, new_comb_ptr, x_ptr, part_ptr, x16_ptr,
    hc_eps, rms_eps, norm_eps, post_mult,
    D: tl.constexpr, N: tl.constexpr, ROWS: tl.constexpr, MODE: tl.constexpr, ITERS: tl.constexpr,
    BT: tl.constexpr, NC: tl.constexpr, NCB: tl.constexpr, FIN: tl.constexpr, SK4: tl.constexpr,
    X16: tl.constexpr,
):
    W: tl.constexpr = ROWS * N
    SSQ: tl.constexpr = (2 + N) * N
    dtype = x_ptr.dtype.element_ty
    jn = tl.arange(0, N)
    if FIN >= D:
        # A row fits one tile: issue its loads (the norm weight; the new streams, which the acquired
        # tickets made visible) before the reductions and Sinkhorn below, which then cover their latency.
        d_row = tl.arange(0, FIN)
        w_row = tl.load(w_ptr + d_row, mask=d_row < D, other=0.0).to(tl.float32)
        if MODE != 2:
            streams_row = tl.load(
                new_streams_ptr + (tok[:, None, None] * N + jn[None, :, None]) * D + d_row[None, None, :],
                mask=tmask[:, None, None] & (d_row < D)[None, None, :], other=0.0, cache_modifier=".cg")
    # Sum the per-chunk partials of the token block ([BT, NCB, W] tiles, bypassing L1).
    cb = tl.arange(0, NCB)
    tot = tl.zeros((BT, W), tl.float32)
    for c0 in tl.static_range(0, NC, NCB):
        ptrs = part_ptr + (tok[:, None, None] * NC + c0 + cb[None, :, None]) * W + kk[None, None, :]
        pm = tmask[:, None, None] & ((c0 + cb) < NC)[None, :, None]
        tot += tl.sum(tl.load(ptrs, mask=pm, other=0.0, cache_modifier=".cg"), axis=1)
    ssq = tl.sum(tl.where(kk[None, :] == SSQ, tot, 0.0), axis=1)
    if MODE == 2:
        r = tl.rsqrt(ssq / D + norm_eps)
    else:
        # The mixer outputs as [BT, ROWS, N]: row 0 pre, row 1 post, rows 2..n+1 the comb logits.
        t3 = tl.reshape(tot, (BT, ROWS, N))
        a = tl.arange(0, ROWS)[None, :, None]
        b = tl.arange(0, N)[None, None, :]
        valid = a < 2 + N
        is_comb = valid & (a >= 2)
        s0 = tl.load(scale_ptr)
        s1 = tl.load(scale_ptr + 1)
        s2 = tl.load(scale_ptr + 2)
        sc = tl.where(a == 0, s0, tl.where(a == 1, s1, s2))
        bs = tl.load(base_ptr + a * N + b, mask=valid, other=0.0)
        rm = tl.rsqrt(ssq / (N * D) + rms_eps)
        z = tl.where(valid, tl.fma(t3 * rm[:, None, None], tl.broadcast_to(sc, (BT, ROWS, N)),
                                   tl.broadcast_to(bs, (BT, ROWS, N))), 0.0)
        sig = 1.0 / (1.0 + tl.exp(-z))
        pre = tl.sum(tl.where(a == 0, sig + hc_eps, 0.0), axis=1)
        post = tl.sum(tl.where(a == 1, post_mult * sig, 0.0), axis=1)
        e = tl.exp(z - tl.max(z, axis=2)[:, :, None])
        cm = tl.where(is_comb, e / tl.sum(e, axis=2)[:, :, None] + hc_eps, 0.0)
        cm = cm / (tl.sum(cm, axis=1)[:, None, :] + hc_eps)
        tl.store(new_post_ptr + tok[:, None] * N + jn[None, :], post, mask=tmask[:, None])
        if SK4 > 0 and N == 4:  # registers on the GPU; the interpreter prefers few vector operations
            _sinkhorn4(tl.reshape(cm, (BT, W)), tok, tmask, kk, new_comb_ptr, hc_eps, ITERS, SK4 == 2)
        else:
            cm = _iterate_tiles(cm, hc_eps, ITERS - 1)
            tl.store(new_comb_ptr + tok[:, None, None] * (N * N) + (a - 2) * N + b, cm,
                     mask=tmask[:, None, None] & is_comb)
        # Collapse sum_j pre[j] * streams[j] (cast to the model dtype) and its sum of squares.
        if FIN >= D:
            col = tl.sum(pre[:, :, None] * streams_row.to(tl.float32), axis=1).to(dtype).to(tl.float32)
            r = tl.rsqrt(tl.sum(col * col, axis=1) / D + norm_eps)
        else:
            xsq = tl.zeros((BT, FIN), tl.float32)
            for f in tl.static_range(0, D, FIN):
                d = f + tl.arange(0, FIN)
                m = tmask[:, None] & (d < D)[None, :]
                col = tl.zeros((BT, FIN), tl.float32)
                for j in tl.static_range(N):
                    pj = tl.sum(tl.where(jn[None, :] == j, pre, 0.0), axis=1)
                    sp = new_streams_ptr + (tok[:, None] * N + j) * D + d[None, :]
                    col += pj[:, None] * tl.load(sp, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
                col = col.to(dtype).to(tl.float32)
                tl.store(x_ptr + tok[:, None] * D + d[None, :], col.to(dtype), mask=m)
                xsq += col * col
            r = tl.rsqrt(tl.sum(xsq, axis=1) / D + norm_eps)
    if MODE != 2 and FIN >= D:
        # The whole row is in registers: normalise it there.
        offs = tok[:, None] * D + d_row[None, :]
        _norm_store(x_ptr + offs, x16_ptr + offs, col, r, w_row, tmask[:, None] & (d_row < D)[None, :], X16)
    else:
        tl.debug_barrier()
        for f in tl.static_range(0, D, FIN):
            d = f + tl.arange(0, FIN)
            m = tmask[:, None] & (d < D)[None, :]
            offs = tok[:, None] * D + d[None, :]
            if FIN >= D:
                wv = w_row
            else:
                wv = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
            xv = tl.load(x_ptr + offs, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
            _norm_store(x_ptr + offs, x16_ptr + offs, xv, r, wv, m, X16)


@triton.jit
def _finish_token(
    t0, base_ptr, scale_ptr, w_ptr, new_streams_ptr, new_post_ptr, new_comb_ptr, x_ptr, part_ptr, x16_ptr,
    hc_eps, rms_eps, norm_eps, post_mult,
    D: tl.constexpr, ROWS: tl.constexpr, ITERS: tl.constexpr, NC: tl.constexpr, NCB: tl.constexpr,
    FIN: tl.constexpr, RCP: tl.constexpr, X16: tl.constexpr,
):
    """The finisher of one token's block (n = 4 streams, the row in one tile), with the mixer's outputs
    as scalars: the chunk partials are summed once across the program, the 25 sums go to every thread
    through the token's first partial row (already read), and from there the weights, Sinkhorn, the
    collapse and the norm need no exchange between threads but the norm's one sum. (`_mhc_finish`
    keeps them in [BT, ROWS, 4] tiles, each sum or maximum over them a cross-lane reduction.)"""
    W: tl.constexpr = ROWS * 4
    dtype = x_ptr.dtype.element_ty
    d_row = tl.arange(0, FIN)
    dm = d_row < D
    # The row's loads first (the norm weight; the new streams, visible through the acquired ticket).
    w_row = tl.load(w_ptr + d_row, mask=dm, other=0.0).to(tl.float32)
    sp = new_streams_ptr + t0 * 4 * D + d_row
    r0 = tl.load(sp, mask=dm, other=0.0, cache_modifier=".cg")
    r1 = tl.load(sp + D, mask=dm, other=0.0, cache_modifier=".cg")
    r2 = tl.load(sp + 2 * D, mask=dm, other=0.0, cache_modifier=".cg")
    r3 = tl.load(sp + 3 * D, mask=dm, other=0.0, cache_modifier=".cg")
    cb = tl.arange(0, NCB)
    kk = tl.arange(0, W)
    acc = tl.zeros((NCB, W), tl.float32)
    for c0 in tl.static_range(0, NC, NCB):
        ptrs = part_ptr + (t0 * NC + c0 + cb[:, None]) * W + kk[None, :]
        acc += tl.load(ptrs, mask=((c0 + cb) < NC)[:, None], other=0.0, cache_modifier=".cg")
    tot = tl.sum(acc, axis=0)
    row = part_ptr + t0 * NC * W
    tl.debug_barrier()  # every thread has read the partials before their first row is overwritten
    tl.store(row + kk, tot)
    tl.debug_barrier()
    v = ()
    for i in tl.static_range(25):  # 24 mixer outputs (pre, post, the comb logits), then the sum of squares
        v = v + (tl.load(row + i, cache_modifier=".cg"),)
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    rm = tl.rsqrt(v[24] / (4 * D) + rms_eps)
    z = ()
    for i in tl.static_range(24):
        sc = s0 if i < 4 else (s1 if i < 8 else s2)
        z = z + (tl.fma(v[i] * rm, sc, tl.load(base_ptr + i)),)
    pre = ()
    for j in tl.static_range(4):
        pre = pre + (1.0 / (1.0 + tl.exp(-z[j])) + hc_eps,)
        tl.store(new_post_ptr + t0 * 4 + j, post_mult * (1.0 / (1.0 + tl.exp(-z[4 + j]))))
    c = ()
    for i in tl.static_range(4):  # softmax of each comb row, plus eps
        a, b, e, f = z[8 + 4 * i], z[9 + 4 * i], z[10 + 4 * i], z[11 + 4 * i]
        top = tl.maximum(tl.maximum(a, b), tl.maximum(e, f))
        ea, eb, ee, ef = tl.exp(a - top), tl.exp(b - top), tl.exp(e - top), tl.exp(f - top)
        se = ((ea + eb) + ee) + ef
        c = c + (ea / se + hc_eps, eb / se + hc_eps, ee / se + hc_eps, ef / se + hc_eps)
    cs = ()
    for i in tl.static_range(4):  # then the first iteration's column normalisation
        for j in tl.static_range(4):
            cs = cs + (c[4 * i + j] / ((((c[j] + c[4 + j]) + c[8 + j]) + c[12 + j]) + hc_eps),)
    cs = _iterate4(cs, hc_eps, ITERS - 1, RCP)
    for q in tl.static_range(16):
        tl.store(new_comb_ptr + t0 * 16 + q, cs[q])
    # Collapse sum_j pre[j] * streams[j] (cast to the model dtype), then the norm.
    col = pre[0] * r0.to(tl.float32) + pre[1] * r1.to(tl.float32)
    col = (col + pre[2] * r2.to(tl.float32)) + pre[3] * r3.to(tl.float32)
    col = col.to(dtype).to(tl.float32)
    r = tl.rsqrt(tl.sum(col * col, axis=0) / D + norm_eps)
    out = (w_row * (col * r).to(dtype).to(tl.float32)).to(dtype)
    tl.store(x_ptr + t0 * D + d_row, out, mask=dm)
    if X16:
        tl.store(x16_ptr + t0 * D + d_row, out.to(tl.float16), mask=dm)


@triton.jit
def _norm_store(xp, x16p, xv, r, wv, m, X16: tl.constexpr):
    """RMSNorm as the stock code rounds it: weight * cast(x * r) (weight `wv` in fp32), cast to the model
    dtype; with X16 that result in fp16 to x16p as well."""
    dtype = xp.dtype.element_ty
    y = (xv * r[:, None]).to(dtype).to(tl.float32)
    out = (wv[None, :] * y).to(dtype)
    tl.store(xp, out, mask=m)
    if X16:
        tl.store(x16p, out.to(tl.float16), mask=m)


@triton.jit
def _chunk_program(
    c, tb, out_ptr, streams_ptr, post_ptr, comb_ptr,
    fn_ptr, base_ptr, scale_ptr, w_ptr,
    new_streams_ptr, new_post_ptr, new_comb_ptr, x_ptr,
    part_ptr, ticket_ptr,
    T, hc_eps, rms_eps, norm_eps, post_mult, x16_ptr,
    D: tl.constexpr, N: tl.constexpr, ROWS: tl.constexpr, MODE: tl.constexpr, ITERS: tl.constexpr,
    BT: tl.constexpr, SUB: tl.constexpr, NSUB: tl.constexpr, NC: tl.constexpr, NCB: tl.constexpr,
    FIN: tl.constexpr, SK4: tl.constexpr, PDL: tl.constexpr,
    RELEASE_LATE: tl.constexpr, ITERS_IN: tl.constexpr,
    X16: tl.constexpr, SCALAR: tl.constexpr,
):
    """Program (c, tb): chunk c of the hidden size for token block tb, then its ticket; the program that
    draws the block's last ticket finishes the block."""
    W: tl.constexpr = ROWS * N
    SSQ: tl.constexpr = (2 + N) * N
    CHUNK: tl.constexpr = SUB * NSUB
    dtype = x_ptr.dtype.element_ty
    tok = tb * BT + tl.arange(0, BT)
    tmask = tok < T
    kk = tl.arange(0, W)
    if PDL:
        # Launched as a programmatic dependent: let the next kernel's programs start (with
        # RELEASE_LATE only once this program's partial products are stored, so the next kernel's own
        # prefetch does not compete with these loads), pull this chunk's mixer rows (constants) into L2
        # while the previous kernel finishes, then wait for it.
        if not RELEASE_LATE:
            _launch_dependents()
        if MODE != 2 and D % 4 == 0:  # whole 16-byte pieces of fp32 rows
            rows = fn_ptr + kk[:, None] * (N * D) + tl.arange(0, N)[None, :] * D + c * CHUNK
            _prefetch_l2(rows, tl.minimum(CHUNK, D - c * CHUNK) * 4, (kk < SSQ)[:, None])
        _wait_previous()
    # A pending comb (ITERS_IN > 0) gets its remaining Sinkhorn iterations here: on the register
    # path once the first sub-tile's loads are in flight (below), else in tile form now.
    SK_HERE: tl.constexpr = ITERS_IN > 0 and SK4 > 0 and N == 4
    if MODE != 1:
        if ITERS_IN > 0 and not SK_HERE:
            cs = _pending_comb(comb_ptr, tok, tmask, hc_eps, N, ITERS_IN)
        else:
            cs = _comb(comb_ptr, tok, tmask, N)
    acc = tl.zeros((BT, W, SUB), tl.float32)
    ssq = tl.zeros((BT, SUB), tl.float32)
    for s in tl.static_range(NSUB):
        d = c * CHUNK + s * SUB + tl.arange(0, SUB)
        dm = d < D
        m2 = tmask[:, None] & dm[None, :]
        # Issue all of this sub-tile's loads before any arithmetic on them.
        o = tl.load(out_ptr + tok[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
        src = ()
        mix = ()
        for j in tl.static_range(N):
            if MODE != 1:
                src = src + (tl.load(streams_ptr + (tok[:, None] * N + j) * D + d[None, :], mask=m2, other=0.0),)
            if MODE != 2:
                fp = fn_ptr + kk[:, None] * (N * D) + j * D + d[None, :]
                mix = mix + (tl.load(fp, mask=(kk < SSQ)[:, None] & dm[None, :], other=0.0),)
        if SK_HERE and MODE != 1 and s == 0:
            cs = _iterate4(cs, hc_eps, ITERS_IN, SK4 == 2)
        msum = tl.zeros((BT, SUB), tl.float32)
        for j in tl.static_range(N):
            if MODE == 1:
                v = o
            else:
                # hc_post: post[j] * out + sum_i comb[i, j] * streams[i], cast to the model dtype.
                v = tl.load(post_ptr + tok * N + j, mask=tmask, other=0.0)[:, None] * o
                for i in tl.static_range(N):
                    v = tl.fma(tl.broadcast_to(cs[i * N + j][:, None], (BT, SUB)), src[i].to(tl.float32), v)
                v = v.to(dtype).to(tl.float32)
            if MODE == 2:
                msum += v
            else:
                tl.store(new_streams_ptr + (tok[:, None] * N + j) * D + d[None, :], v.to(dtype), mask=m2)
                ssq = tl.fma(v, v, ssq)
                acc = tl.fma(tl.broadcast_to(v[:, None, :], (BT, W, SUB)),
                             tl.broadcast_to(mix[j][None, :, :], (BT, W, SUB)), acc)
        if MODE == 2:
            mean = (msum / N).to(dtype)
            tl.store(x_ptr + tok[:, None] * D + d[None, :], mean, mask=m2)
            mf = mean.to(tl.float32)
            ssq = tl.fma(mf, mf, ssq)
    part = tl.where(kk[None, :] == SSQ, tl.sum(ssq, axis=1)[:, None], tl.sum(acc, axis=2))
    tl.store(part_ptr + (tok[:, None] * NC + c) * W + kk[None, :], part, mask=tmask[:, None])
    # Every thread's stores precede the release of the ticket.
    tl.debug_barrier()
    if PDL and RELEASE_LATE:
        _launch_dependents()
    ticket = tl.atomic_add(ticket_ptr + tb, 1, sem="acq_rel")
    if ticket == NC - 1:
        tl.store(ticket_ptr + tb, 0)
        if SCALAR:  # one token per block, n = 4, a row in one tile, Sinkhorn in registers; not the last layer
            _finish_token(
                tb, base_ptr, scale_ptr, w_ptr, new_streams_ptr, new_post_ptr, new_comb_ptr, x_ptr, part_ptr, x16_ptr,
                hc_eps, rms_eps, norm_eps, post_mult, D, ROWS, ITERS, NC, NCB, FIN, SK4 == 2, X16,
            )
        else:
            _mhc_finish(
                tok, tmask, kk,
                fn_ptr, base_ptr, scale_ptr, w_ptr, new_streams_ptr, new_post_ptr, new_comb_ptr, x_ptr, part_ptr,
                x16_ptr, hc_eps, rms_eps, norm_eps, post_mult,
                D, N, ROWS, MODE, ITERS, BT, NC, NCB, FIN, SK4, X16,
            )


@triton.jit
def mhc_kernel(
    out_ptr, streams_ptr, post_ptr, comb_ptr,
    fn_ptr, base_ptr, scale_ptr, w_ptr,
    new_streams_ptr, new_post_ptr, new_comb_ptr, x_ptr,
    part_ptr, ticket_ptr,
    T, hc_eps, rms_eps, norm_eps, post_mult, x16_ptr,
    D: tl.constexpr, N: tl.constexpr, ROWS: tl.constexpr, MODE: tl.constexpr, ITERS: tl.constexpr,
    BT: tl.constexpr, SUB: tl.constexpr, NSUB: tl.constexpr, NC: tl.constexpr, NCB: tl.constexpr,
    FIN: tl.constexpr, SK4: tl.constexpr, PDL: tl.constexpr,
    RELEASE_LATE: tl.constexpr = False, ITERS_IN: tl.constexpr = 0,
    X16: tl.constexpr = False, SCALAR: tl.constexpr = False,
):
    """Grid (NC, token blocks): the chunk programs, the last of each block finishing it."""
    _chunk_program(
        tl.program_id(0), tl.program_id(1), out_ptr, streams_ptr, post_ptr, comb_ptr, fn_ptr, base_ptr, scale_ptr,
        w_ptr, new_streams_ptr, new_post_ptr, new_comb_ptr, x_ptr, part_ptr, ticket_ptr,
        T, hc_eps, rms_eps, norm_eps, post_mult, x16_ptr,
        D, N, ROWS, MODE, ITERS, BT, SUB, NSUB, NC, NCB, FIN, SK4, PDL,
        RELEASE_LATE, ITERS_IN, X16, SCALAR,
    )
