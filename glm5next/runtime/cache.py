"""The cache tensors of one model: paged DSA caches and per-sequence KDA slots.

Every tensor carries one extra scratch block (paged caches) or slot (KDA
states) past the end. Rows whose slot is -1 (graph padding) are redirected
there, so a padded row never touches a real sequence's cache and every write
keeps a static shape.

Under tensor parallelism each rank holds the KDA states of its own heads only. The DSA caches
hold per-token latents and indexer keys shared by every head, so every rank holds all of them
(each writes the same rows); only the per-sequence KDA slots shrink with the group size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import DSA, KDA, Glm5NextConfig


@dataclass
class DsaCache:
    """Paged caches of one DSA layer, each `[num_blocks + 1, rows_per_block, width]`."""

    latent: torch.Tensor
    """[blocks + 1, block_size, kv_lora_rank]: the MLA latent `c` of every token."""
    index_key: torch.Tensor
    """[blocks + 1, block_size, index_head_dim]: the indexer key `kI` of every token."""
    index_gate: torch.Tensor
    """[blocks + 1, block_size, index_head_dim]: the KPool gate logits `gI` of every token."""
    pooled_key: torch.Tensor
    """[blocks + 1, block_size / kpool, index_head_dim]: the pooled key of every complete pool."""

    @property
    def block_size(self) -> int:
        return self.latent.shape[1]

    @property
    def num_blocks(self) -> int:
        """Usable blocks (the scratch block not counted)."""
        return self.latent.shape[0] - 1

    def token_rows(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        """Flat token rows for `slot_mapping`, with -1 redirected to the scratch block."""
        scratch = self.num_blocks * self.block_size
        return torch.where(slot_mapping < 0, torch.full_like(slot_mapping, scratch), slot_mapping)


@dataclass
class KdaState:
    """Per-sequence state of one KDA layer, each `[num_slots + 1, ...]`."""

    conv: torch.Tensor
    """[slots + 1, 3 * heads * head_dim, conv_kernel - 1]: last pre-conv q|k|v rows, oldest first."""
    recurrent: torch.Tensor
    """[slots + 1, heads, key_dim, value_dim] fp32: the delta-rule state S (HF layout)."""
    verify: dict[str, torch.Tensor] | None = None
    """Speculative decoding only: what a verify step of q tokens leaves per slot for `commit` —
    'window' [slots + 1, 3HK, conv_kernel - 1 + q] (the old conv rows then the q new pre-conv rows),
    'k', 'g' [slots + 1, q, H, K], 'v' [slots + 1, q, H, V], 'beta' [slots + 1, q, H], all fp32
    except the window (the conv dtype). A verify step leaves `conv` and `recurrent` untouched."""

    @property
    def num_slots(self) -> int:
        """Usable slots (the scratch slot not counted)."""
        return self.conv.shape[0] - 1

    def slots(self, state_indices: torch.Tensor) -> torch.Tensor:
        """State slots with -1 redirected to the scratch slot."""
        return torch.where(state_indices < 0, torch.full_like(state_indices, self.num_slots), state_indices)


class ModelCache:
    """The caches of every attention layer of a model, MTP layer included."""

    def __init__(
        self,
        config: Glm5NextConfig,
        num_blocks: int,
        block_size: int,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device | str,
        include_mtp: bool = True,
        verify_tokens: int = 0,
        tp_size: int = 1,
    ) -> None:
        if block_size % config.index_kpool:
            raise ValueError(f"block_size={block_size} must be a multiple of index_kpool={config.index_kpool}")
        self.config = config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_slots = num_slots
        self.dsa: dict[int, DsaCache] = {}
        self.kda: dict[int, KdaState] = {}
        dsa_layers = [i for i, k in enumerate(config.layer_kinds) if k == DSA]
        if include_mtp and config.num_nextn_predict_layers:
            dsa_layers.append(config.mtp_layer_idx)
        pools = block_size // config.index_kpool
        for i in dsa_layers:
            self.dsa[i] = DsaCache(
                latent=torch.zeros(num_blocks + 1, block_size, config.kv_lora_rank, dtype=dtype, device=device),
                index_key=torch.zeros(num_blocks + 1, block_size, config.index_head_dim, dtype=dtype, device=device),
                index_gate=torch.zeros(num_blocks + 1, block_size, config.index_head_dim, dtype=dtype, device=device),
                pooled_key=torch.zeros(num_blocks + 1, pools, config.index_head_dim, dtype=dtype, device=device),
            )
        h, d = config.linear_num_heads // tp_size, config.linear_head_dim
        c = h * d
        for i, k in enumerate(config.layer_kinds):
            if k == KDA:
                self.kda[i] = KdaState(
                    conv=torch.zeros(num_slots + 1, 3 * c, config.linear_conv_kernel_dim - 1, dtype=dtype, device=device),
                    recurrent=torch.zeros(num_slots + 1, h, d, d, dtype=torch.float32, device=device),
                )
                if verify_tokens > 1:
                    n, q, f32 = num_slots + 1, verify_tokens, dict(dtype=torch.float32, device=device)
                    self.kda[i].verify = {
                        "window": torch.zeros(n, 3 * c, config.linear_conv_kernel_dim - 1 + q, dtype=dtype, device=device),
                        "k": torch.zeros(n, q, h, d, **f32), "g": torch.zeros(n, q, h, d, **f32),
                        "v": torch.zeros(n, q, h, d, **f32), "beta": torch.zeros(n, q, h, **f32),
                    }

    def tensors(self) -> list[torch.Tensor]:
        """Every cache tensor (for snapshots in tests and byte accounting)."""
        out = []
        for c in self.dsa.values():
            out += [c.latent, c.index_key, c.index_gate, c.pooled_key]
        for s in self.kda.values():
            out += [s.conv, s.recurrent]
        return out

    @staticmethod
    def bytes_per_block(config: Glm5NextConfig, block_size: int, dtype: torch.dtype, include_mtp: bool = True) -> int:
        """Bytes one paged block costs across every DSA layer."""
        n = sum(1 for k in config.layer_kinds if k == DSA) + (1 if include_mtp and config.num_nextn_predict_layers else 0)
        per_token = config.kv_lora_rank + 2 * config.index_head_dim + config.index_head_dim / config.index_kpool
        return int(n * block_size * per_token * torch.tensor([], dtype=dtype).element_size())

    @staticmethod
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
    per_block = ModelCache.bytes_per_block(config, block_size, dtype, include_mtp)
    rest = budget_bytes - (num_slots + 1) * ModelCache.bytes_per_slot(config, dtype, verify_tokens, tp_size) - per_block
    return max(rest // per_block, 0)
