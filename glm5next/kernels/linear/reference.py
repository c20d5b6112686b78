"""fp32 PyTorch references of the skinny projection kernels, with the same signatures."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...checkpoint.fp8 import FP8_DTYPE, dequantize_fp8


def _dense(weight: torch.Tensor, scale_inv: torch.Tensor | None) -> torch.Tensor:
    if weight.dtype == FP8_DTYPE:
        return dequantize_fp8(weight, scale_inv, torch.float32)
    return weight.float()


def _emit(y: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return y.to(x.dtype)
    out.copy_(y)
    return out


def linear_reference(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor | None = None,
                     out: torch.Tensor | None = None, split_k: int | None = None, block_n: int | None = None,
                     **_: object) -> torch.Tensor:
    """`x @ dequant(weight).T` computed in fp32, returned in x's dtype (or written into `out`)."""
    return _emit(x.float() @ _dense(weight, scale_inv).T, x, out)


def linear_multi_reference(x: torch.Tensor, projections, outs=None, **_: object) -> list[torch.Tensor]:
    """`[linear_reference(x, w, s) for w, s in projections]` (into `outs` when given)."""
    outs = [None] * len(projections) if outs is None else list(outs)
    return [linear_reference(x, w, s, o) for (w, s), o in zip(projections, outs)]


def gate_up_swiglu_reference(x: torch.Tensor, gate_w: torch.Tensor, gate_s: torch.Tensor | None,
                             up_w: torch.Tensor, up_s: torch.Tensor | None, limit: float,
                             out: torch.Tensor | None = None, **_: object) -> torch.Tensor:
    """`silu(min(g, limit)) * clamp(u, -limit, limit)` with g, u the fp32 gate and up projections."""
    g = x.float() @ _dense(gate_w, gate_s).T
    u = x.float() @ _dense(up_w, up_s).T
    return _emit(F.silu(g.clamp(max=limit)) * u.clamp(min=-limit, max=limit), x, out)
