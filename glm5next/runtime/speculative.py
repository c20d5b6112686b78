"""MTP speculative decoding: the switch, the drafter, and the acceptance rules.

Each step verifies q = k + 1 tokens per decoding request: its last accepted token and k drafts.
Greedy requests accept the longest prefix of drafts equal to the target's choices, then the
target's next token. Sampled requests use the standard rejection rule (accept a draft d with
probability min(1, p(d) / q(d)); on a rejection draw from the normalised max(p - q, 0); after k
acceptances draw a bonus token from p), so every output token is distributed as the target's.

The MTP layer drafts from the trunk's post-norm hidden state at position i and the embedding of the
token at i + 1. After every trunk step it first catches up over the positions whose next token is
now known (the accepted tokens, or a prefill chunk), writing its own DSA cache there; the output at
the last position is the first draft. Each further draft feeds the previous draft hidden state and
the embedding of the previous draft, reusing the first draft step's indexer selection.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from .batch_sampler import BatchSampler, SamplingTensors, row_keys, uniforms
from ..forward import ForwardContext, to_device
from .metadata import build_metadata
from .sampler import SamplingParams, filtered_probs

MAX_SPECULATIVE_TOKENS = 5
ACCEPT_COUNTER_BASE = 2 << 40
"""The acceptance uniforms of a verify row hash (seed, ACCEPT_COUNTER_BASE + 8 * tokens generated)."""
RESIDUAL_COUNTER_BASE = 3 << 40
"""Its corrected or bonus token's draw hashes (seed, RESIDUAL_COUNTER_BASE + 8 * tokens generated)."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """`{"method": "mtp", "num_speculative_tokens": k}`, as vLLM users write it."""

    method: str
    num_speculative_tokens: int

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """None, a dict, a JSON string or a SpeculativeConfig; a ValueError names what is wrong."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be an object like {\"method\": \"mtp\", \"num_speculative_tokens\": 2}")
        unknown = sorted(set(value) - {"method", "num_speculative_tokens"})
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown} (known: method, num_speculative_tokens)")
        method = value.get("method")
        if method != "mtp":
            raise ValueError(f"speculative_config.method={method!r}: only 'mtp' (the checkpoint's draft layer) exists")
        k = value.get("num_speculative_tokens", 1)
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens={k!r} must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}]")
        return cls(method, k)


@dataclass
class DraftRow:
    """One request's MTP catch-up: positions start .. start + n - 1, whose next tokens are known."""

    slot: int
    blocks: list[int]
    start: int
    hidden: torch.Tensor
    """[n, D] the trunk's post-norm hidden states at those positions."""
    next_tokens: list[int]
    """[n] the token at each position + 1."""
    params: SamplingParams | None
    """The request's sampling parameters when it wants drafts now (its prompt is complete), else None."""
    generator: torch.Generator | None = None
    request_id: str = ""


class MtpDrafter:
    """Runs the model's MTP layer over the paged cache's MTP layer to propose k tokens per request."""

    def __init__(self, model, cache, k: int, stages=None) -> None:
        if model.mtp is None:
            raise ValueError("speculative_config method 'mtp' needs a checkpoint with an MTP layer; this one has none")
        self.model, self.cache, self.k = model, cache, k
        self.stages = stages
        """The executor's `DraftStages`, through which the draft layer's projections and shared expert run."""
        self.prefix = model.mtp.self_attn.prefix
        self.device = model.embed_tokens.device

    def _ctx(self, md) -> ForwardContext:
        return ForwardContext({self.prefix: md}, md.positions)

    def forward_mtp(self, embedded, hidden, ctx: ForwardContext, **kw):
        """The draft layer's forward (`MtpLayer.forward`; `kw`: selection, return_selection), through the
        executor's draft stages where there are any."""
        if self.stages is not None:
            return self.stages.forward(self.model.mtp, embedded, hidden, ctx, self.cache, **kw)
        return self.model.mtp(embedded, hidden, ctx, self.cache, **kw)

    def _capacity(self, row: DraftRow) -> int:
        return len(row.blocks) * self.cache.block_size

    @torch.inference_mode()
    def draft(self, rows: list[DraftRow]) -> list[tuple[list[int], torch.Tensor | None] | None]:
        """Per row: (k draft tokens, their draft probabilities [k, vocab] for sampled requests, else
        None), or None for rows that want no drafts. Writes the MTP cache at every position it runs."""
        if not rows:
            return []
        md = build_metadata([len(r.next_tokens) for r in rows], [r.start for r in rows], 0,
                            [r.slot for r in rows], [r.blocks for r in rows], self.cache.block_size, self.device)
        emb = self.model.embed(to_device([t for r in rows for t in r.next_tokens], torch.int64, self.device))
        hidden = torch.cat([r.hidden for r in rows])
        out, sel = self.forward_mtp(emb, hidden, self._ctx(md), return_selection=True)
        want = [i for i, r in enumerate(rows) if r.params is not None]
        results: list = [None] * len(rows)
        if not want:
            return results
        last = to_device([md.query_start_loc_cpu[i + 1] - 1 for i in want], torch.int64, self.device)
        h, sel = out[last], sel[last]
        drafts = {i: [] for i in want}
        probs = {i: [] for i in want}
        for j in range(self.k):
            logits = self.model.compute_logits(h)
            toks = []
            for row_i, i in enumerate(want):
                p = rows[i].params
                if p.greedy:
                    toks.append(int(logits[row_i].argmax()))
                else:
                    q = filtered_probs(logits[row_i], p)
                    toks.append(int(torch.multinomial(q.cpu(), 1, generator=rows[i].generator)))
                    probs[i].append(q)
                drafts[i].append(toks[-1])
            if j + 1 == self.k:
                break
            # The next draft: position last + j + 1, fed the draft hidden state and the draft token.
            pos = [rows[i].start + len(rows[i].next_tokens) + j for i in want]
            fits = [p < self._capacity(rows[i]) for p, i in zip(pos, want)]
            dmd = build_metadata([1] * len(want), pos, len(want), [rows[i].slot if f else -1 for i, f in zip(want, fits)],
                                 [rows[i].blocks for i in want], self.cache.block_size, self.device)
            emb = self.model.embed(to_device(toks, torch.int64, self.device))
            h = self.forward_mtp(emb, h, self._ctx(dmd), selection=sel)
        for i in want:
            results[i] = (drafts[i], torch.stack(probs[i]) if probs[i] else None)
        return results


def accept_rows(logits: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None,
                tensors: SamplingTensors, generated: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Acceptance of R verify rows on the device, with one host sync for the caller to read the result.

    `logits` [R, q, vocab] fp32: the target's logits at each verified position; `drafts` [R, k]; for
    rows that sample, `draft_probs` [R, k, vocab], the distribution each draft was drawn from;
    `generated` [R] int64 tokens each request had generated before the step (keys its draws).
    Returns (tokens [R, q], counts [R]): each row emits tokens[:count] — its accepted drafts, then the
    target's token. Greedy rows keep the longest prefix of drafts equal to the argmax and then the
    argmax. Sampled rows keep draft d_j while u_j * q_j(d_j) < p_j(d_j) (u_j uniform), then draw from
    the normalised max(p - q, 0) at the first rejection, or from p after k acceptances, so each emitted
    token is distributed as the target's."""
    R, q, vocab = logits.shape
    k = q - 1
    choice = logits.argmax(-1)  # [R, q]
    greedy_keep = torch.cumprod((drafts == choice[:, :k]).long(), 1)
    tokens_g, counts_g = choice, greedy_keep.sum(1) + 1
    if draft_probs is None or bool(tensors.greedy.all()):
        return tokens_g, counts_g
    sampler = BatchSampler(vocab)
    flat = SamplingTensors(*(t.repeat_interleave(q) for t in (
        tensors.temperature, tensors.greedy, tensors.top_k, tensors.top_p, tensors.min_p, tensors.seed_lo,
        tensors.seed_hi)))
    _, sorted_p, order = sampler.filtered_sorted(logits.reshape(R * q, vocab), flat)
    p = torch.zeros_like(sorted_p).scatter_(1, order, sorted_p / sorted_p.sum(-1, keepdim=True)).view(R, q, vocab)
    qx = torch.cat([draft_probs, draft_probs.new_zeros(R, 1, vocab)], 1)  # nothing drafted after the last
    p_d = p[:, :k].gather(2, drafts[:, :, None])[..., 0]
    q_d = draft_probs.gather(2, drafts[:, :, None])[..., 0]
    k1, k2 = row_keys(tensors, ACCEPT_COUNTER_BASE + 8 * generated)
    u = uniforms(k1, k2, torch.arange(k, device=logits.device).expand(R, k))
    keep = torch.cumprod(((q_d > 0) & (u * q_d < p_d)).long(), 1)
    n = keep.sum(1)  # drafts accepted
    at = n[:, None, None].expand(R, 1, vocab)
    p_n, q_n = p.gather(1, at)[:, 0], qx.gather(1, at)[:, 0]
    residual = (p_n - q_n).clamp(min=0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_n)
    r1, r2 = row_keys(tensors, RESIDUAL_COUNTER_BASE + 8 * generated)
    race = residual / -torch.log(uniforms(r1, r2, torch.arange(vocab, device=logits.device).expand(R, vocab)))
    drawn = race.argmax(-1)
    cols = torch.arange(q, device=logits.device)
    padded = torch.cat([drafts, drafts.new_zeros(R, 1)], 1)
    tokens_s = torch.where(cols < n[:, None], padded, drawn[:, None])
    greedy = tensors.greedy[:, None]
    return torch.where(greedy, tokens_g, tokens_s), torch.where(tensors.greedy, counts_g, n + 1)
