"""What every layer of a step shares: the step metadata, the forward context, the CUDA-graph mode and
the cache views. Types only, and `to_device`, the one way host values of a step reach the device; building
them is the runtime's job (`runtime.metadata`, `runtime.cache`).

A step is a flat list of tokens from several sequences. Decode sequences come
first (one token each, or `q` tokens each in a speculative verify), then prefill
sequences (a chunk of their prompt each). Rows added only to reach a captured
graph size are padding: their tokens have `slot_mapping == -1` and their
sequences `state_indices == -1`, and no cache is written for them.

Every cache tensor carries one extra scratch block (paged caches) or slot (KDA
states) past the end. Rows whose slot is -1 (graph padding) are redirected
there, so a padded row never touches a real sequence's cache and every write
keeps a static shape.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from .config import Glm5NextConfig


def to_device(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype, device=device)` without a stream synchronisation. A copy from pageable
    host memory to a GPU waits for every kernel queued before it (PyTorch synchronises the stream), so the GPU
    runs dry while the host builds the rest of the step; on CUDA the values go through pinned memory and an
    asynchronous copy instead (PyTorch's pinned-memory cache keeps the staging buffer until the copy is done).
    `values`: a list (or a CPU tensor) of numbers."""
    t = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class CUDAGraphMode(enum.Enum):
    """How the step runs: eagerly, or inside (the capture of) a full CUDA graph."""

    NONE = "none"
    FULL = "full"


@dataclass
class AttnMetadata:
    """What one attention layer needs to run a step over the paged caches.

    Device tensors have static shapes for a given graph size. The `*_cpu`
    lists are host copies used only by the eager prefill path.
    """

    num_prefills: int
    """Prefill sequences in the step (they follow the decodes)."""
    num_prefill_tokens: int
    num_decodes: int
    """Decode sequences in the step, padding rows included."""
    num_decode_tokens: int
    positions: torch.Tensor
    """[tokens] int64: absolute position of each token in its sequence."""
    token_to_seq: torch.Tensor
    """[tokens] int64: row of each token's sequence in the per-sequence tensors."""
    slot_mapping: torch.Tensor
    """[tokens] int64: flat paged-cache row (block * block_size + offset); -1 for padding."""
    state_indices: torch.Tensor
    """[seqs] int64: KDA state slot of each sequence; -1 for padding."""
    block_tables: torch.Tensor
    """[seqs, max_blocks] int64: the paged-cache blocks of each sequence, in order."""
    seq_lens: torch.Tensor
    """[seqs] int64: tokens of each sequence once this step's tokens are cached."""
    query_start_loc_cpu: list[int] = field(default_factory=list)
    """[seqs + 1]: first token of each sequence in the step (host)."""
    context_lens_cpu: list[int] = field(default_factory=list)
    """[seqs]: tokens each sequence had cached before this step (host)."""
    num_spec_decodes: int = 0
    """Sequences verifying speculative tokens (counted inside the decodes)."""
    num_spec_decode_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        """Tokens in the step, padding included."""
        return self.num_decode_tokens + self.num_prefill_tokens

    @property
    def num_seqs(self) -> int:
        """Sequences in the step, padding rows included."""
        return self.num_decodes + self.num_prefills

    @property
    def decode_q(self) -> int:
        """Tokens per decode sequence (1 for plain decode, q for a uniform verify)."""
        return self.num_decode_tokens // self.num_decodes if self.num_decodes else 0


@dataclass
class ForwardContext:
    """What a forward pass needs besides the token ids."""

    attn_metadata: dict[str, AttnMetadata]
    """Step metadata keyed by attention layer prefix (e.g. `layers.3.self_attn`)."""
    positions: torch.Tensor
    """[tokens] int64 absolute positions."""
    cudagraph_mode: CUDAGraphMode = CUDAGraphMode.NONE
    capturing: bool = False
    """Whether this forward is being recorded into a CUDA graph (on the CPU: declared so, to run
    the planned path eagerly). Warm-ups before a capture run with False, so they take the stock path."""

    def metadata(self, prefix: str) -> AttnMetadata:
        """The step metadata of the attention layer at `prefix`."""
        return self.attn_metadata[prefix]


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


@dataclass(eq=False)
class ModelCache:
    """The caches of every attention layer of a model, MTP layer included (allocated by
    `runtime.cache.allocate_cache`)."""

    config: Glm5NextConfig
    block_size: int
    """Tokens per paged block."""
    num_blocks: int
    """Usable paged blocks (the scratch block not counted)."""
    num_slots: int
    """Usable KDA state slots (the scratch slot not counted)."""
    dsa: dict[int, DsaCache] = field(default_factory=dict)
    """The paged caches of each DSA layer, by layer index (the MTP layer's under `config.mtp_layer_idx`)."""
    kda: dict[int, KdaState] = field(default_factory=dict)
    """The per-sequence states of each KDA layer, by layer index."""

    def tensors(self) -> list[torch.Tensor]:
        """Every cache tensor (for snapshots in tests and byte accounting)."""
        out = []
        for c in self.dsa.values():
            out += [c.latent, c.index_key, c.index_gate, c.pooled_key]
        for s in self.kda.values():
            out += [s.conv, s.recurrent]
        return out
