"""What follows a pure verify step, as one CUDA graph per verify size: the KDA commit over the
accepted tokens, the MTP catch-up and k draft steps, with the drafts drawn on the device.

After a verify graph replays, the host decides acceptance (one sync), writes each row's accepted
count and tokens into static buffers (one host-to-device copy), and replays the draft graph of that
size. The graph reads the verify step's static metadata and its post-norm hidden states, and:

1. advances every KDA state over the accepted tokens (`kda_commit.commit_rows`);
2. runs the MTP layer over all q verified positions of each row, fed the accepted tokens: a row's
   positions past its accepted ones see garbage, but attention is causal and their cache entries lie
   past the sequence, rewritten before they are read; the output at the last accepted position is the
   first draft's hidden state;
3. draws k drafts, each further draft step at the next position (metadata computed on the device from
   the accepted counts) reusing the first step's indexer selection. Greedy rows take the argmax;
   sampled rows draw by `BatchSampler` (counter-hashed per request, so a row's draws do not depend on
   the batch) and keep the filtered draft distribution [k, vocab] for the rejection rule.

Two graphs per size: all rows greedy (no sort over the vocabulary), or some rows sampled. On the CPU
(`Runner.graph_mode`) the same function runs eagerly over the same static buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..forward import AttnMetadata, CUDAGraphMode, ForwardContext
from .batch_sampler import BatchSampler, SamplingTensors
from .kda_commit import commit_rows
from .sampler import SamplingParams

DRAFT_COUNTER_BASE = 1 << 40
"""Draft draws hash (seed, DRAFT_COUNTER_BASE + 8 * tokens generated + j): apart from any other draw."""
_INTS = ("accepted", "capacity", "greedy", "top_k", "seed_lo", "seed_hi", "counter")
_FLOATS = ("temperature", "top_p", "min_p")


@dataclass
class DraftRequest:
    """One verify row's share of the post-verify graph."""

    request_id: str
    tokens: list[int]
    """The tokens accepted this step (accepted drafts, then the target's token)."""
    capacity: int
    """Cache positions the request's blocks hold."""
    params: SamplingParams
    """Its sampling parameters, seed fixed."""
    generated: int
    """Tokens it had generated before this step (keys its draft draws)."""


class DraftGraphs:
    """The post-verify graphs of one engine (see the module docstring)."""

    def __init__(self, runner, drafter, k: int) -> None:
        self.runner, self.drafter, self.k, self.q = runner, drafter, k, runner.q
        self.model, self.cache, self.device = runner.model, runner.cache, runner.device
        self.vocab = self.model.config.vocab_size
        self.sampler = BatchSampler(self.vocab)
        rows = max(runner.capture_sizes) // self.q
        self.rows = rows
        width = len(_INTS) * rows + rows * self.q
        self.ints = torch.zeros(width, dtype=torch.int64, device=self.device)
        self.ints_host = torch.zeros(width, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        self.floats = torch.ones(len(_FLOATS) * rows, dtype=torch.float32, device=self.device)
        self.floats_host = torch.ones(len(_FLOATS) * rows, dtype=torch.float32,
                                      pin_memory=self.device.type == "cuda")
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]] = {}
        self.num_replays = 0

    # ------------------------------------------------------------ buffers
    def _int(self, name: str, n: int) -> torch.Tensor:
        i = _INTS.index(name) * self.rows
        return self.ints[i : i + n]

    def _float(self, name: str, n: int) -> torch.Tensor:
        i = _FLOATS.index(name) * self.rows
        return self.floats[i : i + n]

    def _next_ids(self, size: int) -> torch.Tensor:
        start = len(_INTS) * self.rows
        return self.ints[start : start + size]

    def load(self, size: int, rows: list[DraftRequest]) -> None:
        """Fill the static inputs for `rows`, padding rows after them."""
        n = size // self.q
        ih, fh = self.ints_host, self.floats_host
        ih.zero_()
        fh.fill_(1.0)
        R = self.rows
        ih[_INTS.index("greedy") * R : _INTS.index("greedy") * R + n] = 1
        ih[_INTS.index("top_k") * R : _INTS.index("top_k") * R + n] = self.vocab
        fh[_FLOATS.index("min_p") * R : _FLOATS.index("min_p") * R + n] = 0.0
        base = len(_INTS) * R
        for r, row in enumerate(rows):
            toks, p = row.tokens, row.params
            vals = {"accepted": len(toks), "capacity": row.capacity, "greedy": int(p.greedy),
                    "top_k": self.vocab if p.top_k <= 0 else min(p.top_k, self.vocab),
                    "seed_lo": p.seed & 0xFFFFFFFF, "seed_hi": (p.seed % 2**64) >> 32,
                    "counter": DRAFT_COUNTER_BASE + 8 * row.generated}
            for name, v in vals.items():
                ih[_INTS.index(name) * R + r] = v
            for name, v in (("temperature", 1.0 if p.greedy else p.temperature), ("top_p", p.top_p),
                            ("min_p", p.min_p)):
                fh[_FLOATS.index(name) * R + r] = v
            ih[base + r * self.q : base + r * self.q + len(toks)] = torch.tensor(toks, dtype=torch.int64)
        self.ints.copy_(ih, non_blocking=True)
        self.floats.copy_(fh, non_blocking=True)

    # ------------------------------------------------------------ the work
    def _draw(self, logits: torch.Tensor, n: int, j: int, sampled: bool):
        if not sampled:
            return logits.argmax(dim=-1), None
        t = SamplingTensors(
            temperature=self._float("temperature", n), greedy=self._int("greedy", n) != 0,
            top_k=self._int("top_k", n), top_p=self._float("top_p", n), min_p=self._float("min_p", n),
            seed_lo=self._int("seed_lo", n), seed_hi=self._int("seed_hi", n))
        tokens, _ = self.sampler.sample(logits, t, self._int("counter", n) + j)
        _, probs, order = self.sampler.filtered_sorted(logits, t)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        return tokens, torch.zeros_like(probs).scatter_(1, order, probs)

    def _post(self, size: int, hidden: torch.Tensor, sampled: bool):
        """Commit, catch-up and k drafts for the verify step of `size` tokens whose post-norm hidden
        states are `hidden`: (drafts [rows, k] int64, draft probabilities [rows, k, vocab] or None)."""
        q, n = self.q, size // self.q
        md = self.runner.static.metadata(size, q)
        accepted = self._int("accepted", n)
        for state in self.cache.kda.values():
            commit_rows(state, state.slots(md.state_indices), accepted)
        prefix = self.drafter.prefix
        ctx = ForwardContext({prefix: md}, md.positions, CUDAGraphMode.FULL, True)
        emb = self.model.embed(self._next_ids(size))
        out, sel = self.drafter.forward_mtp(emb, hidden[:size], ctx, return_selection=True)
        rows = torch.arange(n, device=self.device)
        last = rows * q + (accepted - 1).clamp(min=0)
        h, sel = out[last], sel[last]
        start = md.positions.view(n, q)[:, 0]
        capacity = self._int("capacity", n)
        bs = self.cache.block_size
        drafts, probs = [], []
        for j in range(self.k):
            tok, p = self._draw(self.model.compute_logits(h), n, j, sampled)
            drafts.append(tok)
            probs.append(p)
            if j + 1 == self.k:
                break
            pos = start + accepted + j
            fits = (pos < capacity) & (accepted > 0)
            block = md.block_tables.gather(1, (pos // bs).clamp(max=md.block_tables.shape[1] - 1)[:, None])[:, 0]
            dmd = AttnMetadata(
                num_prefills=0, num_prefill_tokens=0, num_decodes=n, num_decode_tokens=n, positions=pos,
                token_to_seq=rows, slot_mapping=torch.where(fits, block * bs + pos % bs, -1),
                state_indices=md.state_indices, block_tables=md.block_tables, seq_lens=pos + 1)
            dctx = ForwardContext({prefix: dmd}, pos, CUDAGraphMode.FULL, True)
            h = self.drafter.forward_mtp(self.model.embed(tok), h, dctx, selection=sel)
        return torch.stack(drafts, 1), (torch.stack(probs, 1) if sampled else None)

    # ------------------------------------------------------------ graphs
    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per verify size and sampling kind, after the runner captured its verify graphs."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for size in reversed(self.runner.capture_sizes):
            hidden = self.runner.graphs[size][2]
            for sampled in (True, False):
                self.runner.load_decode([], size)
                self.load(size, [])
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    self._post(size, hidden, sampled)  # warm-up outside the capture
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    drafts, probs = self._post(size, hidden, sampled)
                self.graphs[(size, sampled)] = (graph, drafts, probs)
        torch.cuda.synchronize()

    @torch.inference_mode()
    def run(self, size: int, hidden: torch.Tensor, rows: list[DraftRequest]):
        """After the verify step of `size` tokens (whose static metadata the runner still holds and
        whose post-norm hidden states are `hidden`): per row, (k draft tokens, their draft
        probabilities [k, vocab] for sampled rows, else None)."""
        sampled = any(not row.params.greedy for row in rows)
        self.load(size, rows)
        if (size, sampled) in self.graphs:
            graph, drafts, probs = self.graphs[(size, sampled)]
            graph.replay()
            self.num_replays += 1
        else:  # graph mode on the CPU: the same work, eagerly
            pad = hidden.new_zeros(size - hidden.shape[0], hidden.shape[1])
            drafts, probs = self._post(size, torch.cat([hidden, pad]), sampled)
        tokens = drafts[: len(rows)].tolist()
        return [(tokens[r], probs[r].clone() if probs is not None and not row.params.greedy else None)
                for r, row in enumerate(rows)]
