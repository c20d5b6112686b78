"""FP8 e4m3 block quantization with power-of-two scales, as the checkpoint stores weights.

The inverse is `glm5next.model.params.dequantize_fp8`. Scales are powers of
two, so dividing by them is exact and dequantization (fp8 value times scale)
is exact in both bf16 and fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model.params import FP8_BLOCK, FP8_DTYPE, scale_shape

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
