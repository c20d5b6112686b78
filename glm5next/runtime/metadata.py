"""Building the per-step metadata every attention layer reads (the types are in `glm5next.forward`)."""

from __future__ import annotations

import torch

from ..forward import AttnMetadata, to_device


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
    i64 = torch.int64
    num_decode_tokens = sum(query_lens[:num_decodes])
    return AttnMetadata(
        num_prefills=len(query_lens) - num_decodes,
        num_prefill_tokens=sum(query_lens[num_decodes:]),
        num_decodes=num_decodes,
        num_decode_tokens=num_decode_tokens,
        positions=to_device(positions, i64, dev),
        token_to_seq=to_device(token_to_seq, i64, dev),
        slot_mapping=to_device(slots, i64, dev),
        state_indices=to_device(state_indices, i64, dev),
        block_tables=to_device(tables, i64, dev),
        seq_lens=to_device([c + q for q, c in zip(query_lens, context_lens)], i64, dev),
        query_start_loc_cpu=starts,
        context_lens_cpu=list(context_lens),
    )
