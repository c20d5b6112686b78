"""The resolved plan of a policy on a model's shapes: per stage and token count, the chosen variant and
the launch parameters of every kernel it runs (what `glm5next describe-plan` prints).

Needs no GPU and no weights: shapes come from the model's tensor inventory, launch parameters from the
same plan functions the kernels use (`plan_launch`, the boundary's `plan`), for a GPU of `sms` SMs and a
bf16 model (FP8 projections then read the fp16 copies their producers write).
"""

from __future__ import annotations

import torch

from ..checkpoint.inventory import expected_tensors
from ..config import DSA, KDA, Glm5NextConfig
from ..kernels import boundary as boundary_kernels
from ..kernels.dsa import keeps_fp8, plan_dsa, select_levels
from ..kernels.kda import plan_kda
from ..kernels.linear import plan_launch
from ..kernels.moe import plan_moe
from ..model.backbone import Glm5NextModel
from .linear import DSA_GROUP, DSA_SINGLES, EARLY, KDA_GROUP, KDA_SINGLES, RELEASE_LATE
from .logits import CHOICES as LOGITS_CHOICES
from .policy import STAGES, Policy

H200_SMS = 132
"""SMs of an H100 / H200, which the launch plans fill."""
_BYTES = {"bf16": 2, "fp32": 4, "fp8": 1}


def _weights(config: Glm5NextConfig) -> dict[str, tuple[tuple[int, ...], int]]:
    """Checkpoint tensor name -> (shape, element bytes) of the model's trunk."""
    specs = Glm5NextModel(config, with_mtp=False).tensor_specs()
    official = expected_tensors(config, include_mtp=False)
    return {k: (tuple(s.shape), _BYTES.get(str(official[k].official_dtype), 2)) for k, s in specs.items()}


def _linear(name: str, tokens: int, members: list[tuple[str, tuple[int, int], int]], sms: int, gated=False,
            **overrides) -> dict:
    """One skinny launch of `members` [(name, [N, K], element bytes)]."""
    ns = [shape[0] for _, shape, _ in members]
    K = members[0][1][1]
    sizes = [b for _, _, b in members]
    fp8 = max(sizes) == 1
    plan = plan_launch(tokens, ns, K, min(sizes), "cuda", sms, gated, widest_bytes=max(sizes), x16=fp8, **overrides)
    return dict(launch=name, grid=(plan.tiles, plan.split_k), block=(plan.block_m, plan.block_n, plan.block_k),
                split_k=plan.split_k, stages=plan.num_stages, warps=plan.num_warps,
                products="fp16" if plan.half else ("bf16" if min(sizes) <= 2 else "tf32x3"), tma=plan.tma,
                pdl="late" if plan.pdl_late else plan.pdl)


def _boundary(tokens: int, D: int, n: int, choice: str) -> dict:
    p = boundary_kernels.plan(tokens, D, n, on_gpu=True)
    deferred = choice == "fused-deferred"
    return dict(launch="mhc_boundary", grid=p.grid, block_t=p.block_t, chunk=p.chunk, sub=p.sub,
                fin=p.finisher_tile, sinkhorn=p.sinkhorn,
                finisher="scalars" if boundary_kernels.finishes_by_scalars(p, 0, n, D, deferred) else "tiles",
                deferred=deferred, warps=boundary_kernels.NUM_WARPS, pdl=True)


def stage_launches(w: dict, config: Glm5NextConfig, stage: str, choice: str, T: int, sms: int = H200_SMS) -> list[dict]:
    """The launches `stage` runs with `choice` at T tokens in its first layer that has it (`w`: `_weights`)."""
    kinds = config.layer_kinds

    def member(prefix: str, name: str):
        shape, b = w[f"{prefix}.{name}.weight"]
        return name, shape, b

    if stage == "boundary":
        return [_boundary(T, config.hidden_size, config.hc_mult, choice)]
    if stage in ("kda_proj", "dsa_proj"):
        kind = KDA if stage == "kda_proj" else DSA
        if kind not in kinds:
            return []
        prefix = f"layers.{kinds.index(kind)}.self_attn"
        group, singles = (KDA_GROUP, KDA_SINGLES) if kind == KDA else (DSA_GROUP, DSA_SINGLES)
        if choice == "single":
            return [_linear(n, T, [member(prefix, n)], sms) for n in group + singles]
        first = _linear("group:" + "|".join(n.split(".")[-1] for n in group), T, [member(prefix, n) for n in group],
                        sms, pdl=True if choice in EARLY else None)
        if choice in RELEASE_LATE:
            first["boundary_before"] = "releases late"
        return [first] + [_linear(n, T, [member(prefix, n)], sms) for n in singles]
    if stage in ("dense_mlp", "shared_expert"):
        moe = config.moe_layers
        idx = next((i for i, m in enumerate(moe) if m == (stage == "shared_expert")), None)
        if idx is None:
            return []
        prefix = f"layers.{idx}.mlp" + (".shared_experts" if stage == "shared_expert" else "")
        overlap = choice == "fused-overlap"
        return [_linear("gate|up+swiglu", T, [member(prefix, "gate_proj")], sms, gated=True,
                        pdl="late" if overlap else None),
                _linear("down_proj", T, [member(prefix, "down_proj")], sms, pdl=True if overlap else None)]
    if stage == "kda":
        if KDA not in kinds:
            return []
        h, d = config.linear_num_heads, config.linear_head_dim
        p = plan_kda(d)
        return [dict(launch="conv+gates+delta+norm", grid=(T, h, d // p.block_v), block_v=p.block_v,
                     warps=p.num_warps)]
    if stage == "dsa":
        if DSA not in kinds:
            return []
        h = config.num_attention_heads
        pools = config.max_position_embeddings // config.index_kpool
        p = plan_dsa(T, h, pools, config.index_topk_pools, config.index_kpool, sms)
        groups = -(-h // p.heads_per_program)
        r, v = config.kv_lora_rank, config.v_head_dim
        weights = "fp8" if keeps_fp8(config.qk_nope_head_dim, v) else "widened"
        return [dict(launch="write_cache", grid=(T,), pooled_keys="of the pools the step completes"),
                dict(launch="index_scores", grid=(T, p.score_splits), block_p=p.block_p, warps=p.num_warps),
                *[dict(launch="select_pools", grid=(T, chunks), block=block, warps=p.select_warps,
                       threshold="bitwise", level="final" if chunks == 1 else "chunks")
                  for _, chunks, block in select_levels(pools, config.index_topk_pools, p.select_chunk)],
                dict(launch="absorb", grid=(h, -(-r // p.block_r)), block=(p.block_m, p.block_k, p.block_r),
                     weights=weights),
                dict(launch="attend", grid=(T, groups, p.kv_splits), heads=p.heads_per_program, block_n=p.block_n,
                     warps=p.attend_warps)] + \
            ([dict(launch="merge_splits", grid=(T, h, -(-r // p.merge_block_r)), block_r=p.merge_block_r)]
             if p.kv_splits > 1 else []) + \
            [dict(launch="value_up", grid=(h, -(-v // p.block_v)), block_v=p.block_v, block_k=p.up_block_k,
                  weights=weights)]
    if stage == "moe":
        if not any(config.moe_layers):
            return []
        p = plan_moe(T, config.hidden_size, torch.device("cuda"))
        e, inter, k = config.n_routed_experts, config.moe_intermediate_size, config.num_experts_per_tok
        slots = -(-T // p.block_m) + min(T * k, e) - (1 if p.shared_side else 0)
        side = [dict(launch="shared gate|up+swiglu", grid=(-(-inter // p.side_block_n),), stream="second",
                     block=(p.block_m, p.side_block_n, p.block_k)),
                dict(launch="shared down", grid=(-(-config.hidden_size // (2 * p.side_block_n)),), stream="second",
                     block=(p.block_m, 2 * p.side_block_n, p.block_k))] if p.shared_side else []
        launches = [*side, dict(launch="router_rows" if p.router_rows else "router_logits",
                         grid=(-(-e // p.router_block_e), p.router_split),
                         block=(p.block_t, p.router_block_e, p.router_block_k), warps=p.router_warps),
                    *([dict(launch="topk+group", grid=(1,), block_t=p.block_t, block_m=p.block_m)] if p.topk_group
                      else [dict(launch="topk", grid=(T,)),
                            dict(launch="group", grid=(1,), block_t=p.block_t, block_m=p.block_m)]),
                    dict(launch="gate|up+swiglu", grid=(slots, -(-inter // p.gate_up_block_n)),
                         block=(p.block_m, p.gate_up_block_n, p.block_k), stages=p.num_stages, warps=p.num_warps,
                         products="fp16" if p.half else "bf16"),
                    dict(launch="down", grid=(slots, -(-config.hidden_size // p.down_block_n)),
                         block=(p.block_m, p.down_block_n, p.block_k), stages=p.down_stages or p.num_stages,
                         warps=p.num_warps),
                    dict(launch="combine", grid=(T, -(-config.hidden_size // p.combine_block_n)))]
        return [{**launch, "pdl": True} for launch in launches] if p.pdl else launches
    if stage == "logits_head":
        shape, b = w["lm_head.weight"]
        return [_linear("lm_head", T, [("lm_head", shape, b)], sms, **LOGITS_CHOICES[choice])]
    raise ValueError(f"unknown stage {stage!r}")


def describe(config: Glm5NextConfig, policy: Policy, tokens: list[int], sms: int = H200_SMS) -> list[dict]:
    """Rows of (stage, tokens, choice, and one launch's parameters), per token count in stage order."""
    w = _weights(config)
    rows = []
    for T in tokens:
        for stage in STAGES:
            choice = policy(stage, T)
            if choice is None:
                rows.append(dict(stage=stage, tokens=T, choice="stock"))
                continue
            rows += [dict(stage=stage, tokens=T, choice=choice, **launch)
                     for launch in stage_launches(w, config, stage, choice, T, sms)]
    return rows


def merge_equal_choices(tables: dict, config: Glm5NextConfig, sms: int = H200_SMS) -> dict:
    """`tables` (stage -> {tokens: choice}) with every choice replaced by the first of its stage's choices
    (`STAGES` order) whose launches at that token count are equal to its own: two choices that launch the
    same kernels with the same parameters are one, and the timing noise between them is no reason to ship
    either name."""
    w = _weights(config)
    out = {}
    for stage, table in tables.items():
        out[stage] = {}
        for tokens, choice in table.items():
            if choice in (None, "stock") or stage not in STAGES:
                out[stage][tokens] = choice
                continue
            T = int(tokens)
            mine = stage_launches(w, config, stage, choice, T, sms)
            out[stage][tokens] = next(c for c in STAGES[stage]
                                      if c == choice or stage_launches(w, config, stage, c, T, sms) == mine)
    return out


def format_rows(rows: list[dict]) -> list[str]:
    """One line per launch: stage, tokens, choice, launch, then its parameters."""
    lines = []
    for r in rows:
        head = f"{r['stage']:14s} T={r['tokens']:<3d} {r['choice']:16s}"
        if "launch" not in r:
            lines.append(head + " (stock module)")
            continue
        params = " ".join(f"{k}={v}" for k, v in r.items() if k not in ("stage", "tokens", "choice", "launch"))
        lines.append(f"{head} {r['launch']:28s} {params}")
    return lines
