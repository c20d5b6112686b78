"""Allocating the caches of one model (paged DSA caches and per-sequence KDA slots), and what they cost.

The cache types themselves live in `glm5next.forward`; see there for the scratch block and slot that
padded rows write to.

Under tensor parallelism each rank holds the KDA states of its own heads only. The DSA caches
hold per-token latents and indexer keys shared by every head, so every rank holds all of them
(each writes the same rows); only the per-sequence KDA slots shrink with the group size.
"""

from __future__ import annotations

import torch

from ..config import DSA, KDA, Glm5NextConfig
from ..forward import DsaCache, KdaState, ModelCache


def allocate_cache(
    config: Glm5NextConfig,
    num_blocks: int,
    block_size: int,
    num_slots: int,
    dtype: torch.dtype,
    device: torch.device | str,
    include_mtp: bool = True,
    verify_tokens: int = 0,
    tp_size: int = 1,
) -> ModelCache:
    """Zeroed caches for every attention layer: `num_blocks` paged blocks of `block_size` tokens per DSA
    layer (the MTP layer's too, when `include_mtp` and the config has one), `num_slots` KDA state slots
    per KDA layer (this rank's heads of `tp_size`), and the verify scratch of `verify_tokens`-token
    speculative steps when > 1."""
    if block_size % config.index_kpool:
        raise ValueError(f"block_size={block_size} must be a multiple of index_kpool={config.index_kpool}")
    cache = ModelCache(config, block_size, num_blocks, num_slots)
    dsa_layers = [i for i, k in enumerate(config.layer_kinds) if k == DSA]
    if include_mtp and config.num_nextn_predict_layers:
        dsa_layers.append(config.mtp_layer_idx)
    pools = block_size // config.index_kpool
    for i in dsa_layers:
        cache.dsa[i] = DsaCache(
            latent=torch.zeros(num_blocks + 1, block_size, config.kv_lora_rank, dtype=dtype, device=device),
            index_key=torch.zeros(num_blocks + 1, block_size, config.index_head_dim, dtype=dtype, device=device),
            index_gate=torch.zeros(num_blocks + 1, block_size, config.index_head_dim, dtype=dtype, device=device),
            pooled_key=torch.zeros(num_blocks + 1, pools, config.index_head_dim, dtype=dtype, device=device),
        )
    h, d = config.linear_num_heads // tp_size, config.linear_head_dim
    c = h * d
    for i, k in enumerate(config.layer_kinds):
        if k == KDA:
            cache.kda[i] = KdaState(
                conv=torch.zeros(num_slots + 1, 3 * c, config.linear_conv_kernel_dim - 1, dtype=dtype, device=device),
                recurrent=torch.zeros(num_slots + 1, h, d, d, dtype=torch.float32, device=device),
            )
            if verify_tokens > 1:
                n, q, f32 = num_slots + 1, verify_tokens, dict(dtype=torch.float32, device=device)
                cache.kda[i].verify = {
                    "window": torch.zeros(n, 3 * c, config.linear_conv_kernel_dim - 1 + q, dtype=dtype, device=device),
                    "k": torch.zeros(n, q, h, d, **f32), "g": torch.zeros(n, q, h, d, **f32),
                    "v": torch.zeros(n, q, h, d, **f32), "beta": torch.zeros(n, q, h, **f32),
                }
    return cache


def zero_usable(cache: ModelCache) -> None:
    """Every usable block and slot of `cache` (MTP layer and verify scratch included) back to the zeros
    `allocate_cache` gave them; the scratch block and slot, which only padding rows write, are left alone."""
    for t in cache.tensors() + [t for s in cache.kda.values() for t in (s.verify or {}).values()]:
        t[:-1].zero_()


def bytes_per_block(config: Glm5NextConfig, block_size: int, dtype: torch.dtype, include_mtp: bool = True) -> int:
    """Bytes one paged block costs across every DSA layer."""
    n = sum(1 for k in config.layer_kinds if k == DSA) + (1 if include_mtp and config.num_nextn_predict_layers else 0)
    per_token = config.kv_lora_rank + 2 * config.index_head_dim + config.index_head_dim / config.index_kpool
    return int(n * block_size * per_token * torch.tensor([], dtype=dtype).element_size())


def bytes_per_slot(config: Glm5NextConfig, dtype: torch.dtype, verify_tokens: int = 0, tp_size: int = 1) -> int:
    """Bytes one sequence's KDA states cost across every KDA layer (with the verify scratch of
    `verify_tokens`-token speculative steps, when > 1), on one of `tp_size` ranks."""
    n = sum(1 for k in config.layer_kinds if k == KDA)
    size = torch.tensor([], dtype=dtype).element_size()
    keep = config.linear_conv_kernel_dim - 1
    h, d = config.linear_num_heads // tp_size, config.linear_head_dim
    per = 3 * h * d * keep * size + h * d * d * 4
    if verify_tokens > 1:
        per += 3 * h * d * (keep + verify_tokens) * size + verify_tokens * (3 * h * d + h) * 4
    return n * per


def blocks_for_budget(
    config: Glm5NextConfig, budget_bytes: int, block_size: int, num_slots: int, dtype: torch.dtype,
    include_mtp: bool = True, verify_tokens: int = 0, tp_size: int = 1,
) -> int:
    """Paged blocks that fit in `budget_bytes` once `num_slots` KDA slots (and the scratch block and slot) are paid,
    on one of `tp_size` ranks."""
    per_block = bytes_per_block(config, block_size, dtype, include_mtp)
    rest = budget_bytes - (num_slots + 1) * bytes_per_slot(config, dtype, verify_tokens, tp_size) - per_block
    return max(rest // per_block, 0)
