"""The MoE stage against its floor and its peers, one MoE layer of GLM-5.3-Flash at real shapes
(random weights in the checkpoint's dtypes, 288 FP8 experts of width 2048, top-8, one shared expert).

Per token count: the bytes the layer must read (router, every distinct expert the routing touched,
the shared expert, activations) over the read bandwidth measured in this process; the stage's launch
plan and plan variants; the stock module (graph-safe path, as a captured step runs it); and
`torch._grouped_mm` over bf16 copies of the same experts with the stock router (what transformers'
grouped experts path does). Every time is the median of CUDA-graph replays, each graph holding the
layer over `--rotate` different inputs so routing varies between calls. Accuracy: the stage's and the
stock module's bf16 outputs against the fp32 reference, relative to its largest value.

    python benchmarks/moe_stage.py [--tokens 1,2,4,8,16,32,64] [--variants] [--profile] [--out moe.json]

`benchmarks/stage_tables.py --moe moe.json --policy FILE` writes the run's `moe` table into a policy file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from glm5next.bench.floor import capture, measure_read_bandwidth, time_replays
from glm5next.bench.slice import build_slice_model, slice_config
from glm5next.config import ROUTER_NORM_EPS
from glm5next.kernels.moe import ExpertWeights, moe_forward, moe_reference, plan_moe, route
from glm5next.model.mlp import clamped_swiglu
from glm5next.checkpoint.fp8 import dequantize_fp8
from profile_step import profile_graph

VARIANTS = {
    "router_split": [8, 32],
    "router_block_e": [16, 64],
    "router_block_k": [32, 128, 256],
    "block_k": [64],
    "block_m": [16, 32, 64],
    "gate_up_block_n": [32, 64, 128],
    "down_block_n": [32, 64, 128],
    "num_stages": [2, 3, 4, 5],
    "down_stages": [3, 4],
    "num_warps": [2, 8],
    "half": [False],
    "topk_group": [True, False],
    "pdl": [True, False],
    "shared_side": [True, False],
}
"""Single-field changes to the default plan that `--variants` times at every token count."""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def median_us(fn, calls: int, replays: int = 30) -> float:
    graph = capture(fn)
    us = statistics.median(time_replays(graph, replays, 3)) * 1e3 / calls
    del graph
    return us


class GroupedMmPeer:
    """The stock router, then `torch._grouped_mm` over bf16 copies of every expert (gate|up stacked,
    then down), the routing weights, the index-add combine and the stock shared expert."""

    def __init__(self, moe) -> None:
        ex = moe.experts
        e, i, d = ex.gate_proj.shape
        self.moe, self.e, self.i = moe, e, i
        # Linear layout [E, N, K], passed transposed: mat_b [E, K, N] with K contiguous.
        self.gate_up = torch.empty(e, 2 * i, d, dtype=torch.bfloat16, device=ex.gate_proj.device)
        self.down = torch.empty(e, d, i, dtype=torch.bfloat16, device=ex.gate_proj.device)
        for k in range(e):
            self.gate_up[k, :i] = dequantize_fp8(ex.gate_proj[k], ex.gate_proj_scale_inv[k], torch.bfloat16)
            self.gate_up[k, i:] = dequantize_fp8(ex.up_proj[k], ex.up_proj_scale_inv[k], torch.bfloat16)
            self.down[k] = dequantize_fp8(ex.down_proj[k], ex.down_proj_scale_inv[k], torch.bfloat16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ids, w = self.moe.gate(x)
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(self.e, dtype=torch.int32, device=x.device).index_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        tok = order // k
        gu = torch._grouped_mm(x[tok], self.gate_up.transpose(1, 2), offs=offs)
        h = clamped_swiglu(gu[:, : self.i], gu[:, self.i:], self.moe.experts.swiglu_limit)
        y = torch._grouped_mm(h, self.down.transpose(1, 2), offs=offs).float() * w.reshape(-1)[order, None]
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device).index_add_(0, tok, y)
        return out.to(x.dtype) + self.moe.shared_experts(x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64")
    ap.add_argument("--rotate", type=int, default=4, help="different inputs per graph")
    ap.add_argument("--variants", action="store_true", help="time single-field plan variants too")
    ap.add_argument("--fields", default=",".join(VARIANTS), help="the plan fields --variants varies")
    ap.add_argument("--plans", default="", help="with --variants, also these several-field plans, e.g. "
                    "'gate_up_block_n=128,topk_group=1;gate_up_block_n=32,down_block_n=32'")
    ap.add_argument("--profile", action="store_true", help="the stage's kernels one by one (torch.profiler)")
    ap.add_argument("--no-peer", action="store_true", help="skip the grouped_mm peer (14.5 GB of bf16 copies)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--small", action="store_true", help="the slice's small widths (a dry run of this script)")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    dev = torch.device(args.device)
    tokens = [int(t) for t in args.tokens.split(",")]
    config = slice_config(num_layers=4, small=args.small)  # layer 3 is the first MoE layer
    log("building layers 0-3 of the slice")
    model = build_slice_model(config, dev)
    moe = model.layers[3].mlp
    w = ExpertWeights.of(moe)
    expert_bytes = sum(t.numel() * t.element_size() for t in (w.gate[0], w.up[0], w.down[0], w.gate_scale[0],
                                                                w.up_scale[0], w.down_scale[0]))
    router_bytes = w.router.numel() * 4 + w.bias.numel() * 4
    bw = measure_read_bandwidth(dev)["bytes_per_s"]
    log(f"read bandwidth {bw / 1e12:.2f} TB/s; one expert {expert_bytes / 1e6:.1f} MB")
    peer = None if args.no_peer else GroupedMmPeer(moe)
    top_k, scale, limit = moe.gate.top_k, moe.gate.routed_scaling_factor, moe.experts.swiglu_limit
    gen = torch.Generator(device=dev).manual_seed(0)
    result = {"gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__, "bandwidth": bw,
              "date": time.strftime("%Y-%m-%d"), "rows": []}
    for m in tokens:
        xs = [torch.randn(m, config.hidden_size, generator=gen, device=dev).to(torch.bfloat16)
              for _ in range(args.rotate)]
        slots = torch.arange(m, device=dev)
        plan = plan_moe(m, config.hidden_size, dev)
        touched = [int(torch.unique(route(x, w, top_k, scale, True, ROUTER_NORM_EPS, plan, slots).ids).numel())
                   for x in xs]  # distinct routed experts
        nbytes = statistics.mean(router_bytes + (n + 1) * expert_bytes + 2 * x.numel() * 2 for n, x in zip(touched, xs))
        floor_us = nbytes / bw * 1e6
        outs = [torch.empty_like(x) for x in xs]

        side = torch.cuda.Stream(dev) if dev.type == "cuda" else None  # plans with the shared expert beside

        def stage(plan=plan):
            for x, o in zip(xs, outs):
                moe_forward(x, w, top_k, scale, True, ROUTER_NORM_EPS, limit, plan, slots, out=o, side=side)

        row = {"tokens": m, "experts_touched": statistics.mean(touched), "bytes": nbytes, "floor_us": floor_us,
               "plan": plan.describe()}
        row["stage_us"] = median_us(stage, args.rotate)
        row["stage_bw_fraction"] = floor_us / row["stage_us"]
        if args.profile:
            graph = capture(stage)
            row["stage_kernels"] = {name: v["us"] / args.rotate
                                    for name, v in profile_graph(graph)["top_kernels"].items()}
            del graph
            log(f"M={m} stage kernels (us per layer): " + ", ".join(
                f"{name.split('_kernel')[0]} {us:.1f}" for name, us in row["stage_kernels"].items()))
        row["stock_us"] = median_us(lambda: [moe(x, graph_safe=True) for x in xs], args.rotate)
        if peer is not None:
            try:
                row["grouped_mm_us"] = median_us(lambda: [peer(x) for x in xs], args.rotate)
            except Exception as e:  # noqa: BLE001 - the peer's limits are part of the result
                row["grouped_mm_error"] = f"{type(e).__name__}: {e}"
        want = moe_reference(xs[0].float(), w, top_k, scale, True, ROUTER_NORM_EPS, limit, slots)
        stage()
        den = want.abs().max()
        row["stage_rel_err"] = float((outs[0].float() - want).abs().max() / den)
        row["stock_rel_err"] = float((moe(xs[0], graph_safe=True).float() - want).abs().max() / den)
        if args.variants:
            row["variants"], row["variant_rel_err"] = {}, {}

            def try_variant(name, fields):
                """Time one plan variant and check its output against the reference (NaN-filled first)."""
                try:  # (a plan the shapes refuse is reported as such)
                    alt = plan_moe(m, config.hidden_size, dev, **fields)
                    outs[0].fill_(float("nan"))
                    stage(alt)
                    row["variant_rel_err"][name] = float((outs[0].float() - want).abs().max() / den)
                    row["variants"][name] = median_us(lambda: stage(alt), args.rotate)
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
                    row["variants"][name] = f"{type(e).__name__}: {str(e)[:100]}"
            for field, values in VARIANTS.items():
                if field not in args.fields.split(","):
                    continue
                for v in values:
                    if getattr(plan, field) == v or (field == "block_m" and v > max(16, m)):
                        continue
                    try_variant(f"{field}={v}", {field: v})
            for combo in filter(None, args.plans.split(";")):
                try_variant(combo, {f: int(v) for f, v in (kv.split("=") for kv in combo.split(","))})
        result["rows"].append(row)
        peer_txt = f"{row['grouped_mm_us']:.1f}" if "grouped_mm_us" in row else row.get("grouped_mm_error", "-")[:60]
        log(f"M={m}: experts {row['experts_touched']:.1f}, floor {floor_us:.1f} us, stage {row['stage_us']:.1f} us "
            f"({100 * row['stage_bw_fraction']:.1f} %), stock {row['stock_us']:.1f} us, grouped_mm {peer_txt}; "
            f"rel err stage {row['stage_rel_err']:.2e} stock {row['stock_rel_err']:.2e}")
        if args.variants:
            log("   " + "  ".join(f"{k} {v:.1f} (err {row['variant_rel_err'][k]:.1e})" if isinstance(v, float)
                                 else f"{k} {v}" for k, v in row["variants"].items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
