"""KDA prefill on CUDA: the delta rule over every prefill sequence of a step in one call of
flash-linear-attention's chunked kernel (`fla.ops.kda.chunk_kda`, bounded gate).

Measured against the stock chunked form (`glm5next.model.kda_recurrence.kda_chunked`, PyTorch) at real
shapes on an H100 (bench/results/2026-12-06-h100-kda-prefill.json): 2.1 ms against 152 ms for one
8192-token prompt per layer, 2.2 ms against 153 ms for 8 prompts of 1024. fla's products are bf16 / tf32,
so a bf16 model takes this path and an fp32 model keeps the stock fp32 form (its 1e-4 bar).

fla is imported on first use: it is a dependency of the CUDA path only, and importing it costs seconds.
"""

from __future__ import annotations

import torch

__all__ = ["kda_prefill"]


def kda_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                initial: torch.Tensor, cu_seqlens: torch.Tensor, lower_bound: float,
                dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta-rule outputs [T, H, V] (`dtype`) and final states [N, H, K, V] fp32 of N sequences laid
    end to end (see `kda_prefill_reference` for the function).

    q, k: [T, H, K] (unit-norm, q already times the query scale); v: [T, H, V]; g: [T, H, K] fp32
    log-decays in [lower_bound, 0); beta: [T, H]; initial: [N, H, K, V] fp32 (not modified);
    cu_seqlens: [N + 1] int64 sequence starts on the device. q, k, v and beta are cast to `dtype`.
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
    qb, kb, vb = (z.to(dtype).unsqueeze(0) for z in (q, k, v))
    out, final = chunk_kda(qb, kb, vb, g.float().unsqueeze(0), beta.to(dtype).unsqueeze(0), scale=1.0,
                           initial_state=initial, output_final_state=True, safe_gate=True,
                           lower_bound=lower_bound, cu_seqlens=cu_seqlens)
    return out[0], final
