"""The mHC boundary kernel over prefill rows: launch plans (tokens per program, columns per chunk) at real
width against the default plan, which was tuned for decode steps of at most 64 tokens.

    python benchmarks/boundary_rows.py [--tokens 2048,8192] [--out boundary-rows.json]

Why: in the slice's 8192-token prefill (H100, bench/results/2026-12-06-h100-prefill-8k-s36.json) a boundary
over 2048 rows took 0.62 ms for ~0.16 GB of streams, a ~0.05 ms read-and-write. With two tokens a program,
each chunk program reads its chunk's columns of the mixer (24 rows of fp32) for two tokens only: 1.5 GB of
mixer reads a boundary at 2048 rows. More tokens a program divide that traffic (eight now: 0.43 ms).

Times are medians of CUDA-event timings of eager launches; every plan's outputs are compared with the
default plan's (new streams, post, comb and the normalised input).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from glm5next.config import MHC_POST_MULT
from glm5next.kernels import boundary
from kda_prefill import log, median_ms

PLANS = [(None, None), (2, 256), (8, 512), (32, 256)]
"""(tokens a program, columns a chunk); (None, None) is the default plan (8 x 256 past 64 rows). Measured before
(H100, 2026-12-06, bench/results/2026-12-06-h100-boundary-rows.log): 2 tokens 745-792 us at 2048 rows, 4 852,
8 434-506, 16 566; each plan compiles for ~30 s on a fresh machine."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="2048,8192")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    n, d = 4, 4096
    g = torch.Generator(device=dev).manual_seed(0)
    fn = torch.randn((2 + n) * n, n * d, generator=g, device=dev) * 0.02
    base = torch.randn((2 + n) * n, generator=g, device=dev) * 0.1
    scale = torch.rand(3, generator=g, device=dev) + 0.5
    norm_w = 1.0 + 0.1 * torch.randn(d, generator=g, device=dev)
    consts = dict(hc_eps=1e-6, rms_eps=1e-6, norm_eps=1e-6, sinkhorn_iters=20, post_mult=MHC_POST_MULT)
    result = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "rows": []}
    for t in (int(x) for x in args.tokens.split(",")):
        out = torch.randn(t, d, generator=g, device=dev).bfloat16()
        streams = torch.randn(t, n, d, generator=g, device=dev).bfloat16()
        post = torch.rand(t, n, generator=g, device=dev) * 2
        comb = torch.softmax(torch.randn(t, n, n, generator=g, device=dev), -1)
        bytes_moved = 2 * streams.numel() * 2 + 2 * out.numel() * 2
        row = {"tokens": t, "bytes": bytes_moved, "plans": {}}
        want = None
        for block_t, chunk in PLANS:
            name = "default" if block_t is None else f"{block_t} tokens x {chunk} columns"

            def launch():
                return boundary.mhc_boundary(out, streams, post, comb, fn, base, scale, norm_w, block_t=block_t,
                                             chunk=chunk, **consts)

            try:
                got = launch()
                ms = median_ms(launch, 9)
            except Exception as exc:  # noqa: BLE001 - a plan the kernel refuses is part of the result
                row["plans"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                log(f"T={t} {name}: {row['plans'][name]['error']}")
                continue
            if want is None:
                want = [x.float().clone() for x in got]
            err = max(float((a.float() - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in zip(got, want))
            row["plans"][name] = {"ms": ms, "tb_per_s": bytes_moved / ms / 1e9, "err_vs_default": err}
            log(f"T={t} {name}: {ms * 1e3:.1f} us, {bytes_moved / ms / 1e9:.2f} TB/s, err vs default {err:.1e}")
        result["rows"].append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
