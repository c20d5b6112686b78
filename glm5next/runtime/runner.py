"""One forward step over a set of sequences: metadata, caches, logits."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import DSA
from ..model.backbone import Glm5NextModel
from .cache import ModelCache
from .metadata import CUDAGraphMode, ForwardContext, build_metadata


@dataclass
class Sequence:
    """One request's tokens and the cache it owns."""

    token_ids: list[int]
    slot: int
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0
    """Tokens already run through the model (their caches are written)."""

    @property
    def is_decode(self) -> bool:
        return self.num_cached == len(self.token_ids) - 1 and self.num_cached > 0


class BlockPool:
    """Free lists of paged blocks and KDA state slots."""

    def __init__(self, num_blocks: int, num_slots: int) -> None:
        self.free_blocks = list(range(num_blocks - 1, -1, -1))
        self.free_slots = list(range(num_slots - 1, -1, -1))

    def take_slot(self) -> int:
        if not self.free_slots:
            raise RuntimeError("no free KDA state slot")
        return self.free_slots.pop()

    def grow(self, seq: Sequence, tokens: int, block_size: int) -> None:
        """Give `seq` enough blocks to hold `tokens` tokens."""
        need = -(-tokens // block_size) - len(seq.blocks)
        if need > len(self.free_blocks):
            raise RuntimeError(f"out of cache blocks: need {need}, {len(self.free_blocks)} free")
        seq.blocks.extend(self.free_blocks.pop() for _ in range(max(need, 0)))

    def release(self, seq: Sequence) -> None:
        self.free_blocks.extend(reversed(seq.blocks))
        self.free_slots.append(seq.slot)
        seq.blocks = []


class Runner:
    """Runs the stock backbone one step at a time over paged caches."""

    def __init__(self, model: Glm5NextModel, cache: ModelCache) -> None:
        self.model = model
        self.cache = cache
        self.device = cache.kda[next(iter(cache.kda))].conv.device if cache.kda else next(iter(cache.dsa.values())).latent.device
        self.prefixes = [layer.self_attn.prefix for layer in model.layers]
        self.dsa_prefixes = [layer.self_attn.prefix for layer in model.layers if layer.layer_kind == DSA]

    @torch.inference_mode()
    def step(self, seqs: list[Sequence], max_chunk: int | None = None) -> torch.Tensor:
        """Run every sequence's uncached tokens (decodes first) and return the fp32
        logits [len(seqs), vocab] of each sequence's last run token, in `seqs` order.

        A prefill longer than `max_chunk` runs only its first `max_chunk` tokens.
        """
        order = sorted(range(len(seqs)), key=lambda i: not seqs[i].is_decode)
        ordered = [seqs[i] for i in order]
        num_decodes = sum(s.is_decode for s in ordered)
        query_lens, context_lens, ids = [], [], []
        for s in ordered:
            q = len(s.token_ids) - s.num_cached
            if max_chunk is not None:
                q = min(q, max_chunk)
            query_lens.append(q)
            context_lens.append(s.num_cached)
            ids.extend(s.token_ids[s.num_cached : s.num_cached + q])
        md = build_metadata(
            query_lens, context_lens, num_decodes,
            [s.slot for s in ordered], [s.blocks for s in ordered],
            self.cache.block_size, self.device,
        )
        ctx = ForwardContext({p: md for p in self.prefixes}, md.positions, CUDAGraphMode.NONE)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        hidden = self.model(input_ids, ctx, self.cache)
        last = torch.tensor(md.query_start_loc_cpu[1:], device=self.device) - 1
        logits = self.model.compute_logits(hidden[last])
        for s, q in zip(ordered, query_lens):
            s.num_cached += q
        out = torch.empty_like(logits)
        out[torch.tensor(order, device=self.device)] = logits
        return out
