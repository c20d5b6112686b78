"""The stock GLM-5.3-Flash backbone: embedding, 45 mHC layers, final norm, LM head, MTP layer."""

from __future__ import annotations

import torch
from torch import nn

from ..checkpoint.loader import load_checkpoint
from ..checkpoint.specs import TensorSpec, set_param
from ..config import MHC_POST_MULT, Glm5NextConfig
from ..forward import CUDAGraphMode, ForwardContext, ModelCache
from ..kernels import boundary as boundary_kernels
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
        """The post-final-norm hidden states [T, D] of tokens `input_ids` [T]. Eager steps of a bf16 model on a
        GPU (prefill, mixed steps) run the mHC between sublayers on the fused boundary kernels
        (`forward_fused`); the others run each layer's PyTorch form (`forward_stock`)."""
        embedded = self.embed(input_ids)
        if self.runs_fused_boundaries(embedded, ctx):
            return self.forward_fused(embedded, ctx, cache)
        return self.forward_stock(embedded, ctx, cache)

    @staticmethod
    def runs_fused_boundaries(embedded: torch.Tensor, ctx: ForwardContext) -> bool:
        """Whether `forward` takes `forward_fused`: an eager step (not captured) of bf16 activations on a GPU (the
        boundary kernels' GPU tests are bf16 and fp32; an fp32 model keeps the PyTorch form, the reference)."""
        return embedded.is_cuda and embedded.dtype == torch.bfloat16 and ctx.cudagraph_mode == CUDAGraphMode.NONE

    def forward_stock(self, embedded: torch.Tensor, ctx: ForwardContext, cache: ModelCache) -> torch.Tensor:
        """`forward` from the embeddings [T, D], layer by layer in PyTorch."""
        streams = hc_expand(embedded, self.config.hc_mult)
        for layer in self.layers:
            streams = layer(streams, ctx, cache)
        return self.norm(hc_contract(streams))

    def forward_fused(self, embedded: torch.Tensor, ctx: ForwardContext, cache: ModelCache) -> torch.Tensor:
        """`forward` from the embeddings [T, D] with every mHC boundary in one launch (`glm5next.kernels.boundary`):
        the first layer's expand + pre + norm, between two sublayers the post of one, the pre of the next and
        its norm, the last layer's post + mean of the streams + final norm. The sublayers are the layers' own."""
        c = self.config
        consts = dict(hc_eps=c.hc_eps, rms_eps=c.rms_norm_eps, sinkhorn_iters=c.hc_sinkhorn_iters, post_mult=MHC_POST_MULT)

        def boundary(out, streams, post, comb, hc, norm):
            return boundary_kernels.mhc_boundary(out, streams, post, comb, hc.fn, hc.base, hc.scale, norm.weight,
                                                 norm_eps=norm.eps, **consts)

        first = self.layers[0]
        streams, post, comb, x = boundary_kernels.mhc_first(embedded, first.attn_hc.fn, first.attn_hc.base,
                                                            first.attn_hc.scale, first.input_layernorm.weight,
                                                            norm_eps=first.input_layernorm.eps, **consts)
        for i, layer in enumerate(self.layers):
            out = layer.attention(x, ctx, cache)
            streams, post, comb, x = boundary(out, streams, post, comb, layer.ffn_hc, layer.post_attention_layernorm)
            out = layer.ffn(x, ctx)
            if i + 1 < len(self.layers):
                nxt = self.layers[i + 1]
                streams, post, comb, x = boundary(out, streams, post, comb, nxt.attn_hc, nxt.input_layernorm)
        return boundary_kernels.mhc_last(out, streams, post, comb, self.norm.weight, norm_eps=self.norm.eps)

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
