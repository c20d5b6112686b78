"""Sampling parameters and next-token choice."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MAX_LOGPROBS = 20
"""The most alternatives a request may ask log-probabilities for."""
GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this pick the most likely token: dividing fp32 logits by less can overflow to inf."""


@dataclass
class SamplingParams:
    """How one request picks its tokens and when it stops."""

    temperature: float = 1.0
    """0 (or anything below `GREEDY_TEMPERATURE`) picks the most likely token (greedy)."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 (or 0) keeps every token."""
    min_p: float = 0.0
    """Drops tokens whose probability is below min_p times the top probability."""
    max_tokens: int = 16
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    """Return the logprob of each chosen token and of the `logprobs` most likely ones (0 to 20); None: none."""
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0) or self.temperature == float("inf"):
            raise ValueError(f"temperature={self.temperature!r} must be a finite number >= 0")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k!r} must be -1 (off), 0 (off) or a positive integer")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p={self.min_p!r} must be in [0, 1]")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be a positive integer")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r} must be an integer")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs={self.logprobs!r} must be None or an integer in [0, {MAX_LOGPROBS}]")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(isinstance(t, int) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r} must be a list of integers")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop={self.stop!r} must be a non-empty string or a list of them")

    @property
    def greedy(self) -> bool:
        """Whether the request takes the most likely token at every step."""
        return self.temperature < GREEDY_TEMPERATURE


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The next token for one sequence's logits [vocab] (fp32)."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = filtered_probs(logits, params)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [vocab] after temperature, top-k, top-p and min-p."""
    logits = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = (torch.cumsum(sorted_p, -1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum()
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
    return probs
