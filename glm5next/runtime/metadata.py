"""Per-step metadata that every attention layer reads, and the forward context.

A step is a flat list of tokens from several sequences. Decode sequences come
first (one token each, or `q` tokens each in a speculative verify), then prefill
sequences (a chunk of their prompt each). Rows added only to reach a captured
graph size are padding: their tokens have `slot_mapping == -1` and their
sequences `state_indices == -1`, and no cache is written for them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


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


def build_metadata(
    query_lens: list[int],
    context_lens: list[int],
    num_decodes: int,
    state_indices: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str,
    max_blocks: int | None = None,
) -> AttnMetadata:
    """Step metadata for sequences whose first `num_decodes` entries decode.

    `query_lens[i]` tokens of sequence i run in this step, after
    `context_lens[i]` cached ones. A sequence with state index -1 is padding:
    its tokens get slot -1 and write nothing.
    """
    if not (len(query_lens) == len(context_lens) == len(state_indices) == len(block_tables)):
        raise ValueError("query_lens, context_lens, state_indices and block_tables must have one entry per sequence")
    if block_size % 4:
        raise ValueError(f"block_size={block_size} must be a multiple of 4 (the KPool size alignment)")
    positions, token_to_seq, slots, starts = [], [], [], [0]
    for s, (q, c) in enumerate(zip(query_lens, context_lens)):
        pad = state_indices[s] < 0
        table = block_tables[s]
        for p in range(c, c + q):
            positions.append(p)
            token_to_seq.append(s)
            if pad:
                slots.append(-1)
            else:
                if p // block_size >= len(table):
                    raise ValueError(f"sequence {s}: position {p} has no cache block (table has {len(table)})")
                slots.append(table[p // block_size] * block_size + p % block_size)
        starts.append(starts[-1] + q)
    width = max_blocks if max_blocks is not None else max([len(t) for t in block_tables] + [1])
    tables = torch.zeros(len(block_tables), width, dtype=torch.int64)
    for s, t in enumerate(block_tables):
        if len(t) > width:
            raise ValueError(f"sequence {s} has {len(t)} blocks, more than max_blocks={width}")
        if t:
            tables[s, : len(t)] = torch.tensor(t, dtype=torch.int64)
    dev = torch.device(device)
    i64 = dict(dtype=torch.int64, device=dev)
    num_decode_tokens = sum(query_lens[:num_decodes])
    return AttnMetadata(
        num_prefills=len(query_lens) - num_decodes,
        num_prefill_tokens=sum(query_lens[num_decodes:]),
        num_decodes=num_decodes,
        num_decode_tokens=num_decode_tokens,
        positions=torch.tensor(positions, **i64),
        token_to_seq=torch.tensor(token_to_seq, **i64),
        slot_mapping=torch.tensor(slots, **i64),
        state_indices=torch.tensor(state_indices, **i64),
        block_tables=tables.to(dev),
        seq_lens=torch.tensor([c + q for q, c in zip(query_lens, context_lens)], **i64),
        query_start_loc_cpu=starts,
        context_lens_cpu=list(context_lens),
    )
