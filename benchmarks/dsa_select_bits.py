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

from glm5next.kernels.dsa import DsaPlan, select_pools
from glm5next.kernels.dsa.indexer import select_entries, select_store


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
    pool, ok, ordered, key = select_entries(src_ptr, src_key_ptr, pos_ptr, slot_ptr, s_src, n_src, t, c, KP, BLOCK,
                                            FROM_SCORES)
    take, at, kept = _top_bits(key, ok, K)
    select_store(dst_ptr, dst_key_ptr, count_ptr, s_dst, t, c, pool, ordered, take, at, kept, K, W, WB, KB, FINAL)


def select_bits(scores: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, kpool: int, k: int,
                plan: DsaPlan, out: torch.Tensor, count: torch.Tensor) -> None:
    """`select_pools` (the same levels and chunks) on `select_bits_kernel`, into out [T, k] and count [T]."""
    select_pools(scores, positions, slots, kpool, k, plan, out=out, count=count, kernel=select_bits_kernel)


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
