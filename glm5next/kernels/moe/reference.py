"""fp32 references of the MoE kernels, in plain PyTorch, sharing no code with them or the model.

Same arguments as the entry points in `glm5next.kernels.moe` (`ExpertWeights` for the weights), so a
test runs both on the same inputs. Ties in the top-k go to the lower expert index; the k chosen
experts of a token are listed by descending selection score.
"""

from __future__ import annotations

import torch


def _widen(w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """A weight [..., N, K] in fp32, times its 128x128 block scales [..., ceil(N/128), ceil(K/128)] if any."""
    w = w.float()
    if scale is None:
        return w
    n, k = w.shape[-2:]
    s = scale.float().repeat_interleave(128, dim=-2).repeat_interleave(128, dim=-1)
    return w * s[..., :n, :k]


def route_reference(x: torch.Tensor, router_w: torch.Tensor, bias: torch.Tensor, top_k: int, scale: float,
                    norm: bool, eps: float, slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The chosen experts [T, top_k] int64 (-1 for padded tokens) and their weights [T, top_k] fp32 (0 there)."""
    scores = torch.sigmoid(x.float() @ router_w.float().t())
    sel = scores + bias.float()
    # A stable descending sort lists equal scores in ascending expert order.
    ids = torch.sort(sel, dim=-1, descending=True, stable=True).indices[:, :top_k]
    w = scores.gather(1, ids)
    if norm:
        w = w / (w.sum(-1, keepdim=True) + eps)
    w = w * scale
    if slots is not None:
        pad = slots < 0
        ids = ids.masked_fill(pad[:, None], -1)
        w = w.masked_fill(pad[:, None], 0.0)
    return ids, w


def _swiglu(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    g = g.clamp(max=limit)
    return g * torch.sigmoid(g) * u.clamp(-limit, limit)


def moe_reference(x: torch.Tensor, weights, top_k: int, scale: float, norm: bool, eps: float, limit: float,
                  slots: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE output [T, D] in x's dtype: per token, the weighted routed experts plus the shared expert,
    summed in fp32 (0 for padded tokens). `weights` is an `ExpertWeights`."""
    w = weights
    ids, rw = route_reference(x, w.router, w.bias, top_k, scale, norm, eps, slots)
    xf = x.float()
    out = torch.zeros(x.shape[0], w.down.shape[1], dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        if slots is not None and slots[t] < 0:
            continue
        experts = [(int(e), float(rw[t, k])) for k, e in enumerate(ids[t])]
        for e, wt in experts:
            g = _widen(w.gate[e], None if w.gate_scale is None else w.gate_scale[e]) @ xf[t]
            u = _widen(w.up[e], None if w.up_scale is None else w.up_scale[e]) @ xf[t]
            out[t] += wt * (_widen(w.down[e], None if w.down_scale is None else w.down_scale[e]) @ _swiglu(g, u, limit))
        g = _widen(w.shared_gate, w.shared_gate_scale) @ xf[t]
        u = _widen(w.shared_up, w.shared_up_scale) @ xf[t]
        out[t] += _widen(w.shared_down, w.shared_down_scale) @ _swiglu(g, u, limit)
    return out.to(x.dtype)
