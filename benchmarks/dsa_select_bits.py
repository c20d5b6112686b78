"""Experiment: the DSA selection's threshold found bit by bit instead of by radix histograms.

The shipped selection (`glm5next/kernels/dsa/indexer.py`, `_top`) narrows the K-th largest 32-bit key with
four 8-bit radix passes, each a 256-bin `tl.histogram` of the block, its cumulative sum and a max: one
program a token takes ~15 us over an 8K table (2052 pools) whatever the token count (H100, s44). Here the
threshold is built from the top bit down: a bit stays set where at least K keys are >= the prefix with it,
32 counts of the block (a compare and a sum each) and no histogram. Ties, ranks and the output are as
shipped (the lower pool first among equal keys), so the selection must be identical.

    python benchmarks/dsa_select_bits.py        # the interpreter against the shipped kernel (CPU)

On a GPU, `benchmarks/dsa_select.py --bits` times it beside the shipped selection on the same scores.
"""

from __future__ import annotations

import os

if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import triton
import triton.language as tl

from glm5next.kernels.dsa import DsaPlan, select_levels
from glm5next.kernels.dsa.indexer import _visible_pools


@triton.jit
def _top_bits(key, ok, K: tl.constexpr):
    """`_top` of the shipped kernel with the threshold found bit by bit (see the module docstring)."""
    n = tl.sum(ok.to(tl.int32), 0)
    k = tl.minimum(n, K)
    take = ok
    if n > K:
        prefix = tl.full([], 0, tl.uint32)
        for b in tl.static_range(32):
            cand = prefix | tl.full([], 1 << (31 - b), tl.uint32)
            if tl.sum((ok & (key >= cand)).to(tl.int32), 0) >= k:
                prefix = cand
        need = k - tl.sum((ok & (key > prefix)).to(tl.int32), 0)
        eq = (ok & (key == prefix)).to(tl.int32)
        rank = tl.cumsum(eq, 0) - eq  # lower positions first among equal keys
        take = (ok & (key > prefix)) | ((eq != 0) & (rank < need))
    at = tl.cumsum(take.to(tl.int32), 0) - 1
    return take, at, k


@triton.jit
def select_bits_kernel(
    src_ptr, src_key_ptr, pos_ptr, slot_ptr, dst_ptr, dst_key_ptr, count_ptr, s_src, s_dst, n_src,
    K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr, W: tl.constexpr, WB: tl.constexpr, KB: tl.constexpr,
    FROM_SCORES: tl.constexpr, FINAL: tl.constexpr,
):
    """`select_pools_kernel` with `_top_bits` (same arguments, same outputs)."""
    t = tl.program_id(0)
    c = tl.program_id(1)
    i = c * BLOCK + tl.arange(0, BLOCK)
    if FROM_SCORES:
        ok = i < _visible_pools(pos_ptr, slot_ptr, t, n_src, KP)
        s = tl.load(src_ptr + t * s_src + i, mask=ok, other=0.0) + 0.0  # -0.0 reads as +0.0
        bits = s.to(tl.int32, bitcast=True)
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # signed order of the scores
        pool = i
    else:
        pool = tl.load(src_ptr + t * s_src + i, mask=i < n_src, other=-1)
        ok = pool >= 0
        ordered = tl.load(src_key_ptr + t * s_src + i, mask=ok, other=0)
    key = (ordered ^ -2147483648).to(tl.uint32, bitcast=True)  # larger score, larger key (unsigned)
    take, at, kept = _top_bits(key, ok, K)
    if FINAL:
        row = dst_ptr + t * s_dst
        tl.store(row + at, pool.to(tl.int64), mask=take)
        j = tl.arange(0, KB)
        tl.store(row + j, tl.full([KB], -1, tl.int64), mask=(j >= kept) & (j < K))
        tl.store(count_ptr + t, kept)
    else:
        at = at + (t * s_dst + c * W)
        tl.store(dst_ptr + at, pool.to(tl.int32), mask=take)
        tl.store(dst_key_ptr + at, ordered, mask=take)
        j = tl.arange(0, WB)
        tl.store(dst_ptr + t * s_dst + c * W + j, tl.full([WB], -1, tl.int32), mask=(j >= kept) & (j < W))


def select_bits(scores: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, kpool: int, k: int,
                plan: DsaPlan, out: torch.Tensor, count: torch.Tensor) -> None:
    """`select_pools` (the same levels and chunks) on `select_bits_kernel`, into out [T, k] and count [T]."""
    t, _ = scores.shape
    src, src_key, s_src = scores, scores, scores.stride(0)
    levels = select_levels(scores.shape[1], k, plan.select_chunk)
    for level, (n, chunks, block) in enumerate(levels):
        final = level == len(levels) - 1
        w = min(block, k)
        if final:
            dst, dst_key, s_dst = out, out, out.stride(0)
        else:
            cand = torch.empty(2, t, chunks * w, dtype=torch.int32, device=scores.device)
            dst, dst_key, s_dst = cand[0], cand[1], chunks * w
        select_bits_kernel[(t, chunks)](
            src, src_key, positions, slots, dst, dst_key, count, s_src, s_dst, n, K=k, KP=kpool, BLOCK=block, W=w,
            WB=triton.next_power_of_2(w), KB=triton.next_power_of_2(k), FROM_SCORES=level == 0, FINAL=final,
            num_warps=plan.select_warps)
        src, src_key, s_src = dst, dst_key, s_dst


def main() -> None:
    from glm5next.kernels.dsa import plan_dsa, select_pools_reference
    gen = torch.Generator().manual_seed(0)
    for n_pools, tokens, chunk in ((300, 3, 128), (700, 2, 256)):
        scores = torch.randn(tokens, n_pools, generator=gen)
        scores[:, : n_pools // 3] = scores[:, :1]  # a run of equal scores across the cut
        positions = torch.full((tokens,), n_pools * 4 - 1, dtype=torch.int64)
        positions[0] = 4 * 100 + 2  # a token that sees fewer pools
        slots = torch.arange(tokens, dtype=torch.int64)
        plan = plan_dsa(tokens, 64, n_pools, 64, 4, 132, select_chunk=chunk)
        out = torch.full((tokens, 64), -2, dtype=torch.int64)
        count = torch.empty(tokens, dtype=torch.int32)
        select_bits(scores, positions, slots, 4, 64, plan, out, count)
        want = select_pools_reference(scores, positions, slots, 4, 64)[0]
        print(f"{n_pools} pools, {tokens} tokens, chunks of {chunk}: {'equal' if torch.equal(out, want) else 'DIFFERS'}")
        if not torch.equal(out, want):
            raise SystemExit("the bitwise selection differs from the reference")


if __name__ == "__main__":
    main()
