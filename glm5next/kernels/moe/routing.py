"""Triton kernels of the MoE router and of the routing that groups a step's rows by expert.

`router_logits_kernel`: fp32 logits `x @ W.T` of the router weight `[E, D]` (fp32), split over K so
that its few output tiles (288 experts) still spread over the GPU; every split stores its partial
`[S, T, E]`, and the top-k kernel sums them in split order (deterministic, no atomics).

`topk_kernel`, one program per token: sigmoid scores, the bias for selection only, top-k with the lower
expert index first among equal scores, the chosen scores renormalised and scaled.

`group_kernel`, one program for the whole step (T <= 64 tokens): the grouping the expert kernels read,
from the pairs sorted by expert (no histogram, no atomics). The expert kernels run over
"slots": first the shared expert, which every valid token routes to, its rows cut into slots of at
most BLOCK_M (so its programs need not loop where the routed ones do not), then the routed experts
this step touches, one slot each, in ascending expert order. A slot is (expert, first row, row count),
the shared expert's expert -1; its rows are pair indices `p = t * top_k + k` for routed pairs
(ascending t within an expert) and `T * top_k + t` for the shared expert's. Padded tokens (a negative
slot mapping) choose no expert and own no row.

With PDL (a programmatic-dependent launch, `kernels/pdl.py`) each kernel lets the next one start as it
begins; the router's programs first fetch their weight tile into L2 (a constant), so its read overlaps the
kernel before; every read of the step's data comes after `wait_previous`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..pdl import launch_dependents, prefetch_l2, wait_previous


@triton.jit
def _prefetch_rows(w_ptr, e, E, K, k0, K_PER_SPLIT):
    """With PDL: the next kernel may start; this program's router rows `e`, columns k0 .. k0 + K_PER_SPLIT,
    fetched into L2 (one bulk prefetch a row where its bytes are 16-byte aligned, else none); then the
    wait for the kernel before."""
    launch_dependents()
    nbytes = tl.minimum(K_PER_SPLIT, K - k0) * 4
    aligned = ((K * 4) % 16 == 0) & ((k0 * 4) % 16 == 0) & (nbytes % 16 == 0)
    prefetch_l2(w_ptr + e.to(tl.int64) * K + k0, nbytes, (e < E) & aligned)
    wait_previous()


@triton.jit
def router_logits_kernel(x_ptr, w_ptr, part_ptr, T, E, K, stride_x, K_PER_SPLIT,
                         BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                         PDL: tl.constexpr = False):
    """part[s, t, e] = sum over split s's K range of x[t, k] * w[e, k], in fp32."""
    pid_e = tl.program_id(0)
    pid_s = tl.program_id(1)
    t = tl.arange(0, BLOCK_T)
    e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    if PDL:
        _prefetch_rows(w_ptr, e, E, K, pid_s * K_PER_SPLIT, K_PER_SPLIT)
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
def router_rows_kernel(x_ptr, w_ptr, part_ptr, T, E, K, stride_x, K_PER_SPLIT,
                       BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """part[s, t, e] as `router_logits_kernel` makes it, for few tokens: the split's whole [BLOCK_E,
    K_PER_SPLIT] tile of the router loaded at once (K_PER_SPLIT <= BLOCK_K), then reduced against one
    token's row at a time in fp32 (no shared-memory round trip of a product)."""
    pid_e = tl.program_id(0)
    pid_s = tl.program_id(1)
    e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    k = pid_s * K_PER_SPLIT + tl.arange(0, BLOCK_K)
    kmask = (k < K) & (tl.arange(0, BLOCK_K) < K_PER_SPLIT)
    if PDL:
        _prefetch_rows(w_ptr, e, E, K, pid_s * K_PER_SPLIT, K_PER_SPLIT)
    w = tl.load(w_ptr + e[:, None] * K + k[None, :], mask=(e[:, None] < E) & kmask[None, :], other=0.0)
    for t in range(T):
        x = tl.load(x_ptr + t * stride_x + k, mask=kmask, other=0.0).to(tl.float32)
        tl.store(part_ptr + (pid_s * T + t) * E + e, tl.sum(w * x[None, :], 1), mask=e < E)


@triton.jit
def _topk_token(part_ptr, bias_ptr, slots_ptr, ids_ptr, weights_ptr, t, T, E, scale, eps,
                S: tl.constexpr, TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr, NORM: tl.constexpr,
                HAS_SLOTS: tl.constexpr, BLOCK_E: tl.constexpr):
    """Token t's routing (see `topk_kernel`), stored to ids / weights."""
    e = tl.arange(0, BLOCK_E)
    emask = e < E
    logits = tl.zeros([BLOCK_E], dtype=tl.float32)
    for s in tl.static_range(S):  # unrolled: every split's load in flight at once
        logits += tl.load(part_ptr + (s * T + t) * E + e, mask=emask, other=0.0)
    scores = tl.sigmoid(logits)
    sel = scores + tl.load(bias_ptr + e, mask=emask, other=0.0).to(tl.float32) + 0.0  # -0.0 reads as +0.0
    bits = sel.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
    lowest = -9223372036854775807 - 1
    key = tl.where(emask, ordered * 4294967296 + (BLOCK_E - 1 - e), lowest)
    kk = tl.arange(0, TOP_K_PAD)
    ids = tl.full([TOP_K_PAD], -1, dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        top = tl.max(key, axis=0)
        ids = tl.where(kk == k, (BLOCK_E - 1 - (top & 4294967295)).to(tl.int32), ids)
        key = tl.where(key == top, lowest, key)
    w = tl.sum(tl.where(e[None, :] == ids[:, None], scores[None, :], 0.0), axis=1)
    if NORM:
        w = w / (tl.sum(w, axis=0) + eps)
    w = w * scale
    if HAS_SLOTS:
        pad = tl.load(slots_ptr + t) < 0
        ids = tl.where(pad, -1, ids)
        w = tl.where(pad, 0.0, w)
    tl.store(ids_ptr + t * TOP_K + kk, ids, mask=kk < TOP_K)
    tl.store(weights_ptr + t * TOP_K + kk, w, mask=kk < TOP_K)


@triton.jit
def topk_kernel(part_ptr, bias_ptr, slots_ptr, ids_ptr, weights_ptr, T, E, scale, eps,
                S: tl.constexpr, TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr, NORM: tl.constexpr,
                HAS_SLOTS: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr = False):
    """One token per program: its logits summed over the S splits in order, sigmoid scores, top-k of
    scores + bias with the lower expert index first among equal values, the chosen scores renormalised
    and scaled. Writes ids / weights `[T, TOP_K]` (a padded token: -1 / 0). Each pick is one reduction of
    an int64 key: the order-preserving bits of score + bias above the reversed expert index."""
    if PDL:
        launch_dependents()
        wait_previous()
    _topk_token(part_ptr, bias_ptr, slots_ptr, ids_ptr, weights_ptr, tl.program_id(0), T, E, scale, eps,
                S, TOP_K, TOP_K_PAD, NORM, HAS_SLOTS, BLOCK_E)


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _group(ids_ptr, slots_ptr, slot_expert_ptr, slot_start_ptr, slot_count_ptr, rows_ptr, n_slots_ptr, T,
           TOP_K: tl.constexpr, HAS_SLOTS: tl.constexpr, BLOCK_T: tl.constexpr, SPAN: tl.constexpr,
           BLOCK_M: tl.constexpr):
    """The grouping of `group_kernel`."""
    t = tl.arange(0, BLOCK_T)
    valid = t < T
    if HAS_SLOTS:
        valid = valid & (tl.load(slots_ptr + t, mask=t < T, other=-1) >= 0)
    n_valid = tl.sum(valid.to(tl.int32), 0)
    vrank = tl.cumsum(valid.to(tl.int32), 0) - 1
    tl.store(rows_ptr + vrank, T * TOP_K + t, mask=valid)  # the shared expert's rows: valid tokens in order
    n_shared = tl.cdiv(n_valid, BLOCK_M)
    j = tl.arange(0, BLOCK_T // BLOCK_M)
    jmask = j < n_shared
    tl.store(slot_expert_ptr + j, tl.full([BLOCK_T // BLOCK_M], -1, tl.int32), mask=jmask)
    tl.store(slot_start_ptr + j, j * BLOCK_M, mask=jmask)
    tl.store(slot_count_ptr + j, tl.minimum(n_valid - j * BLOCK_M, BLOCK_M), mask=jmask)

    # The routed pairs sorted by (expert, pair); an expert's run of them is one slot.
    i = tl.arange(0, SPAN)
    e = tl.load(ids_ptr + i, mask=i < T * TOP_K, other=-1)
    big = 1 << 30
    key = tl.sort(tl.where(e >= 0, e * SPAN + i, big))
    n_pairs = tl.sum((key < big).to(tl.int32), 0)
    live = i < n_pairs
    se = key // SPAN
    tl.store(rows_ptr + n_valid + i, key % SPAN, mask=live)
    prev = tl.gather(se, tl.maximum(i - 1, 0), 0)
    nxt = tl.gather(se, tl.minimum(i + 1, SPAN - 1), 0)
    first = live & ((i == 0) | (se != prev))
    last = live & ((i == n_pairs - 1) | (se != nxt))
    rank = tl.cumsum(first.to(tl.int32), 0) - 1
    run_start = tl.associative_scan(tl.where(first, i, 0), 0, _max)
    tl.store(slot_expert_ptr + n_shared + rank, se, mask=first)
    tl.store(slot_start_ptr + n_shared + rank, n_valid + i, mask=first)
    tl.store(slot_count_ptr + n_shared + rank, i - run_start + 1, mask=last)
    tl.store(n_slots_ptr, n_shared + tl.sum(first.to(tl.int32), 0))


@triton.jit
def group_kernel(ids_ptr, slots_ptr, slot_expert_ptr, slot_start_ptr, slot_count_ptr, rows_ptr, n_slots_ptr, T,
                 TOP_K: tl.constexpr, HAS_SLOTS: tl.constexpr, BLOCK_T: tl.constexpr, SPAN: tl.constexpr,
                 BLOCK_M: tl.constexpr, PDL: tl.constexpr = False):
    """One program: the step's slots and rows (see the module docstring) from ids `[T, TOP_K]` (-1 for a
    padded token). SPAN: a power of two of at least T * TOP_K."""
    if PDL:
        launch_dependents()
        wait_previous()
    _group(ids_ptr, slots_ptr, slot_expert_ptr, slot_start_ptr, slot_count_ptr, rows_ptr, n_slots_ptr, T,
           TOP_K, HAS_SLOTS, BLOCK_T, SPAN, BLOCK_M)


@triton.jit
def topk_group_kernel(part_ptr, bias_ptr, slots_ptr, ids_ptr, weights_ptr, slot_expert_ptr, slot_start_ptr,
                      slot_count_ptr, rows_ptr, n_slots_ptr, T, E, scale, eps,
                      S: tl.constexpr, TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr, NORM: tl.constexpr,
                      HAS_SLOTS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr, SPAN: tl.constexpr,
                      BLOCK_M: tl.constexpr, PDL: tl.constexpr = False):
    """`topk_kernel` and `group_kernel` in one program for few tokens (one launch less; the tokens' top-k
    run one after another): the same ids, weights and grouping."""
    if PDL:
        launch_dependents()
        wait_previous()
    for t in range(T):
        _topk_token(part_ptr, bias_ptr, slots_ptr, ids_ptr, weights_ptr, t, T, E, scale, eps,
                    S, TOP_K, TOP_K_PAD, NORM, HAS_SLOTS, BLOCK_E)
    tl.debug_barrier()  # the ids this program's threads stored, visible to all of them
    _group(ids_ptr, slots_ptr, slot_expert_ptr, slot_start_ptr, slot_count_ptr, rows_ptr, n_slots_ptr, T,
           TOP_K, HAS_SLOTS, BLOCK_T, SPAN, BLOCK_M)
