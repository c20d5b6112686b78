"""The stock GLM-5.3-Flash backbone: embedding, 45 mHC layers, final norm, LM head, MTP layer."""

from __future__ import annotations

import torch
from torch import nn

from ..checkpoint.loader import load_checkpoint
from ..checkpoint.specs import TensorSpec, set_param
from ..config import Glm5NextConfig
from ..forward import ForwardContext, ModelCache
from ..parallel.collectives import all_gather
from ..parallel.group import SINGLE, TensorParallel, check_divisible
from ..parallel.layers import ColumnParallelLinear, vocab_parallel_embedding
from .layer import DecoderLayer
from .mhc import hc_contract, hc_expand
from .mtp import MtpLayer
from .norm import RMSNorm


class Glm5NextModel(nn.Module):
    """The text tower. Built on the meta device; `from_pretrained` installs the weights."""

    def __init__(self, config: Glm5NextConfig, with_mtp: bool = True, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        check_divisible(config, tp.size)
        self.config = config
        self.tp = tp
        """This process's tensor-parallel rank and group (`SINGLE`: the whole model here)."""
        d = config.hidden_size
        vocab = tp.split(config.vocab_size, "vocab_size")
        self.embed_tokens = nn.Parameter(torch.empty(vocab, d, device="meta"), requires_grad=False)
        """This rank's rows of the embedding table [vocab / tp, D]."""
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.lm_head = ColumnParallelLinear(d, config.vocab_size, tp, "vocab_size")
        self.mtp = MtpLayer(config, tp) if with_mtp and config.num_nextn_predict_layers else None
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        """Layers whose hidden states a draft model would collect (none: no such drafts here)."""

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        progress: bool = True,
        tp: TensorParallel = SINGLE,
    ) -> "Glm5NextModel":
        """The backbone with the weights of the checkpoint in `model_dir`; under tensor parallelism,
        this rank's shards only, read as slices of the checkpoint's tensors."""
        config = Glm5NextConfig.from_file(model_dir)
        model = cls(config, tp=tp)
        mtp_prefix = model.mtp.prefix + "." if model.mtp is not None else None
        report = load_checkpoint(model_dir, model.tensor_specs(), dtype, device, mtp_prefix, progress=progress)
        if model.mtp is not None and not report.has_mtp:
            model.mtp = None
        model.dtype = dtype
        model.load_report = report
        return model.eval()

    def tensor_specs(self) -> dict[str, TensorSpec]:
        """Every checkpoint tensor, named as in the checkpoint without `model.language_model.`."""
        specs = {
            "embed_tokens.weight": TensorSpec(
                (self.config.vocab_size, self.config.hidden_size), lambda t, s: set_param(self, "embed_tokens", t),
                shard=self.tp.shard(0),
            ),
            **self.norm.tensor_specs("norm"),
            **self.lm_head.tensor_specs("lm_head"),
        }
        for layer in self.layers:
            specs.update(layer.tensor_specs())
        if self.mtp is not None:
            specs.update(self.mtp.tensor_specs())
        return specs

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, D] (no scaling)."""
        return vocab_parallel_embedding(input_ids, self.embed_tokens, self.tp)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext, cache: ModelCache) -> torch.Tensor:
        """The post-final-norm hidden states [T, D] of tokens `input_ids` [T]."""
        streams = hc_expand(self.embed(input_ids), self.config.hc_mult)
        for layer in self.layers:
            streams = layer(streams, ctx, cache)
        return self.norm(hc_contract(streams))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab] in fp32 for post-norm hidden states [T, D] (scale 1, no soft-cap); under
        tensor parallelism each rank projects onto its vocab rows and every rank gathers all of them."""
        return all_gather(self.lm_head(hidden).float(), self.tp, dim=-1)

    def draft(
        self, next_ids: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext, cache: ModelCache
    ) -> torch.Tensor:
        """The MTP layer's draft hidden state [T, D] (see `MtpLayer.forward`)."""
        if self.mtp is None:
            raise RuntimeError("this checkpoint has no MTP layer: speculative decoding is unavailable")
        return self.mtp(self.embed(next_ids), hidden, ctx, cache)
