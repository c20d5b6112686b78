"""Next-token choice for a whole batch on the device, free of host syncs.

Host work happens once per batch change in `SamplingTensors.from_params` (plan); the per-step
`BatchSampler.sample` (run) is fixed-shape tensor work with no `.item()` and no branches on data, so
it can sit inside a captured decode step.

Randomness is an exponential race: token = argmax(p_v / E_v) with E_v = -log(U_v) is an exact draw
from p. Each U_v comes from a counter-based hash of (row seed, row step, vocab index), so a row's
draw depends on nothing else in the batch and replays exactly from its seed and step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..forward import to_device
from .sampler import SamplingParams

MASK32 = 0xFFFFFFFF
"""The low 32 bits of an int64 lane; every hash word is kept below 2**32 so no product overflows."""
FMIX_C1 = 0x85EBCA6B
"""The first multiplier of MurmurHash3's 32-bit finaliser."""
FMIX_C2 = 0xC2B2AE35
"""The second multiplier of MurmurHash3's 32-bit finaliser."""
GOLDEN32 = 0x9E3779B9
"""2**32 divided by the golden ratio, spreading consecutive counters across the word."""
STEP_SALT = 0x632BE5AB
"""A constant mixed into the step word so seed 0 at step 0 does not hash from all-zero input."""
UNIFORM_BITS = 24
"""Bits of hash kept per uniform: exactly representable in fp32."""


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling settings of one batch, as device tensors [batch]."""

    temperature: torch.Tensor
    """[B] fp32; 1.0 on greedy rows so division stays finite."""
    greedy: torch.Tensor
    """[B] bool; rows that take the argmax."""
    top_k: torch.Tensor
    """[B] int64 in [1, vocab]; vocab where top-k is off."""
    top_p: torch.Tensor
    """[B] fp32 in (0, 1]."""
    min_p: torch.Tensor
    """[B] fp32 in [0, 1]; 0 where min-p is off."""
    seed_lo: torch.Tensor
    """[B] int64; the low 32 bits of each row's seed."""
    seed_hi: torch.Tensor
    """[B] int64; the high 32 bits of each row's seed (mod 2**64)."""

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        device: torch.device | str,
        vocab: int,
        generator: torch.Generator | None = None,
    ) -> "SamplingTensors":
        """The batch's settings; unseeded rows get a seed drawn from `generator` (host)."""
        if not params:
            raise ValueError("params is empty; a batch has at least one row")
        if vocab < 1:
            raise ValueError(f"vocab={vocab!r} must be a positive integer")
        temps, greedy, ks, ps, mins, seeds = [], [], [], [], [], []
        for i, p in enumerate(params):
            min_p = float(getattr(p, "min_p", 0.0) or 0.0)
            if not 0.0 <= min_p <= 1.0:
                raise ValueError(f"params[{i}].min_p={min_p!r} must be in [0, 1]")
            is_greedy = p.greedy
            greedy.append(is_greedy)
            temps.append(1.0 if is_greedy else float(p.temperature))
            ks.append(vocab if p.top_k <= 0 else min(int(p.top_k), vocab))
            ps.append(float(p.top_p))
            mins.append(min_p)
            if p.seed is None:
                seed = int(torch.randint(0, 2**62, (), generator=generator))
            else:
                seed = int(p.seed) % 2**64
            seeds.append(seed)

        def put(values, dtype):
            return to_device(values, dtype, device)

        return cls(
            temperature=put(temps, torch.float32),
            greedy=put(greedy, torch.bool),
            top_k=put(ks, torch.int64),
            top_p=put(ps, torch.float32),
            min_p=put(mins, torch.float32),
            seed_lo=put([s & MASK32 for s in seeds], torch.int64),
            seed_hi=put([s >> 32 for s in seeds], torch.int64),
        )

    @property
    def batch(self) -> int:
        """The number of rows."""
        return self.temperature.shape[0]


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2**32 for int64 x in [0, 2**32), computed in 16-bit halves so nothing overflows."""
    lo = x & 0xFFFF
    hi = x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser of int64 words in [0, 2**32)."""
    h = h ^ (h >> 16)
    h = _mul32(h, FMIX_C1)
    h = h ^ (h >> 13)
    h = _mul32(h, FMIX_C2)
    return h ^ (h >> 16)


def row_keys(tensors: SamplingTensors, step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two independent 32-bit keys [B] int64 per row from (seed, step)."""
    step_lo = step & MASK32
    step_hi = (step >> 32) & MASK32
    h = _fmix32(tensors.seed_lo ^ _mul32(step_lo ^ STEP_SALT, GOLDEN32))
    h = _fmix32(h ^ _mul32(tensors.seed_hi, FMIX_C1))
    k1 = _fmix32(h ^ _mul32(step_hi, FMIX_C2))
    # Not fmix32(k1 ^ const): that equals the first uniform round at one fixed vocab index.
    k2 = _fmix32(_mul32(k1 ^ STEP_SALT, FMIX_C2))
    return k1, k2


def uniforms(k1: torch.Tensor, k2: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1), fp32, shaped like `index` [B, N] (int64 vocab ids), keyed per row by k1, k2 [B]."""
    h = _fmix32(k1[:, None] ^ _mul32(index, GOLDEN32))
    h = _fmix32(h ^ k2[:, None])
    bits = (h >> (32 - UNIFORM_BITS)).to(torch.float32)
    return (bits + 0.5) * (1.0 / (1 << UNIFORM_BITS))


class BatchSampler:
    """The device-side next-token sampler for a batch over a fixed vocabulary."""

    def __init__(self, vocab: int):
        if vocab < 1:
            raise ValueError(f"vocab={vocab!r} must be a positive integer")
        self.vocab = vocab

    def plan(self, params: list[SamplingParams], device, generator: torch.Generator | None = None):
        """The `SamplingTensors` for `params` on `device`."""
        return SamplingTensors.from_params(params, device, self.vocab, generator)

    def filtered_sorted(
        self, logits: torch.Tensor, tensors: SamplingTensors
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Scaled logits [B, V], and probs [B, V] after top-k/top-p/min-p in descending order with their vocab ids."""
        scaled = logits / tensors.temperature[:, None]
        # Stable so tied tokens keep vocab order whatever else is in the batch.
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
        kth = sorted_logits.gather(1, (tensors.top_k - 1)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        # top_p == 1 keeps everything: rounding in cumsum must not clip the tail.
        before = torch.cumsum(probs, dim=-1) - probs
        drop = (before >= tensors.top_p[:, None]) & (tensors.top_p < 1.0)[:, None]
        drop |= probs < tensors.min_p[:, None] * probs[:, :1]
        drop[:, 0] = False
        return scaled, probs.masked_fill(drop, 0.0), order

    def sample(
        self, logits: torch.Tensor, tensors: SamplingTensors, step: int | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [B] int64 and their logprobs [B] fp32 under the temperature-scaled, unfiltered softmax.

        `logits` is [B, vocab] fp32; `step` is one counter for every row or a [B] int64 tensor
        of per-row counters (e.g. tokens generated so far).
        """
        if logits.dim() != 2 or logits.shape[1] != self.vocab or logits.shape[0] != tensors.batch:
            raise ValueError(f"logits {tuple(logits.shape)} must be [{tensors.batch}, {self.vocab}]")
        if logits.dtype != torch.float32:
            raise ValueError(f"logits dtype {logits.dtype} must be float32")
        if not isinstance(step, torch.Tensor):
            step = torch.full((tensors.batch,), int(step), dtype=torch.int64, device=logits.device)
        step = step.to(torch.int64).expand(tensors.batch)
        scaled, probs, order = self.filtered_sorted(logits, tensors)
        k1, k2 = row_keys(tensors, step)
        race = probs / -torch.log(uniforms(k1, k2, order))
        drawn = order.gather(1, race.argmax(dim=-1, keepdim=True)).squeeze(1)
        tokens = torch.where(tensors.greedy, logits.argmax(dim=-1), drawn)
        logprobs = torch.log_softmax(scaled, dim=-1).gather(1, tokens[:, None]).squeeze(1)
        return tokens, logprobs
