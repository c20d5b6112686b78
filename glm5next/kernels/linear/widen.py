"""FP8 block-scaled weights widened to 16 or 32 bits in one launch: what a prefill chunk's dense linears
hand to cuBLAS.

`widen_fp8(w, s, dtype)` is `checkpoint.fp8.dequantize_fp8(w, s, dtype)` (each e4m3 value times its 128x128
block's fp32 scale, rounded once to `dtype`): the same values, read once (1 byte an element) and written once,
where the PyTorch form builds full-size fp32 temporaries (the repeated scales, the widened weight, their
product) on the way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...checkpoint.fp8 import FP8_DTYPE, scale_shape

BLOCK_N = 32
BLOCK_K = 128
"""A program's tile (both divide the 128-wide scale block, so a tile has one scale)."""


@triton.jit
def widen_kernel(w_ptr, s_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out [N, K] = w [N, K] (e4m3) times its block scale s [ceil(N/128), ceil(K/128)], rounded to out's dtype."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (n < N)[:, None] & (k < K)[None, :]
    w = tl.load(w_ptr + n[:, None].to(tl.int64) * K + k[None, :], mask=mask, other=0.0)
    scale = tl.load(s_ptr + (pid_n * BLOCK_N // 128) * tl.cdiv(K, 128) + pid_k * BLOCK_K // 128)
    tl.store(out_ptr + n[:, None].to(tl.int64) * K + k[None, :], (w.to(tl.float32) * scale).to(out_ptr.dtype.element_ty),
             mask=mask)


def widen_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """The FP8 `weight` [N, K] times its block scales `scale_inv` [ceil(N/128), ceil(K/128)] (taken in fp32, as
    `dequantize_fp8` takes them) as `dtype` [N, K] (bf16, fp16 or fp32): `dequantize_fp8`'s values in one
    launch (into `out`, contiguous, when given)."""
    if weight.dtype != FP8_DTYPE or weight.dim() != 2:
        raise ValueError(f"widen_fp8 takes a 2-D {FP8_DTYPE} weight, got {weight.dtype} {tuple(weight.shape)}")
    if tuple(scale_inv.shape) != scale_shape(tuple(weight.shape)):
        raise ValueError(f"widen_fp8: block scales {tuple(scale_inv.shape)} do not fit a weight "
                         f"{tuple(weight.shape)} (expected {scale_shape(tuple(weight.shape))})")
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"widen_fp8 writes bf16, fp16 or fp32, not {dtype}")
    n, k = weight.shape
    if out is None:
        out = torch.empty(n, k, dtype=dtype, device=weight.device)
    elif out.shape != weight.shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"widen_fp8: out must be a contiguous {dtype} {tuple(weight.shape)} tensor")
    widen_kernel[(triton.cdiv(n, BLOCK_N), triton.cdiv(k, BLOCK_K))](
        weight.contiguous(), scale_inv.float().contiguous(), out, n, k, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out
