"""KDA prefill on CUDA: the delta rule over every prefill sequence of a step in one call of
flash-linear-attention's chunked kernel (`fla.ops.kda.chunk_kda`, bounded gate), its inputs in one Triton
launch (`kda_prefill_inputs`: the short conv with SiLU, the l2-normalised heads, the decay and beta) and its
output's gated norm in another (`gated_norm`).

Measured against the stock chunked form (`glm5next.model.kda_recurrence.kda_chunked`, PyTorch) at real
shapes on an H100 (bench/results/2026-12-06-h100-kda-prefill.json): 2.1 ms against 152 ms for one
8192-token prompt per layer, 2.2 ms against 153 ms for 8 prompts of 1024. fla's products are bf16 / tf32,
so a bf16 model takes this path and an fp32 model keeps the stock fp32 form (its 1e-4 bar).

fla is imported on first use: it is a dependency of the CUDA path only, and importing it costs seconds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...forward import to_device

__all__ = ["gated_norm", "kda_prefill", "kda_prefill_inputs"]


@triton.jit
def prefill_inputs_kernel(q_ptr, k_ptr, v_ptr, f_ptr, b_ptr, s_q, s_k, s_v, s_f, s_b,
                          conv_w_ptr, conv_ptr, s_conv, a_log_ptr, dt_bias_ptr, seq_ptr, start_ptr, slot_ptr,
                          qo_ptr, ko_ptr, vo_ptr, g_ptr, beta_ptr, L, scale, l2_eps, lower_bound,
                          H: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, W: tl.constexpr,
                          BLOCK_T: tl.constexpr):
    """Program (row block, group * H + head): for groups 0 / 1 / 2 (q / k / v) the causal conv of the head's
    channels over each row's sequence (rows before its start from the sequence's conv window in the state,
    or zeros for a fresh one), SiLU, rounded to the output dtype; q and k l2-normalised (q times `scale`);
    for group 3 the log-decay `lower_bound * sigmoid(exp(A_log) * (f + dt_bias))` fp32 and beta = sigmoid(b)."""
    pid_t = tl.program_id(0)
    grp = tl.program_id(1) // H
    h = tl.program_id(1) % H
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < L
    c = tl.arange(0, KP)  # K padded to a power of two
    cmask = c < K
    mask = rmask[:, None] & cmask[None, :]
    col = h * K + c
    if grp == 3:
        f = tl.load(f_ptr + rows[:, None] * s_f + col[None, :], mask=mask, other=0.0).to(tl.float32)
        raw = f + tl.load(dt_bias_ptr + col, mask=cmask, other=0.0).to(tl.float32)[None, :]
        rate = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
        tl.store(g_ptr + rows[:, None] * (H * K) + col[None, :], lower_bound * tl.sigmoid(rate * raw), mask=mask)
        b = tl.load(b_ptr + rows * s_b + h, mask=rmask, other=0.0).to(tl.float32)
        tl.store(beta_ptr + rows * H + h, tl.sigmoid(b).to(beta_ptr.dtype.element_ty), mask=rmask)
    else:
        if grp == 0:
            x_ptr, s_x, o_ptr = q_ptr, s_q, qo_ptr
        elif grp == 1:
            x_ptr, s_x, o_ptr = k_ptr, s_k, ko_ptr
        else:
            x_ptr, s_x, o_ptr = v_ptr, s_v, vo_ptr
        chan = grp * (H * K) + col
        seq = tl.load(seq_ptr + rows, mask=rmask, other=0)
        j = rows - tl.load(start_ptr + seq, mask=rmask, other=0)  # the row's index in its sequence
        slot = tl.load(slot_ptr + seq, mask=rmask, other=-1).to(tl.int64)
        acc = tl.zeros([BLOCK_T, KP], dtype=tl.float32)
        for i in tl.static_range(W):
            inside = (j - (W - 1) + i >= 0)[:, None]
            x = tl.load(x_ptr + (rows - (W - 1) + i)[:, None] * s_x + col[None, :], mask=mask & inside, other=0.0)
            old = tl.load(conv_ptr + slot[:, None] * s_conv + chan[None, :] * (W - 1) + (j + i)[:, None],
                          mask=mask & (~inside) & (slot >= 0)[:, None], other=0.0)
            tap = tl.load(conv_w_ptr + chan * W + i, mask=cmask, other=0.0)
            acc += tl.where(inside, x.to(tl.float32), old.to(tl.float32)) * tap[None, :]
        act = (acc * tl.sigmoid(acc)).to(o_ptr.dtype.element_ty).to(tl.float32)
        if grp < 2:
            act = act / tl.sqrt(tl.sum(act * act, axis=1) + l2_eps)[:, None]
            if grp == 0:
                act = act * scale
        tl.store(o_ptr + rows[:, None] * (H * K) + col[None, :], act.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gated_norm_kernel(x_ptr, gate_ptr, w_ptr, y_ptr, R, s_gate, eps, D: tl.constexpr, DP: tl.constexpr,
                      BLOCK_R: tl.constexpr):
    """y[r] = w * x[r] * rsqrt(mean(x[r]^2) + eps) * sigmoid(gate[r]) in fp32, rounded to y's dtype."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, DP)
    mask = (r < R)[:, None] & (c < D)[None, :]
    x = tl.load(x_ptr + r[:, None] * D + c[None, :], mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + r[:, None] * s_gate + c[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + c, mask=c < D, other=0.0).to(tl.float32)
    y = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps))[:, None] * w[None, :]
    tl.store(y_ptr + r[:, None] * D + c[None, :], (y * tl.sigmoid(gate)).to(y_ptr.dtype.element_ty), mask=mask)


def kda_prefill_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
                       conv_w: torch.Tensor, conv: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                       starts: list[int], slots: torch.Tensor, heads: int, lower_bound: float, l2_eps: float,
                       dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The delta rule's inputs of prefill rows laid end to end, in one launch: (q, k, v) [L, H, K] in `dtype`
    (conv + SiLU of the q / k / v projections [L, HK], rounded to `dtype`; q and k l2-normalised, q times
    K^-1/2), the log-decay g [L, H, K] fp32 of the decay projection f [L, HK] and beta = sigmoid(b) [L, H]
    in `dtype`. `starts`: the N + 1 sequence starts (host ints, from 0); `slots` [N] int64: each sequence's
    conv-state slot in `conv` [slots, 3HK, W - 1], -1 for a fresh sequence (zeros before its first row);
    `conv_w` [3HK, W] fp32 taps. The state is only read (the caller advances it)."""
    L, width = q.shape
    K = width // heads
    n = len(starts) - 1
    W = conv_w.shape[1]
    for name, t in (("q", q), ("k", k), ("v", v), ("f", f), ("b", b)):
        if t.shape[0] != L or t.stride(-1) != 1:
            raise ValueError(f"KDA prefill inputs: {name} {tuple(t.shape)} needs {L} rows of unit column stride")
    if conv_w.shape != (3 * width, W) or not conv_w.is_contiguous() or conv.shape[1:] != (3 * width, W - 1) \
            or conv.stride(2) != 1 or conv.stride(1) != W - 1 or slots.shape != (n,) or starts[-1] != L:
        raise ValueError(f"KDA prefill inputs: taps {tuple(conv_w.shape)}, conv state {tuple(conv.shape)}, "
                         f"{tuple(slots.shape)} slots for {n} sequences over {L} rows")
    dev = q.device
    lens = torch.tensor([starts[i + 1] - starts[i] for i in range(n)])
    seq = to_device(torch.repeat_interleave(torch.arange(n, dtype=torch.int32), lens), torch.int32, dev)
    start = to_device(starts[:-1], torch.int32, dev)
    out = [torch.empty(L, heads, K, dtype=dtype, device=dev) for _ in range(3)]
    g = torch.empty(L, heads, K, dtype=torch.float32, device=dev)
    beta = torch.empty(L, heads, dtype=dtype, device=dev)
    block_t = 16
    prefill_inputs_kernel[(triton.cdiv(L, block_t), 4 * heads)](
        q, k, v, f, b, q.stride(0), k.stride(0), v.stride(0), f.stride(0), b.stride(0), conv_w, conv, conv.stride(0),
        a_log, dt_bias, seq, start, slots, out[0], out[1], out[2], g, beta, L, K**-0.5, l2_eps, lower_bound,
        H=heads, K=K, KP=triton.next_power_of_2(K), W=W, BLOCK_T=block_t, num_warps=4)
    return (*out, g, beta)


def gated_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x * rsqrt(mean(x^2) + eps) * sigmoid(gate)` over the last dim D in fp32, in x's dtype: x [R, D]
    contiguous, gate [R, D] of unit column stride, weight [D] (`glm5next.model.kda.gated_rms_norm` in one launch)."""
    r, d = x.shape
    if not x.is_contiguous() or gate.shape != (r, d) or gate.stride(1) != 1 or weight.shape != (d,):
        raise ValueError(f"gated norm: x {tuple(x.shape)}, gate {tuple(gate.shape)}, weight {tuple(weight.shape)}")
    y = torch.empty_like(x)
    block_r = 16
    gated_norm_kernel[(triton.cdiv(r, block_r),)](x, gate, weight, y, r, gate.stride(0), eps, D=d,
                                                  DP=triton.next_power_of_2(d), BLOCK_R=block_r)
    return y


def kda_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                initial: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_host: torch.Tensor, lower_bound: float,
                dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta-rule outputs [T, H, V] (`dtype`) and final states [N, H, K, V] fp32 of N sequences laid
    end to end (see `kda_prefill_reference` for the function).

    q, k: [T, H, K] (unit-norm, q already times the query scale); v: [T, H, V]; g: [T, H, K] fp32
    log-decays in [lower_bound, 0); beta: [T, H]; initial: [N, H, K, V] fp32 (not modified);
    cu_seqlens: [N + 1] int64 sequence starts on the device, and the same on the host (`cu_seqlens_host`,
    from which fla sizes its chunk list without reading the device's copy, a stream sync per call). q, k, v
    and beta are cast to `dtype`.
    """
    from fla.ops.kda import chunk_kda  # noqa: PLC0415 - optional package, seconds to import

    t, h, d = q.shape
    n = cu_seqlens.shape[0] - 1
    if initial.shape != (n, h, d, v.shape[-1]) or initial.dtype != torch.float32:
        raise ValueError(f"KDA prefill: initial state {tuple(initial.shape)} {initial.dtype} for {n} sequences "
                         f"of {h} heads of {d}, fp32 expected")
    if k.shape != q.shape or g.shape != q.shape or v.shape[:2] != (t, h) or beta.shape != (t, h):
        raise ValueError(f"KDA prefill: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"g {tuple(g.shape)}, beta {tuple(beta.shape)} disagree")
    if cu_seqlens_host.shape != cu_seqlens.shape or cu_seqlens_host.is_cuda:
        raise ValueError(f"KDA prefill: the host's sequence lengths {tuple(cu_seqlens_host.shape)} "
                         f"({cu_seqlens_host.device}) for {tuple(cu_seqlens.shape)} on the device")
    qb, kb, vb = (z.to(dtype).unsqueeze(0) for z in (q, k, v))
    out, final = chunk_kda(qb, kb, vb, g.float().unsqueeze(0), beta.to(dtype).unsqueeze(0), scale=1.0,
                           initial_state=initial, output_final_state=True, safe_gate=True,
                           lower_bound=lower_bound, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_host)
    return out[0], final
