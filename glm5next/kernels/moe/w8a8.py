"""Triton kernels of the grouped experts on FP8 tensor cores (w8a8): activations quantised to e4m3 per row
and 128-channel group, multiplied as e4m3 against the experts' e4m3 weights with fp32 accumulation.

Each 128-deep K block's product is scaled by its row's activation scale and the weight's 128x128 block
scale before it joins the accumulator, so the result is the product of the dequantised operands. The
weights never widen: they go from memory to the tensor cores as stored, which is what lets a prefill
chunk's experts run at the FP8 rate instead of paying a conversion per weight element.

The slots, rows and shared-expert addressing are those of `experts.py` (one program per slot and output
tile, rows of pair p of token p // TOP_K or, past T * TOP_K, the shared expert's token p - T * TOP_K), but
the grid's fastest axis runs over the output tiles: the programs running at once share a few slots' rows,
which stay in L2 across their tiles, rather than a tile of every slot. At 2048 / 8192 tokens on the H100
that took the experts from 5.42 / 11.80 to 4.32 / 10.41 ms (bench/results/2026-12-06-h100-moe-prefill-w8a8.json).
gate|up quantises its SwiGLU output the same way in its epilogue (a BLOCK_N of 128 is one group), so
the down product reads e4m3 too.

Quantisation rounds to nearest even explicitly and then converts a value e4m3 holds exactly: the
interpreter's own conversion truncates, and this way the GPU, the interpreter and PyTorch's
`to(torch.float8_e4m3fn)` give the same bits.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .experts import _offset

@triton.jit
def _to_e4m3(v):
    """v (fp32, |v| <= 448) rounded to nearest even on the e4m3 grid (3 mantissa bits, subnormals below 2^-6),
    as an exact fp32 value."""
    bits = v.to(tl.int32, bitcast=True)
    exp = tl.maximum((bits >> 23) & 0xFF, 127 - 6)
    ulp = ((exp - 3) << 23).to(tl.float32, bitcast=True)
    magic = 12582912.0  # 1.5 * 2^23: adding and subtracting it rounds |x| < 2^22 to an integer, ties to even
    return ((v / ulp + magic) - magic) * ulp


@triton.jit
def _quantize(v, mask):
    """The rows of v [R, C] (C channels: one group) quantised: e4m3 values as fp32 [R, C] and scales [R]
    (the group's largest magnitude over 448, at least 1e-10 / 448: an all-zero group quantises to zeros)."""
    amax = tl.max(tl.where(mask, tl.abs(v), 0.0), axis=1)
    s = tl.maximum(amax, 1e-10) / 448.0
    q = tl.minimum(tl.maximum(v / s[:, None], -448.0), 448.0)
    return _to_e4m3(q), s


@triton.jit
def quantize_rows_kernel(x_ptr, q_ptr, s_ptr, T, K, stride_x, BLOCK_T: tl.constexpr):
    """q[t, k] = e4m3(x[t, k] / s[t, g]), s[t, g] = max |x[t, 128 g : 128 g + 128]| / 448 (fp32)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    g = tl.program_id(1)
    k = g * 128 + tl.arange(0, 128)
    mask = (t < T)[:, None] & (k < K)[None, :]
    x = tl.load(x_ptr + t[:, None] * stride_x + k[None, :], mask=mask, other=0.0).to(tl.float32)
    q, s = _quantize(x, mask)
    tl.store(q_ptr + t[:, None] * K + k[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + t * tl.cdiv(K, 128) + g, s, mask=t < T)


@triton.jit
def _product(a, w, scale, F32: tl.constexpr):
    """a [BM, 128] times the weight tile w [BN, 128] (transposed), e4m3 both, times scale [BM, BN]."""
    if F32:  # the interpreter: the same values, multiplied in fp32
        acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    else:
        acc = tl.dot(a, tl.trans(w))
    return acc * scale


@triton.jit
def gate_up_kernel(xq_ptr, xs_ptr, wg_ptr, wu_ptr, sg_ptr, su_ptr, hq_ptr, hs_ptr,
                   slot_expert_ptr, slot_start_ptr, slot_count_ptr, rows_ptr, n_slots_ptr,
                   shared_wg, shared_wu, shared_sg, shared_su, T, N, K, limit,
                   TOP_K: tl.constexpr, F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """h[p] = silu(min(g, limit)) * clamp(u, -limit, limit) of the slot's rows p from the quantised x, stored
    quantised: hq [P, N] e4m3 and hs [P, ceil(N / 128)] (BLOCK_N is 128: a tile is one group of a row)."""
    slot = tl.program_id(1)
    if slot >= tl.load(n_slots_ptr):
        return
    pid_n = tl.program_id(0)
    ks = tl.cdiv(K, 128)
    e = tl.load(slot_expert_ptr + slot)
    start = tl.load(slot_start_ptr + slot)
    count = tl.load(slot_count_ptr + slot)
    wg_off = _offset(e, N * K, shared_wg)
    wu_off = _offset(e, N * K, shared_wu)
    sg_off = _offset(e, tl.cdiv(N, 128) * ks, shared_sg) + pid_n * ks
    su_off = _offset(e, tl.cdiv(N, 128) * ks, shared_su) + pid_n * ks
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    for m0 in range(0, count, BLOCK_M):
        r = m0 + tl.arange(0, BLOCK_M)
        rmask = r < count
        p = tl.load(rows_ptr + start + r, mask=rmask, other=0)
        tok = tl.where(p >= T * TOP_K, p - T * TOP_K, p // TOP_K)
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kb in range(0, ks):
            k = kb * 128 + tl.arange(0, 128)
            kmask = k < K
            a = tl.load(xq_ptr + tok[:, None] * K + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            a_s = tl.load(xs_ptr + tok * ks + kb, mask=rmask, other=0.0)
            wmask = nmask[:, None] & kmask[None, :]
            wg = tl.load(wg_ptr + wg_off + n[:, None] * K + k[None, :], mask=wmask, other=0.0)
            wu = tl.load(wu_ptr + wu_off + n[:, None] * K + k[None, :], mask=wmask, other=0.0)
            acc_g += _product(a, wg, a_s[:, None] * tl.load(sg_ptr + sg_off + kb), F32)
            acc_u += _product(a, wu, a_s[:, None] * tl.load(su_ptr + su_off + kb), F32)
        g = tl.minimum(acc_g, limit)
        u = tl.minimum(tl.maximum(acc_u, -limit), limit)
        mask = rmask[:, None] & nmask[None, :]
        q, s = _quantize(g * tl.sigmoid(g) * u, mask)
        tl.store(hq_ptr + p[:, None] * N + n[None, :], q.to(hq_ptr.dtype.element_ty), mask=mask)
        tl.store(hs_ptr + p * tl.cdiv(N, 128) + pid_n, s, mask=rmask)


@triton.jit
def down_kernel(hq_ptr, hs_ptr, w_ptr, s_ptr, weights_ptr, y_ptr,
                slot_expert_ptr, slot_start_ptr, slot_count_ptr, rows_ptr, n_slots_ptr,
                shared_w, shared_s, T, N, K,
                TOP_K: tl.constexpr, F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """y[p, n] = weight(p) * (h[p] @ Wd[e].T)[n] in fp32 from the quantised h (weight 1 for the shared
    expert's rows, the routing weight of pair p otherwise)."""
    slot = tl.program_id(1)
    if slot >= tl.load(n_slots_ptr):
        return
    pid_n = tl.program_id(0)
    ks = tl.cdiv(K, 128)
    e = tl.load(slot_expert_ptr + slot)
    start = tl.load(slot_start_ptr + slot)
    count = tl.load(slot_count_ptr + slot)
    w_off = _offset(e, N * K, shared_w)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    s_row = _offset(e, tl.cdiv(N, 128) * ks, shared_s) + (n // 128) * ks  # a tile may span scale blocks
    for m0 in range(0, count, BLOCK_M):
        r = m0 + tl.arange(0, BLOCK_M)
        rmask = r < count
        p = tl.load(rows_ptr + start + r, mask=rmask, other=0)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kb in range(0, ks):
            k = kb * 128 + tl.arange(0, 128)
            kmask = k < K
            a = tl.load(hq_ptr + p[:, None] * K + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            a_s = tl.load(hs_ptr + p * ks + kb, mask=rmask, other=0.0)
            w = tl.load(w_ptr + w_off + n[:, None] * K + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
            w_s = tl.load(s_ptr + s_row + kb, mask=nmask, other=0.0)
            acc += _product(a, w, a_s[:, None] * w_s[None, :], F32)
        wt = tl.load(weights_ptr + p, mask=rmask & (p < T * TOP_K), other=1.0)
        tl.store(y_ptr + p[:, None] * N + n[None, :], acc * wt[:, None], mask=rmask[:, None] & nmask[None, :])
