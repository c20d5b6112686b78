"""Experiment: the prefill experts with every operand read by the tensor memory accelerator (TMA).

The shipped prefill kernels (`glm5next/kernels/moe/prefill.py`) gather each tile's activation rows through
per-row pointers and address the weight tiles element by element: every program spends registers and
instructions on addresses beside the two fp32 accumulators and the widened weight tile. Here the
activations are first gathered once into the routing's order (`xs[j] = x[token(rows[j])]`, fp16: bf16 ->
fp16 is exact in fp16's range), so a tile's rows are contiguous; then both the activation tile and the FP8
weight tiles load as TMA boxes (host-side tensor descriptors: routed weights viewed as [E * N, K], the
shared expert's as its own [N, K]), and gate|up writes h in the same order, which down reads as boxes too.
Products and numerics as the shipped plan (the widened weight the left operand, fp16 products, fp32
accumulation, one block scale per K step).

    python benchmarks/moe_prefill_tma.py        # the interpreter against moe_prefill (CPU)

On a GPU, `benchmarks/moe_prefill.py` times `VARIANTS` beside the shipped plan.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from glm5next.kernels.moe import ExpertWeights, Routing, group_rows, moe_prefill
from glm5next.kernels.moe.experts import _offset, _swiglu, combine_kernel


@triton.jit
def _wx(w, xt, scale, F32: tl.constexpr):
    """The weight tile w [BN, BK] times activations xt [BK, BM], scaled: [BN, BM] fp32."""
    if F32:
        return tl.dot(w.to(tl.float32), xt.to(tl.float32), input_precision="ieee") * scale
    return tl.dot(w.to(tl.float16), xt) * scale


@triton.jit
def _gate_up_loop(xd, gd, ud, row0, wrow, sg_ptr, su_ptr, K, F32: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        xt = tl.trans(xd.load([row0, k0]))
        acc_g += _wx(gd.load([wrow, k0]), xt, tl.load(sg_ptr + k0 // 128), F32)
        acc_u += _wx(ud.load([wrow, k0]), xt, tl.load(su_ptr + k0 // 128), F32)
    return acc_g, acc_u


@triton.jit
def gate_up_tma_kernel(xd, gd, ud, shared_gd, shared_ud, sg_ptr, su_ptr, h_ptr,
                       slot_expert_ptr, slot_start_ptr, slot_count_ptr, n_slots_ptr, shared_sg, shared_su,
                       N, K, limit, F32: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """hs[j, n] = silu(min(g, limit)) * clamp(u, -limit, limit) for the tile's sorted rows j; xs, the
    weights (FP8 [E * N, K] and the shared expert's [N, K]) through descriptors."""
    pid_n = tl.program_id(0)
    slot = tl.program_id(1)
    if slot >= tl.load(n_slots_ptr):
        return
    e = tl.load(slot_expert_ptr + slot)
    start = tl.load(slot_start_ptr + slot)
    count = tl.load(slot_count_ptr + slot)
    ks = tl.cdiv(K, 128)
    s_row = (pid_n * BLOCK_N // 128) * ks
    sg = sg_ptr + _offset(e, tl.cdiv(N, 128) * ks, shared_sg) + s_row
    su = su_ptr + _offset(e, tl.cdiv(N, 128) * ks, shared_su) + s_row
    if e < 0:
        acc_g, acc_u = _gate_up_loop(xd, shared_gd, shared_ud, start, pid_n * BLOCK_N, sg, su, K, F32,
                                     BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        acc_g, acc_u = _gate_up_loop(xd, gd, ud, start, e * N + pid_n * BLOCK_N, sg, su, K, F32,
                                     BLOCK_M, BLOCK_N, BLOCK_K)
    h = _swiglu(acc_g, acc_u, limit)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_M)
    tl.store(h_ptr + (start + r)[None, :] * N + n[:, None], h.to(h_ptr.dtype.element_ty),
             mask=(n < N)[:, None] & (r < count)[None, :])


@triton.jit
def _down_loop(hd, wd, row0, wrow, s_ptr, K, F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        acc += _wx(wd.load([wrow, k0]), tl.trans(hd.load([row0, k0])), tl.load(s_ptr + k0 // 128), F32)
    return acc


@triton.jit
def down_tma_kernel(hd, wd, shared_wd, s_ptr, weights_ptr, y_ptr,
                    slot_expert_ptr, slot_start_ptr, slot_count_ptr, rows_ptr, n_slots_ptr, shared_s, T, N, K,
                    TOP_K: tl.constexpr, F32: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[p, n] = weight(p) * (Wd[e] hs[j])[n] in fp32 for the tile's sorted rows j (pair p = rows[j])."""
    pid_n = tl.program_id(0)
    slot = tl.program_id(1)
    if slot >= tl.load(n_slots_ptr):
        return
    e = tl.load(slot_expert_ptr + slot)
    start = tl.load(slot_start_ptr + slot)
    count = tl.load(slot_count_ptr + slot)
    ks = tl.cdiv(K, 128)
    s = s_ptr + _offset(e, tl.cdiv(N, 128) * ks, shared_s) + (pid_n * BLOCK_N // 128) * ks
    if e < 0:
        acc = _down_loop(hd, shared_wd, start, pid_n * BLOCK_N, s, K, F32, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        acc = _down_loop(hd, wd, start, e * N + pid_n * BLOCK_N, s, K, F32, BLOCK_M, BLOCK_N, BLOCK_K)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_M)
    rmask = r < count
    p = tl.load(rows_ptr + start + r, mask=rmask, other=0)
    wt = tl.load(weights_ptr + p, mask=rmask & (p < T * TOP_K), other=1.0)
    tl.store(y_ptr + p[None, :] * N + n[:, None], acc * wt[None, :], mask=(n < N)[:, None] & rmask[None, :])


def experts(x: torch.Tensor, w: ExpertWeights, r: Routing, limit: float, block_m: int, block_n: int,
            down_block_n: int, block_k: int, warps: int, stages: int) -> torch.Tensor:
    """The TMA kernels over routing `r` (tiles of at most `block_m` rows, `group_rows`) and the combine: [T, D]
    in x's dtype. FP8 experts only; fp16 products, fp32 ones for fp32 activations (the interpreter)."""
    t, d = x.shape
    e, n_inter, _ = w.gate.shape
    top_k = r.ids.shape[1]
    f32 = x.dtype == torch.float32
    act = torch.float32 if f32 else torch.float16
    rows = r.rows.long()
    tok = torch.where(rows >= t * top_k, rows - t * top_k, rows // top_k)
    xs = x.to(act).index_select(0, tok)
    hs = torch.empty(rows.numel(), n_inter, dtype=act, device=x.device)
    offs = w.shared_offsets()

    def desc(tensor, rows_box, cols_box):
        return TensorDescriptor.from_tensor(tensor, [rows_box, cols_box])

    consts = dict(F32=f32, BLOCK_M=block_m, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    gate_up_tma_kernel[(triton.cdiv(n_inter, block_n), r.max_slots)](
        desc(xs, block_m, block_k), desc(w.gate.view(e * n_inter, d), block_n, block_k),
        desc(w.up.view(e * n_inter, d), block_n, block_k), desc(w.shared_gate, block_n, block_k),
        desc(w.shared_up, block_n, block_k), w.gate_scale, w.up_scale, hs,
        r.slot_expert, r.slot_start, r.slot_count, r.n_slots, offs[3], offs[4], n_inter, d, float(limit),
        BLOCK_N=block_n, **consts)
    y = torch.empty(t * top_k + t, d, dtype=torch.float32, device=x.device)
    down_tma_kernel[(triton.cdiv(d, down_block_n), r.max_slots)](
        desc(hs, block_m, block_k), desc(w.down.view(e * d, n_inter), down_block_n, block_k),
        desc(w.shared_down, down_block_n, block_k), w.down_scale, r.weights, y,
        r.slot_expert, r.slot_start, r.slot_count, r.rows, r.n_slots, offs[5], t, d, n_inter,
        TOP_K=top_k, BLOCK_N=down_block_n, **consts)
    out = torch.empty(t, d, dtype=x.dtype, device=x.device)
    combine_kernel[(t, triton.cdiv(d, 1024))](y, y, out, t, d, out.stride(0), TOP_K=top_k, HAS_SLOTS=False,
                                             BLOCK_N=1024)
    return out


def check() -> None:
    """The interpreter (fp32): the TMA kernels against moe_prefill at odd sizes, experts over several tiles."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from test_kernels_moe import random_weights  # noqa: PLC0415 - the tests' random experts

    e, d, i, k, t = 13, 192, 256, 3, 37
    w = random_weights(e, d, i, seed=3)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(3))
    ids = torch.stack([torch.randperm(e, generator=torch.Generator().manual_seed(j))[:k] for j in range(t)])
    weights = torch.rand(t, k, generator=torch.Generator().manual_seed(4))
    want = moe_prefill(x, ids, weights, w, 10.0)
    for bm, bn, bk in ((16, 64, 64), (32, 128, 128)):
        got = experts(x, w, group_rows(ids, weights, e, bm), 10.0, bm, bn, bn, bk, 4, 1)
        err = float((got - want).abs().max() / want.abs().max())
        print(f"tiles {bm} x {bn} x {bk}: against moe_prefill {err:.1e}")
        assert err < 1e-5, err


VARIANTS = {  # name: (block_m, block_n, down_block_n, block_k, warps, stages): `experts`' arguments after limit
    "tma m64 n64/64 k128 w4 s3": (64, 64, 64, 128, 4, 3),
    "tma m64 n64/64 k128 w4 s4": (64, 64, 64, 128, 4, 4),
    "tma m64 n128/128 k128 w8 s3": (64, 128, 128, 128, 8, 3),
    "tma m128 n64/64 k128 w8 s3": (128, 64, 64, 128, 8, 3),
    "tma m128 n128/128 k64 w8 s3": (128, 128, 128, 64, 8, 3),
}


if __name__ == "__main__":
    check()
