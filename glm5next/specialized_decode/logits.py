"""The LM head stage: the BF16 [vocab, D] projection for up to 64 rows."""

from __future__ import annotations

import torch

from ..kernels import linear as linear_kernels
from ..parallel.layers import Linear

CHOICES = {"gemv": dict(split_k=1), "splitk": dict(split_k=None)}
"""Launch variants: one pass over K per output tile, or the kernel's split-K heuristic."""


class LogitsStage:
    """fp32 logits through the skinny projection kernel (rounded to the head's dtype first, as stock)."""

    def __init__(self, lm_head: Linear) -> None:
        self.weight = lm_head.weight

    def __call__(self, hidden: torch.Tensor, choice: str) -> torch.Tensor:
        return linear_kernels.skinny_linear(hidden, self.weight, None, **CHOICES[choice]).float()
