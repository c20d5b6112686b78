"""Triton kernels of the MoE router and of the routing that groups a step's rows by expert.

`router_logits_kernel`: fp32 logits `x @ W.T` of the router weight `[E, D]` (fp32), split over K so
that its few output tiles (288 experts) still spread over the GPU; every split stores its partial
`[S, T, E]`, and the routing kernel sums them in split order (deterministic, no atomics).

`route_kernel`: one program for the whole step (T <= 64 tokens): sigmoid scores, the bias for
selection only, top-k with the lower expert index first among equal scores, the chosen scores
renormalised and scaled; then the grouping the expert kernels read. The expert kernels run over
"slots": first the shared expert, which every valid token routes to, its rows cut into slots of at
most BLOCK_M (so its programs need not loop where the routed ones do not), then the routed experts
this step touches, one slot each, in ascending expert order. A slot is (expert, first row, row count),
the shared expert's expert -1; its rows are pair indices `p = t * top_k + k` for routed pairs
(ascending t within an expert) and `T * top_k + t` for the shared expert's. Padded tokens (a negative
slot mapping) choose no expert and own no row.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def router_logits_kernel(x_ptr, w_ptr, part_ptr, T, E, K, stride_x, K_PER_SPLIT,
                         BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """part[s, t, e] = sum over split s's K range of x[t, k] * w[e, k], in fp32."""
    pid_e = tl.program_id(0)
    pid_s = tl.program_id(1)
    t = tl.arange(0, BLOCK_T)
    e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    k_lo = pid_s * K_PER_SPLIT
    for k0 in range(k_lo, k_lo + K_PER_SPLIT, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        x = tl.load(x_ptr + t[:, None] * stride_x + k[None, :], mask=(t[:, None] < T) & kmask[None, :], other=0.0)
        w = tl.load(w_ptr + e[:, None] * K + k[None, :], mask=(e[:, None] < E) & kmask[None, :], other=0.0)
        acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    out = part_ptr + pid_s * T * E + t[:, None] * E + e[None, :]
    tl.store(out, acc, mask=(t[:, None] < T) & (e[None, :] < E))


@triton.jit
def route_kernel(part_ptr, bias_ptr, slots_ptr, ids_ptr, weights_ptr, slot_expert_ptr, slot_start_ptr,
                 slot_count_ptr, rows_ptr, n_slots_ptr, T, E, S, scale, eps,
                 TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr, NORM: tl.constexpr, HAS_SLOTS: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr):
    """Top-k routing of T tokens and their grouping by expert (see the module docstring).

    Writes ids / weights `[T, TOP_K]` (padded tokens: -1 / 0), slot_expert / slot_start / slot_count,
    rows, and n_slots = the shared expert's slots + the routed experts touched.
    BLOCK_E > E, so bin BLOCK_E - 1 of the histogram collects the pairs of padded tokens.
    """
    t = tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    kk = tl.arange(0, TOP_K_PAD)
    tmask = t < T
    emask = e < E
    valid = tmask
    if HAS_SLOTS:
        valid = valid & (tl.load(slots_ptr + t, mask=tmask, other=-1) >= 0)

    logits = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for s in range(S):
        logits += tl.load(part_ptr + s * T * E + t[:, None] * E + e[None, :],
                          mask=tmask[:, None] & emask[None, :], other=0.0)
    scores = tl.sigmoid(logits)
    bias = tl.load(bias_ptr + e, mask=emask, other=0.0).to(tl.float32)
    sel = tl.where(emask[None, :], scores + bias[None, :], float("-inf"))

    ids = tl.zeros([BLOCK_T, TOP_K_PAD], dtype=tl.int32)
    w = tl.zeros([BLOCK_T, TOP_K_PAD], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        best = tl.max(sel, axis=1)
        pick = tl.min(tl.where(sel == best[:, None], e[None, :], BLOCK_E), axis=1)  # lowest index among ties
        hit = e[None, :] == pick[:, None]
        wk = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        sel = tl.where(hit, float("-inf"), sel)
        ids = tl.where(kk[None, :] == k, pick[:, None], ids)
        w = tl.where(kk[None, :] == k, wk[:, None], w)
    if NORM:
        w = w / (tl.sum(w, axis=1)[:, None] + eps)
    w = w * scale

    kmask = kk < TOP_K
    pv = valid[:, None] & kmask[None, :]
    out = t[:, None] * TOP_K + kk[None, :]
    tl.store(ids_ptr + out, tl.where(pv, ids, -1), mask=tmask[:, None] & kmask[None, :])
    tl.store(weights_ptr + out, tl.where(pv, w, 0.0), mask=tmask[:, None] & kmask[None, :])

    # Counts and offsets per expert; the pairs of padded tokens fall into the spare last bin.
    binned = tl.reshape(tl.where(pv, ids, BLOCK_E - 1), [BLOCK_T * TOP_K_PAD])
    counts = tl.where(emask, tl.histogram(binned, BLOCK_E), 0)
    first = tl.cumsum(counts, 0) - counts
    active = counts > 0
    rank = tl.cumsum(active.to(tl.int32), 0) - 1
    n_valid = tl.sum(valid.to(tl.int32), 0)
    n_shared = tl.cdiv(n_valid, BLOCK_M)
    j = tl.arange(0, BLOCK_T // BLOCK_M)
    jmask = j < n_shared
    tl.store(slot_expert_ptr + j, tl.full([BLOCK_T // BLOCK_M], -1, tl.int32), mask=jmask)
    tl.store(slot_start_ptr + j, j * BLOCK_M, mask=jmask)
    tl.store(slot_count_ptr + j, tl.minimum(n_valid - j * BLOCK_M, BLOCK_M), mask=jmask)
    tl.store(slot_expert_ptr + n_shared + rank, e, mask=active)
    tl.store(slot_start_ptr + n_shared + rank, n_valid + first, mask=active)
    tl.store(slot_count_ptr + n_shared + rank, counts, mask=active)
    tl.store(n_slots_ptr, n_shared + tl.sum(active.to(tl.int32), 0))

    # The shared expert's rows: the valid tokens in order; then the routed pairs sorted by (expert, pair).
    vrank = tl.cumsum(valid.to(tl.int32), 0) - 1
    tl.store(rows_ptr + vrank, T * TOP_K + t, mask=valid)
    span: tl.constexpr = BLOCK_T * TOP_K_PAD
    key = tl.where(pv, ids * span + out, BLOCK_E * span)
    key = tl.sort(tl.reshape(key, [span]))
    i = tl.arange(0, span)
    tl.store(rows_ptr + n_valid + i, key % span, mask=key < BLOCK_E * span)
