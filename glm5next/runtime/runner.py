"""One forward step over a set of sequences: metadata, caches, logits.

Pure-decode steps of a captured size replay a CUDA graph; every other step runs
eagerly. Graphs are captured once per size in `capture_sizes`, largest first,
into one memory pool. A replayed step reads its inputs from static device
buffers that the runner refills before each replay (one host-to-device copy);
rows past the step's decodes are padding with slot -1 and write no cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..forward import AttnMetadata, CUDAGraphMode, ForwardContext, ModelCache, to_device
from ..model.backbone import Glm5NextModel
from .host_times import HostTimes
from .kda_commit import commit
from .metadata import build_metadata

DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)
"""Decode sizes captured by default; a step of n decodes replays the smallest size >= n."""

Item = tuple[list[int], int, int, int, list[int]]
"""(token_ids, num_computed, num_tokens, slot, blocks): one sequence's share of a step."""


@dataclass
class TokenPatch:
    """Step tokens the host does not know yet: the tokens a step still in flight samples, run by the next step
    (the engine schedules step n + 1 while step n runs). `positions` [P] int64 are the places in the step's flat
    token list, `tokens` [P] int64 their values, both on the step's device; the host's placeholders there are
    overwritten on the device before the forward reads them."""

    positions: torch.Tensor
    tokens: torch.Tensor

    def apply(self, input_ids: torch.Tensor) -> None:
        input_ids.index_copy_(0, self.positions, self.tokens)


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


def check_capture_sizes(sizes) -> tuple[int, ...]:
    """`sizes` as a sorted tuple of distinct positive integers, or a ValueError naming the bad one."""
    out = sorted(set(sizes))
    bad = [s for s in out if not isinstance(s, int) or s < 1]
    if bad or not out:
        raise ValueError(f"capture_sizes={list(sizes)!r}: every size must be a positive integer (got {bad or 'none'})")
    return tuple(out)


class _StaticInputs:
    """Device buffers a captured graph reads, with a pinned host mirror filled per step."""

    FIELDS = ("input_ids", "positions", "token_to_seq", "slot_mapping", "state_indices", "seq_lens")

    def __init__(self, size: int, max_blocks: int, device: torch.device) -> None:
        self.size, self.max_blocks = size, max_blocks
        width = len(self.FIELDS) * size + size * max_blocks
        self.device_buf = torch.zeros(width, dtype=torch.int64, device=device)
        self.host_buf = torch.zeros(width, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.host_np = self.host_buf.numpy()
        self.by_state: dict[int, tuple[list[int], np.ndarray, int]] = {}
        """KDA state slot -> the block ids last loaded for it, the same as a zero-padded table row, and that
        content's version (a number no other content had)."""
        self.rows: list[int | None] = [None] * size
        """The version each block-table row of the host mirror holds (None: zeros)."""
        self._versions = 0
        self.copied = torch.cuda.Event() if device.type == "cuda" else None
        """Recorded after each copy of the host mirror: the mirror is rewritten only once the copy before has
        run (with the next step scheduled while one runs, the copy may still be queued)."""
        self.views = {}
        for i, name in enumerate(self.FIELDS):
            self.views[name] = self.device_buf[i * size : (i + 1) * size]
        start = len(self.FIELDS) * size
        self.views["block_tables"] = self.device_buf[start:].view(size, max_blocks)

    def metadata(self, n: int, q: int = 1) -> AttnMetadata:
        """Decode metadata of `n` tokens, q per row, over the first rows of every buffer."""
        v, rows = self.views, n // q
        return AttnMetadata(
            num_prefills=0, num_prefill_tokens=0, num_decodes=rows, num_decode_tokens=n,
            positions=v["positions"][:n], token_to_seq=v["token_to_seq"][:n], slot_mapping=v["slot_mapping"][:n],
            state_indices=v["state_indices"][:rows], block_tables=v["block_tables"][:rows], seq_lens=v["seq_lens"][:rows],
            num_spec_decodes=rows if q > 1 else 0, num_spec_decode_tokens=n if q > 1 else 0,
        )

    def load(self, items: list, size: int, q: int, block_size: int) -> None:
        """Write the inputs of a decode (q = 1) or uniform verify step of `items` (q tokens each), padded
        with whole rows to `size` tokens, into the host mirror, and copy it over: the values
        `build_metadata` gives the same rows (a padding row: positions 0..q-1, slot -1, state -1, no blocks),
        written straight into the buffer. Each sequence's table is kept as a row (by its KDA state slot): a decode
        step converts only the block ids a sequence gained, and a row that moves is one row copy."""
        s, mb = self.size, self.max_blocks
        rows = size // q
        ids, pos, seq, slots, states, lens = [], [], [], [], [], []
        for r, (toks, c, _, state, blocks) in enumerate(items):
            if len(blocks) > mb:
                raise ValueError(f"sequence {r} has {len(blocks)} blocks, more than max_blocks={mb}")
            if (c + q - 1) // block_size >= len(blocks):
                raise ValueError(f"sequence {r}: position {c + q - 1} has no cache block (table has {len(blocks)})")
            ids += toks[c : c + q]
            for p in range(c, c + q):
                pos.append(p)
                seq.append(r)
                slots.append(blocks[p // block_size] * block_size + p % block_size)
            states.append(state)
            lens.append(c + q)
        for r in range(len(items), rows):  # padding rows
            pos += range(q)
            seq += [r] * q
            slots += [-1] * q
            states.append(-1)
            lens.append(q)
        ids += [0] * (size - len(ids))
        if self.copied is not None:
            self.copied.synchronize()
        h = self.host_np
        for i, values in enumerate((ids, pos, seq, slots, states, lens)):
            h[i * s : i * s + len(values)] = values
        tables = h[len(self.FIELDS) * s :].reshape(s, mb)
        for r in range(rows):
            if r >= len(items):
                if self.rows[r] is not None:
                    tables[r] = 0
                    self.rows[r] = None
                continue
            state, blocks = items[r][3], items[r][4]
            if not isinstance(blocks, list):
                blocks = list(blocks)
            held = self.by_state.get(state)
            if held is None or held[0] != blocks:
                # A sequence's table grows at its end: convert only the new ids where the old ones are a prefix.
                k = len(held[0]) if held is not None and held[0] == blocks[: len(held[0])] else 0
                row = held[1] if k else np.zeros(mb, dtype=np.int64)
                row[k : len(blocks)] = blocks[k:]
                self._versions += 1
                held = (list(blocks), row, self._versions)
                self.by_state[state] = held
            if self.rows[r] != held[2]:
                tables[r] = held[1]
                self.rows[r] = held[2]
        live = {item[3] for item in items}
        if len(self.by_state) > 2 * max(len(live), 1):  # forget finished sequences now and then
            self.by_state = {st: v for st, v in self.by_state.items() if st in live}
        self.device_buf.copy_(self.host_buf, non_blocking=True)
        if self.copied is not None:
            self.copied.record()


class Runner:
    """Runs the stock backbone one step at a time over paged caches.

    `capture()` records one CUDA graph per size in `capture_sizes`; after it,
    `execute` replays them for pure-decode steps of up to the largest size.
    """

    def __init__(
        self,
        model: Glm5NextModel,
        cache: ModelCache,
        max_model_len: int | None = None,
        capture_sizes=DEFAULT_CAPTURE_SIZES,
        executor=None,
        verify_tokens: int = 1,
    ) -> None:
        self.model = model
        self.executor = executor
        """A `SpecializedDecode` that plans captured decode steps, or None (stock only)."""
        self.cache = cache
        self.device = model.embed_tokens.device
        self.prefixes = [layer.self_attn.prefix for layer in model.layers]
        self.q = verify_tokens
        """Tokens per decoding row in captured steps: 1, or q = k + 1 under speculative decoding."""
        self.capture_sizes = tuple(s for s in check_capture_sizes(capture_sizes) if s % verify_tokens == 0)
        if not self.capture_sizes:
            raise ValueError(f"no capture size in {list(capture_sizes)} is a multiple of the {verify_tokens} "
                             f"tokens each verify row runs")
        max_model_len = max_model_len or model.config.max_position_embeddings
        self.max_blocks = -(-max_model_len // cache.block_size)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        """Token count -> (graph, its fp32 logits [tokens, vocab], its post-norm hidden states [tokens, D])."""
        self.static: _StaticInputs | None = None
        self.graph_mode = False
        """Run graph-eligible steps eagerly, but as a capture would (static shapes, FULL mode)."""
        self.num_replays = 0
        self.host_times = HostTimes()
        """Where `execute` charges its host time: `inputs`, then `launch` (an engine passes its own)."""
        if executor is not None:
            executor.prepare_kv(cache)

    # ------------------------------------------------------------------ eager
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
        out[to_device(order, torch.int64, self.device)] = logits
        return out

    @torch.inference_mode()
    def execute(self, items: list[Item], num_decodes: int, allow_graph: bool = True,
                patch: TokenPatch | None = None) -> torch.Tensor:
        """The fp32 logits [len(items), vocab] of each item's last run token.

        Each item is `(token_ids, num_computed, num_tokens, slot, blocks)`: run
        `token_ids[num_computed : num_computed + num_tokens]` after `num_computed`
        cached tokens. The first `num_decodes` items decode one token each.
        `allow_graph=False` runs the step eagerly even where a graph exists. `patch`: step positions whose
        token the host does not know yet, and their values on the device (see `TokenPatch`).
        """
        size = self.graph_size(len(items), num_decodes)
        if allow_graph and size is not None and (self.graphs or self.graph_mode):
            return self._replay(items, size, patch)[0]
        query_lens = [n for _, _, n, _, _ in items]
        ids = [t for toks, c, n, _, _ in items for t in toks[c : c + n]]
        md = build_metadata(
            query_lens, [c for _, c, _, _, _ in items], num_decodes,
            [slot for *_, slot, _ in items], [blocks for *_, blocks in items],
            self.cache.block_size, self.device,
        )
        ctx = ForwardContext({p: md for p in self.prefixes}, md.positions, CUDAGraphMode.NONE)
        ids = to_device(ids, torch.int64, self.device)
        if patch is not None:
            patch.apply(ids)
        self.host_times.lap("inputs")
        hidden = self.model(ids, ctx, self.cache)
        last = to_device(md.query_start_loc_cpu[1:], torch.int64, self.device) - 1
        logits = self.model.compute_logits(hidden[last])
        self.host_times.lap("launch")
        return logits

    @torch.inference_mode()
    def execute_verify(self, items: list[Item], num_decodes: int, q: int):
        """An eager step whose first `num_decodes` items verify q tokens each (their last accepted token
        and q - 1 drafts), followed by prefill chunks. Returns the post-norm hidden states [T, D] of every
        token and the step metadata (its `query_start_loc_cpu` locates each item's tokens)."""
        query_lens = [n for _, _, n, _, _ in items]
        if any(n != q for n in query_lens[:num_decodes]):
            raise ValueError(f"every verify row runs q={q} tokens, got {query_lens[:num_decodes]}")
        ids = [t for toks, c, n, _, _ in items for t in toks[c : c + n]]
        md = build_metadata(
            query_lens, [c for _, c, _, _, _ in items], num_decodes,
            [slot for *_, slot, _ in items], [blocks for *_, blocks in items], self.cache.block_size, self.device,
        )
        md.num_spec_decodes = num_decodes if q > 1 else 0
        md.num_spec_decode_tokens = num_decodes * q if q > 1 else 0
        ctx = ForwardContext({p: md for p in self.prefixes}, md.positions, CUDAGraphMode.NONE)
        return self.model(to_device(ids, torch.int64, self.device), ctx, self.cache), md

    def commit_verify(self, slots: list[int], accepted: list[int]) -> None:
        """Advance every KDA layer's state of `slots` over its first `accepted` verified tokens."""
        for state in self.cache.kda.values():
            commit(state, slots, accepted)

    # ----------------------------------------------------------------- graphs
    def graph_size(self, num_items: int, num_decodes: int) -> int | None:
        """The captured token count a step of `num_items` decoding sequences (q tokens each) replays,
        or None (eager)."""
        if num_decodes != num_items or num_items == 0:
            return None
        return next((s for s in self.capture_sizes if s >= num_items * self.q), None)

    def _ensure_static(self) -> _StaticInputs:
        if self.static is None:
            self.static = _StaticInputs(self.capture_sizes[-1], self.max_blocks, self.device)
        return self.static

    def _forward(self, size: int, capturing: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode forward of `size` tokens over the static buffers: (fp32 logits, post-norm hidden
        states); planned by the executor when `capturing` (a capture, or a step declared as one) and it
        accepts the step."""
        st = self._ensure_static()
        md = st.metadata(size, self.q)
        ctx = ForwardContext({p: md for p in self.prefixes}, md.positions, CUDAGraphMode.FULL, capturing)
        ids = st.views["input_ids"][:size]
        step = self.executor.plan(ctx, size) if self.executor is not None else None
        if step is not None:
            hidden = self.executor.run(step, ids)
            return self.executor.compute_logits(hidden), hidden
        hidden = self.model(ids, ctx, self.cache)
        return self.model.compute_logits(hidden), hidden

    @torch.inference_mode()
    def load_decode(self, items: list[Item], size: int) -> None:
        """Fill the static buffers for `items` (q tokens each) padded with whole rows to `size` tokens."""
        self._ensure_static().load(items, size, self.q, self.cache.block_size)

    def _replay(self, items: list[Item], size: int, patch: TokenPatch | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        self.load_decode(items, size)
        if patch is not None:
            patch.apply(self.static.views["input_ids"])
        self.host_times.lap("inputs")
        if size in self.graphs:
            graph, logits, hidden = self.graphs[size]
            graph.replay()
            self.num_replays += 1
        else:
            logits, hidden = self._forward(size, capturing=True)  # graph mode: run as the capture would
        self.host_times.lap("launch")
        n = len(items) * self.q
        return logits[:n], hidden[:n]

    @torch.inference_mode()
    def verify_graph(self, items: list[Item]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A pure verify step (every item q tokens) replayed from its graph (or run as one in graph mode):
        (fp32 logits, post-norm hidden states) of every token; None when no captured size fits."""
        size = self.graph_size(len(items), len(items))
        if size is None or not (self.graphs or self.graph_mode):
            return None
        return self._replay(items, size)

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one CUDA graph per capture size, largest first, into one memory pool."""
        if self.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device; this runner's model is on " + str(self.device))
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for size in reversed(self.capture_sizes):
            self.load_decode([], size)  # every row padding: nothing real is written
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward(size, capturing=False)  # warm-up: lazy initialisation outside the capture
                if self.executor is not None:
                    self._forward(size, capturing=True)  # compiles and warms the planned path's kernels
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits, hidden = self._forward(size, capturing=True)
            self.graphs[size] = (graph, logits, hidden)
        torch.cuda.synchronize()
