"""MoE prefill: the grouped expert kernels over prompt chunks (`glm5next.kernels.moe.moe_prefill`, routed
and shared experts) at real shapes, one MoE layer of the slice, against a cuBLAS bf16 GEMM of the same
FLOPs and `torch._grouped_mm` over bf16 copies of the experts, for several launch plans.

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
from glm5next.kernels.moe import MAX_TOKENS, ExpertWeights, MoePlan, moe_prefill, prefill_plan
from kda_prefill import log, median_ms
from moe_stage import GroupedMmPeer

PLANS = {  # name: (block_m, gate_up_block_n, down_block_n, block_k, warps, stages)
    "m64 n64/128 k128 w8 s3": (64, 64, 128, 128, 8, 3),
    "m128 n128/128 k64 w8 s3": (128, 128, 128, 64, 8, 3),
    "m128 n128/128 k64 w8 s4": (128, 128, 128, 64, 8, 4),
    "m64 n128/128 k128 w8 s3": (64, 128, 128, 128, 8, 3),
    "m64 n128/128 k64 w4 s4": (64, 128, 128, 64, 4, 4),
}


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
        want = moe_prefill(x, ids, weights, w, limit, production)
        den = want.float().abs().max()
        exact = moe_prefill(x.float(), ids, weights, w, limit, production)
        for name, (bm, gn, dn, bk, warps, stages) in PLANS.items():
            plan = MoePlan(MAX_TOKENS, 32, 1, 64, bm, gn, dn, bk, warps, stages, 1024)
            try:
                ms = median_ms(lambda: moe_prefill(x, ids, weights, w, limit, plan), 7)
                got = moe_prefill(x, ids, weights, w, limit, plan).float()
                err = float((got - want.float()).abs().max() / den)
                rms = float((got - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt())
                row["plans"][name] = {"ms": ms, "of_cublas": cublas_ms / ms, "err": err, "rms_vs_fp32": rms}
                log(f"T={t} {name}: {ms:.2f} ms, {cublas_ms / ms:.2f} of cuBLAS ({cublas_ms:.2f} ms), err {err:.1e}, "
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
