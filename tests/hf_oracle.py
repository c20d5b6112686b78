"""transformers' Glm5Next as the correctness oracle, driven on CPU in plain PyTorch."""

from __future__ import annotations

import sys

import torch


def hf_modeling():
    """transformers' glm5_next modeling module, imported with flash-linear-attention
    hidden (otherwise its modeling code routes KDA to GPU kernels)."""
    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "fla" or k.startswith("fla.")}
    sys.modules["fla"] = None
    try:
        import transformers
        from transformers.models.glm5_next import modeling_glm5_next
    finally:
        del sys.modules["fla"]
        sys.modules.update(saved)
    transformers.logging.set_verbosity_error()
    return modeling_glm5_next


def import_hf():
    """transformers' `Glm5NextForConditionalGeneration` (see `hf_modeling`)."""
    return hf_modeling().Glm5NextForConditionalGeneration


class HfRunner:
    """Prefill then one-token decode steps through transformers with its own cache."""

    def __init__(self, model_dir: str, dtype: torch.dtype) -> None:
        cls = import_hf()
        self.model = cls.from_pretrained(model_dir, dtype=dtype).eval()
        if dtype == torch.float32:
            # transformers keeps each tensor in its stored dtype; widening the bf16
            # ones is exact and gives the all-fp32 model the comparison needs.
            self.model = self.model.float()
        self.past = None

    @torch.inference_mode()
    def step(self, ids: list[int]) -> torch.Tensor:
        """fp32 logits [len(ids), vocab] of feeding `ids` after everything fed so far."""
        out = self.model(input_ids=torch.tensor([ids]), past_key_values=self.past, use_cache=True)
        self.past = out.past_key_values
        return out.logits[0].float()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
