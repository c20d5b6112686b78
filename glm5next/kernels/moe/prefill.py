"""Triton kernels of the grouped experts over prefill chunks: gate|up with the clamped SwiGLU and down with
the routing weight, one tile of at most BLOCK_M rows of one expert a program (`group_rows` gives every tile
its own slot), each product transposed.

A program computes W[e] [BLOCK_N, K] @ x.T [K, rows] for its tile of rows and its BLOCK_N output columns: the
weight tile is the left operand. On Hopper the left operand of a tensor-core product may come from registers,
so each FP8 tile widened in registers goes straight to the tensor cores; as the right operand (the decode
kernels' form, `experts.py`) it would be written to shared memory and read back first. The output-column
blocks of a tile are the grid's fastest axis: the programs that share a tile's activation rows run together
and find them in L2. Products in fp16 (e4m3 widens to fp16 in one instruction) or bf16, fp32 accumulation;
fp32 activations (and the interpreter) multiply in fp32 ("ieee"). Weights and scales are addressed as in
`experts.py` (the shared expert at fixed offsets from the stacked routed tensors).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .experts import _swiglu, down_tile, expert_columns, gate_up_tiles


@triton.jit
def _wx(w, xt, scale, F32: tl.constexpr, HALF: tl.constexpr):
    """The weight tile w [BN, BK] times activations xt [BK, BM], scaled: [BN, BM] fp32."""
    if F32:
        acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
    elif HALF:
        acc = tl.dot(w.to(tl.float16), xt.to(tl.float16))
    else:
        acc = tl.dot(w.to(xt.dtype), xt)
    return acc * scale


@triton.jit
def _tile(slot_expert_ptr, slot_start_ptr, slot_count_ptr, rows_ptr, slot, BLOCK_M: tl.constexpr):
    """The slot's expert, its rows p [BLOCK_M] (pair indices) and their mask."""
    e = tl.load(slot_expert_ptr + slot)
    r = tl.arange(0, BLOCK_M)
    rmask = r < tl.load(slot_count_ptr + slot)
    p = tl.load(rows_ptr + tl.load(slot_start_ptr + slot) + r, mask=rmask, other=0)
    return e, p, rmask


@triton.jit
def gate_up_rows_kernel(x_ptr, wg_ptr, wu_ptr, sg_ptr, su_ptr, h_ptr,
                        slot_expert_ptr, slot_start_ptr, slot_count_ptr, rows_ptr, n_slots_ptr,
                        shared_wg, shared_wu, shared_sg, shared_su,
                        T, N, K, stride_x, limit,
                        TOP_K: tl.constexpr, HAS_SCALE: tl.constexpr, F32: tl.constexpr, HALF: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """h[p, n] = silu(min(g, limit)) * clamp(u, -limit, limit) for the tile's rows p, g = Wg[e] x[token(p)]
    and u likewise (token(p) = p // TOP_K for routed pairs, p - T * TOP_K for the shared expert's rows)."""
    pid_n = tl.program_id(0)
    slot = tl.program_id(1)
    if slot >= tl.load(n_slots_ptr):
        return
    e, p, rmask = _tile(slot_expert_ptr, slot_start_ptr, slot_count_ptr, rows_ptr, slot, BLOCK_M)
    tok = tl.where(p >= T * TOP_K, p - T * TOP_K, p // TOP_K)
    wg_off, sg_off, n, nmask = expert_columns(e, pid_n, shared_wg, shared_sg, N, K, BLOCK_N)
    wu_off, su_off, n, nmask = expert_columns(e, pid_n, shared_wu, shared_su, N, K, BLOCK_N)
    acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        xt = tl.load(x_ptr + tok[None, :] * stride_x + k[:, None], mask=kmask[:, None] & rmask[None, :], other=0.0)
        wg, wu, sg, su = gate_up_tiles(wg_ptr, wu_ptr, sg_ptr, su_ptr, wg_off, wu_off, sg_off, su_off, n, nmask, k,
                                       kmask, k0, K, HAS_SCALE)
        acc_g += _wx(wg, xt, sg, F32, HALF)
        acc_u += _wx(wu, xt, su, F32, HALF)
    h = _swiglu(acc_g, acc_u, limit)
    tl.store(h_ptr + p[None, :] * N + n[:, None], h.to(h_ptr.dtype.element_ty), mask=nmask[:, None] & rmask[None, :])


@triton.jit
def down_rows_kernel(h_ptr, w_ptr, s_ptr, weights_ptr, y_ptr,
                     slot_expert_ptr, slot_start_ptr, slot_count_ptr, rows_ptr, n_slots_ptr,
                     shared_w, shared_s, T, N, K,
                     TOP_K: tl.constexpr, HAS_SCALE: tl.constexpr, F32: tl.constexpr, HALF: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[p, n] = weight(p) * (Wd[e] h[p])[n] in fp32 for the tile's rows p (weight 1 for the shared expert's
    rows, the routing weight of pair p otherwise)."""
    pid_n = tl.program_id(0)
    slot = tl.program_id(1)
    if slot >= tl.load(n_slots_ptr):
        return
    e, p, rmask = _tile(slot_expert_ptr, slot_start_ptr, slot_count_ptr, rows_ptr, slot, BLOCK_M)
    w_off, s_off, n, nmask = expert_columns(e, pid_n, shared_w, shared_s, N, K, BLOCK_N)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        ht = tl.load(h_ptr + p[None, :] * K + k[:, None], mask=kmask[:, None] & rmask[None, :], other=0.0)
        w, s = down_tile(w_ptr, s_ptr, w_off, s_off, n, nmask, k, kmask, k0, K, HAS_SCALE)
        acc += _wx(w, ht, s, F32, HALF)
    wt = tl.load(weights_ptr + p, mask=rmask & (p < T * TOP_K), other=1.0)
    tl.store(y_ptr + p[None, :] * N + n[:, None], acc * wt[None, :], mask=nmask[:, None] & rmask[None, :])
