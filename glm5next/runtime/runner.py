"""One forward step over a set of sequences: metadata, caches, logits."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

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


class Runner:
    """Runs the stock backbone one step at a time over paged caches."""

    def __init__(self, model: Glm5NextModel, cache: ModelCache) -> None:
        self.model = model
        self.cache = cache
        self.device = model.embed_tokens.device
        self.prefixes = [layer.self_attn.prefix for layer in model.layers]

    @torch.inference_mode()
    def step(self, seqs: list[Sequence], max_chunk: int | None = None) -> torch.Tensor:
        """Run every sequence's uncached tokens (decodes first) and return the fp32
        logits [len(seqs), vocab] of each sequence's last run token, in `seqs` order.

        A prefill longer than `max_chunk` runs only its first `max_chunk` tokens.
        """
        order = sorted(range(len(seqs)), key=lambda i: not seqs[i].is_decode)
        ordered = [seqs[i] for i in order]
        items = []
        for s in ordered:
            q = len(s.token_ids) - s.num_cached
            items.append((s.token_ids, s.num_cached, q if max_chunk is None else min(q, max_chunk), s.slot, s.blocks))
        logits = self.execute(items, sum(s.is_decode for s in ordered))
        for s, item in zip(ordered, items):
            s.num_cached += item[2]
        out = torch.empty_like(logits)
        out[torch.tensor(order, device=self.device)] = logits
        return out

    @torch.inference_mode()
    def execute(self, items: list[tuple[list[int], int, int, int, list[int]]], num_decodes: int) -> torch.Tensor:
        """The fp32 logits [len(items), vocab] of each item's last run token.

        Each item is `(token_ids, num_computed, num_tokens, slot, blocks)`: run
        `token_ids[num_computed : num_computed + num_tokens]` after `num_computed`
        cached tokens. The first `num_decodes` items decode one token each.
        """
        query_lens = [n for _, _, n, _, _ in items]
        ids = [t for toks, c, n, _, _ in items for t in toks[c : c + n]]
        md = build_metadata(
            query_lens, [c for _, c, _, _, _ in items], num_decodes,
            [slot for *_, slot, _ in items], [blocks for *_, blocks in items],
            self.cache.block_size, self.device,
        )
        ctx = ForwardContext({p: md for p in self.prefixes}, md.positions, CUDAGraphMode.NONE)
        hidden = self.model(torch.tensor(ids, dtype=torch.int64, device=self.device), ctx, self.cache)
        last = torch.tensor(md.query_start_loc_cpu[1:], device=self.device) - 1
        return self.model.compute_logits(hidden[last])
