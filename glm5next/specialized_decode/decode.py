"""The specialized decode executor over the stock backbone: one plan per step (which stage runs what), then
every layer's stages in one loop.

`SpecializedDecode` is built once the weights are loaded; it reads the backbone and never
modifies it. For a captured decode step of at most 64 tokens (a pure decode, or a uniform verify
of q tokens per request) `plan()` returns a `Step`, and `run()` walks every layer, calling each
stage object itself, or the stock module where the policy says stock at this token count:

- between sublayers, the fused mHC boundary (`BoundaryStage`) or the stock post, pre and norm;
- the attention sublayer: where the projection stage runs (`ProjectionStage`), its projections
  (`kda` / `dsa`, returning what the stock `project` piece returns), else the stock `project`; then
  the middle piece: in a KDA layer the KDA stage (`KdaStage`: conv, gates, recurrence, norm in one
  launch) or the stock `KimiDeltaAttention.mix`, in a DSA layer the DSA stage (`DsaStage`: pool scores,
  top-k, sparse attention and value-up) or the stock `SparseMLA.attention` (cache writes, indexer,
  sparse attention); then the o_proj (`kda_output` / `dsa_output`, the DSA
  values' cast included, or the stock one); where no stage runs any piece, the stock sublayer;
- the FFN: the MoE stage (router, routed and shared experts), the dense MLP stage, or the shared
  expert stage added to the stock router and routed experts (`MoE.routed_experts`); else the
  stock module.

The stock modules never consult anything the executor sets: which code runs is decided here.
`DraftStages.forward` runs the MTP draft layer the same way.

Under tensor parallelism the executor runs on every rank over that rank's shards. `plan()` reads
only the step metadata, so every rank plans alike. Where the policy's `boundary` table covers the
token count (up to `boundary_max_tokens`), sublayers leave their outputs TP-partial (`partial()`):
the stock pieces run inside `partial_outputs()`, so their row-parallel output stays this rank's
share, and `reduced_boundary` all-reduces it and applies the boundary — one collective per
sublayer, where the fused symmetric-memory kernel will do both in one launch on GPUs. Elsewhere
the stock modules all-reduce their own outputs. The head stage's vocab shards are all-gathered.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext

import torch

from ..config import DSA, KDA
from ..model.backbone import Glm5NextModel
from ..model.mhc import hc_contract, hc_expand, hc_post
from ..forward import AttnMetadata, CUDAGraphMode, ForwardContext
from ..parallel.collectives import all_gather, all_reduce, partial_outputs, reduce_output
from .boundary import BoundaryStage
from .copies import Fp16Copies
from .dense_mlp import DenseMlpStage
from .dsa import DsaStage
from .kda import KdaStage
from .linear import ProjectionStage
from .logits import LogitsStage
from .moe import MoeStage
from .policy import MAX_TOKENS, Policy

logger = logging.getLogger(__name__)


class Step:
    """A planned step: q tokens per request, the positions and the per-layer metadata."""

    def __init__(self, q: int, positions: torch.Tensor, metadata: dict[str, AttnMetadata], ctx: ForwardContext,
                 cache) -> None:
        self.q, self.positions, self.metadata, self.ctx, self.cache = q, positions, metadata, ctx, cache

    @property
    def tokens(self) -> int:
        return self.positions.shape[-1]

    @property
    def slots(self) -> torch.Tensor:
        """[tokens] int64: each token's cache slot, -1 for the rows that pad the step to its graph size."""
        return next(iter(self.metadata.values())).slot_mapping


def is_decode(md: AttnMetadata, q: int, b: int) -> bool:
    """Whether one layer's metadata is a pure decode (q = 1) or a uniform verify of b tokens.

    Captured graphs pad whole requests, so every row of a verify holds q tokens. Verify rows may be
    filed as decodes or as short prefills of q tokens each; both are uniform verify steps.
    """
    if q == 1:
        return (not md.num_prefills and not md.num_spec_decodes
                and md.num_decode_tokens == md.num_decodes == b)
    if md.num_prefills:
        return not md.num_decodes and md.num_prefills * q == md.num_prefill_tokens == b
    return md.num_decode_tokens == md.num_decodes * q == b


class _LogOnce:
    def __init__(self) -> None:
        self.seen: set[str] = set()

    def __call__(self, message: str, *args) -> None:
        text = message % args
        if text not in self.seen:
            self.seen.add(text)
            logger.info(text)


class LayerStages:
    """The stages of one decoder layer's decode, shared by the trunk and the MTP draft layer."""

    policy: Policy
    batches: list[int]

    def _build_stages(self, layers) -> None:
        config = self.text_config
        self.copies = Fp16Copies()
        self.boundary_stage = BoundaryStage(config, self.copies) if self.policy.enabled("boundary") else None
        if self.boundary_stage is not None:
            eps = {n.eps for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)}
            if len(eps) != 1:
                logger.warning("specialized decode: mixed norm eps %s, no fused boundary", sorted(eps))
                self.boundary_stage = None
        self.projections = ProjectionStage(layers, self.policy, self.backbone.embed_tokens.dtype, self.copies)
        self.kda = {}
        if self.policy.enabled("kda"):
            self.kda = {layer.layer_idx: KdaStage(layer.self_attn) for layer in layers
                        if layer.layer_kind == KDA and KdaStage.supports(layer.self_attn)}
        self.dsa = {}
        if self.policy.enabled("dsa"):
            dtype = self.backbone.embed_tokens.dtype
            self.dsa = {layer.layer_idx: DsaStage(layer.self_attn, dtype) for layer in layers
                        if layer.layer_kind == DSA and DsaStage.supports(layer.self_attn)}
        self.dense = {}
        if self.policy.enabled("dense_mlp"):
            self.dense = {layer.layer_idx: DenseMlpStage(layer.mlp, self.copies) for layer in layers
                          if not layer.mlp_is_moe and DenseMlpStage.supports(layer.mlp)}
        self.moe = {}
        if self.policy.enabled("moe"):
            self.moe = {layer.layer_idx: MoeStage(layer.mlp) for layer in layers
                        if layer.mlp_is_moe and MoeStage.supports(layer.mlp)}
        self.shared = {}
        if self.policy.enabled("shared_expert"):
            if not config.norm_topk_prob:
                logger.warning("specialized decode: unsupported routing (unnormalized top-k), no MoE stages")
            else:
                self.shared = {layer.layer_idx: DenseMlpStage(layer.mlp.shared_experts, self.copies) for layer in layers
                               if layer.mlp_is_moe and DenseMlpStage.supports(layer.mlp.shared_experts)}

    @property
    def boundary_max_tokens(self) -> int:
        """The largest token count the policy's boundary table lists (0: none)."""
        return max(self.policy.tables.get("boundary", {}), default=0)

    def partial(self, tokens: int) -> bool:
        """Whether sublayers leave their output TP-partial for `reduced_boundary` at this token count:
        under tensor parallelism, where the policy runs the boundary stage."""
        return (self.backbone.tp.size > 1 and tokens <= self.boundary_max_tokens
                and self.policy("boundary", tokens) is not None)

    def runs_moe(self, layer_idx: int, tokens: int) -> bool:
        """Whether the MoE stage runs layer `layer_idx`'s FFN at this token count (shared expert included)."""
        return layer_idx in self.moe and self.policy("moe", tokens) is not None

    def mlp_release_late(self, layer, tokens: int) -> bool:
        """Whether the boundary before `layer`'s MLP releases the next launch only after its partial
        products: the MLP's first launch, the dense MLP's or (an MoE layer's shared expert runs first)
        the shared expert's, is "fused-overlap" at this token count."""
        if layer.layer_idx in self.dense:
            return self.policy("dense_mlp", tokens) == "fused-overlap"
        if self.runs_moe(layer.layer_idx, tokens):
            return False
        return layer.layer_idx in self.shared and self.policy("shared_expert", tokens) == "fused-overlap"

    def reads_x16(self, layer, sublayer: str, tokens: int) -> bool:
        """Whether `layer`'s "attention" or "mlp" sublayer runs a stage at this token count whose first
        launch reads an fp16 copy of its input (then the boundary before it writes one)."""
        if sublayer == "attention":
            return self.projections.reads_x16(layer, tokens)
        dtype = self.backbone.embed_tokens.dtype
        if self.runs_moe(layer.layer_idx, tokens):
            return False
        dense, shared = self.dense.get(layer.layer_idx), self.shared.get(layer.layer_idx)
        return ((dense is not None and bool(self.policy("dense_mlp", tokens)) and dense.reads_x16(tokens, dtype))
                or (shared is not None and bool(self.policy("shared_expert", tokens))
                    and shared.reads_x16(tokens, dtype)))

    def attention(self, layer, x: torch.Tensor, step: Step) -> tuple[torch.Tensor, bool]:
        """The attention output and whether it is still TP-partial: the projection stage, the stock
        middle piece and the o_proj stage where the policy runs the projections, else the stock sublayer."""
        tokens = x.shape[0]
        partial = self.partial(tokens)
        attn, md = layer.self_attn, step.ctx.metadata(layer.self_attn.prefix)
        projections = self.projections.runs(layer, tokens)
        with partial_outputs() if partial else nullcontext():
            if layer.layer_kind == KDA:
                mix = self.kda.get(layer.layer_idx) if self.policy("kda", tokens) else None
                mix = mix if mix is not None and mix.runs(md) else None
                if not projections and mix is None:
                    return layer.attention(x, step.ctx, step.cache), partial
                state = step.cache.kda[layer.layer_idx]
                p = self.projections.kda(attn, x, tokens) if projections else attn.project(x)
                y = mix(p, md, state) if mix is not None else attn.mix(p, md, state)
                return (self.projections.kda_output(attn, y, tokens) if projections else attn.o_proj(y)), partial
            if not projections and self.sparse(attn, md, tokens) is None:
                return layer.attention(x, step.ctx, step.cache), partial
            return self.dsa_attention(attn, x, md, step.cache.dsa[layer.layer_idx], projections=projections)[0], partial

    def sparse(self, attn, md: AttnMetadata, tokens: int) -> DsaStage | None:
        """The DSA stage that replaces `attn.attention` for this step, or None (stock)."""
        stage = self.dsa.get(attn.layer_idx) if self.policy("dsa", tokens) else None
        return stage if stage is not None and stage.runs(md) else None

    def dsa_attention(self, attn, x: torch.Tensor, md: AttnMetadata, cache, selection=None,
                      return_selection: bool = False,
                      projections: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`attn.forward` (a DSA sublayer's) with its projections and o_proj on the projection stage where
        `projections`, and its middle piece on the DSA stage where it runs: the output [T, hidden] and the
        selection (or None)."""
        tokens = x.shape[0]
        p = self.projections.dsa(attn, x, tokens) if projections else attn.project(x)
        middle = self.sparse(attn, md, tokens) or attn.attention
        values, chosen = middle(p, md, cache, selection, return_selection)
        if not projections:
            return attn.output(values, x.dtype), chosen
        return self.projections.dsa_output(attn, values, x.dtype, tokens), chosen

    def ffn_stages(self, layer, x: torch.Tensor, ctx: ForwardContext, slots: torch.Tensor | None):
        """This rank's partial FFN output [T, D] where a stage runs `layer`'s FFN at this token count
        (`slots`: the step's cache slots, for the MoE stage), else None."""
        idx, tokens = layer.layer_idx, x.shape[0]
        if self.runs_moe(idx, tokens):
            return self.moe[idx](x, slots)  # this rank's share of the experts
        dense = self.dense.get(idx)
        choice = self.policy("dense_mlp", tokens) if dense is not None else None
        if choice:
            return dense(x, overlap=choice == "fused-overlap")  # this rank's share of the row-parallel down
        shared = self.shared.get(idx)
        choice = self.policy("shared_expert", tokens) if shared is not None else None
        graph_safe = ctx.cudagraph_mode != CUDAGraphMode.NONE
        if not choice or layer.mlp.runs_grouped(x, graph_safe):
            return None
        # The shared expert first, right after the boundary that produces x, then the stock router and
        # routed experts, summed as `MoE.forward` sums them.
        y = shared(x, overlap=choice == "fused-overlap")
        return layer.mlp.routed_experts(x, graph_safe) + y

    def mlp(self, layer, x: torch.Tensor, step: Step) -> tuple[torch.Tensor, bool]:
        """The FFN output and whether it is still TP-partial."""
        partial = self.partial(x.shape[0])
        out = self.ffn_stages(layer, x, step.ctx, step.slots)
        if out is not None:
            return (out if partial else all_reduce(out, self.backbone.tp)), partial
        with partial_outputs() if partial else nullcontext():
            return layer.ffn(x, step.ctx), partial

    def boundary(self, hc, norm, out, streams, post, comb, release_late: bool = False, x16: bool = False):
        """The previous sublayer's mHC post, then the next sublayer's pre and its norm (`release_late`:
        the fused kernel lets the launch after it start only once its partial products are stored;
        `x16`: it also writes the normalized input in fp16 for the stage that reads it)."""
        choice = self.policy("boundary", out.shape[0]) if self.boundary_stage is not None else None
        if choice:
            return self.boundary_stage(out, streams, post, comb, hc, norm, release_late, choice == "fused-deferred",
                                       x16)
        streams = hc_post(out, streams, post, comb)
        x, post, comb = hc.pre(streams)
        return streams, post, comb, norm(x)

    def reduced_boundary(self, hc, norm, out, streams, post, comb, release_late: bool = False, x16: bool = False):
        """`boundary` of a TP-partial sublayer output: the sum over the ranks, then the boundary. (On
        GPUs the fused kernel is to read the ranks' shares over symmetric memory in the same launch.)"""
        return self.boundary(hc, norm, all_reduce(out, self.backbone.tp), streams, post, comb, release_late, x16)


class DraftStages(LayerStages):
    """The MTP draft layer's stages: its DSA projections and its shared expert, at the token counts the
    policy gives them (a plain pre-norm block: no mHC boundary)."""

    def __init__(self, executor: "SpecializedDecode") -> None:
        self.backbone, self.text_config, self.policy = executor.backbone, executor.text_config, executor.policy
        self.batches = executor.batches
        mtp = executor.backbone.mtp
        self.layers_by_idx = {mtp.layer_idx: mtp}
        self._build_stages([mtp])
        self.boundary_stage = None
        self.moe = {}  # the draft layer's routed experts run stock (its shared expert on its stage)
        self.calls = 0
        """Draft-layer forwards that ran at least one stage."""

    def runs_any(self, layer, tokens: int, md: AttnMetadata | None = None) -> bool:
        """Whether a stage runs part of the draft layer at this token count (of a step of metadata `md`)."""
        sparse = md is not None and self.sparse(layer.self_attn, md, tokens) is not None
        return (self.projections.runs(layer, tokens) or sparse
                or (layer.layer_idx in self.shared and self.policy("shared_expert", tokens) is not None))

    def forward(self, mtp, embedded: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext, cache,
                selection: torch.Tensor | None = None, return_selection: bool = False):
        """`MtpLayer.forward` with its DSA projections and o_proj and its shared expert on the stages the
        policy gives this token count, the rest stock (outputs reduced where they are made)."""
        tokens = embedded.shape[0]
        md = ctx.metadata(mtp.self_attn.prefix)
        self.calls += self.runs_any(mtp, tokens, md)
        z = mtp.combine(embedded, hidden, md.positions)
        x, dsa_cache = mtp.input_layernorm(z), cache.dsa[mtp.layer_idx]
        projections = self.projections.runs(mtp, tokens)
        if projections or self.sparse(mtp.self_attn, md, tokens) is not None:
            a, chosen = self.dsa_attention(mtp.self_attn, x, md, dsa_cache, selection, return_selection, projections)
        else:
            a = mtp.self_attn(x, md, dsa_cache, selection, return_selection,
                              ctx.cudagraph_mode != CUDAGraphMode.NONE)
            a, chosen = a if return_selection else (a, None)
        r = a + z
        x = mtp.post_attention_layernorm(r)
        f = self.ffn_stages(mtp, x, ctx, None)
        if f is None:
            f = mtp.mlp(x, graph_safe=ctx.cudagraph_mode != CUDAGraphMode.NONE)
        else:
            f = reduce_output(f, self.backbone.tp)
        out = mtp.shared_head_norm(f + r)
        return (out, chosen) if return_selection else out


class SpecializedDecode(LayerStages):
    """Built once the weights are loaded. Reads the backbone, never modifies it."""

    def __init__(self, backbone: Glm5NextModel, policy: Policy, capture_sizes, q: int = 1) -> None:
        self.backbone = backbone
        self.text_config = backbone.config
        self.policy = policy
        self.q = q
        self.layers = list(backbone.layers)
        self.layers_by_idx = {layer.layer_idx: layer for layer in self.layers}
        self.batches = sorted(b for b in capture_sizes if b <= MAX_TOKENS and b % q == 0)
        self._log = _LogOnce()
        self._build_stages(self.layers)
        self.head = None
        self.build_logits()
        self.draft_stages = DraftStages(self) if backbone.mtp is not None else None
        self.cache = None
        self.planned_steps = 0
        """Steps `plan()` accepted (captures, or steps declared as captured)."""

    # ------------------------------------------------------------------ logits
    def build_logits(self) -> None:
        """The LM head projection at the row counts the policy gives it (a BF16 head only)."""
        self.head = None
        if not self.policy.enabled("logits_head"):
            return
        weight = self.backbone.lm_head.weight
        if weight.dtype != torch.bfloat16 or self.backbone.lm_head.is_fp8:
            logger.warning("specialized decode: the LM head is %s, not BF16: stock head", weight.dtype)
            return
        self.head = LogitsStage(self.backbone.lm_head)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [rows, vocab] of post-norm hidden states, through the head stage where planned."""
        choice = self.policy("logits_head", hidden.shape[0])
        if self.head is not None and choice is not None and hidden.is_contiguous():
            return all_gather(self.head(hidden, choice), self.backbone.tp, dim=-1)  # vocab shards made whole
        return self.backbone.compute_logits(hidden)

    def prepare_kv(self, cache) -> None:
        """Bind the cache tensors the runner allocated (again whenever it reallocates them)."""
        self.cache = cache

    # -------------------------------------------------------------------- plan
    def plan(self, ctx: ForwardContext, num_tokens: int) -> Step | None:
        """This step's plan, or None to run the stock forward.

        Stock runs for: steps outside a graph capture (warm-ups included, so every stock kernel runs
        before its capture); graph modes other than full; token counts without a planned size (above
        64 or not a multiple of q); backbones that collect auxiliary hidden states; steps with a
        prompt row; speculative steps whose requests do not all verify q tokens. Every predicate reads
        only the forward context and the token count, identical on every rank.
        """
        b = num_tokens
        if not ctx.capturing:
            return None
        if ctx.cudagraph_mode != CUDAGraphMode.FULL:
            self._log("specialized decode skips a %s-mode %d-token capture", ctx.cudagraph_mode.value, b)
            return None
        if b not in self.batches:
            self._log("specialized decode skips a %d-token capture (planned sizes %s)", b, self.batches)
            return None
        if self.backbone.aux_hidden_state_layers:
            self._log("specialized decode skips captures: aux layers %s", self.backbone.aux_hidden_state_layers)
            return None
        rows = list(ctx.attn_metadata.values())
        if not rows:
            return None
        q = self.q if any(md.num_spec_decodes for md in rows) else 1
        bad = next((md for md in rows if not is_decode(md, q, b)), None)
        if b % q or bad is not None:
            fields = ("num_prefills", "num_decodes", "num_decode_tokens", "num_spec_decodes", "num_spec_decode_tokens")
            self._log("specialized decode skips a %d-token capture (q=%d): %s", b, q,
                      {f: getattr(bad, f) for f in fields} if bad is not None else "not a multiple of q")
            return None
        self._log("specialized decode plans %d-token steps", b)
        self.planned_steps += 1
        return Step(q, ctx.positions, ctx.attn_metadata, ctx, self.cache)

    # --------------------------------------------------------------------- run
    def layer(self, layer, x, partial, streams, post, comb, step: Step):
        """`DecoderLayer.forward` for a planned step; `x` is the previous sublayer's output (or the
        embeddings before layer 0). Returns the next state, or the final hidden states after the last layer."""
        tokens = x.shape[0]
        late = self.projections.release_late(layer, tokens)
        fused = self.policy("boundary", tokens) if self.boundary_stage is not None else None
        deferred = fused == "fused-deferred"  # then every comb between two boundaries is pending
        x16 = self.reads_x16(layer, "attention", tokens)
        if post is None:
            if fused:
                streams, post, comb, x = self.boundary_stage.first(x, layer.attn_hc, layer.input_layernorm, late,
                                                                   deferred, x16)
            else:
                streams = hc_expand(x, self.text_config.hc_mult)
                x, post, comb = layer.attn_hc.pre(streams)
                x = layer.input_layernorm(x)
        else:
            bound = self.reduced_boundary if partial else self.boundary
            streams, post, comb, x = bound(layer.attn_hc, layer.input_layernorm, x, streams, post, comb, late, x16)
        x, partial = self.attention(layer, x, step)
        bound = self.reduced_boundary if partial else self.boundary
        streams, post, comb, x = bound(layer.ffn_hc, layer.post_attention_layernorm, x, streams, post, comb,
                                       self.mlp_release_late(layer, tokens), self.reads_x16(layer, "mlp", tokens))
        x, partial = self.mlp(layer, x, step)
        if layer is self.layers[-1]:
            if partial:  # the last layer reduces before contracting
                x = all_reduce(x, self.backbone.tp)
            if fused:
                return (self.boundary_stage.last(x, streams, post, comb, self.backbone.norm, deferred),
                        False, None, None, None)
            return self.backbone.norm(hc_contract(hc_post(x, streams, post, comb))), False, None, None, None
        return x, partial, streams, post, comb

    def run(self, step: Step, input_ids: torch.Tensor) -> torch.Tensor:
        """Normalized hidden states [tokens, D] of a planned step."""
        x = self.backbone.embed(input_ids)
        state = (False, None, None, None)
        try:
            for layer in self.layers:
                x, *state = self.layer(layer, x, *state, step)
        finally:
            self.copies.clear()
        return x
