"""The KDA delta rule in fp32: one step, a per-token loop, and a chunked form of the same function.

Per head, the state `S` [K, V] first decays per key row by `exp(g)` (g a
log-decay), then learns `v` at key `k` with strength `beta`:

    S <- diag(exp(g)) S
    S <- S + k (beta (v - S^T k))^T
    o  = S^T q

Every function here takes prepared fp32 inputs: unit-norm keys, unit-norm
queries already multiplied by the query scale, log-decays `g`, write strengths
`beta`. `kda_recurrent` is the obviously-correct loop; `kda_chunked` computes
the same function 64 tokens at a time and shares no code with it.
"""

from __future__ import annotations

import torch

CHUNK_SIZE = 64
"""Tokens per block of the chunked delta rule."""


def kda_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The output [..., H, V] and next state [..., H, K, V] of one delta-rule step.

    q, k: [..., H, K] fp32; v: [..., H, V] fp32; g: [..., H, K] fp32 log-decay;
    beta: [..., H] fp32; state: [..., H, K, V] fp32 (not modified).
    """
    s = state * g.exp().unsqueeze(-1)
    recalled = (s * k.unsqueeze(-1)).sum(-2)
    delta = beta.unsqueeze(-1) * (v - recalled)
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (s * q.unsqueeze(-1)).sum(-2), s


def kda_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs [T, H, V] and final state [H, K, V] of one sequence, one token at a time.

    q, k: [T, H, K] fp32; v: [T, H, V] fp32; g: [T, H, K] fp32; beta: [T, H] fp32;
    state: [H, K, V] fp32 initial state (not modified).
    """
    outs = []
    for t in range(q.shape[0]):
        o, state = kda_step(q[t], k[t], v[t], g[t], beta[t], state)
        outs.append(o)
    if not outs:
        return v.new_zeros(0, *v.shape[1:]), state.clone()
    return torch.stack(outs), state


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs [T, H, V] and final state [H, K, V] of one sequence, `chunk_size` tokens at a time.

    Same arguments as `kda_recurrent`. Inside a chunk with start state S0 and
    cumulative log-decays G_t = g_1 + ... + g_t, unrolling the recurrence gives
    the write vectors d_t = beta_t (v_t - S_{t-1}'^T k_t) as the solution of
    a unit lower-triangular system

        d_t + sum_{s<t} A_ts d_s = beta_t v_t - beta_t S0^T (exp(G_t) * k_t),
        A_ts = beta_t sum_i k_t[i] k_s[i] exp(G_t[i] - G_s[i]),

    i.e. d = U - W S0 with U, W independent of S0. Then

        o_t  = S0^T (exp(G_t) * q_t) + sum_{s<=t} (q_t . exp(G_t - G_s) * k_s) d_s
        S_C  = diag(exp(G_C)) S0 + sum_s (exp(G_C - G_s) * k_s) d_s^T.

    Decays are only ever formed as exp(G_t - G_s) with s <= t, so nothing
    overflows however strong the gates are.
    """
    q, k, v, g = (x.transpose(0, 1) for x in (q, k, v, g))  # [H, T, *]
    beta = beta.transpose(0, 1)  # [H, T]
    length = q.shape[1]
    outs = []
    for c0 in range(0, length, chunk_size):
        c1 = min(c0 + chunk_size, length)
        qc, kc, vc, bc = q[:, c0:c1], k[:, c0:c1], v[:, c0:c1], beta[:, c0:c1, None]
        cum = g[:, c0:c1].cumsum(1)  # [H, C, K]
        n = c1 - c0
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        # Mask before exp: above the diagonal G_t - G_s is positive and could overflow.
        gap = cum.unsqueeze(2) - cum.unsqueeze(1)  # [H, t, s, K]
        decay = torch.where(causal[:, :, None], gap, torch.full_like(gap, float("-inf"))).exp()
        kk = (kc.unsqueeze(2) * kc.unsqueeze(1) * decay).sum(-1)  # [H, t, s]
        system = torch.eye(n, device=q.device) + (bc * kk).tril(-1)
        rhs = torch.cat([bc * vc, bc * kc * cum.exp()], dim=-1)
        sol = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        u, w = sol.split([vc.shape[-1], kc.shape[-1]], dim=-1)
        writes = u - w @ state  # [H, C, V]
        qk = (qc.unsqueeze(2) * kc.unsqueeze(1) * decay).sum(-1)  # [H, t, s], zero above the diagonal
        outs.append((qc * cum.exp()) @ state + qk @ writes)
        last = cum[:, -1:]  # [H, 1, K]
        state = state * last.transpose(1, 2).exp() + (kc * (last - cum).exp()).transpose(1, 2) @ writes
    if not outs:
        return v.new_zeros(0, v.shape[0], v.shape[2]), state.clone()
    return torch.cat(outs, dim=1).transpose(0, 1).contiguous(), state
