"""The KDA decode kernel's fp32 reference: plain, self-contained PyTorch of the same signature as
`kda_decode`, one token at a time, with the stock module's rounding points (conv SiLU output, beta,
the delta-rule output, each rounded to the output dtype)."""

from __future__ import annotations

import torch


def kda_decode_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor, f: torch.Tensor,
                         g: torch.Tensor, conv: torch.Tensor, state: torch.Tensor, index: torch.Tensor, w,
                         tokens_per_row: int, verify: dict[str, torch.Tensor] | None = None,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """See `glm5next.kernels.kda.kda_decode`: the gated, normalised outputs [rows * q, H * V] of q tokens per
    row; advances `conv` and `state` of each row's slot (or, with `verify`, fills it and leaves them)."""
    n_tok, hk = q.shape
    qper = tokens_per_row
    rows = n_tok // qper
    h, d = w.num_heads, w.head_dim
    keep = conv.shape[-1]
    dtype = q.dtype
    out = torch.empty(n_tok, h * d, dtype=dtype, device=q.device) if out is None else out
    taps = w.conv.float()  # [3HK, keep + 1]
    rate = w.a_log.float().exp()[:, None]
    for r in range(rows):
        slot = int(index[r])
        toks = slice(r * qper, (r + 1) * qper)
        if slot < 0:
            out[toks] = 0
            continue
        pre = torch.cat([q[toks], k[toks], v[toks]], dim=-1).t().to(conv.dtype)  # [3HK, qper]
        window = torch.cat([conv[slot], pre], dim=-1).float()  # [3HK, keep + qper]
        s = state[slot].float()
        for t in range(qper):
            a = (window[:, t : t + keep + 1] * taps).sum(-1)
            act = torch.nn.functional.silu(a).to(dtype).float().view(3, h, d)
            qt, kt, vt = act[0], act[1], act[2]
            qt = qt / torch.sqrt((qt * qt).sum(-1, keepdim=True) + w.l2_eps) * d**-0.5
            kt = kt / torch.sqrt((kt * kt).sum(-1, keepdim=True) + w.l2_eps)
            tok = r * qper + t
            raw = f[tok].float().view(h, d) + w.dt_bias.float().view(h, d)
            gt = w.lower_bound * torch.sigmoid(rate * raw)
            bt = torch.sigmoid(b[tok].float()).to(dtype).float()
            s = s * gt.exp()[..., None]
            delta = bt[:, None] * (vt - (s * kt[..., None]).sum(-2))
            s = s + kt[..., None] * delta[:, None, :]
            o = (s * qt[..., None]).sum(-2).to(dtype).float()  # [H, V]
            y = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + w.eps) * w.norm.float()
            out[tok] = (y * torch.sigmoid(g[tok].float().view(h, d))).reshape(-1).to(out.dtype)
            if verify is not None:
                verify["k"][slot, t] = kt
                verify["g"][slot, t] = gt
                verify["v"][slot, t] = vt
                verify["beta"][slot, t] = bt
        if verify is not None:
            verify["window"][slot, :, : keep + qper] = torch.cat([conv[slot], pre], dim=-1)
        else:
            conv[slot] = torch.cat([conv[slot], pre], dim=-1)[:, -keep:]
            state[slot] = s
    return out


def kda_prefill_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          initial: torch.Tensor, cu_seqlens: torch.Tensor, lower_bound: float,
                          dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """See `glm5next.kernels.kda.prefill.kda_prefill`: per sequence, per token, the fp32 delta rule
    (decay the state per key row by exp(g), learn v at k with strength beta, read it at q); the outputs in
    `dtype`, the final states fp32. `lower_bound` is the gate's bound (the inputs already respect it)."""
    del lower_bound
    outs, finals = [], []
    starts = [int(x) for x in cu_seqlens]
    for i in range(len(starts) - 1):
        s = initial[i].float().clone()
        for t in range(starts[i], starts[i + 1]):
            s = s * g[t].float().exp()[..., None]
            delta = beta[t].float()[:, None] * (v[t].float() - (s * k[t].float()[..., None]).sum(-2))
            s = s + k[t].float()[..., None] * delta[:, None, :]
            outs.append((s * q[t].float()[..., None]).sum(-2))
        finals.append(s)
    return torch.stack(outs).to(dtype), torch.stack(finals)
