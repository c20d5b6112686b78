"""Experiment: the MoE's down launch reading the routing and prefetching its weights before it waits.

At one token the shipped plan chains its launches as programmatic dependents (`MoePlan.pdl`): each launch
releases the next as it starts, and the next waits for it before reading anything the step made. Down's
programs can therefore not know their expert until gate|up has finished, and its 75 MB start streaming
only then (ncu, s46: gate|up at 76 % of DRAM bandwidth in 0.55 waves, down at 68 %: fills and tails). Here
gate|up releases down only after its own wait, when the routing is complete, so each down program reads its
slot's expert at once and asks L2 for its weight tile before it waits for gate|up's h: down's bytes stream
in gate|up's tail. The products, their order and the combine are the shipped ones: the bits must be equal.

    python benchmarks/moe_early_down.py        # the interpreter against moe_forward (CPU, no PDL there)

On a GPU, `benchmarks/moe_stage.py --early-down` times it beside the shipped plan at one token.
"""

from __future__ import annotations

import os

if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import triton
import triton.language as tl

from glm5next.kernels import pdl as _pdl
from glm5next.kernels.moe import ExpertWeights, MoePlan, _expert_buffers, _half, route
from glm5next.kernels.moe.experts import _prefetch_shared, combine_kernel, down_slot, expert_columns, gate_up_slot
from glm5next.kernels.pdl import launch_dependents, prefetch_l2, wait_previous


@triton.jit
def gate_up_kernel(x_ptr, wg_ptr, wu_ptr, sg_ptr, su_ptr, h_ptr, slot_expert_ptr, slot_start_ptr, slot_count_ptr,
                   rows_ptr, n_slots_ptr, shared_wg, shared_wu, shared_sg, shared_su, T, N, K, stride_x, limit,
                   TOP_K: tl.constexpr, HAS_SCALE: tl.constexpr, F32: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """The shipped gate|up (every slot), releasing the next launch after its wait instead of before."""
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    if PDL:
        if HAS_SCALE:
            if slot == 0:
                n_pf = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
                _prefetch_shared(wg_ptr, shared_wg, n_pf, N, K)
                _prefetch_shared(wu_ptr, shared_wu, n_pf, N, K)
        wait_previous()
        launch_dependents()  # the routing is complete: down may read it before its own wait
    if slot >= tl.load(n_slots_ptr):
        return
    gate_up_slot(x_ptr, wg_ptr, wu_ptr, sg_ptr, su_ptr, h_ptr, slot_expert_ptr, slot_start_ptr, slot_count_ptr,
                 rows_ptr, slot, pid_n, shared_wg, shared_wu, shared_sg, shared_su, T, N, K, stride_x, limit,
                 TOP_K, HAS_SCALE, F32, HALF, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def down_kernel(h_ptr, w_ptr, s_ptr, weights_ptr, y_ptr, slot_expert_ptr, slot_start_ptr, slot_count_ptr, rows_ptr,
                n_slots_ptr, shared_w, shared_s, T, N, K,
                TOP_K: tl.constexpr, HAS_SCALE: tl.constexpr, F32: tl.constexpr, HALF: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """The shipped down, each program asking L2 for its expert's weight tile before it waits for gate|up."""
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    n_slots = tl.load(n_slots_ptr)
    if PDL:
        launch_dependents()
        if HAS_SCALE:
            if slot < n_slots:
                e_pf = tl.load(slot_expert_ptr + slot)
                w_pf, _s, n_pf, _m = expert_columns(e_pf, pid_n, shared_w, shared_s, N, K, BLOCK_N)
                prefetch_l2(w_ptr + w_pf + n_pf.to(tl.int64) * K, K, (n_pf < N) & (K % 16 == 0))
        wait_previous()
    if slot >= n_slots:
        return
    down_slot(h_ptr, w_ptr, s_ptr, weights_ptr, y_ptr, slot_expert_ptr, slot_start_ptr, slot_count_ptr, rows_ptr,
              slot, pid_n, shared_w, shared_s, T, N, K, TOP_K, HAS_SCALE, F32, HALF, BLOCK_M, BLOCK_N, BLOCK_K)


def moe_early_down(x: torch.Tensor, w: ExpertWeights, top_k: int, scale: float, norm: bool, eps: float,
                   limit: float, plan: MoePlan, slots: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """`moe_forward` under `plan` (no shared expert beside the routing) with the two expert launches above."""
    if plan.shared_side:
        raise ValueError("the experiment runs the shared expert in the routed launches")
    t, d = x.shape
    n_inter = w.gate.shape[1]
    f32, half = _half(x, w, plan)
    offs = w.shared_offsets()
    on = plan.pdl and _pdl.enabled(x.device)
    pdl = {"launch_pdl": True} if on else {}
    r = route(x, w, top_k, scale, norm, eps, plan, slots)
    h, y = _expert_buffers(x, top_k, w, plan)
    consts = dict(TOP_K=top_k, HAS_SCALE=w.scaled, F32=f32, HALF=half, BLOCK_M=plan.block_m, BLOCK_K=plan.block_k,
                  PDL=on, num_warps=plan.num_warps, **pdl)
    gate_up_kernel[(r.max_slots, triton.cdiv(n_inter, plan.gate_up_block_n))](
        x, w.gate, w.up, w.gate_scale, w.up_scale, h, r.slot_expert, r.slot_start, r.slot_count, r.rows,
        r.n_slots, offs[0], offs[1], offs[3], offs[4], t, n_inter, d, x.stride(0), float(limit),
        BLOCK_N=plan.gate_up_block_n, num_stages=plan.num_stages, **consts)
    down_kernel[(r.max_slots, triton.cdiv(d, plan.down_block_n))](
        h, w.down, w.down_scale, r.weights, y, r.slot_expert, r.slot_start, r.slot_count, r.rows, r.n_slots,
        offs[2], offs[5], t, d, n_inter, BLOCK_N=plan.down_block_n, num_stages=plan.down_stages or plan.num_stages,
        **consts)
    combine_kernel[(t, triton.cdiv(d, plan.combine_block_n))](
        y, slots if slots is not None else y, out, t, d, out.stride(0), TOP_K=top_k, HAS_SLOTS=slots is not None,
        BLOCK_N=plan.combine_block_n, **({"PDL": True, "launch_pdl": True} if on else {}))
    return out


def main() -> None:
    from glm5next.bench.slice import build_slice_model, slice_config
    from glm5next.config import ROUTER_NORM_EPS
    from glm5next.kernels.moe import moe_forward, plan_moe
    moe = build_slice_model(slice_config(num_layers=4, small=True), torch.device("cpu")).layers[3].mlp
    w = ExpertWeights.of(moe)
    for tokens in (1, 3):
        x = torch.randn(tokens, w.gate.shape[2])
        slots = torch.arange(tokens)
        slots[-1] = -1 if tokens > 1 else 0  # a padded row
        plan = plan_moe(tokens, x.shape[1], x.device)
        args = (x, w, moe.gate.top_k, moe.gate.routed_scaling_factor, True, ROUTER_NORM_EPS, moe.experts.swiglu_limit,
                plan, slots)
        want = moe_forward(*args, out=torch.full_like(x, float("nan")))
        got = moe_early_down(*args, out=torch.full_like(x, float("nan")))
        print(f"{tokens} token(s): {'equal' if torch.equal(got, want) else 'DIFFERS'}")
        if not torch.equal(got, want):
            raise SystemExit("the experiment differs from moe_forward")


if __name__ == "__main__":
    main()
