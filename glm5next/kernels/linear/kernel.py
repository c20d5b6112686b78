"""Triton kernels of the skinny projections: a decode step's few rows times big weights.

One kernel serves every entry point. A program owns a BLOCK_N slice of one projection's
output columns for all M rows (padded to BLOCK_M) and one split of the K range; it streams
its weight tile once along K (unit stride, so loads coalesce and vectorise) and accumulates
in fp32 with `tl.dot` (M padded to 16: the weight tiles travel through the multi-stage shared-memory
pipeline, by cp.async or, from tensor descriptors, by TMA bulk copies). bf16/fp16 activations meet bf16/fp16-widened
weights on the tensor cores; fp32 activations or fp32 weights use tf32x3 (about fp32
accuracy), fed in small K chunks so the split operands fit in registers. On CPU (the
interpreter, whose bf16 products are wrong) everything is widened to fp32 first.

FP8 weights are decoded in registers: the raw e4m3 value is widened exactly, multiplied by
the activations, and the partial product of each K chunk of at most 128 is scaled by its single
128x128 block scale. That holds because BLOCK_N divides 128, BLOCK_K is a multiple or a divisor
of 128, and tiles start on multiples of themselves, so a chunk never straddles two scale blocks.

Split-K is deterministic and needs one launch: each split stores its fp32 partial tile,
bumps a per-tile counter, and the program that arrives last sums every partial in split
order, applies the epilogue (a cast, or the clamped SwiGLU of the gated variant), writes
the output and resets the counter to zero for the next launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import pdl as _pdl
from ..pdl import launch_dependents, prefetch_l2, wait_previous

MAX_PROJECTIONS = 6
COUNTER_SLOTS = 1 << 14
"""Per-device split-K arrival counters: one per output tile of a launch (all zero between launches)."""
_counters: dict[tuple[str, int | None], torch.Tensor] = {}


@dataclass(frozen=True)
class LaunchPlan:
    """The launch parameters of one skinny projection call."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    """K splits (each program covers ceil(K steps / split_k) steps); the launch grid is (tiles, split_k)."""
    num_warps: int = 4
    num_stages: int = 4
    f32_sub_k: int = 32
    """K chunk of one fp32 (tf32x3) product inside a BLOCK_K step, bounding its registers."""
    tma: bool = False
    """Load the (FP8) weight tiles with the tensor-memory accelerator (Hopper's bulk tensor copy, from
    a host-built descriptor per weight) instead of per-thread loads; out-of-range rows and columns
    arrive as zeros."""
    half: bool = False
    """FP8 weights meet 16-bit activations in fp16 products (e4m3 widens to fp16 in one instruction per
    pair; bf16 activations convert exactly for 2^-14 <= |x| < 65504, and below that lose bits only where
    their products are below fp32's accumulation error). A program whose products come out non-finite
    redoes its share in bf16 products."""
    tiles: int = 0
    """Output tiles of BLOCK_N columns over every projection: the launch grid is (tiles, split_k)."""
    pdl: bool = False
    """Launch as a programmatic dependent (`glm5next.kernels.pdl`): the programs start while the
    previous kernel finishes and first pull the leading K steps of their weight tiles into L2 (as
    many as keep a launch's prefetch within `PREFETCH_BYTES`), then wait for it."""
    pdl_late: bool = False
    """With `pdl`, release the next kernel only once a program's products are done (before its split-K
    epilogue) instead of at its start, so the next launch's programs do not take SM slots and L2 while
    this one still streams its weights."""


PREFETCH_BYTES = 32 << 20
"""Most weight bytes one launch pulls into L2 before its wait (the H200's L2 holds 60 MB)."""


@triton.jit
def _prefetch_tile(w_ptr, local, pid_k, N, K, ITERS, PF_ITERS, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """L2 prefetch of the first PF_ITERS K steps of a program's weight tile: one bulk copy per row."""
    ELEM: tl.constexpr = w_ptr.dtype.element_ty.primitive_bitwidth // 8
    rows = local * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = pid_k * ITERS * BLOCK_K
    nbytes = tl.minimum(PF_ITERS * BLOCK_K, K - k0) * ELEM
    prefetch_l2(w_ptr + rows.to(tl.int64) * K + k0, nbytes, rows < N)


@triton.jit
def _mma(xt, wt, F32: tl.constexpr):
    """[BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] in fp32 accumulation."""
    if F32:
        return tl.dot(xt.to(tl.float32), wt.to(tl.float32), input_precision="tf32x3")  # ~fp32 accuracy
    return tl.dot(xt, wt.to(xt.dtype))  # exact for FP8 values; bf16 weights unchanged


@triton.jit
def _weight_tile(w_ptr, w_offs, w_ok, n0, k0, TMA: tl.constexpr):
    """The weight tile [SUB, BLOCK_N] of the chunk at k0."""
    if TMA:
        wt = tl.trans(w_ptr.load([n0, k0]))  # [BLOCK_N, SUB] through a tensor descriptor
    else:
        wt = tl.load(w_ptr + w_offs + k0, mask=w_ok, other=0.0)
    return wt


@triton.jit
def _chunk(x_ptrs, w_ptr, w2_ptr, w_offs, kk, row_ok, col_ok, K, n0, k0, s_ptr, s2_ptr, s_row, F32: tl.constexpr,
           TWO: tl.constexpr, IS_FP8: tl.constexpr, HALF: tl.constexpr, TMA: tl.constexpr):
    """The products of the K chunk starting at k0 with W (and W2 when TWO; else W again, unused),
    each times its 128x128 block scale when IS_FP8 (a chunk never spans two scale blocks). With TMA
    w_ptr and w2_ptr are tensor descriptors of [BLOCK_N, SUB] blocks."""
    k_ok = (k0 + kk) < K
    xt = tl.load(x_ptrs + k0, mask=row_ok & k_ok[None, :], other=0.0)
    if HALF and IS_FP8:
        xt = xt.to(tl.float16)  # the weights then widen to fp16 in _mma (F32 is then false)
    w_ok = k_ok[:, None] & col_ok
    part = _mma(xt, _weight_tile(w_ptr, w_offs, w_ok, n0, k0, TMA), F32)
    # A chunk wholly past K (the second half of a 256-wide last step) has no scale block: its products
    # are zeros, and the masked load keeps whatever lies past the scales (a NaN, say) out of them.
    s_ok = k0 < K
    if IS_FP8:
        part = part * tl.load(s_ptr + s_row + k0 // 128, mask=s_ok, other=0.0)
    part2 = part
    if TWO:
        part2 = _mma(xt, _weight_tile(w2_ptr, w_offs, w_ok, n0, k0, TMA), F32)
        if IS_FP8:
            part2 = part2 * tl.load(s2_ptr + s_row + k0 // 128, mask=s_ok, other=0.0)
    return part, part2


@triton.jit
def _accumulate(x_ptr, stride_xm, M, K, w_ptr, s_ptr, w2_ptr, s2_ptr, s_stride, n0, N, it0, n_it,
                IS_FP8: tl.constexpr, F32: tl.constexpr, TWO: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F32_SUB: tl.constexpr,
                HALF: tl.constexpr, TMA: tl.constexpr):
    """x[:, K range] @ W[n0:n0+BLOCK_N, K range].T (and the same with W2 when TWO), in fp32."""
    # fp32 products (tf32x3) hold 3 operand copies in registers: feed them F32_SUB K at a time;
    # an FP8 chunk stays within one 128-wide scale block. fp16 products (HALF, FP8 weights) take
    # precedence over F32, which the interpreter sets for every projection of 16-bit activations.
    PROD32: tl.constexpr = F32 and not (HALF and IS_FP8)
    WIDE: tl.constexpr = F32_SUB if PROD32 else BLOCK_K
    SUB: tl.constexpr = min(WIDE, 128) if IS_FP8 else WIDE
    cols = n0 + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, SUB)
    s_row = (n0 // 128) * s_stride
    rows = tl.arange(0, BLOCK_M)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + kk[None, :]
    row_ok = rows[:, None] < M
    w_offs = cols[None, :] * K + kk[:, None]  # [SUB, BLOCK_N] view of the row-major W[n, k]
    col_ok = cols[None, :] < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for i in range(n_it):
        k0 = (it0 + i) * BLOCK_K
        for c in tl.static_range(0, BLOCK_K, SUB):
            part, part2 = _chunk(x_ptrs, w_ptr, w2_ptr, w_offs, kk, row_ok, col_ok, K, n0, k0 + c, s_ptr, s2_ptr,
                                 s_row, PROD32, TWO, IS_FP8, HALF, TMA)
            acc += part
            if TWO:
                acc2 += part2
    return acc, acc2


@triton.jit
def _finish(acc, acc2, o_ptr, stride_om, n0, M, N, limit, o16_ptr, TWO: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, O16: tl.constexpr):
    """Store the tile (after the clamped SwiGLU of gate=acc, up=acc2 when TWO); with O16 the stored
    values in fp16 to o16_ptr as well (the output's strides)."""
    rows = tl.arange(0, BLOCK_M)
    cols = n0 + tl.arange(0, BLOCK_N)
    val = acc
    if TWO:
        g = tl.minimum(acc, limit)
        u = tl.minimum(tl.maximum(acc2, -limit), limit)
        val = g / (1.0 + tl.exp(-g)) * u
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    out = val.to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + rows[:, None] * stride_om + cols[None, :], out, mask=mask)
    if O16:
        tl.store(o16_ptr + rows[:, None] * stride_om + cols[None, :], out.to(tl.float16), mask=mask)


@triton.jit
def _project(x_ptr, stride_xm, M, K, K_ITERS, ITERS, split, tile, local, pid_k, ws_ptr, cnt_ptr,
             num_tiles, limit, s_stride, w_ptr, s_ptr, w2_ptr, s2_ptr, o_ptr, stride_om, N, r_ptr, r2_ptr, pf_iters,
             xb_ptr, o16_ptr, IS_FP8: tl.constexpr, F32: tl.constexpr, TWO: tl.constexpr,
             SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             F32_SUB: tl.constexpr, HALF: tl.constexpr, TMA: tl.constexpr,
             PDL: tl.constexpr, PDL_LATE: tl.constexpr, O16: tl.constexpr):
    """One program's share of one projection: tile `local` of it, K split `pid_k`. With PDL it first lets
    the next kernel start (with PDL_LATE only after its products), prefetches its weight tiles' first
    pf_iters K steps into L2 (from the plain pointers r_ptr / r2_ptr), then waits for the previous kernel."""
    n0 = local * BLOCK_N
    it0 = pid_k * ITERS
    n_it = tl.minimum(ITERS, K_ITERS - it0)
    if PDL:
        if not PDL_LATE:
            launch_dependents()
        if pf_iters > 0:
            _prefetch_tile(r_ptr, local, pid_k, N, K, ITERS, pf_iters, BLOCK_N, BLOCK_K)
            if TWO:
                _prefetch_tile(r2_ptr, local, pid_k, N, K, ITERS, pf_iters, BLOCK_N, BLOCK_K)
        wait_previous()
    acc, acc2 = _accumulate(x_ptr, stride_xm, M, K, w_ptr, s_ptr, w2_ptr, s2_ptr, s_stride, n0, N, it0, n_it,
                            IS_FP8, F32, TWO, BLOCK_M, BLOCK_N, BLOCK_K, F32_SUB, HALF, TMA)
    if HALF and IS_FP8:
        # An activation beyond fp16's range (|x| >= 65504) makes this program's products non-finite
        # (inf, or NaN against a zero weight): it then redoes its share in bf16 products (fp32 in the
        # interpreter), so the result is that path's whatever the activations.
        ok = tl.abs(acc) < 3.0e38
        if TWO:
            ok = ok & (tl.abs(acc2) < 3.0e38)
        if tl.min(ok.to(tl.int32)) == 0:
            acc, acc2 = _accumulate(xb_ptr, stride_xm, M, K, w_ptr, s_ptr, w2_ptr, s2_ptr, s_stride, n0, N, it0,
                                    n_it, IS_FP8, F32, TWO, BLOCK_M, BLOCK_N, BLOCK_K, F32_SUB, False, TMA)
    if PDL and PDL_LATE:
        launch_dependents()
    if SPLIT:
        TILE: tl.constexpr = BLOCK_M * BLOCK_N
        PARTS: tl.constexpr = 2 if TWO else 1
        r = tl.arange(0, BLOCK_M)
        c = tl.arange(0, BLOCK_N)
        keep = (r[:, None] < M) & (c[None, :] < BLOCK_N)
        mine = ws_ptr + tile * (PARTS * TILE) + r[:, None] * BLOCK_N + c[None, :]
        split_stride = num_tiles * (PARTS * TILE)
        tl.store(mine + pid_k * split_stride, acc, mask=keep)
        if TWO:
            tl.store(mine + pid_k * split_stride + TILE, acc2, mask=keep)
        tl.debug_barrier()  # every thread's partial is written before the release below
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == split - 1:
            tot = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            tot2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(split):  # fixed order: the result does not depend on who came last
                tot += tl.load(mine + s * split_stride, mask=keep, other=0.0, cache_modifier=".cg")
                if TWO:
                    tot2 += tl.load(mine + s * split_stride + TILE, mask=keep, other=0.0, cache_modifier=".cg")
            _finish(tot, tot2, o_ptr, stride_om, n0, M, N, limit, o16_ptr, TWO, BLOCK_M, BLOCK_N, O16)
            tl.store(cnt_ptr + tile, 0)
    else:
        _finish(acc, acc2, o_ptr, stride_om, n0, M, N, limit, o16_ptr, TWO, BLOCK_M, BLOCK_N, O16)


@triton.jit
def _member(x_ptr, stride_xm, M, K, K_ITERS, ITERS, split, tile, lo, hi, pid_k, ws_ptr, cnt_ptr, num_tiles, limit,
            s_stride, w, s, o, so, N, r, pf_iters, xb_ptr,
            IS_FP8: tl.constexpr, F32: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F32_SUB: tl.constexpr, HALF: tl.constexpr,
            TMA: tl.constexpr, PDL: tl.constexpr, PDL_LATE: tl.constexpr):
    """The program's share of an ungated projection that owns tiles [lo, hi), if `tile` is one of them."""
    if (tile >= lo) & (tile < hi):
        _project(x_ptr, stride_xm, M, K, K_ITERS, ITERS, split, tile, tile - lo, pid_k, ws_ptr, cnt_ptr, num_tiles,
                 limit, s_stride, w, s, w, s, o, so, N, r, r, pf_iters, xb_ptr, xb_ptr, IS_FP8, F32, False, SPLIT,
                 BLOCK_M, BLOCK_N, BLOCK_K, F32_SUB, HALF, TMA, PDL, PDL_LATE, False)


@triton.jit
def skinny_kernel(x_ptr, stride_xm, M, K, K_ITERS, ITERS, split, ws_ptr, cnt_ptr, num_tiles, limit, s_stride,
                  up_w, up_s,
                  w0, s0, o0, so0, N0, T1,
                  w1, s1, o1, so1, N1, T2,
                  w2, s2, o2, so2, N2, T3,
                  w3, s3, o3, so3, N3, T4,
                  w4, s4, o4, so4, N4, T5,
                  w5, s5, o5, so5, N5,
                  pf_iters, up_r, r0, r1, r2, r3, r4, r5, xb_ptr, o16_ptr,
                  NUM: tl.constexpr, FP8_MASK: tl.constexpr, F32_MASK: tl.constexpr, TWO: tl.constexpr,
                  SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  F32_SUB: tl.constexpr, HALF: tl.constexpr, TMA: tl.constexpr, PDL: tl.constexpr,
                  PDL_LATE: tl.constexpr, O16: tl.constexpr = False):
    """Grid (num_tiles, split). Projection p owns tiles [T_p, T_{p+1}) (T_0 = 0, T_NUM = num_tiles);
    bit p of FP8_MASK / F32_MASK says whether its weight is FP8 / whether it multiplies in fp32.
    With TWO (one projection only) projection 0 is the gate and up_w/up_s the up weight. With TMA every
    weight (w_p, up_w) is a tensor descriptor. x_ptr holds the activations the products take (with HALF
    possibly an fp16 copy of them), xb_ptr (same strides) the activations as given, for the bf16 redo of a
    program whose fp16 products overflow. r_p / up_r are the weights' plain pointers, for the L2 prefetch
    of a programmatic-dependent launch (PDL). With O16 (one projection only) projection 0's output goes in
    fp16 to o16_ptr as well."""
    tile = tl.program_id(0)
    pid_k = tl.program_id(1)
    if tile < T1:
        _project(x_ptr, stride_xm, M, K, K_ITERS, ITERS, split, tile, tile, pid_k, ws_ptr, cnt_ptr, num_tiles,
                 limit, s_stride, w0, s0, up_w, up_s, o0, so0, N0, r0, up_r, pf_iters, xb_ptr, o16_ptr,
                 FP8_MASK & 1, F32_MASK & 1, TWO, SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, F32_SUB, HALF, TMA,
                 PDL, PDL_LATE, O16)
    if NUM > 1:
        _member(x_ptr, stride_xm, M, K, K_ITERS, ITERS, split, tile, T1, T2, pid_k, ws_ptr, cnt_ptr, num_tiles, limit,
                s_stride, w1, s1, o1, so1, N1, r1, pf_iters, xb_ptr, (FP8_MASK >> 1) & 1, (F32_MASK >> 1) & 1, SPLIT,
                BLOCK_M, BLOCK_N, BLOCK_K, F32_SUB, HALF, TMA, PDL, PDL_LATE)
    if NUM > 2:
        _member(x_ptr, stride_xm, M, K, K_ITERS, ITERS, split, tile, T2, T3, pid_k, ws_ptr, cnt_ptr, num_tiles, limit,
                s_stride, w2, s2, o2, so2, N2, r2, pf_iters, xb_ptr, (FP8_MASK >> 2) & 1, (F32_MASK >> 2) & 1, SPLIT,
                BLOCK_M, BLOCK_N, BLOCK_K, F32_SUB, HALF, TMA, PDL, PDL_LATE)
    if NUM > 3:
        _member(x_ptr, stride_xm, M, K, K_ITERS, ITERS, split, tile, T3, T4, pid_k, ws_ptr, cnt_ptr, num_tiles, limit,
                s_stride, w3, s3, o3, so3, N3, r3, pf_iters, xb_ptr, (FP8_MASK >> 3) & 1, (F32_MASK >> 3) & 1, SPLIT,
                BLOCK_M, BLOCK_N, BLOCK_K, F32_SUB, HALF, TMA, PDL, PDL_LATE)
    if NUM > 4:
        _member(x_ptr, stride_xm, M, K, K_ITERS, ITERS, split, tile, T4, T5, pid_k, ws_ptr, cnt_ptr, num_tiles, limit,
                s_stride, w4, s4, o4, so4, N4, r4, pf_iters, xb_ptr, (FP8_MASK >> 4) & 1, (F32_MASK >> 4) & 1, SPLIT,
                BLOCK_M, BLOCK_N, BLOCK_K, F32_SUB, HALF, TMA, PDL, PDL_LATE)
    if NUM > 5:
        _member(x_ptr, stride_xm, M, K, K_ITERS, ITERS, split, tile, T5, num_tiles, pid_k, ws_ptr, cnt_ptr, num_tiles,
                limit, s_stride, w5, s5, o5, so5, N5, r5, pf_iters, xb_ptr, (FP8_MASK >> 5) & 1, (F32_MASK >> 5) & 1,
                SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, F32_SUB, HALF, TMA, PDL, PDL_LATE)


def tile_counters(device: torch.device) -> torch.Tensor:
    """The device's split-K counters, created (zeroed) on first use, which must precede any capture."""
    key = (device.type, device.index)
    buf = _counters.get(key)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("run a split-K skinny projection once before capturing a CUDA graph: "
                               "its tile counters are allocated on first use")
        buf = _counters[key] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return buf


def _aligned16(weights: list[torch.Tensor]) -> bool:
    """What a plan cannot know from shapes alone: whether every weight's base and rows are 16-byte aligned,
    as tensor descriptors (`tma`; the plan already holds every weight FP8, the activations 16-bit,
    BLOCK_K <= 128) and the bulk L2 prefetch of `pdl` (whole 16-byte pieces) need."""
    return all(w.shape[1] * w.element_size() % 16 == 0 and w.data_ptr() % 16 == 0 for w in weights)


def _prefetch_iters(weights: list[torch.Tensor], iters: int) -> int:
    """K steps per program a programmatic-dependent launch prefetches: all of them while the launch's
    weights fit in PREFETCH_BYTES, else that share; none where rows or bases are not 16-byte aligned."""
    if not _aligned16(weights):
        return 0
    total = sum(w.numel() * w.element_size() for w in weights)
    return iters if total <= PREFETCH_BYTES else iters * PREFETCH_BYTES // total


def launch(x: torch.Tensor, weights: list[torch.Tensor], scales: list[torch.Tensor | None],
           outs: list[torch.Tensor], plan: LaunchPlan, up: tuple[torch.Tensor, torch.Tensor | None] | None = None,
           limit: float = 0.0, x16: torch.Tensor | None = None, out16: torch.Tensor | None = None) -> None:
    """Run `skinny_kernel` for validated arguments: outs[p] = x @ dequant(weights[p]).T, or with `up`
    (one projection) outs[0] = swiglu(x @ gate.T, x @ up.T) clamped at `limit`. `x16` (x in fp16, x's
    strides) feeds the products where they are fp16 and every weight FP8, so no program converts x;
    `out16` (one projection; outs[0]'s strides) receives outs[0] in fp16 as well."""
    M, K = x.shape
    bm, bn, bk = plan.block_m, plan.block_n, plan.block_k
    bounds, total = [], 0
    for w in weights:
        total += triton.cdiv(w.shape[0], bn)
        bounds.append(total)
    k_iters = triton.cdiv(K, bk)
    iters = triton.cdiv(k_iters, max(1, min(plan.split_k, k_iters)))
    split = triton.cdiv(k_iters, iters)
    parts = 2 if up is not None else 1
    if split > 1:
        if total > COUNTER_SLOTS:
            raise ValueError(f"{total} output tiles exceed the {COUNTER_SLOTS} split-K counters; raise block_n")
        if split * total * parts * bm * bn >= 2**31:
            raise ValueError("the split-K workspace would need 64-bit offsets; lower split_k")
        ws = torch.empty(split * total * parts * bm * bn, dtype=torch.float32, device=x.device)
        cnt = tile_counters(x.device)
    else:
        ws = cnt = x
    on_cpu = x.device.type == "cpu"  # the interpreter multiplies bf16 wrongly: widen everything there
    every = weights + ([] if up is None else [up[0]])
    tma = plan.tma and _aligned16(every)

    def operand(w: torch.Tensor):  # with TMA a descriptor (built per call: a CUDA graph keeps its bytes)
        return TensorDescriptor.from_tensor(w, [bn, bk]) if tma else w

    every_fp8 = all(s is not None for s in scales) and (up is None or up[1] is not None)
    xa = x16 if x16 is not None and plan.half and every_fp8 else x  # the activations the products take

    fp8_mask = f32_mask = 0
    s_stride = 1
    per_proj = []
    for p in range(MAX_PROJECTIONS):
        if p < len(weights):
            w, s, o = weights[p], scales[p], outs[p]
            if s is not None:
                fp8_mask |= 1 << p
                s_stride = s.stride(0)
            if on_cpu or x.dtype == torch.float32 or (s is None and w.dtype != x.dtype):
                f32_mask |= 1 << p
            per_proj += [operand(w), w if s is None else s, o, o.stride(0), w.shape[0]]
        else:
            per_proj += [x, x, x, 0, 0]
        if p < MAX_PROJECTIONS - 1:
            per_proj.append(bounds[p] if p < len(weights) else total)
    up_w, up_s = (x, x) if up is None else (operand(up[0]), up[0] if up[1] is None else up[1])
    pdl = plan.pdl and _pdl.enabled(x.device)
    pf_iters = _prefetch_iters(every, iters) if pdl else 0
    raw = [x if up is None else up[0]] + [weights[p] if p < len(weights) else x for p in range(MAX_PROJECTIONS)]
    skinny_kernel[(total, split)](
        xa, x.stride(0), M, K, k_iters, iters, split, ws, cnt, total, float(limit), s_stride, up_w, up_s, *per_proj,
        pf_iters, *raw, x, x if out16 is None else out16,
        NUM=len(weights), FP8_MASK=fp8_mask, F32_MASK=f32_mask, TWO=up is not None, SPLIT=split > 1,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, F32_SUB=min(plan.f32_sub_k, bk), HALF=plan.half, TMA=tma, PDL=pdl,
        PDL_LATE=pdl and plan.pdl_late, O16=out16 is not None,
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
        **({"launch_pdl": True} if pdl else {}))
