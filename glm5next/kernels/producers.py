"""Kernels that produce a projection's input and, beside it, its fp16 copy.

An FP8 projection that multiplies in fp16 (`glm5next.kernels.linear.reads_x16`) reads an fp16 copy of
its bf16 input when one is given, instead of converting the activation tiles in every program at every
K step. The fused boundary and the gate|up write such copies of their outputs; these two kernels do the
same for inputs that stock code produces in a step:

- `rms_norm`: `glm5next.model.norm.rms_norm` of rows (in the DSA attention, the q_a norm, whose output
  the q_b and the indexer's wq_b read), in one launch instead of the stock code's chain of elementwise
  ones;
- `cast`: `x.to(dtype)` of a strided `[T, H, V]` (or `[T, C]`) fp32 tensor into a contiguous
  `[T, H*V]` one (the attention's values before the o_proj), the cast and the reshape's copy in one launch.

Each writes the result in the input's (`cast`: the given) dtype exactly as the stock code rounds it, and,
where `out16` is given, that result converted to fp16 as well. The references compute the same in
PyTorch. CUDA-graph safe: no host syncs, outputs allocated with static shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_FLOAT = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _norm_row(x_ptr, w_ptr, out_ptr, out16_ptr, row, D, stride_x, eps, x16, BLOCK_D: tl.constexpr):
    """Row `row`: fp32 statistics, cast(x * rsqrt(mean(x^2) + eps)), times the weight, cast. `x16` (nonzero:
    write the fp16 copy) is a runtime flag, so the copy leaves the compiled reduction, and so the result, as
    it is without one."""
    d = tl.arange(0, BLOCK_D)
    m = d < D
    xv = tl.load(x_ptr + row * stride_x + d, mask=m, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(xv * xv, axis=0) / D + eps)
    dtype = out_ptr.dtype.element_ty
    y = (xv * r).to(dtype).to(tl.float32)
    out = (tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32) * y).to(dtype)
    tl.store(out_ptr + row * D + d, out, mask=m)
    if x16 != 0:
        tl.store(out16_ptr + row * D + d, out.to(tl.float16), mask=m)


@triton.jit(do_not_specialize=["x16"])  # (Triton would otherwise compile x16 == 1 as a constant)
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, out16_ptr, D, stride_x, eps, x16, BLOCK_D: tl.constexpr):
    """One row per program."""
    _norm_row(x_ptr, w_ptr, out_ptr, out16_ptr, tl.program_id(0), D, stride_x, eps, x16, BLOCK_D)


@triton.jit(do_not_specialize=["x16"])
def _cast_kernel(x_ptr, out_ptr, out16_ptr, H, V, stride_t, stride_h, stride_v, x16, BLOCK_C: tl.constexpr):
    """Row `program_id(0)`, columns of block `program_id(1)` of the flattened [H*V] row."""
    row = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = c < H * V
    src = x_ptr + row.to(tl.int64) * stride_t + (c // V) * stride_h + (c % V) * stride_v
    out = tl.load(src, mask=m, other=0.0).to(out_ptr.dtype.element_ty)
    dst = row.to(tl.int64) * H * V + c
    tl.store(out_ptr + dst, out, mask=m)
    if x16 != 0:
        tl.store(out16_ptr + dst, out.to(tl.float16), mask=m)


def _output(out: torch.Tensor | None, name: str, dtype: torch.dtype, shape, device) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if out.dtype != dtype or tuple(out.shape) != tuple(shape) or not out.is_contiguous() or out.device != device:
        raise ValueError(f"{name} must be a contiguous {dtype} {tuple(shape)} tensor on {device}, got "
                         f"{'contiguous' if out.is_contiguous() else 'strided'} {out.dtype} {tuple(out.shape)} on {out.device}")
    return out


def _copy_or_stand_in(out16: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """The copy's buffer, or (none asked for) `out` viewed as fp16, never written: the pointer's type and
    alignment, and so the compiled kernel, are the same either way."""
    return out.view(torch.float16) if out16 is None else out16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out16: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of the rows of `x` [T, D] (unit stride along D) with `weight` [D], in x's dtype, rounded as
    `glm5next.model.norm.rms_norm` rounds it (into `out` where given); with `out16` ([T, D] fp16) the
    result in fp16 there too."""
    _check_norm_input(x, weight, "x")
    T, D = x.shape
    out = _output(out, "out", x.dtype, (T, D), x.device)
    if out16 is not None:
        _output(out16, "out16", torch.float16, (T, D), x.device)
    if T:
        _rms_norm_kernel[(T,)](x, weight, out, _copy_or_stand_in(out16, out), D, x.stride(0), eps,
                               int(out16 is not None), BLOCK_D=triton.next_power_of_2(D), num_warps=4)
    return out


def _check_norm_input(x: torch.Tensor, weight: torch.Tensor, name: str) -> None:
    if x.dim() != 2 or x.dtype not in _FLOAT or (x.stride(1) != 1 and x.shape[1] > 1):
        raise ValueError(f"{name} must be a 2-D float matrix with unit stride along its rows, got "
                         f"{tuple(x.shape)} {x.dtype}")
    if weight.shape != (x.shape[1],) or weight.device != x.device or weight.stride(0) != 1:
        raise ValueError(f"weight must be a [{x.shape[1]}] vector on {x.device} (the norm of {name}), got "
                         f"{tuple(weight.shape)}")


CAST_BLOCK = 1024
"""Columns a program of `cast` writes."""


def cast(x: torch.Tensor, dtype: torch.dtype, out16: torch.Tensor | None = None,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """`x.to(dtype)` of `x` [T, H, V] or [T, C] (any strides) as a contiguous [T, H*V] tensor (into `out`
    where given); with `out16` ([T, H*V] fp16) that result in fp16 there too."""
    if x.dim() not in (2, 3) or x.dtype not in _FLOAT or dtype not in _FLOAT:
        raise ValueError(f"cast takes a 2-D or 3-D float tensor to a float dtype, got {tuple(x.shape)} {x.dtype}"
                         f" -> {dtype}")
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    T, H, V = x3.shape
    out = _output(out, "out", dtype, (T, H * V), x.device)
    if out16 is not None:
        _output(out16, "out16", torch.float16, (T, H * V), x.device)
    if T and H * V:
        _cast_kernel[(T, triton.cdiv(H * V, CAST_BLOCK))](
            x3, out, _copy_or_stand_in(out16, out), H, V, *x3.stride(), int(out16 is not None),
            BLOCK_C=CAST_BLOCK, num_warps=4)
    return out


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, out16: torch.Tensor | None = None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """`rms_norm` in PyTorch (the stock norm's numerics: fp32 statistics, x's dtype out), and its fp16
    conversion into `out16`."""
    x32 = x.float()
    y = (weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)).to(x.dtype)
    out = y if out is None else out.copy_(y)
    if out16 is not None:
        out16.copy_(out)
    return out


def cast_reference(x: torch.Tensor, dtype: torch.dtype, out16: torch.Tensor | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """`cast` in PyTorch."""
    y = x.to(dtype).reshape(x.shape[0], -1)
    out = y if out is None else out.copy_(y)
    if out16 is not None:
        out16.copy_(out)
    return out
