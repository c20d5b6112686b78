"""The MoE router's two forms, same process, same inputs: split-K products (`router_logits_kernel`, fp32
`tl.dot`) and the row form (`router_rows_kernel`: each program holds its [experts, K] tile of the router
in registers and reduces it against each token's row), at several tiles; and the top-k kernel at 4, 2
and 1 warps. Router copies are rotated past the L2 (4.7 MB each); every time is
the median of CUDA-graph replays. The logits of both forms are checked against an fp64 product, the
selected experts against each other.

    python benchmarks/moe_routing_ab.py [--tokens 1,8,64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import triton

from glm5next.bench.floor import capture, measure_read_bandwidth, time_replays
from glm5next.kernels.moe import plan_moe
from glm5next.kernels.moe.routing import router_logits_kernel, router_rows_kernel, topk_kernel

E, D, TOP_K = 288, 4096, 8
COPIES = 16


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def median_us(fn, calls: int) -> float:
    graph = capture(fn)
    return statistics.median(time_replays(graph, 30, 3)) * 1e3 / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,8,64")
    args = ap.parse_args()
    dev = torch.device("cuda")
    bw = measure_read_bandwidth(dev)["bytes_per_s"]
    log(f"{torch.cuda.get_device_name(dev)}; read bandwidth {bw / 1e12:.2f} TB/s; router {E} x {D} fp32, "
        f"{COPIES} copies rotated")
    gen = torch.Generator(device=dev).manual_seed(0)
    routers = [torch.randn(E, D, generator=gen, device=dev) * D**-0.5 for _ in range(COPIES)]
    bias = torch.randn(E, generator=gen, device=dev) * 0.01
    floor_us = E * D * 4 / bw * 1e6
    for t in (int(x) for x in args.tokens.split(",")):
        x = torch.randn(t, D, generator=gen, device=dev).to(torch.bfloat16)
        plan = plan_moe(64, D, dev)  # the split-K products' tiles
        k_split = triton.cdiv(triton.cdiv(D, plan.router_split), plan.router_block_k) * plan.router_block_k
        split = triton.cdiv(D, k_split)
        parts = [torch.empty(split, t, E, device=dev) for _ in range(COPIES)]

        def production():
            for w, part in zip(routers, parts):
                router_logits_kernel[(triton.cdiv(E, plan.router_block_e), split)](
                    x, w, part, t, E, D, x.stride(0), k_split,
                    BLOCK_T=max(16, triton.next_power_of_2(t)), BLOCK_E=plan.router_block_e,
                    BLOCK_K=plan.router_block_k)

        forms = {"products": (production, parts)}
        for block_e, rsplit in ((16, 16), (32, 16), (32, 32), (64, 32), (16, 32)):
            ks = D // rsplit
            rparts = [torch.empty(rsplit, t, E, device=dev) for _ in range(COPIES)]

            def rows(block_e=block_e, rsplit=rsplit, ks=ks, rparts=rparts, warps=4):
                for w, part in zip(routers, rparts):
                    router_rows_kernel[(triton.cdiv(E, block_e), rsplit)](
                        x, w, part, t, E, D, x.stride(0), ks, BLOCK_E=block_e,
                        BLOCK_K=triton.next_power_of_2(ks), num_warps=warps)

            forms[f"rows e{block_e} s{rsplit}"] = (rows, rparts)
            forms[f"rows e{block_e} s{rsplit} 8w"] = (lambda f=rows: f(warps=8), rparts)
        want = x.double() @ routers[0].double().t()
        line = []
        for name, (fn, out) in forms.items():
            out[0].fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            err = float((out[0].double().sum(0) - want).abs().max())
            line.append(f"{name} {median_us(fn, COPIES):.1f} (err {err:.1e})")
        log(f"T={t}: router floor {floor_us:.1f} us | " + " | ".join(line))
        # top-k at 4 / 2 / 1 warps on the production partials
        ids = torch.empty(t, TOP_K, dtype=torch.int32, device=dev)
        wts = torch.empty(t, TOP_K, device=dev)
        res = []
        for warps in (4, 2, 1):
            def topk(warps=warps):
                topk_kernel[(t,)](parts[0], bias, ids, ids, wts, t, E, 2.5, 1e-20, S=split, TOP_K=TOP_K, TOP_K_PAD=8,
                                  NORM=True, HAS_SLOTS=False, BLOCK_E=triton.next_power_of_2(E), num_warps=warps)
            topk()
            torch.cuda.synchronize()
            first = ids.clone()
            res.append(f"{warps}w {median_us(topk, 1):.1f}")
            assert torch.equal(first, ids)
        log(f"T={t}: topk " + " | ".join(res))


if __name__ == "__main__":
    main()
