"""MoE prefill: the grouped expert kernels over prompt chunks (`glm5next.kernels.moe.moe_prefill`, routed
and shared experts) at real shapes, one MoE layer of the slice, against a cuBLAS bf16 GEMM of the same
FLOPs and `torch._grouped_mm` over bf16 copies of the experts, for several launch plans; also the decode
kernels (`experts_forward`, the weight tile the right operand of each product) over the same row tiles,
the form prefill used before `kernels/moe/prefill.py`, and the experiment of `moe_prefill_tma.py` (every
operand a TMA box).

    python benchmarks/moe_prefill.py [--tokens 2048,8192] [--no-peer] [--out moe-prefill.json]

Times are medians of 7 CUDA-event timings of eager calls (prefill is not captured); the router is not timed
(its choice is made once per token count). FLOPs: tokens x (top-k + 1) x 3 products of 2 x D x I.
Accuracy: each plan's output against the production plan's, relative to its largest value, and its RMS
error against the same kernels in fp32 (activations fp32, products in fp32), relative to that output's RMS.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from glm5next.bench.slice import build_slice_model, slice_config
from glm5next.kernels.moe import (MAX_TOKENS, PREFILL_CHUNK, ExpertWeights, MoePlan, PrefillPlan, experts_forward,
                                  group_rows, moe_prefill, prefill_plan)
from kda_prefill import log, median_ms
from moe_prefill_tma import VARIANTS as TMA_VARIANTS
from moe_prefill_tma import experts as tma_experts
from moe_stage import GroupedMmPeer

PLANS = {  # name: PrefillPlan(block_m, block_n, down_block_n, block_k, warps, stages, half)
    "m64 n64/64 k128 w4 s3 fp16": PrefillPlan(64, 64, 64, 128, 4, 3, True),
    "m64 n64/64 k128 w4 s4 fp16": PrefillPlan(64, 64, 64, 128, 4, 4, True),
    "m64 n32/64 k128 w4 s3 fp16": PrefillPlan(64, 32, 64, 128, 4, 3, True),
    "m128 n64/64 k128 w8 s3 fp16": PrefillPlan(128, 64, 64, 128, 8, 3, True),
    "m128 n64/64 k128 w4 s3 fp16": PrefillPlan(128, 64, 64, 128, 4, 3, True),
    "m64 n128/128 k128 w8 s3 fp16": PrefillPlan(64, 128, 128, 128, 8, 3, True),
}
"""Measured before (H100, 2026-12-06, `-moe-prefill-s37*.json`): 128 x 128 tiles, BLOCK_K 64, 32-row tiles and
bf16 products all slower; here the shipped plan's neighbours and 128-row tiles with 64 columns (whose two
fp32 accumulators fit the registers). s46: 64 x 64 with 8 warps (BLOCK_K 64 or 128) and the weights times
their block scales before the products lost too (docs/decisions.md)."""
BEFORE = MoePlan(MAX_TOKENS, 32, 1, 64, 64, 64, 128, 128, 8, 3, 1024)
"""The decode kernels' plan prefill ran on before (row tiles of 64, bf16 products)."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="2048,8192")
    ap.add_argument("--no-peer", action="store_true", help="skip the grouped_mm peer (14.5 GB of bf16 copies)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    config = slice_config(num_layers=4)  # layer 3 is the first MoE layer
    model = build_slice_model(config, dev)
    moe = model.layers[3].mlp
    w = ExpertWeights.of(moe)
    limit = moe.experts.swiglu_limit
    e, inter, d = w.gate.shape
    k = config.num_experts_per_tok
    peer = None if args.no_peer else GroupedMmPeer(moe)
    production = prefill_plan(dev)
    result = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "production": production.describe(), "rows": []}
    gen = torch.Generator(device=dev).manual_seed(0)
    for t in (int(x) for x in args.tokens.split(",")):
        x = (torch.randn(t, d, generator=gen, device=dev) * 0.5).to(torch.bfloat16)
        with torch.no_grad():
            ids, weights = moe.gate(x)
        flops = t * (k + 1) * 3 * 2 * d * inter
        a = torch.randn(t * (k + 1), d, device=dev, dtype=torch.bfloat16)
        b1 = torch.randn(d, 2 * inter, device=dev, dtype=torch.bfloat16)
        b2 = torch.randn(inter, d, device=dev, dtype=torch.bfloat16)
        h = torch.empty(t * (k + 1), inter, device=dev, dtype=torch.bfloat16)
        cublas_ms = median_ms(lambda: (torch.matmul(a, b1), torch.matmul(h, b2)), 7)
        row = {"tokens": t, "tflop": flops / 1e12, "cublas_bf16_ms": cublas_ms, "plans": {}}

        def chunked(block_m, run, like):
            """`run(rows, their routing, out rows)` over chunks of at most PREFILL_CHUNK tokens, as moe_prefill
            cuts them: [T, D] like `like`."""
            out = torch.empty_like(like)
            for a in range(0, t, PREFILL_CHUNK):
                rows = slice(a, min(t, a + PREFILL_CHUNK))
                run(rows, group_rows(ids[rows], weights[rows], e, block_m), out[rows])
            return out

        def before(xin=x):
            return chunked(BEFORE.block_m, lambda s, r, o: experts_forward(xin[s], w, r, limit, BEFORE, out=o), xin)

        want = before()
        den = want.float().abs().max()
        exact = before(x.float())
        forms = {"decode kernels (before)": before}
        for name, plan in PLANS.items():
            forms[name] = lambda plan=plan: moe_prefill(x, ids, weights, w, limit, plan)
        for name, cfg in TMA_VARIANTS.items():
            forms[name] = lambda cfg=cfg: chunked(
                cfg[0], lambda s, r, o: o.copy_(tma_experts(x[s], w, r, limit, *cfg)), x)
        for name, fn in forms.items():
            try:
                ms = median_ms(fn, 7)
                got = fn().float()
                err = float((got - want.float()).abs().max() / den)
                rms = float((got - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt())
                row["plans"][name] = {"ms": ms, "of_cublas": cublas_ms / ms, "err_vs_before": err, "rms_vs_fp32": rms}
                log(f"T={t} {name}: {ms:.2f} ms, {cublas_ms / ms:.2f} of cuBLAS ({cublas_ms:.2f} ms), vs before {err:.1e}, "
                    f"RMS vs fp32 {rms:.1e}")
            except Exception as exc:  # noqa: BLE001 - a plan the kernels refuse is part of the result
                row["plans"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                log(f"T={t} {name}: {row['plans'][name]['error']}")
        if peer is not None:
            with torch.no_grad():
                row["grouped_mm_ms"] = median_ms(lambda: peer(x), 7)
            log(f"T={t} grouped_mm peer (router included): {row['grouped_mm_ms']:.2f} ms")
        result["rows"].append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
