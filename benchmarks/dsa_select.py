"""The DSA selection alone (`glm5next.kernels.dsa.select_pools`: the top-512 pools of each token's scores):
its launches in a CUDA graph at block tables of 8K and 128K tokens of context, 1 / 8 / 64 tokens, each
token seeing every pool of its table, for the plan's chunk and warps and their neighbours. Each variant's
selection is checked against the stock `top_pools` order (`select_pools_reference`) on the same scores.

    python benchmarks/dsa_select.py [--pools 2052,32772] [--tokens 1,8,64] [--scores ties,distinct] [--out F]

Run it on two packages (PYTHONPATH) in one device call to compare kernels; times are medians of 50 replays
of a graph holding `ROTATE` calls on different score rows (so the scores come from HBM, not L2).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import glm5next
from glm5next.bench.floor import capture, time_replays
from glm5next.kernels.dsa import plan_dsa, select_pools, select_pools_reference

KPOOL, TOPK, HEADS = 4, 512, 64
ROTATE = 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pools", default="2052,32772", help="block-table widths in pools (8K and 128K tokens)")
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--variants", default="select_warps=4;select_warps=8;select_warps=16;select_chunk=2048;"
                    "select_chunk=1024", help="plan overrides, ';' between variants")
    ap.add_argument("--scores", default="ties,distinct", help="ties: a run of equal scores across the cut in every "
                    "token; distinct: random scores alone")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    gen = torch.Generator(device=dev).manual_seed(0)
    package = os.path.relpath(os.path.dirname(glm5next.__file__))  # which package ran: the checkout's or a base
    result = {"gpu": torch.cuda.get_device_name(dev), "package": package, "date": time.strftime("%Y-%m-%d"),
              "rows": []}
    for kind, n_pools in ((k, int(x)) for k in args.scores.split(",") for x in args.pools.split(",")):
        for t in (int(x) for x in args.tokens.split(",")):
            scores = [torch.randn(t, n_pools, generator=gen, device=dev) for _ in range(ROTATE)]
            for s in scores if kind == "ties" else ():  # ties in every token: a run of equal scores across the cut
                s[:, : n_pools // 3] = s[:, :1]
            positions = torch.full((t,), n_pools * KPOOL - 1, dtype=torch.int64, device=dev)
            slots = torch.arange(t, dtype=torch.int64, device=dev)
            want = [select_pools_reference(s, positions, slots, KPOOL, TOPK)[0] for s in scores]
            row = {"scores": kind, "pools": n_pools, "tokens": t, "us": {}, "equal": {}}
            for variant in ["plan"] + [v for v in args.variants.split(";") if v]:
                over = {} if variant == "plan" else {k: int(v) for k, v in (kv.split("=") for kv in variant.split(","))}
                plan = plan_dsa(t, HEADS, n_pools, TOPK, KPOOL, sms, **over)
                outs = [torch.full((t, TOPK), -2, dtype=torch.int64, device=dev) for _ in scores]
                counts = [torch.empty(t, dtype=torch.int32, device=dev) for _ in scores]

                def run(plan=plan, outs=outs, counts=counts):
                    for s, o, c in zip(scores, outs, counts):
                        select_pools(s, positions, slots, KPOOL, TOPK, plan, out=o, count=c)

                graph = capture(run)
                ms = statistics.median(time_replays(graph, 50, 5))
                row["us"][variant] = round(ms * 1e3 / ROTATE, 2)
                row["equal"][variant] = all(torch.equal(o, w) for o, w in zip(outs, want))
            result["rows"].append(row)
            print(f"{kind} pools {n_pools} tokens {t}: " + "  ".join(
                f"{v} {us} us{'' if row['equal'][v] else ' (DIFFERS)'}" for v, us in row["us"].items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
