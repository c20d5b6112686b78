"""Where a captured decode step of the slice spends its time, kernel by kernel: `torch.profiler` over
replays of the planned step's CUDA graph (and of the stock graph), kernels grouped by family.

    python benchmarks/profile_step.py [--tokens 1,8,64] [--policy FILE] [--stock] [--out profile.json]

Per token count: the step's replay time against its floor (the bytes the step reads, distinct experts
from the routing of an eager step, over the read bandwidth measured in this process), the number of kernels one replay launches, and per family
(by kernel name) the summed kernel time, its share of the kernel time and its launch count; every kernel's
time and launches in the JSON, under its full name.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from glm5next.bench.floor import floor_seconds, measure_read_bandwidth, record_routing, step_bytes, time_replays
from glm5next.bench.slice import build_slice_model, fill_context, make_cache, slice_config
from glm5next.bench.stock import _items
from glm5next.runtime.runner import Runner
from glm5next.specialized_decode import Policy, SpecializedDecode

FAMILIES = [
    ("moe (ours)", r"gate_up_kernel|gate_up_rows_kernel|down_kernel|down_rows_kernel|combine_kernel|topk_kernel|"
                   r"group_kernel|router_logits_kernel|router_rows_kernel"),
    ("dsa (ours)", r"indexer_inputs_kernel|index_scores_kernel|select_pools_kernel|head_product_kernel|attend_kernel|merge_splits_kernel|write_cache_kernel"),
    ("boundary (ours)", r"boundary|sinkhorn|mhc_kernel"),
    ("projections (ours)", r"skinny|linear_kernel|gate_up_swiglu|_linear|rms_norm_pair|producer|norm_cast"),
    ("gemm (cuBLAS)", r"gemm|gemv|cutlass|sm90_xmma|nvjet|splitKreduce"),
    ("kda prefill (ours)", r"prefill_inputs_kernel|gated_norm_kernel"),
    ("kda prefill (fla)", r"chunk_kda|chunk_gla|chunk_gated_delta|recompute_w_u|chunk_local_cumsum|kda_gate"),
    ("copy / dequantize", r"widen_kernel|copy|CatArrayBatched|to_copy|direct_copy|unrolled_elementwise"),
    ("sort / top-k / index", r"sort|topk|Sort|radix|index|gather|scatter|nonzero|cumsum|bitonic"),
    ("elementwise / reduce", r"elementwise|reduce|Reduce|softmax|norm"),
    ("kda (ours)", r"kda_decode"),
]


def family(name: str) -> str:
    for fam, pattern in FAMILIES:
        if re.search(pattern, name):
            return fam
    return "other"


def short_name(name: str) -> str:
    """A kernel's name without its return type, namespaces' anonymity and template or argument lists, for
    printing (e.g. `at::native::unrolled_elementwise_kernel`)."""
    name = name.removeprefix("void ").replace("(anonymous namespace)::", "")
    cut = min((i for i in (name.find("<"), name.find("(")) if i >= 0), default=len(name))
    return name[:cut]


def profile_graph(graph, replays: int = 3) -> dict:
    """Kernel time by family over `replays` replays, per replay."""
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    fams: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    names: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        for table, key in ((fams, family(ev.name)), (names, ev.name)):
            table[key][0] += us / replays
            table[key][1] += 1 / replays
    total = sum(v[0] for v in fams.values())
    return {"kernel_us": total, "kernels": round(sum(v[1] for v in fams.values())),
            "families": {k: {"us": v[0], "share": v[0] / total, "launches": round(v[1])}
                         for k, v in sorted(fams.items(), key=lambda kv: -kv[1][0])},
            "top_kernels": {k: {"us": v[0], "launches": round(v[1])}
                            for k, v in sorted(names.items(), key=lambda kv: -kv[1][0])}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--policy", default=None, help="policy file (default: the one shipped for this GPU)")
    ap.add_argument("--stock", action="store_true", help="profile the stock graph too")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    tokens = [int(t) for t in args.tokens.split(",")]
    config = slice_config(8)
    model = build_slice_model(config, dev)
    policy = Policy.from_file(args.policy) if args.policy else Policy.for_gpu(torch.cuda.get_device_name(dev), torch.cuda.get_device_capability(dev))
    cache = make_cache(config, tokens[-1], args.context, 16, model.embed_tokens.dtype, dev)
    blocks = fill_context(cache, tokens[-1], args.context)
    bw = measure_read_bandwidth(dev)["bytes_per_s"]
    floors = {}
    eager = Runner(model, cache, len(blocks[0]) * 16, tokens)
    for m in tokens:  # the floor: the bytes an eager step of this routing reads, over the read bandwidth
        items = _items(m, args.context, blocks, config.vocab_size, 0)
        routing = record_routing(model, lambda: eager.execute(items, m))
        floors[m] = floor_seconds(step_bytes(model, cache, routing, m, args.context)["total"], bw) * 1e3
    del eager
    result = {"gpu": torch.cuda.get_device_name(dev), "date": time.strftime("%Y-%m-%d"), "policy": repr(policy),
              "context": args.context, "bandwidth": bw, "rows": []}
    paths = [("planned", SpecializedDecode(model, policy, tokens))] + ([("stock", None)] if args.stock else [])
    for path, executor in paths:
        runner = Runner(model, cache, len(blocks[0]) * 16, tokens, executor)
        runner.capture()
        for m in tokens:
            runner.load_decode(_items(m, args.context, blocks, config.vocab_size, 0), m)
            graph = runner.graphs[m][0]
            ms = statistics.median(time_replays(graph, 20, 3))
            row = {"path": path, "tokens": m, "step_ms": ms, "floor_ms": floors[m], "over_floor": ms / floors[m],
                   **profile_graph(graph)}
            result["rows"].append(row)
            print(f"[{path}] M={m}: step {ms:.3f} ms, floor {floors[m]:.3f} ms ({ms / floors[m]:.1f}x), "
                  f"{row['kernels']} kernels, kernel time {row['kernel_us']:.0f} us", flush=True)
            for fam, v in row["families"].items():
                print(f"    {fam:22s} {v['us']:9.1f} us {100 * v['share']:5.1f} % {v['launches']:5d} launches")
            for name, v in list(row["top_kernels"].items())[:8]:
                print(f"      {v['us']:9.1f} us x{v['launches']:4d}  {short_name(name)}")
        del runner
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
