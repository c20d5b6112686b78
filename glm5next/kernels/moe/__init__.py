"""The MoE layer of a step of up to 64 tokens in six launches (five where the plan has top-k and grouping in
one program): router logits (split-K), top-k (a program per token), grouping by expert (one program),
grouped gate|up with the clamped SwiGLU, grouped down with the routing weight, and the per-token combine.
Each expert's weights are read once per step for all the rows routed to it; the shared expert is one more
expert that every valid token routes to with weight 1. With `MoePlan.shared_side` the shared expert runs in
two launches of its own first, on a second stream where the caller gives one (a branch of a captured graph),
beside the routing; the routed launches skip its slot and the combine waits for it.

Every launch has a static grid (sized for the most experts a step can touch), reads its row counts
from the device and needs no host sync, so the whole layer is CUDA-graph safe after one eager call
compiles it. The output is deterministic: each token's experts are summed in a fixed order.

Prefill chunks (any number of tokens, eager) take the router's choice from the stock module, group the rows
by expert in PyTorch (`group_rows`: a slot per tile of rows) and run the prefill kernels (`prefill.py`) and
the same combine: `moe_prefill`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import triton

from .. import pdl as _pdl
from .experts import combine_kernel, down_kernel, gate_up_kernel, shared_down_kernel, shared_gate_up_kernel
from .prefill import down_rows_kernel, gate_up_rows_kernel
from .reference import moe_reference, route_reference
from .routing import group_kernel, router_logits_kernel, router_rows_kernel, topk_group_kernel, topk_kernel

__all__ = ["ExpertWeights", "MoePlan", "PrefillPlan", "Routing", "experts_forward", "group_rows", "moe_forward",
           "moe_prefill", "moe_reference", "plan_moe", "prefill_experts", "prefill_plan", "route", "route_reference",
           "shared_expert_beside"]

MAX_TOKENS = 64
"""Most tokens one call takes (the routing kernel holds the whole step in one program)."""
FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class ExpertWeights:
    """One MoE layer's weights as the kernels read them (views of the model's tensors, never copies):
    router `[E, D]` fp32 and its selection bias `[E]`; routed experts stacked, gate / up `[E, I, D]`,
    down `[E, D, I]`, FP8 with block scales `[E, ceil(N/128), ceil(K/128)]` or 16/32-bit with None; the
    shared expert's gate / up `[I, D]` and down `[D, I]` in the same storage type."""

    router: torch.Tensor
    bias: torch.Tensor
    gate: torch.Tensor
    gate_scale: torch.Tensor | None
    up: torch.Tensor
    up_scale: torch.Tensor | None
    down: torch.Tensor
    down_scale: torch.Tensor | None
    shared_gate: torch.Tensor
    shared_gate_scale: torch.Tensor | None
    shared_up: torch.Tensor
    shared_up_scale: torch.Tensor | None
    shared_down: torch.Tensor
    shared_down_scale: torch.Tensor | None

    def __post_init__(self) -> None:
        e, i, d = self.gate.shape
        want = {"gate": (e, i, d), "up": (e, i, d), "down": (e, d, i), "shared_gate": (i, d), "shared_up": (i, d),
                "shared_down": (d, i), "router": (e, d), "bias": (e,)}
        for name, shape in want.items():
            t = getattr(self, name)
            if tuple(t.shape) != shape:
                raise ValueError(f"MoE weights: {name} is {tuple(t.shape)}, expected {shape}")
            if not t.is_contiguous():
                raise ValueError(f"MoE weights: {name} must be contiguous")
        scaled = {n: getattr(self, n + "_scale") is not None for n in ("gate", "up", "down", "shared_gate",
                                                                       "shared_up", "shared_down")}
        if len(set(scaled.values())) != 1 or len({getattr(self, n).dtype for n in scaled}) != 1:
            raise ValueError("MoE weights: routed and shared experts must share one storage type")
        if self.scaled != (self.gate.dtype == FP8):
            raise ValueError("MoE weights: FP8 weights need block scales, other weights none")

    @property
    def scaled(self) -> bool:
        return self.gate_scale is not None

    @classmethod
    def of(cls, moe) -> "ExpertWeights":
        """The weights of a `glm5next.model.moe.MoE` module."""
        ex, sh = moe.experts, moe.shared_experts
        return cls(moe.gate.weight, moe.gate.e_score_correction_bias,
                   ex.gate_proj, ex.gate_proj_scale_inv, ex.up_proj, ex.up_proj_scale_inv,
                   ex.down_proj, ex.down_proj_scale_inv,
                   sh.gate_proj.weight, sh.gate_proj.weight_scale_inv, sh.up_proj.weight, sh.up_proj.weight_scale_inv,
                   sh.down_proj.weight, sh.down_proj.weight_scale_inv)

    def shared_offsets(self) -> tuple[int, int, int, int, int, int]:
        """Element offsets of the shared expert's gate, up, down weights and their scales from the stacked
        routed tensors' bases (the kernels address both from one pointer)."""
        pairs = [(self.gate, self.shared_gate), (self.up, self.shared_up), (self.down, self.shared_down),
                 (self.gate_scale, self.shared_gate_scale), (self.up_scale, self.shared_up_scale),
                 (self.down_scale, self.shared_down_scale)]
        out = []
        for base, t in pairs:
            if base is None:
                out.append(0)
                continue
            delta = t.data_ptr() - base.data_ptr()
            if delta % base.element_size():
                raise ValueError("MoE weights: the shared expert is not element-aligned with the routed experts")
            out.append(delta // base.element_size())
        return tuple(out)


@dataclass(frozen=True)
class MoePlan:
    """Launch parameters of one MoE call (a deterministic function of the shapes and the device)."""

    block_t: int
    """Tokens padded to a power of two of at least 16 (the router's and the routing kernel's rows)."""
    router_block_e: int
    router_split: int
    router_block_k: int
    block_m: int
    """Rows of one expert per product (an expert with more loops over blocks of them)."""
    gate_up_block_n: int
    down_block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    combine_block_n: int
    half: bool = False
    """FP8 experts only: products in fp16 (activations and the SwiGLU output rounded to fp16) instead of bf16."""
    router_rows: bool = False
    """The router logits in the row form (`router_rows_kernel`: a program's whole tile of the router at once,
    one token at a time) instead of split-K products."""
    router_warps: int = 4
    down_stages: int | None = None
    """Pipeline stages of the down launch (None: `num_stages`, as gate|up)."""
    topk_group: bool = False
    """Top-k and grouping in one program (`topk_group_kernel`: one launch less, the tokens one after another)
    instead of a top-k program per token and then the grouping's."""
    pdl: bool = False
    """Every launch a programmatic dependent of the one before (`kernels/pdl.py`; CUDA on SM90+ only): the
    router's weights and the shared expert's fetched into L2 while the kernels before still run."""
    shared_side: bool = False
    """The shared expert in launches of its own (`shared_gate_up_kernel`, `shared_down_kernel`) issued before
    the routing, on the caller's second stream where it gives one (a branch of a captured graph): its bytes
    stream beside the routing's latency-bound launches; the routed launches skip its slot. Steps of at most
    block_m tokens."""
    side_block_n: int = 32
    """Columns a program of the shared expert's own gate|up launch (its down takes twice as many)."""

    def describe(self) -> str:
        router = "row form" if self.router_rows else "split-K products"
        return (f"router {router}, {self.router_split} splits x {self.router_block_e} experts; experts BLOCK_M {self.block_m}, "
                f"gate|up BLOCK_N {self.gate_up_block_n}, down BLOCK_N {self.down_block_n}, BLOCK_K {self.block_k}, "
                f"{self.num_warps} warps, {self.num_stages} stages (down {self.down_stages or self.num_stages})"
                + (", fp16 products" if self.half else "")
                + (", top-k and grouping in one program" if self.topk_group else "")
                + (f", the shared expert beside the routing ({self.side_block_n} columns a program)"
                   if self.shared_side else "")
                + (", programmatic-dependent launches" if self.pdl else ""))


def plan_moe(tokens: int, hidden: int, device: torch.device, **overrides) -> MoePlan:
    """The launch plan for `tokens` rows; `overrides` replace single fields (the tuner's variants)."""
    if not 1 <= tokens <= MAX_TOKENS:
        raise ValueError(f"the MoE kernels take 1-{MAX_TOKENS} tokens, got {tokens}")
    block_t = max(16, triton.next_power_of_2(tokens))
    if device.type == "cpu":  # the interpreter pays per program and per operation: few, large programs
        plan = MoePlan(block_t, 64, 2, 64, 16, 64, 64, 128, 4, 1, 256, router_rows=tokens <= 8)
    elif tokens <= 8:
        # The row-form router (16 experts x 128 channels a program, 8 warps): 3.7 / 6.6 us at 1 / 8 tokens
        # against 12.2 / 13.1 for the split-K products; at 64 tokens 31 against 28 (H100, 2026-12-06,
        # bench/results/2026-12-06-h100-moe-routing-ab.log). Three pipeline stages for gate|up at one token
        # (the stage: 119 against 128 us a layer for four, -moe-variants-2.json), four for down (its launch
        # took 31.5 us at four, 36.7 at three in the step profiles) and for both from 8 tokens on.
        # gate|up columns a program: 128 at one token (the stage 107.6 against 116.0 us: 144 programs in one wave
        # against 288 in 1.09 of the H100's), 32 at two (169.0 against 181.0), 64 above (4 and 8 tokens: 32 and
        # 128 lost); top-k with the grouping in one program at one token (1.5-1.9 us faster in three draws, a
        # launch less; 22 us slower at 8 tokens). H100, 2026-12-07,
        # bench/results/2026-12-07-h100-moe-plans-s41-*.json. Programmatic-dependent launches at one token only
        # (the router's and the shared expert's weights fetched into L2 while the kernels before run): the stage
        # 102.8 against 104.9 us, the step 2.188 against 2.205 ms; from 4 tokens on they lose (the stage +5 us
        # at 4 and 8, +34 at 32; the step +35 / +209 us at 8 / 64: the early programs hold SM slots). H100,
        # 2026-12-07, bench/results/2026-12-07-h100-moe-pdl-s43.json, -profile-s43.json, -profile-2077be2-s43.json.
        # The shared expert on a second stream beside the routing at 2-4 tokens, 32 columns a program (64 down):
        # 166.9-168.7 against 177.4-177.8 us at two tokens, 291.9-292.1 against 295.0-295.2 at four; at one
        # token it loses (107-111 against 102.7: the launches before it no longer overlap), at 8 and 16 it is
        # noise. H100, 2026-12-07, bench/results/2026-12-07-h100-moe-side-s45{,-2}.json.
        gate_up_n = {1: 128, 2: 32}.get(tokens, 64)
        plan = MoePlan(block_t, 16, -(-hidden // 128), 128, 16, gate_up_n, 64, 128, 4, 3 if tokens == 1 else 4, 1024,
                       half=True, router_rows=True, router_warps=8, down_stages=4, topk_group=tokens == 1,
                       pdl=tokens == 1, shared_side=2 <= tokens <= 4)
    else:  # fp16 products: 5-10 % faster than bf16 at 1-64 tokens on the H100 (e4m3 widens to fp16 natively);
        # 64 experts a router program: 9 us a layer faster than 32 at 1 and 8 tokens (H100, 2026-12-06)
        k_split = max(64, hidden // 16)
        plan = MoePlan(block_t, 64, -(-hidden // k_split), 64, 16, 64, 64, 128, 4, 4, 1024, half=True)
    plan = MoePlan(**{**plan.__dict__, **overrides})
    if plan.block_m > block_t:
        plan = MoePlan(**{**plan.__dict__, "block_m": block_t})
    if plan.shared_side and tokens > plan.block_m:
        raise ValueError(f"the shared expert beside the routing takes steps of at most block_m={plan.block_m} "
                         f"tokens, got {tokens}")
    return plan


@dataclass
class Routing:
    """A step's routing, on the device: ids / weights `[T, top_k]` (padded tokens -1 / 0), the slots
    (expert, first row, row count; the shared expert's expert -1), the rows (pair indices, see
    `routing.py`) and the number of slots in use."""

    ids: torch.Tensor
    weights: torch.Tensor
    slot_expert: torch.Tensor
    slot_start: torch.Tensor
    slot_count: torch.Tensor
    rows: torch.Tensor
    n_slots: torch.Tensor

    @property
    def max_slots(self) -> int:
        return self.slot_expert.shape[0]


def _pdl_args(plan: MoePlan, device: torch.device) -> dict:
    """The PDL constant and launch attribute of the plan's launches on `device` (none where it has no PDL)."""
    return {"PDL": True, "launch_pdl": True} if plan.pdl and _pdl.enabled(device) else {}


def route(x: torch.Tensor, w: ExpertWeights, top_k: int, scale: float, norm: bool, eps: float, plan: MoePlan,
          slots: torch.Tensor | None = None) -> Routing:
    """Router logits and routing of `x` [T, D], T <= 64, in three launches (two with `plan.topk_group`; rows
    with `slots` < 0 are padding)."""
    t, d = x.shape
    e = w.router.shape[0]
    if x.stride(1) != 1:
        raise ValueError("MoE input rows must be contiguous")
    dev = x.device
    k_split = triton.cdiv(triton.cdiv(d, plan.router_split), plan.router_block_k) * plan.router_block_k
    split = triton.cdiv(d, k_split)
    part = torch.empty(split, t, e, dtype=torch.float32, device=dev)
    pdl = _pdl_args(plan, dev)
    if plan.router_rows:
        router_rows_kernel[(triton.cdiv(e, plan.router_block_e), split)](
            x, w.router, part, t, e, d, x.stride(0), k_split, BLOCK_E=plan.router_block_e,
            BLOCK_K=triton.next_power_of_2(k_split), num_warps=plan.router_warps, **pdl)
    else:
        router_logits_kernel[(triton.cdiv(e, plan.router_block_e), split)](
            x, w.router, part, t, e, d, x.stride(0), k_split,
            BLOCK_T=plan.block_t, BLOCK_E=plan.router_block_e, BLOCK_K=plan.router_block_k,
            num_warps=plan.router_warps, **pdl)
    i32 = dict(dtype=torch.int32, device=dev)
    max_slots = triton.cdiv(t, plan.block_m) + min(t * top_k, e)
    r = Routing(torch.empty(t, top_k, **i32), torch.empty(t, top_k, dtype=torch.float32, device=dev),
                torch.empty(max_slots, **i32), torch.empty(max_slots, **i32), torch.empty(max_slots, **i32),
                torch.empty(t * top_k + t, **i32), torch.empty(1, **i32))
    slots_arg = slots if slots is not None else r.ids
    topk = dict(S=split, TOP_K=top_k, TOP_K_PAD=triton.next_power_of_2(top_k), NORM=norm, HAS_SLOTS=slots is not None,
                BLOCK_E=triton.next_power_of_2(e))
    group = dict(BLOCK_T=plan.block_t, SPAN=max(16, triton.next_power_of_2(t * top_k)), BLOCK_M=plan.block_m)
    if plan.topk_group:
        topk_group_kernel[(1,)](
            part, w.bias, slots_arg, r.ids, r.weights, r.slot_expert, r.slot_start, r.slot_count, r.rows, r.n_slots,
            t, e, float(scale), float(eps), **topk, **group, **pdl)
        return r
    topk_kernel[(t,)](part, w.bias, slots_arg, r.ids, r.weights, t, e, float(scale), float(eps), **topk, **pdl)
    group_kernel[(1,)](r.ids, slots_arg, r.slot_expert, r.slot_start, r.slot_count, r.rows, r.n_slots, t,
                       TOP_K=top_k, HAS_SLOTS=slots is not None, **group, **pdl)
    return r


def group_rows(ids: torch.Tensor, weights: torch.Tensor, num_experts: int, block_m: int) -> Routing:
    """The routing of chosen experts `ids` [T, k] (weights [T, k] fp32) for any T, in PyTorch: every row
    tile of at most `block_m` rows of one expert (the shared expert's first) its own slot, so programs never
    loop. No host sync: the slots are sized for the most tiles T tokens can make (`n_slots` on the device
    says how many are in use; the rest hold no rows)."""
    t, k = ids.shape
    dev = ids.device
    flat = ids.reshape(-1)
    counts = torch.cat([torch.full((1,), t, dtype=torch.int64, device=dev),
                        torch.zeros(num_experts, dtype=torch.int64, device=dev).index_add_(
                            0, flat, torch.ones_like(flat))])
    first = torch.cumsum(counts, 0) - counts
    tiles = (counts + block_m - 1) // block_m
    ends = torch.cumsum(tiles, 0)
    # The shared expert's tiles, then at most one partial tile per touched expert beside the full ones.
    most = -(-t // block_m) + t * k // block_m + min(num_experts, t * k)
    slot = torch.arange(most, device=dev)
    slot_of = torch.searchsorted(ends, slot, right=True).clamp_(max=num_experts)
    within = slot - (ends - tiles)[slot_of]
    start = first[slot_of] + within * block_m
    count = (counts[slot_of] - within * block_m).clamp_(0, block_m)
    rows = torch.cat([t * k + torch.arange(t, device=dev), torch.argsort(flat, stable=True)])
    i32 = dict(dtype=torch.int32)
    return Routing(ids.to(**i32), weights.float(), (slot_of - 1).to(**i32), start.to(**i32), count.to(**i32),
                   rows.to(**i32), ends[-1:].to(**i32))


def _half(x: torch.Tensor, w: ExpertWeights, plan: MoePlan) -> tuple[bool, bool]:
    """(fp32 products, fp16 products) for activations `x` and weights `w` under `plan`."""
    f32 = x.dtype == torch.float32 or x.device.type == "cpu"
    return f32, plan.half and w.scaled and not f32


def _expert_buffers(x: torch.Tensor, top_k: int, w: ExpertWeights, plan: MoePlan) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-pair SwiGLU outputs h [pairs, I] and expert outputs y [pairs, D] fp32 of a step."""
    t, d = x.shape
    pairs = t * top_k + t
    half = _half(x, w, plan)[1]
    return (torch.empty(pairs, w.gate.shape[1], dtype=torch.float16 if half else x.dtype, device=x.device),
            torch.empty(pairs, d, dtype=torch.float32, device=x.device))


def shared_expert_beside(x: torch.Tensor, w: ExpertWeights, top_k: int, limit: float, plan: MoePlan,
                         slots: torch.Tensor | None, h: torch.Tensor, y: torch.Tensor) -> None:
    """The shared expert's rows of h and y (`_expert_buffers`) in two launches that need no routing
    (`plan.shared_side`, at most block_m tokens), on the current stream."""
    t, d = x.shape
    n_inter = w.gate.shape[1]
    f32, half = _half(x, w, plan)
    offs = w.shared_offsets()
    consts = dict(TOP_K=top_k, HAS_SLOTS=slots is not None, HAS_SCALE=w.scaled, F32=f32, HALF=half, BLOCK_M=plan.block_m,
                  BLOCK_K=plan.block_k, num_warps=plan.num_warps)
    slots_arg = slots if slots is not None else y
    shared_gate_up_kernel[(triton.cdiv(n_inter, plan.side_block_n),)](
        x, w.gate, w.up, w.gate_scale, w.up_scale, h, slots_arg, offs[0], offs[1], offs[3], offs[4],
        t, n_inter, d, x.stride(0), float(limit), BLOCK_N=plan.side_block_n, num_stages=plan.num_stages, **consts)
    shared_down_kernel[(triton.cdiv(d, 2 * plan.side_block_n),)](
        h, w.down, w.down_scale, y, y, slots_arg, offs[2], offs[5], t, d, n_inter,
        BLOCK_N=2 * plan.side_block_n, num_stages=plan.down_stages or plan.num_stages, **consts)


def experts_forward(x: torch.Tensor, w: ExpertWeights, r: Routing, limit: float, plan: MoePlan,
                    slots: torch.Tensor | None = None, out: torch.Tensor | None = None,
                    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
                    join: torch.cuda.Stream | None = None) -> torch.Tensor:
    """The grouped experts of routing `r` over `x` [T, D] and the combine: [T, D] in x's dtype (0 for
    padded tokens, `slots` < 0). `shared`: the buffers h, y of `shared_expert_beside`, whose shared rows
    its launches fill (issued on stream `join`, which the combine waits for); the launches here then skip
    the shared expert's slot."""
    t, d = x.shape
    top_k = r.ids.shape[1]
    n_inter = w.gate.shape[1]
    dev = x.device
    f32, half = _half(x, w, plan)
    offs = w.shared_offsets()
    pdl = _pdl_args(plan, dev)
    first = 0 if shared is None else 1
    h, y = shared if shared is not None else _expert_buffers(x, top_k, w, plan)
    gate_up_kernel[(r.max_slots - first, triton.cdiv(n_inter, plan.gate_up_block_n))](
        x, w.gate, w.up, w.gate_scale, w.up_scale, h, r.slot_expert, r.slot_start, r.slot_count, r.rows,
        r.n_slots, offs[0], offs[1], offs[3], offs[4], t, n_inter, d, x.stride(0), float(limit), first,
        TOP_K=top_k, HAS_SCALE=w.scaled, F32=f32, HALF=half, BLOCK_M=plan.block_m, BLOCK_N=plan.gate_up_block_n,
        BLOCK_K=plan.block_k, num_warps=plan.num_warps, num_stages=plan.num_stages, **pdl)
    down_kernel[(r.max_slots - first, triton.cdiv(d, plan.down_block_n))](
        h, w.down, w.down_scale, r.weights, y, r.slot_expert, r.slot_start, r.slot_count, r.rows, r.n_slots,
        offs[2], offs[5], t, d, n_inter, first,
        TOP_K=top_k, HAS_SCALE=w.scaled, F32=f32, HALF=half, BLOCK_M=plan.block_m, BLOCK_N=plan.down_block_n,
        BLOCK_K=plan.block_k, num_warps=plan.num_warps, num_stages=plan.down_stages or plan.num_stages, **pdl)
    if out is None:
        out = torch.empty(t, d, dtype=x.dtype, device=dev)
    if join is not None:  # the shared expert's launches ran on another stream: the combine waits for them
        torch.cuda.current_stream(dev).wait_stream(join)
        pdl = {}
    combine_kernel[(t, triton.cdiv(d, plan.combine_block_n))](
        y, slots if slots is not None else y, out, t, d, out.stride(0),
        TOP_K=top_k, HAS_SLOTS=slots is not None, BLOCK_N=plan.combine_block_n, **pdl)
    return out


def moe_forward(x: torch.Tensor, w: ExpertWeights, top_k: int, scale: float, norm: bool, eps: float, limit: float,
                plan: MoePlan, slots: torch.Tensor | None = None, out: torch.Tensor | None = None,
                side: torch.cuda.Stream | None = None) -> torch.Tensor:
    """The MoE output [T, D] in x's dtype of `x` [T, D], T <= 64, in six launches: per token, its routed
    experts weighted plus the shared expert, summed in fp32 in a fixed order; 0 for padded tokens
    (`slots` < 0). With `plan.shared_side` the shared expert's two launches come first, on stream `side`
    where one is given (beside the routing; the combine waits for them)."""
    if not plan.shared_side:
        return experts_forward(x, w, route(x, w, top_k, scale, norm, eps, plan, slots), limit, plan, slots, out)
    shared = _expert_buffers(x, top_k, w, plan)  # on this stream, which frees them after the join
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        shared_expert_beside(x, w, top_k, limit, plan, slots, *shared)
    r = route(x, w, top_k, scale, norm, eps, plan, slots)
    return experts_forward(x, w, r, limit, plan, slots, out, shared, side)


PREFILL_CHUNK = 4096
"""Tokens one prefill call runs the experts over at a time (bounds the fp32 per-pair outputs: 9 x 16 KB a token)."""


@dataclass(frozen=True)
class PrefillPlan:
    """Launch parameters of the prefill experts (`prefill.py`)."""

    block_m: int
    """Rows of one expert a program (`group_rows` cuts every expert's rows into tiles of at most this many)."""
    block_n: int
    """Output columns a gate|up program (of gate and of up each)."""
    down_block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    half: bool
    """Products in fp16 (activations and the SwiGLU output rounded to fp16; FP8 weights widen exactly) instead
    of the activations' 16-bit type."""

    def __post_init__(self) -> None:
        for name in ("block_n", "down_block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or 128 % v:
                raise ValueError(f"prefill plan: {name} {v} must divide the 128-wide scale block (16-128), as the "
                                 "kernels read one scale per tile")

    def describe(self) -> str:
        return (f"tiles of {self.block_m} rows, gate|up BLOCK_N {self.block_n}, down BLOCK_N {self.down_block_n}, "
                f"BLOCK_K {self.block_k}, {self.num_warps} warps, {self.num_stages} stages"
                + (", fp16 products" if self.half else ""))


def prefill_plan(device: torch.device) -> PrefillPlan:
    """The launch plan of prefill chunks; the interpreter takes few, large programs.

    H100, one MoE layer of the slice (bench/results/2026-12-06-h100-moe-prefill-s37*.json): 5.53 / 17.37 ms at
    2048 / 8192 tokens, against 7.22 / 24.13 for the decode kernels over the same tiles (the form before) and
    7.59 / 13.75 for torch._grouped_mm over bf16 copies. fp16 products make the difference (bf16: 7.43 / 24.36;
    e4m3 widens to fp16 in one instruction); tiles of 128 or 32 rows, 8 warps with 128 columns, BLOCK_K 64
    were slower."""
    if device.type == "cpu":
        return PrefillPlan(64, 64, 64, 128, 4, 1, False)
    return PrefillPlan(64, 64, 64, 128, 4, 3, True)


def prefill_experts(x: torch.Tensor, w: ExpertWeights, r: Routing, limit: float, plan: PrefillPlan,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """The grouped experts of routing `r` (tiles of at most `plan.block_m` rows, one a slot: `group_rows`) over
    `x` [T, D] and the combine: [T, D] in x's dtype."""
    t, d = x.shape
    top_k = r.ids.shape[1]
    n_inter = w.gate.shape[1]
    dev = x.device
    f32 = x.dtype == torch.float32 or dev.type == "cpu"
    half = plan.half and not f32
    offs = w.shared_offsets()
    pairs = t * top_k + t
    h = torch.empty(pairs, n_inter, dtype=torch.float16 if half else x.dtype, device=dev)
    # fp16 products: the activations converted once here rather than by every program at every K step (the
    # same values: the kernel's conversion, hoisted).
    xin = x.to(torch.float16) if half else x
    consts = dict(TOP_K=top_k, HAS_SCALE=w.scaled, F32=f32, HALF=half, BLOCK_M=plan.block_m, BLOCK_K=plan.block_k,
                  num_warps=plan.num_warps, num_stages=plan.num_stages)
    gate_up_rows_kernel[(triton.cdiv(n_inter, plan.block_n), r.max_slots)](
        xin, w.gate, w.up, w.gate_scale, w.up_scale, h, r.slot_expert, r.slot_start, r.slot_count, r.rows,
        r.n_slots, offs[0], offs[1], offs[3], offs[4], t, n_inter, d, xin.stride(0), float(limit),
        BLOCK_N=plan.block_n, **consts)
    y = torch.empty(pairs, d, dtype=torch.float32, device=dev)
    down_rows_kernel[(triton.cdiv(d, plan.down_block_n), r.max_slots)](
        h, w.down, w.down_scale, r.weights, y, r.slot_expert, r.slot_start, r.slot_count, r.rows, r.n_slots,
        offs[2], offs[5], t, d, n_inter, BLOCK_N=plan.down_block_n, **consts)
    if out is None:
        out = torch.empty(t, d, dtype=x.dtype, device=dev)
    combine_kernel[(t, triton.cdiv(d, 1024))](y, y, out, t, d, out.stride(0), TOP_K=top_k, HAS_SLOTS=False,
                                             BLOCK_N=1024)
    return out


def moe_prefill(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: ExpertWeights, limit: float,
                plan: PrefillPlan | None = None) -> torch.Tensor:
    """The routed and shared experts over `x` [T, D] (any T) for the router's choice `ids` / `weights`
    [T, k]: [T, D] in x's dtype, each token's experts summed in fp32 in a fixed order (eager only)."""
    if plan is None:
        plan = prefill_plan(x.device)
    out = torch.empty_like(x)
    for a in range(0, x.shape[0], PREFILL_CHUNK):
        b = min(x.shape[0], a + PREFILL_CHUNK)
        r = group_rows(ids[a:b], weights[a:b], w.gate.shape[0], plan.block_m)
        prefill_experts(x[a:b], w, r, limit, plan, out=out[a:b])
    return out
