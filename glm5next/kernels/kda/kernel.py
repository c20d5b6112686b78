"""The KDA decode kernel: everything between a KDA layer's projections and its o_proj, one launch.

One program per (row, head, block of BLOCK_V value columns); a row is one sequence's q tokens, run in
order with the head's fp32 state block `[K, BLOCK_V]` held in registers (read once; written once
where the step writes state). Per token, each program:

1. rebuilds the causal short conv of the head's q and k channels (all K of them) and of its v block
   from the cached pre-conv window and the step's projection rows; SiLU in fp32, the result rounded
   to the model dtype as the stock module rounds it;
2. L2-normalises q (then the query scale) and k; forms the bounded log-decay
   `lower_bound * sigmoid(exp(A_log) * (f + dt_bias))` and beta = sigmoid(b) (rounded to the model
   dtype, as the stock module takes it);
3. runs the delta rule on its state block: decay, recall, write, read out;
4. stores its block of the head's output (rounded to the model dtype) and its block's sum of
   squares.

The gated RMSNorm needs the whole head's output, so the head's BLOCK_V-programs count themselves in
on a per-(row, head) counter; the last to arrive (an acquire-release atomic after a CTA barrier)
normalises the head's outputs with `o_norm` and the sigmoid of the output gate, sums the partial
squares in block order (deterministic), advances the conv window of the head's channels (only then
is it safe: every program has read the old one) and resets the counter for the next step.

A verify step (VERIFY) leaves the conv window and the state untouched and stores, per token, what the
runtime's commit replays: the window (old rows, then the q new rows), unit k, v, the log-decay and
beta. Rows whose state index is negative are padding: they write zeros and touch no state.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _conv_row(conv_base, pre_ptr, stride, chan, pch, row, src, Q: tl.constexpr, KEEP: tl.constexpr):
    """Pre-conv row `src` (relative to the step's first token) of channels `chan` [C], fp32: the cached
    window's column src + KEEP below row 0, the step's projection row (column `pch`) after."""
    if src < 0:
        x = tl.load(conv_base + chan * KEEP + (src + KEEP)).to(tl.float32)
    else:
        x = tl.load(pre_ptr + (row * Q + src) * stride + pch).to(tl.float32)
    return x


@triton.jit
def _conv(conv_base, conv_w_ptr, pre_ptr, stride, chan, pch, row, t, Q: tl.constexpr, KEEP: tl.constexpr):
    """The causal conv of channels `chan` at token t, fp32, before its SiLU: the taps one row of channels at a
    time, in one layout (no exchange between threads)."""
    a = tl.zeros(chan.shape, tl.float32)
    for i in tl.static_range(KEEP + 1):
        w = tl.load(conv_w_ptr + chan * (KEEP + 1) + i).to(tl.float32)
        a += w * _conv_row(conv_base, pre_ptr, stride, chan, pch, row, t - KEEP + i, Q, KEEP)
    return a


@triton.jit
def _silu(a, dtype: tl.constexpr):
    """SiLU in fp32, rounded to `dtype` (as stock rounds it)."""
    return (a * tl.sigmoid(a)).to(dtype).to(tl.float32)


@triton.jit
def _advance_window(conv_base, pre_ptr, stride, chan, pch, row, Q: tl.constexpr, KEEP: tl.constexpr):
    """The conv window of channels `chan` after the step: its last KEEP pre-conv rows. Rows still in the old
    window move down first (column i takes column i + Q, read before written), then the step's rows."""
    dt = conv_base.dtype.element_ty
    for i in tl.static_range(KEEP):
        if i + Q < KEEP:
            x = tl.load(conv_base + chan * KEEP + i + Q)
            tl.debug_barrier()  # every thread has read column i + Q before any thread overwrites column i
            tl.store(conv_base + chan * KEEP + i, x)
        else:
            tl.store(conv_base + chan * KEEP + i, tl.load(pre_ptr + (row * Q + i + Q - KEEP) * stride + pch).to(dt))


@triton.jit
def _save_window(conv_base, win_base, s_win, pre_ptr, stride, chan, pch, row, Q: tl.constexpr,
                 KEEP: tl.constexpr, TAPS: tl.constexpr):
    """A verify step's window of channels `chan`: the old KEEP rows, then the step's Q pre-conv rows."""
    keep = tl.arange(0, TAPS)
    kmask = (keep < KEEP)[:, None]
    old = tl.load(conv_base + chan[None, :] * KEEP + keep[:, None], mask=kmask)
    tl.store(win_base + chan[None, :] * s_win + keep[:, None], old.to(win_base.dtype.element_ty), mask=kmask)
    for t in range(Q):
        x = tl.load(pre_ptr + (row * Q + t) * stride + pch)
        tl.store(win_base + chan * s_win + KEEP + t, x.to(win_base.dtype.element_ty))


@triton.jit
def _decay_write(s, kn, gk, beta, av):
    """One delta-rule step of a state block s [K, BLOCK_V]: decay the key rows by exp(gk), then write
    beta * (v - s^T k) at key kn. The decode and the commit kernels share it, so a commit reproduces the
    decode's state bit for bit."""
    s = s * tl.exp(gk)[:, None]
    delta = beta * (av - tl.sum(s * kn[:, None], 0))
    return s + kn[:, None] * delta[None, :]


@triton.jit
def _finish_window(conv_base, win_ptr, s_win, q_ptr, k_ptr, v_ptr, sq, sk, sv, slot, row, h, HK, live,
                   Q: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KEEP: tl.constexpr, TAPS: tl.constexpr,
                   VERIFY: tl.constexpr):
    """The head's conv window once every program of the head has read the old one: advanced over the step,
    or (VERIFY) kept, with the old rows and the step's rows saved for the commit."""
    kk = tl.arange(0, K)
    vall = tl.arange(0, V)
    pk = h * K + kk
    pv = h * V + vall
    if live:
        if VERIFY:
            win_base = win_ptr + slot * (3 * HK) * s_win
            _save_window(conv_base, win_base, s_win, q_ptr, sq, pk, pk, row, Q, KEEP, TAPS)
            _save_window(conv_base, win_base, s_win, k_ptr, sk, HK + pk, pk, row, Q, KEEP, TAPS)
            _save_window(conv_base, win_base, s_win, v_ptr, sv, 2 * HK + pv, pv, row, Q, KEEP, TAPS)
        else:
            _advance_window(conv_base, q_ptr, sq, pk, pk, row, Q, KEEP)
            _advance_window(conv_base, k_ptr, sk, HK + pk, pk, row, Q, KEEP)
            _advance_window(conv_base, v_ptr, sv, 2 * HK + pv, pv, row, Q, KEEP)


@triton.jit
def kda_decode_kernel(
    q_ptr, k_ptr, v_ptr, b_ptr, f_ptr, g_ptr, sq, sk, sv, sb, sf, sg,
    conv_ptr, conv_w_ptr, a_log_ptr, dt_bias_ptr, norm_w_ptr,
    state_ptr, index_ptr, out_ptr, part_ptr, count_ptr,
    win_ptr, vk_ptr, vv_ptr, vg_ptr, vb_ptr, s_win, s_vq,
    H, lower_bound, eps, scale, l2_eps,
    Q: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KEEP: tl.constexpr, TAPS: tl.constexpr,
    BLOCK_V: tl.constexpr, VERIFY: tl.constexpr,
):
    """Grid (rows, H, V // BLOCK_V); see the module docstring. Projection inputs [rows * Q, width] with
    row strides sq..sg; conv window [slots, 3HK, KEEP] (q | k | v channels); conv taps [3HK, KEEP + 1]
    fp32; state [slots, H, K, V] fp32; out [rows * Q, H * V]; part [rows * Q, H, V // BLOCK_V] fp32 and
    count [rows, H] int32 (zero, and left zero) are scratch where BLOCK_V < V (one program per head needs
    neither). Verify: window [slots, 3HK, s_win], k / g [slots, s_vq, H, K], v [slots, s_vq, H, V], beta
    [slots, s_vq, H] (fp32)."""
    row = tl.program_id(0)
    h = tl.program_id(1)
    j = tl.program_id(2)
    NV: tl.constexpr = V // BLOCK_V
    HK = H * K
    HV = H * V
    dtype = out_ptr.dtype.element_ty
    kk = tl.arange(0, K)
    vv = j * BLOCK_V + tl.arange(0, BLOCK_V)
    index = tl.load(index_ptr + row).to(tl.int64)
    live = index >= 0  # padding rows (negative index) write zeros and touch no state
    slot = tl.maximum(index, 0)
    cq = h * K + kk  # the head's q channels, and their projection columns
    ck = HK + h * K + kk
    cv = 2 * HK + h * V + vv
    rate = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    dt = tl.load(dt_bias_ptr + h * K + kk).to(tl.float32)
    w_norm = tl.load(norm_w_ptr + vv).to(tl.float32)
    sp = state_ptr + slot * HK * V + h * K * V + kk[:, None] * V + vv[None, :]
    s = tl.load(sp, mask=live, other=0.0)
    conv_base = conv_ptr + slot * (3 * HK) * KEEP
    part_base = part_ptr + (row * Q * H + h) * NV + j

    for t in range(Q):
        tok = row * Q + t
        # Every read of the token's inputs before any of them is used: a layout exchange between threads (a
        # CTA barrier) between two reads would hold the second until the first has arrived.
        pre_q = _conv(conv_base, conv_w_ptr, q_ptr, sq, cq, h * K + kk, row, t, Q, KEEP)
        pre_k = _conv(conv_base, conv_w_ptr, k_ptr, sk, ck, h * K + kk, row, t, Q, KEEP)
        pre_v = _conv(conv_base, conv_w_ptr, v_ptr, sv, cv, h * V + vv, row, t, Q, KEEP)
        raw = tl.load(f_ptr + tok * sf + h * K + kk).to(tl.float32) + dt
        b_raw = tl.load(b_ptr + tok * sb + h).to(tl.float32)
        gate = tl.load(g_ptr + tok * sg + h * V + vv).to(tl.float32)
        aq = _silu(pre_q, dtype)
        ak = _silu(pre_k, dtype)
        av = _silu(pre_v, dtype)
        qn = aq / tl.sqrt(tl.sum(aq * aq, 0) + l2_eps) * scale
        kn = ak / tl.sqrt(tl.sum(ak * ak, 0) + l2_eps)
        gk = lower_bound * tl.sigmoid(rate * raw)
        beta = tl.sigmoid(b_raw).to(dtype).to(tl.float32)

        s = _decay_write(s, kn, gk, beta, av)
        o = tl.sum(s * qn[:, None], 0).to(dtype)
        of = o.to(tl.float32)
        if NV == 1:  # the whole head here: normalise at once
            rstd = 1.0 / tl.sqrt(tl.sum(of * of, 0) / V + eps)
            y = tl.where(live, of * rstd * w_norm * tl.sigmoid(gate), 0.0)
            tl.store(out_ptr + tok * HV + h * V + vv, y.to(dtype))
        else:
            tl.store(out_ptr + tok * HV + h * V + vv, tl.where(live, o, 0.0).to(dtype))
            tl.store(part_base + t * H * NV, tl.sum(of * of, 0))

        if VERIFY:  # what the commit replays: this block's share of unit k and the decay, its v, beta
            mine = live & ((kk // BLOCK_V) == j)
            vbase = (slot * s_vq + t) * H + h
            tl.store(vk_ptr + vbase * K + kk, kn, mask=mine)
            tl.store(vg_ptr + vbase * K + kk, gk, mask=mine)
            tl.store(vv_ptr + vbase * V + vv, av, mask=live)
            tl.store(vb_ptr + vbase, beta, mask=live & (j == 0))

    if not VERIFY:
        tl.store(sp, s, mask=live)

    if NV == 1:
        tl.debug_barrier()  # every thread has read the old window
        _finish_window(conv_base, win_ptr, s_win, q_ptr, k_ptr, v_ptr, sq, sk, sv, slot, row, h, HK, live,
                       Q, K, V, KEEP, TAPS, VERIFY)
    else:
        # The head's last program to arrive finishes it: every program's stores are released before its
        # count (CTA barrier, then a release), and acquired by the program that completes the count.
        tl.debug_barrier()
        done = tl.atomic_add(count_ptr + row * H + h, 1, sem="acq_rel", scope="gpu")
        if done == NV - 1:
            vall = tl.arange(0, V)
            w = tl.load(norm_w_ptr + vall).to(tl.float32)
            nvb = tl.arange(0, NV)
            for t in range(Q):
                tok = row * Q + t
                o = tl.load(out_ptr + tok * HV + h * V + vall, volatile=True).to(tl.float32)
                parts = tl.load(part_ptr + ((row * Q + t) * H + h) * NV + nvb, volatile=True)
                rstd = 1.0 / tl.sqrt(tl.sum(parts, 0) / V + eps)
                gate = tl.load(g_ptr + tok * sg + h * V + vall).to(tl.float32)
                y = tl.where(live, o * rstd * w * tl.sigmoid(gate), 0.0)
                tl.store(out_ptr + tok * HV + h * V + vall, y.to(dtype))
            # Every program of the head has read the old window: now it may change.
            _finish_window(conv_base, win_ptr, s_win, q_ptr, k_ptr, v_ptr, sq, sk, sv, slot, row, h, HK, live,
                           Q, K, V, KEEP, TAPS, VERIFY)
            tl.atomic_xchg(count_ptr + row * H + h, 0)


@triton.jit
def kda_commit_kernel(state_ptr, conv_ptr, slot_ptr, accepted_ptr, win_ptr, vk_ptr, vv_ptr, vg_ptr, vb_ptr, s_win, s_vq,
                      H, K: tl.constexpr, V: tl.constexpr, KEEP: tl.constexpr, TAPS: tl.constexpr,
                      BLOCK_V: tl.constexpr):
    """Grid (rows, H, V // BLOCK_V): advance each row's state block over its first `accepted` verified
    tokens from what the verify step left (unit k, the log-decay, v, beta: the decode kernel's own
    values, through the same `_decay_write`), and its share of the conv window (the head's q and k
    channels of block j, its v channels) to the window's columns accepted .. accepted + KEEP - 1."""
    row = tl.program_id(0)
    h = tl.program_id(1)
    j = tl.program_id(2)
    HK = H * K
    slot = tl.load(slot_ptr + row).to(tl.int64)
    n = tl.load(accepted_ptr + row).to(tl.int32)
    if n > 0:
        kk = tl.arange(0, K)
        vv = j * BLOCK_V + tl.arange(0, BLOCK_V)
        sp = state_ptr + slot * HK * V + h * K * V + kk[:, None] * V + vv[None, :]
        s = tl.load(sp)
        for t in range(n):
            vbase = (slot * s_vq + t) * H + h
            kn = tl.load(vk_ptr + vbase * K + kk)
            gk = tl.load(vg_ptr + vbase * K + kk)
            av = tl.load(vv_ptr + vbase * V + vv)
            beta = tl.load(vb_ptr + vbase)
            s = _decay_write(s, kn, gk, beta, av)
        tl.store(sp, s)
        keep = tl.arange(0, TAPS)
        kmask = (keep < KEEP)[:, None]
        mine = j * BLOCK_V + tl.arange(0, BLOCK_V)
        for part in tl.static_range(3):
            chan = part * HK + h * K + mine
            x = tl.load(win_ptr + slot * (3 * HK) * s_win + chan[None, :] * s_win + (n + keep)[:, None], mask=kmask)
            tl.store(conv_ptr + slot * (3 * HK) * KEEP + chan[None, :] * KEEP + keep[:, None], x.to(conv_ptr.dtype.element_ty),
                     mask=kmask)
