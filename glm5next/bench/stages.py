"""Each specialized stage against its stock module, at one token count, through CUDA-graph replays.

A case runs one stage the way a planned step runs it (the same explicit calls of the same stage
objects, or of the stock pieces they replace) over every instance the slice has of it — every layer's weights, plus copies where
one layer's bytes would fit in the 60 MB L2 — so each replay streams its weights from HBM. The
time of one call is the replay time over the calls captured in it; where a step runs something
ahead of every call that a choice may overlap (the boundary before a sublayer's projections), the
case runs that too and subtracts its time alone. Where a stage reads an fp16 copy of its input
(`glm5next.specialized_decode.copies`), the case gives it one as the step would: the boundary before
the projections, the dense MLP or the shared expert writes it, and in a DSA layer the q_a norm and the
cast of the attention's values, which the DSA case runs in the attention's order.
`glm5next tune-policy` picks the fastest choice per stage and token count from these cases;
`glm5next bench --mode specialized` reports them beside the bytes each call reads.
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..config import DSA, KDA
from ..forward import AttnMetadata, KdaState
from ..model.kda import KdaProjections
from ..model.mhc import hc_post
from ..specialized_decode.boundary import BoundaryStage
from ..specialized_decode.copies import Fp16Copies
from ..runtime.metadata import build_metadata
from ..specialized_decode.dense_mlp import DenseMlpStage
from ..specialized_decode.dsa import DsaStage
from ..specialized_decode.kda import KdaStage
from ..specialized_decode.linear import (DSA_GROUP, DSA_SINGLES, KDA_GROUP, KDA_SINGLES, RELEASE_LATE, ProjectionStage,
                                          _get)
from ..specialized_decode.logits import LogitsStage
from ..specialized_decode.moe import MoeStage
from ..specialized_decode.policy import STAGES, STOCK, Policy
from .floor import capture, time_replays
from .slice import fill_context, make_cache

L2_BYTES = 60 * 2**20
ROTATE_BYTES = 4 * L2_BYTES
"""Bytes a case cycles through per replay, at least: enough that L2 holds none of it."""


@dataclass
class Case:
    stage: str
    tokens: int
    bytes_per_call: int
    """Weight (and scale) bytes one call reads, averaged over the instances."""
    runs: dict[str, Callable[[], None]] = field(default_factory=dict)
    """choice -> one call of each instance, in order."""
    calls: int = 1
    before: Callable[[], None] | None = None
    """What a step runs ahead of each call (the same in every run), alone: its time is subtracted, so
    a choice that overlaps it (a programmatic launch) is credited with the overlap."""
    before_us: float | None = None
    """The median time of `before` per call, once measured."""


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _linear_bytes(m) -> int:
    return _nbytes(m.weight, m.weight_scale_inv)


def _copies(instance_bytes: int) -> int:
    return max(1, -(-ROTATE_BYTES // max(instance_bytes, 1)))


def boundary_case(model, m: int) -> Case:
    """The fused boundary vs stock post + pre + norm, over every mixer (copied past L2)."""
    cfg, dev, dt = model.config, model.embed_tokens.device, model.embed_tokens.dtype
    gen = torch.Generator(device=dev).manual_seed(m)
    mixers = [(layer.attn_hc, layer.input_layernorm) for layer in model.layers]
    mixers += [(layer.ffn_hc, layer.post_attention_layernorm) for layer in model.layers]
    per = _nbytes(mixers[0][0].fn) + m * cfg.hc_mult * cfg.hidden_size * dt.itemsize * 3
    insts = []
    for k in range(_copies(per * len(mixers))):
        for hc, norm in mixers:
            hc2 = hc if k == 0 else copy.deepcopy(hc)
            streams = torch.randn(m, cfg.hc_mult, cfg.hidden_size, generator=gen, device=dev).to(dt)
            out = torch.randn(m, cfg.hidden_size, generator=gen, device=dev).to(dt)
            post = torch.rand(m, cfg.hc_mult, generator=gen, device=dev) * 2
            comb = torch.full((m, cfg.hc_mult, cfg.hc_mult), 1.0 / cfg.hc_mult, device=dev)
            insts.append((hc2, norm, out, streams, post, comb))
    stage = BoundaryStage(cfg)

    def fused(deferred=False):
        for hc, norm, out, streams, post, comb in insts:
            stage(out, streams, post, comb, hc, norm, deferred=deferred)

    def stock():
        for hc, norm, out, streams, post, comb in insts:
            x, _, _ = hc.pre(hc_post(out, streams, post, comb))
            norm(x)

    # "fused-deferred" takes each (uniform) comb as pending: the same work as in a step that defers.
    return Case("boundary", m, per, {"fused": fused, "fused-deferred": lambda: fused(True), STOCK: stock}, len(insts))


def _projections(attn, kind: str, x: torch.Tensor, y: torch.Tensor, stage: ProjectionStage | None, m: int) -> None:
    """A layer's projections as a planned step calls them (`stage` None: the stock pieces it replaces):
    the projection piece on the boundary's output `x` (a DSA layer's latent norms and the indexer's
    included), then the o_proj of `y` — for DSA, the attention's values (fp32 [T, H, V] as the last
    einsum leaves them), cast first."""
    if kind == KDA:
        if stage is None:
            attn.project(x)
            attn.o_proj(y)
        else:
            stage.kda(attn, x, m)
            stage.kda_output(attn, y, m)
    elif stage is None:
        attn.project(x)
        attn.output(y, x.dtype)
    else:
        stage.dsa(attn, x, m)
        stage.dsa_output(attn, y, x.dtype, m)


def _projection_case(model, m: int, kind: str, stage: str) -> Case:
    """Each layer's projections as a planned step runs them: right after the fused boundary that
    produces their input, the o_proj on random inputs (`_projections`; for DSA the attention's values,
    whose cast it includes). The boundaries alone are the case's `before`."""
    cfg, dev, dt = model.config, model.embed_tokens.device, model.embed_tokens.dtype
    gen = torch.Generator(device=dev).manual_seed(m + 1)
    group_names, single_names = (KDA_GROUP, KDA_SINGLES) if kind == KDA else (DSA_GROUP, DSA_SINGLES)
    layers = [layer for layer in model.layers if layer.layer_kind == kind]
    copies = Fp16Copies()
    boundary = BoundaryStage(cfg, copies)
    grouped = ProjectionStage(layers, Policy({stage: {str(m): "grouped"}}), dt)
    calls, total = [], 0
    for layer in layers:
        attn = layer.self_attn
        state = (torch.randn(m, cfg.hidden_size, generator=gen, device=dev).to(dt),
                 torch.randn(m, cfg.hc_mult, cfg.hidden_size, generator=gen, device=dev).to(dt),
                 torch.rand(m, cfg.hc_mult, generator=gen, device=dev) * 2,
                 torch.full((m, cfg.hc_mult, cfg.hc_mult), 1.0 / cfg.hc_mult, device=dev))
        if kind == DSA:  # the attention's values, heads outermost in memory as the einsum writes them
            y = torch.randn(attn.num_heads, m, attn.v_dim, generator=gen, device=dev).transpose(0, 1)
        else:
            y = torch.randn(m, attn.o_proj.in_features, generator=gen, device=dev).to(dt)
        # Whether the group reads an fp16 copy of the boundary's output: then the boundary writes one in every
        # run and in `before` (where the group does, "single" members can, and stock reads none).
        calls.append((layer, state, y, grouped.reads_x16(layer, m)))
        total += sum(_linear_bytes(_get(attn, n)) for n in group_names + single_names)
    calls = calls * _copies(total)

    def before():
        for layer, state, _, x16 in calls:
            boundary(*state, layer.attn_hc, layer.input_layernorm, x16=x16)
        copies.clear()

    runs = {}
    for choice in STAGES[stage] + (STOCK,):
        projections = ProjectionStage(layers, Policy({stage: {str(m): choice}}), dt, copies)

        def run(projections=projections, late=choice in RELEASE_LATE):
            for layer, state, y, x16 in calls:
                x = boundary(*state, layer.attn_hc, layer.input_layernorm, late, x16=x16)[3]
                runs_stage = projections.runs(layer, m)
                _projections(layer.self_attn, kind, x, y, projections if runs_stage else None, m)
            copies.clear()

        runs[choice] = run
    return Case(stage, m, total // len(layers), runs, len(calls), before)


def _mlp_case(model, m: int, stage: str) -> Case:
    """The dense layers' MLPs, or the MoE layers' shared experts (which an MoE layer runs first), as a
    planned step runs them: right after the fused boundary that produces their input (writing its fp16
    copy where the gate|up reads one; releasing late before "fused-overlap"), the boundaries alone the
    case's `before`. Stock runs the stock MLP (the shared expert alone, not the routed ones)."""
    cfg, dev, dt = model.config, model.embed_tokens.device, model.embed_tokens.dtype
    gen = torch.Generator(device=dev).manual_seed(m + 2)
    copies = Fp16Copies()
    shared = stage == "shared_expert"
    layers = [layer for layer in model.layers if layer.mlp_is_moe == shared]
    mlps = [layer.mlp.shared_experts if shared else layer.mlp for layer in layers]
    per = _linear_bytes(mlps[0].gate_proj) * 2 + _linear_bytes(mlps[0].down_proj)
    boundary = BoundaryStage(cfg, copies)
    calls = []
    for layer, mlp in zip(layers, mlps):
        st = DenseMlpStage(mlp, copies)
        state = (torch.randn(m, cfg.hidden_size, generator=gen, device=dev).to(dt),
                 torch.randn(m, cfg.hc_mult, cfg.hidden_size, generator=gen, device=dev).to(dt),
                 torch.rand(m, cfg.hc_mult, generator=gen, device=dev) * 2,
                 torch.full((m, cfg.hc_mult, cfg.hc_mult), 1.0 / cfg.hc_mult, device=dev))
        calls.append((layer, mlp, st, state, st.reads_x16(m, dt)))
    calls = calls * _copies(per * len(layers))

    def before():
        for layer, _, _, state, x16 in calls:
            boundary(*state, layer.ffn_hc, layer.post_attention_layernorm, x16=x16)
        copies.clear()

    def run(choice):
        late = choice == "fused-overlap"
        for layer, mlp, st, state, x16 in calls:
            x = boundary(*state, layer.ffn_hc, layer.post_attention_layernorm, late, x16=x16)[3]
            if choice == STOCK:
                mlp(x)
            else:
                st(x, overlap=late)
        copies.clear()

    runs = {choice: (lambda choice=choice: run(choice)) for choice in STAGES[stage] + (STOCK,)}
    return Case(stage, m, per, runs, len(calls), before)


def moe_case(model, m: int) -> Case:
    """Every MoE layer's FFN (router, routed experts, shared expert) on its own random input: the stage
    against the stock module's graph-safe path. The bytes are each layer's router, shared expert and the
    distinct experts its routing touched, averaged."""
    cfg, dev, dt = model.config, model.embed_tokens.device, model.embed_tokens.dtype
    gen = torch.Generator(device=dev).manual_seed(m + 3)
    calls, total = [], 0
    for layer in model.layers:
        if layer.mlp_is_moe and MoeStage.supports(layer.mlp):
            stage = MoeStage(layer.mlp)
            x = torch.randn(m, cfg.hidden_size, generator=gen, device=dev).to(dt)
            ids = layer.mlp.gate(x)[0]
            experts = layer.mlp.experts
            per_expert = sum(_nbytes(t) for t in (experts.gate_proj, experts.up_proj, experts.down_proj,
                                                  experts.gate_proj_scale_inv, experts.up_proj_scale_inv,
                                                  experts.down_proj_scale_inv)) // experts.num_experts
            total += (_nbytes(layer.mlp.gate.weight) + per_expert * (1 + int(torch.unique(ids).numel())))
            calls.append((layer.mlp, stage, x))
    runs = {"grouped": lambda: [stage(x) for _, stage, x in calls],
            STOCK: lambda: [moe(x, graph_safe=True) for moe, _, x in calls]}
    return Case("moe", m, total // max(len(calls), 1), runs, len(calls))


def kda_case(model, m: int) -> Case:
    """Every KDA layer's middle (conv, gates, delta rule, gated norm) on random projections of m decode rows,
    each row its own state slot (fp32 states read and written once: the bytes counted), every instance
    on states of its own so that the replay streams them from HBM: the stage against the stock
    `KimiDeltaAttention.mix`."""
    cfg, dev, dt = model.config, model.embed_tokens.device, model.embed_tokens.dtype
    gen = torch.Generator(device=dev).manual_seed(m + 5)
    z = torch.zeros(m, dtype=torch.int64, device=dev)
    md = AttnMetadata(0, 0, m, m, z, z, z, torch.arange(m, device=dev), z.view(m, 1), z + 1)
    layers = [layer.self_attn for layer in model.layers if layer.layer_kind == KDA and KdaStage.supports(layer.self_attn)]
    per = 2 * m * layers[0].num_heads * layers[0].head_dim ** 2 * 4 if layers else 0
    calls = []
    for _ in range(_copies(per * len(layers))):
        for attn in layers:
            h, d = attn.num_heads, attn.head_dim
            p = KdaProjections(*(torch.randn(m, n, generator=gen, device=dev).to(dt)
                                 for n in (h * d, h * d, h * d, h, h * d, h * d)))
            state = KdaState(torch.zeros(m + 1, 3 * h * d, attn.conv_kernel - 1, dtype=dt, device=dev),
                             torch.zeros(m + 1, h, d, d, device=dev))
            calls.append((attn, KdaStage(attn), p, state))
    runs = {"fused": lambda: [stage(p, md, state) for _, stage, p, state in calls],
            STOCK: lambda: [attn.mix(p, md, state) for attn, _, p, state in calls]}
    return Case("kda", m, per, runs, len(calls))


DSA_CASE_CONTEXT = 8192
"""Cached tokens before each row's new one in the DSA case (the benchmark's default context)."""


def dsa_case(model, m: int, context: int = DSA_CASE_CONTEXT, copies: int | None = None) -> Case:
    """Every DSA layer's middle (cache writes, pool scores, top-k pools, sparse attention, value-up) for m
    decode rows over `context` cached tokens of random prior context each: the stage against the stock
    `SparseMLA.attention`, both on the projections of one random input per layer. The bytes are the
    stage's floor: each row's visible pooled keys and selected latent rows (the tail included), and
    W_UK / W_UV as the stage reads them (FP8 with their scales where the checkpoint is); the weights are
    copied past the L2 where they fit it (`copies` instances of each layer in all, at most 8, where given)."""
    cfg, dev, dt = model.config, model.embed_tokens.device, model.embed_tokens.dtype
    gen = torch.Generator(device=dev).manual_seed(m + 7)
    layers = [layer.self_attn for layer in model.layers if layer.layer_kind == DSA and DsaStage.supports(layer.self_attn)]
    cache = make_cache(cfg, m, context, 16, dt, dev, tp_size=model.tp.size)
    blocks = fill_context(cache, m, context, seed=m)
    md = build_metadata([1] * m, [context] * m, m, list(range(m)), blocks, cache.block_size, dev)
    calls, total = [], 0
    for attn in layers:
        x = torch.randn(m, cfg.hidden_size, generator=gen, device=dev).to(dt)
        stage, c = DsaStage(attn, dt), cache.dsa[attn.layer_idx]
        pools = (context + 1) // attn.kpool
        rows = min(pools, stage.weights.topk_pools) * attn.kpool + attn.kpool - 1
        w = stage.weights
        total += (_nbytes(w.w_uk, w.w_uv_t, w.w_uk_scale, w.w_uv_t_scale)
                  + m * (pools * c.pooled_key.shape[-1] + rows * c.latent.shape[-1]) * c.latent.element_size())
        calls.append((attn, stage, attn.project(x), c))
    per = total // max(len(calls), 1)
    copies = min(8, _copies(total)) if copies is None else copies
    calls += [(attn, DsaStage(attn, dt), p, c) for _ in range(copies - 1) for attn, _, p, c in calls[: len(layers)]]
    runs = {"sparse": lambda: [stage(p, md, c)[0] for _, stage, p, c in calls],
            STOCK: lambda: [attn.attention(p, md, c, graph_safe=True)[0] for attn, _, p, c in calls]}
    return Case("dsa", m, per, runs, len(calls))


def logits_case(model, m: int) -> Case:
    dev, dt = model.embed_tokens.device, model.embed_tokens.dtype
    h = torch.randn(m, model.config.hidden_size, generator=torch.Generator(device=dev).manual_seed(m), device=dev).to(dt)
    head = LogitsStage(model.lm_head)
    runs = {c: (lambda c=c: head(h, c)) for c in STAGES["logits_head"]}
    runs[STOCK] = lambda: model.compute_logits(h)
    return Case("logits_head", m, _linear_bytes(model.lm_head), runs, 1)


def stage_cases(model, m: int, stages=None) -> list[Case]:
    """Every stage's case at `m` tokens (those in `stages`, when given) that this backbone supports."""
    builders = {
        "boundary": lambda: boundary_case(model, m),
        "kda_proj": lambda: _projection_case(model, m, KDA, "kda_proj"),
        "kda": lambda: kda_case(model, m),
        "dsa": lambda: dsa_case(model, m),
        "dsa_proj": lambda: _projection_case(model, m, DSA, "dsa_proj"),
        "dense_mlp": lambda: _mlp_case(model, m, "dense_mlp"),
        "shared_expert": lambda: _mlp_case(model, m, "shared_expert"),
        "moe": lambda: moe_case(model, m),
        "logits_head": lambda: logits_case(model, m),
    }
    kinds = {layer.layer_kind for layer in model.layers}
    has = {"kda_proj": KDA in kinds, "kda": KDA in kinds, "dsa_proj": DSA in kinds,
           "dsa": any(layer.layer_kind == DSA and DsaStage.supports(layer.self_attn) for layer in model.layers),
           "dense_mlp": any(not layer.mlp_is_moe for layer in model.layers),
           "shared_expert": any(layer.mlp_is_moe for layer in model.layers),
           "moe": any(layer.mlp_is_moe and MoeStage.supports(layer.mlp) for layer in model.layers),
           "logits_head": model.lm_head.weight.dtype == torch.bfloat16, "boundary": True}
    return [builders[s]() for s in (stages or STAGES) if has[s]]


def _median_us(fn, calls: int, replays: int) -> float:
    graph = capture(fn)
    times = [t * 1e3 / calls for t in time_replays(graph, replays, 1)]
    del graph
    return statistics.median(times)


def time_choice(case: Case, choice: str, replays: int = 20) -> float:
    """Median microseconds of one call of `choice`, from CUDA-graph replays of every instance, less
    the median of the case's `before` alone where it has one."""
    us = _median_us(case.runs[choice], case.calls, replays)
    if case.before is not None:
        if case.before_us is None:
            case.before_us = _median_us(case.before, case.calls, replays)
        us -= case.before_us
    return us

