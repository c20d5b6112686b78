"""FP8 e4m3 block-scaled weights as the checkpoint stores them: the storage dtype, the block size, the
scale grid's shape, quantization with power-of-two scales and its inverse.

Scales are powers of two, so dividing by them is exact and dequantization (fp8 value times scale)
is exact in both bf16 and fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
"""Storage dtype of FP8 block-quantized weights."""
FP8_BLOCK = 128
"""Side of the square weight block that shares one FP8 scale."""
FP8_MAX = 448.0
"""Largest finite magnitude of float8 e4m3fn."""


def quantize_fp8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 e4m3 weight [..., out, in] and its fp32 block scales `scale_inv`
    [..., ceil(out/128), ceil(in/128)] of fp32 `weight` [..., out, in].

    Each 128x128 block (edge blocks zero-padded, then cropped) gets the scale
    `2^ceil(log2(amax / 448))`, so the scaled block fits e4m3 without clipping.
    """
    if weight.dim() < 2:
        raise ValueError(f"FP8 block quantization needs a [..., out, in] weight, got shape {tuple(weight.shape)}")
    w = weight.float()
    *lead, rows, cols = w.shape
    grid_rows, grid_cols = scale_shape(tuple(w.shape))[-2:]
    padded = F.pad(w, (0, grid_cols * FP8_BLOCK - cols, 0, grid_rows * FP8_BLOCK - rows))
    blocks = padded.reshape(*lead, grid_rows, FP8_BLOCK, grid_cols, FP8_BLOCK)
    amax = blocks.abs().amax(dim=(-3, -1))
    # An all-zero block gets scale 1 (any power of two would do).
    ratio = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    scale = torch.exp2(torch.ceil(torch.log2(ratio)))
    # Guard against log2 rounding putting amax / scale a hair above the e4m3 range.
    scale = torch.where(amax / scale > FP8_MAX, scale * 2, scale)
    scaled = blocks / scale[..., :, None, :, None]
    q = scaled.reshape(padded.shape)[..., :rows, :cols].to(FP8_DTYPE)
    return q.contiguous(), scale.contiguous()


def scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the block-scale grid of an FP8 weight of `shape` (last two dims blocked)."""
    *lead, rows, cols = shape
    return (*lead, -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`weight` [..., out, in] FP8 times its block scales [..., ceil(out/128), ceil(in/128)], as `dtype`."""
    rows, cols = weight.shape[-2:]
    s = scale_inv.float().repeat_interleave(FP8_BLOCK, dim=-2).repeat_interleave(FP8_BLOCK, dim=-1)
    s = s[..., :rows, :cols]
    return (weight.float() * s).to(dtype)
