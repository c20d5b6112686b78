"""Triton kernels of the grouped experts: gate|up with the clamped SwiGLU, down with the routing
weight, and the per-token combine.

A program owns one slot (an expert: the shared one at slot 0, then the routed experts the step
touches, see `routing.py`) and one BLOCK_N slice of its output columns; it loops over its slot's rows
in blocks of BLOCK_M and, for each, streams its weight slice once along K. Programs past the step's
slot count exit at once, so the grid can be sized for the most slots a step can touch and stay
static under CUDA graphs.

The routed experts' weights are stacked `[E, N, K]`; the shared expert's are separate tensors of one
expert's shape. The kernels address both from the stacked base: the shared expert's weights sit at a
fixed element offset from it (`shared_off`, which may be negative), so one pointer argument serves both.

FP8 weights (e4m3 with fp32 128x128 block scales) are widened exactly in registers; each BLOCK_K
chunk's product is scaled by its one block scale (BLOCK_N divides 128 and BLOCK_K divides 128, and
tiles start on multiples of themselves, so a chunk never straddles two scale blocks). 16-bit
activations meet 16-bit widened weights on the tensor cores with fp32 accumulation; fp32 activations
(and the interpreter, whose bf16 products are wrong) multiply in fp32 ("ieee").

With PDL (a programmatic-dependent launch, `kernels/pdl.py`) every kernel lets the next one start as it
begins and reads the step's data (slots, rows, activations) only after `wait_previous`. Before it, the
programs of slot 0 (the shared expert, which needs no routing) fetch their weight tile into L2: the shared
expert's bytes stream while the routing of the kernels before still runs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..pdl import launch_dependents, prefetch_l2, wait_previous


@triton.jit
def _offset(e, per_expert, shared_off):
    """Element offset from a stacked base of expert e's block (`per_expert` elements each), or of the
    shared expert's (e < 0)."""
    return tl.where(e < 0, shared_off, e.to(tl.int64) * per_expert)


@triton.jit
def _product(x, w, scale, F32: tl.constexpr, HALF: tl.constexpr):
    """x [BM, BK] times the weight tile w [BN, BK] (transposed), scaled: [BM, BN] fp32. HALF: both in
    fp16 (e4m3 widens to fp16 in one conversion, where bf16 takes several)."""
    if F32:
        acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    elif HALF:
        acc = tl.dot(x.to(tl.float16), tl.trans(w.to(tl.float16)))
    else:
        acc = tl.dot(x, tl.trans(w.to(x.dtype)))
    return acc * scale


@triton.jit
def _swiglu(acc_g, acc_u, limit):
    """The clamped SwiGLU of the gate and up products: silu(min(g, limit)) * clamp(u, -limit, limit)."""
    g = tl.minimum(acc_g, limit)
    return g * tl.sigmoid(g) * tl.minimum(tl.maximum(acc_u, -limit), limit)


@triton.jit
def _prefetch_shared(w_ptr, shared_off, n, N, K):
    """L2 prefetch of the shared expert's weight rows `n` (all K columns, one byte each: FP8)."""
    prefetch_l2(w_ptr + shared_off + n.to(tl.int64) * K, K, (n < N) & (K % 16 == 0))


@triton.jit
def gate_up_tiles(wg_ptr, wu_ptr, sg_ptr, su_ptr, wg_off, wu_off, sg_off, su_off, n, nmask, k, kmask, k0, K,
                  HAS_SCALE: tl.constexpr):
    """An expert's gate and up weight tiles [len(n), len(k)] at rows n and columns k (from k0) and their block
    scales (1.0 for unscaled weights)."""
    wmask = nmask[:, None] & kmask[None, :]
    wg = tl.load(wg_ptr + wg_off + n[:, None] * K + k[None, :], mask=wmask, other=0.0)
    wu = tl.load(wu_ptr + wu_off + n[:, None] * K + k[None, :], mask=wmask, other=0.0)
    if HAS_SCALE:
        sg = tl.load(sg_ptr + sg_off + k0 // 128)
        su = tl.load(su_ptr + su_off + k0 // 128)
    else:
        sg = 1.0
        su = 1.0
    return wg, wu, sg, su


@triton.jit
def _gate_up_block(x_ptr, wg_ptr, wu_ptr, sg_ptr, su_ptr, h_ptr, e, p, rmask, pid_n,
                   shared_wg, shared_wu, shared_sg, shared_su, T, N, K, stride_x, limit,
                   TOP_K: tl.constexpr, HAS_SCALE: tl.constexpr, F32: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """h[p, n] of expert e (-1: the shared one) for one block of rows p [BLOCK_M] (under rmask) and the
    program's BLOCK_N columns (see `gate_up_kernel`)."""
    wg_off, sg_off, n, nmask = expert_columns(e, pid_n, shared_wg, shared_sg, N, K, BLOCK_N)
    wu_off, su_off, n, nmask = expert_columns(e, pid_n, shared_wu, shared_su, N, K, BLOCK_N)
    tok = tl.where(p >= T * TOP_K, p - T * TOP_K, p // TOP_K)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        x = tl.load(x_ptr + tok[:, None] * stride_x + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        wg, wu, sg, su = gate_up_tiles(wg_ptr, wu_ptr, sg_ptr, su_ptr, wg_off, wu_off, sg_off, su_off, n, nmask, k,
                                       kmask, k0, K, HAS_SCALE)
        acc_g += _product(x, wg, sg, F32, HALF)
        acc_u += _product(x, wu, su, F32, HALF)
    h = _swiglu(acc_g, acc_u, limit)
    tl.store(h_ptr + p[:, None] * N + n[None, :], h.to(h_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


@triton.jit
def _slot_rows(slot_expert_ptr, slot_start_ptr, slot_count_ptr, slot):
    """Slot `slot`'s expert (-1: the shared one), the first of its rows in the row list and their count."""
    return tl.load(slot_expert_ptr + slot), tl.load(slot_start_ptr + slot), tl.load(slot_count_ptr + slot)


@triton.jit
def _row_block(rows_ptr, start, count, m0, BLOCK_M: tl.constexpr):
    """The slot's rows m0 .. m0 + BLOCK_M - 1 (its pairs p, 0 past `count`) and their mask."""
    r = m0 + tl.arange(0, BLOCK_M)
    rmask = r < count
    return tl.load(rows_ptr + start + r, mask=rmask, other=0), rmask


@triton.jit
def gate_up_kernel(x_ptr, wg_ptr, wu_ptr, sg_ptr, su_ptr, h_ptr,
                   slot_expert_ptr, slot_start_ptr, slot_count_ptr, rows_ptr, n_slots_ptr,
                   shared_wg, shared_wu, shared_sg, shared_su,
                   T, N, K, stride_x, limit, first_slot,
                   TOP_K: tl.constexpr, HAS_SCALE: tl.constexpr, F32: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """h[p, n] = silu(min(g, limit)) * clamp(u, -limit, limit) for the slot's rows p, where
    g = x[token(p)] @ Wg[e].T and u likewise; the token of row p is p // TOP_K for routed pairs and
    p - T * TOP_K for the shared expert's rows. Program i takes slot first_slot + i (1: the shared expert's
    slot runs in `shared_gate_up_kernel`)."""
    slot = tl.program_id(0) + first_slot
    pid_n = tl.program_id(1)
    if PDL:
        launch_dependents()
        if HAS_SCALE:
            if slot == 0:
                n_pf = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
                _prefetch_shared(wg_ptr, shared_wg, n_pf, N, K)
                _prefetch_shared(wu_ptr, shared_wu, n_pf, N, K)
        wait_previous()
    if slot >= tl.load(n_slots_ptr):
        return
    e, start, count = _slot_rows(slot_expert_ptr, slot_start_ptr, slot_count_ptr, slot)
    for m0 in range(0, count, BLOCK_M):
        p, rmask = _row_block(rows_ptr, start, count, m0, BLOCK_M)
        _gate_up_block(x_ptr, wg_ptr, wu_ptr, sg_ptr, su_ptr, h_ptr, e, p, rmask, pid_n,
                       shared_wg, shared_wu, shared_sg, shared_su, T, N, K, stride_x, limit,
                       TOP_K, HAS_SCALE, F32, HALF, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def expert_columns(e, pid_n, shared_w, shared_s, N, K, BLOCK_N: tl.constexpr):
    """Expert e's weight and scale offsets of one matrix (from the stacked bases; the shared expert's at
    `shared_w` / `shared_s`) for column block pid_n, its columns n and their mask."""
    ks = tl.cdiv(K, 128)
    w_off = _offset(e, N * K, shared_w)
    s_off = _offset(e, tl.cdiv(N, 128) * ks, shared_s) + (pid_n * BLOCK_N // 128) * ks
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return w_off, s_off, n, n < N


@triton.jit
def down_tile(w_ptr, s_ptr, w_off, s_off, n, nmask, k, kmask, k0, K, HAS_SCALE: tl.constexpr):
    """An expert's down weight tile [len(n), len(k)] at rows n and columns k (from k0) and its block scale."""
    w = tl.load(w_ptr + w_off + n[:, None] * K + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
    if HAS_SCALE:
        s = tl.load(s_ptr + s_off + k0 // 128)
    else:
        s = 1.0
    return w, s


@triton.jit
def _down_block(h_ptr, w_ptr, s_ptr, weights_ptr, y_ptr, e, p, rmask, pid_n, shared_w, shared_s, T, N, K,
                TOP_K: tl.constexpr, HAS_SCALE: tl.constexpr, F32: tl.constexpr, HALF: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[p, n] of expert e (-1: the shared one) for one block of rows p [BLOCK_M] (under rmask) and the
    program's BLOCK_N columns (see `down_kernel`)."""
    w_off, s_off, n, nmask = expert_columns(e, pid_n, shared_w, shared_s, N, K, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        h = tl.load(h_ptr + p[:, None] * K + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        w, s = down_tile(w_ptr, s_ptr, w_off, s_off, n, nmask, k, kmask, k0, K, HAS_SCALE)
        acc += _product(h, w, s, F32, HALF)
    routed = p < T * TOP_K
    wt = tl.load(weights_ptr + p, mask=rmask & routed, other=1.0)
    tl.store(y_ptr + p[:, None] * N + n[None, :], acc * wt[:, None], mask=rmask[:, None] & nmask[None, :])


@triton.jit
def down_kernel(h_ptr, w_ptr, s_ptr, weights_ptr, y_ptr,
                slot_expert_ptr, slot_start_ptr, slot_count_ptr, rows_ptr, n_slots_ptr,
                shared_w, shared_s, T, N, K, first_slot,
                TOP_K: tl.constexpr, HAS_SCALE: tl.constexpr, F32: tl.constexpr, HALF: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """y[p, n] = weight(p) * (h[p] @ Wd[e].T)[n] in fp32 for the slot's rows p (weight 1 for the
    shared expert's rows, the routing weight of pair p otherwise). Program i takes slot first_slot + i."""
    slot = tl.program_id(0) + first_slot
    pid_n = tl.program_id(1)
    if PDL:
        launch_dependents()
        if HAS_SCALE:
            if slot == 0:
                _prefetch_shared(w_ptr, shared_w, pid_n * BLOCK_N + tl.arange(0, BLOCK_N), N, K)
        wait_previous()
    if slot >= tl.load(n_slots_ptr):
        return
    e, start, count = _slot_rows(slot_expert_ptr, slot_start_ptr, slot_count_ptr, slot)
    for m0 in range(0, count, BLOCK_M):
        p, rmask = _row_block(rows_ptr, start, count, m0, BLOCK_M)
        _down_block(h_ptr, w_ptr, s_ptr, weights_ptr, y_ptr, e, p, rmask, pid_n, shared_w, shared_s, T, N, K,
                    TOP_K, HAS_SCALE, F32, HALF, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def combine_kernel(y_ptr, slots_ptr, out_ptr, T, N, stride_out,
                   TOP_K: tl.constexpr, HAS_SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr = False):
    """out[t] = sum_k y[t * TOP_K + k] (k ascending) + y[T * TOP_K + t], or 0 for a padded token."""
    if PDL:
        launch_dependents()
        wait_previous()
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + (t * TOP_K + k) * N + n, mask=nmask, other=0.0)
    acc += tl.load(y_ptr + (T * TOP_K + t) * N + n, mask=nmask, other=0.0)
    if HAS_SLOTS:
        acc = tl.where(tl.load(slots_ptr + t) >= 0, acc, 0.0)
    tl.store(out_ptr + t * stride_out + n, acc.to(out_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _shared_rows(slots_ptr, T, TOP_K: tl.constexpr, HAS_SLOTS: tl.constexpr, BLOCK_M: tl.constexpr):
    """The shared expert's rows T * TOP_K + t of the step's tokens t < BLOCK_M, and which are valid tokens."""
    t = tl.arange(0, BLOCK_M)
    valid = t < T
    if HAS_SLOTS:
        valid = valid & (tl.load(slots_ptr + t, mask=valid, other=-1) >= 0)
    return T * TOP_K + t, valid


@triton.jit
def shared_gate_up_kernel(x_ptr, wg_ptr, wu_ptr, sg_ptr, su_ptr, h_ptr, slots_ptr,
                          shared_wg, shared_wu, shared_sg, shared_su, T, N, K, stride_x, limit,
                          TOP_K: tl.constexpr, HAS_SLOTS: tl.constexpr, HAS_SCALE: tl.constexpr, F32: tl.constexpr,
                          HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The shared expert's h rows of a step of at most BLOCK_M tokens, one BLOCK_N column block a program:
    `gate_up_kernel`'s slot 0 without the routing (it needs none), so it may run beside it."""
    p, valid = _shared_rows(slots_ptr, T, TOP_K, HAS_SLOTS, BLOCK_M)
    _gate_up_block(x_ptr, wg_ptr, wu_ptr, sg_ptr, su_ptr, h_ptr, tl.full([], -1, tl.int32), p, valid,
                   tl.program_id(0), shared_wg, shared_wu, shared_sg, shared_su, T, N, K, stride_x, limit,
                   TOP_K, HAS_SCALE, F32, HALF, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def shared_down_kernel(h_ptr, w_ptr, s_ptr, weights_ptr, y_ptr, slots_ptr, shared_w, shared_s, T, N, K,
                       TOP_K: tl.constexpr, HAS_SLOTS: tl.constexpr, HAS_SCALE: tl.constexpr, F32: tl.constexpr,
                       HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The shared expert's y rows (weight 1) of a step of at most BLOCK_M tokens, one BLOCK_N column block a
    program: `down_kernel`'s slot 0 without the routing."""
    p, valid = _shared_rows(slots_ptr, T, TOP_K, HAS_SLOTS, BLOCK_M)
    _down_block(h_ptr, w_ptr, s_ptr, weights_ptr, y_ptr, tl.full([], -1, tl.int32), p, valid, tl.program_id(0),
                shared_w, shared_s, T, N, K, TOP_K, HAS_SCALE, F32, HALF, BLOCK_M, BLOCK_N, BLOCK_K)
