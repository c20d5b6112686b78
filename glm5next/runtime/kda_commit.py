"""Speculative decoding's KDA bookkeeping: advancing each state over the tokens a verify step accepted.

A verify step of q tokens per row only reads the KDA conv window and recurrent state, and leaves in
`KdaState.verify` (the scratch `runtime.cache.allocate_cache` sizes) the window and the per-token
k, v, decay and beta it computed; once acceptance is known, `commit` (host lists) or `commit_rows`
(device tensors, inside a CUDA graph) replays the accepted tokens from there, writing the fp32 state
once, so a rejected token never touches it.
"""

from __future__ import annotations

import torch

from ..forward import KdaState
from ..kernels.kda import kda_commit
from ..model.kda_recurrence import kda_step


def commit(state: KdaState, slots: list[int], accepted: list[int]) -> None:
    """Advance each slot's conv window and state over its first `accepted` verified tokens (>= 1),
    from what the verify step left: the fp32 state is written once."""
    keep = state.conv.shape[-1]
    saved = state.verify
    for slot, n in zip(slots, accepted):
        state.conv[slot] = saved["window"][slot, :, n : n + keep]
        s = state.recurrent[slot]
        for j in range(n):
            k = saved["k"][slot, j]
            _, s = kda_step(k, k, saved["v"][slot, j], saved["g"][slot, j], saved["beta"][slot, j], s)
        state.recurrent[slot] = s


def commit_rows(state: KdaState, slots: torch.Tensor, accepted: torch.Tensor) -> None:
    """`commit` for device tensors, with fixed shapes and no host syncs (it runs inside a CUDA graph):
    `slots` [N] int64 (padding already redirected to the scratch slot), `accepted` [N] int64
    tokens to advance over (0 leaves a row as it was). On a GPU, one kernel launch (`kernels.kda.kda_commit`:
    the KDA stage's own arithmetic, so the state is the one its decode of those tokens writes)."""
    saved = state.verify
    if state.recurrent.is_cuda:
        kda_commit(state.conv, state.recurrent, saved, slots, accepted)
        return
    keep = state.conv.shape[-1]
    window = saved["window"][slots]  # [N, 3HK, keep + q]
    cols = accepted[:, None] + torch.arange(keep, device=slots.device)
    conv = window.gather(2, cols[:, None, :].expand(-1, window.shape[1], -1))
    s = state.recurrent[slots]
    for j in range(saved["k"].shape[1]):
        k = saved["k"][slots, j]
        _, nxt = kda_step(k, k, saved["v"][slots, j], saved["g"][slots, j], saved["beta"][slots, j], s)
        s = torch.where((accepted > j).view(-1, 1, 1, 1), nxt, s)
    state.conv.index_copy_(0, slots, conv)
    state.recurrent.index_copy_(0, slots, s)
