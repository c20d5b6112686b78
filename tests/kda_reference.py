"""An independent per-token fp32 reference of one KDA layer, written straight from spec section 5.

It reads the weights of a `KimiDeltaAttention` module but none of its code:
plain loops over tokens and heads, an explicit conv sum, the delta rule on
one `[K, V]` matrix per head, the sigmoid-gated RMSNorm and the output
projection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

L2_EPS = 1e-6


@dataclass
class SequenceState:
    """One sequence's KDA history: pre-conv rows (oldest first) and the per-head fp32 states."""

    rows: list[torch.Tensor]
    """Pre-conv q|k|v rows [3C] fp32, oldest first; exactly conv_kernel - 1 of them."""
    states: list[torch.Tensor]
    """Per head, the delta-rule state [K, V] fp32."""

    @classmethod
    def zeros(cls, layer) -> "SequenceState":
        width = 3 * layer.num_heads * layer.head_dim
        d = layer.head_dim
        return cls(
            rows=[torch.zeros(width) for _ in range(layer.conv_kernel - 1)],
            states=[torch.zeros(d, d) for _ in range(layer.num_heads)],
        )

    def conv_window(self) -> torch.Tensor:
        """The rows as the module's conv window [3C, conv_kernel - 1]."""
        return torch.stack(self.rows, dim=1)

    def recurrent(self) -> torch.Tensor:
        """The states as the module's recurrent slot [H, K, V]."""
        return torch.stack(self.states)


def _w(linear) -> torch.Tensor:
    return linear.weight.detach().float()


def reference_tokens(layer, x: torch.Tensor, seq: SequenceState) -> torch.Tensor:
    """The layer output [L, hidden] fp32 of one sequence's next tokens x [L, hidden]; advances `seq`."""
    heads, d, kernel = layer.num_heads, layer.head_dim, layer.conv_kernel
    c = heads * d
    taps = torch.cat([getattr(layer, n).detach().float()[:, 0, :] for n in ("q_conv1d", "k_conv1d", "v_conv1d")])
    a_log = layer.A_log.detach().float()
    dt_bias = layer.dt_bias.detach().float()
    norm_w = layer.o_norm_weight.detach().float()
    outputs = []
    for t in range(x.shape[0]):
        xt = x[t].float()
        raw = torch.cat([_w(layer.q_proj) @ xt, _w(layer.k_proj) @ xt, _w(layer.v_proj) @ xt])
        history = seq.rows + [raw]  # kernel rows, oldest first
        conv = torch.zeros(3 * c)
        for r in range(kernel):
            conv = conv + taps[:, r] * history[r]
        seq.rows = history[1:]
        act = conv * torch.sigmoid(conv)  # SiLU
        q, k, v = act[:c], act[c : 2 * c], act[2 * c :]
        g_raw = _w(layer.f_b_proj) @ (_w(layer.f_a_proj) @ xt)
        beta = torch.sigmoid(_w(layer.b_proj) @ xt)
        gate_logits = _w(layer.g_b_proj) @ (_w(layer.g_a_proj) @ xt)
        y = torch.zeros(c)
        for h in range(heads):
            sl = slice(h * d, (h + 1) * d)
            gate = layer.lower_bound * torch.sigmoid(torch.exp(a_log[h]) * (g_raw[sl] + dt_bias[sl]))
            qh = q[sl] / torch.sqrt((q[sl] ** 2).sum() + L2_EPS) * d**-0.5
            kh = k[sl] / torch.sqrt((k[sl] ** 2).sum() + L2_EPS)
            s = seq.states[h] * torch.exp(gate)[:, None]
            m = s.T @ kh
            delta = beta[h] * (v[sl] - m)
            s = s + torch.outer(kh, delta)
            seq.states[h] = s
            o = s.T @ qh
            normed = o / torch.sqrt((o**2).mean() + layer.norm_eps)
            y[sl] = norm_w * normed * torch.sigmoid(gate_logits[sl])
        outputs.append(_w(layer.o_proj) @ y)
    return torch.stack(outputs)
