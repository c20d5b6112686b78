"""One launch of each kernel worth a hardware profile, at the slice's real shapes, for Nsight Compute.

    ncu --clock-control none --set full -k regex:'skinny|mhc' -o REPORT python -m glm5next.bench.profile_kernels

Each case runs twice (the first call compiles and allocates the split-K counters; both launches are
profiled, the second is the one to read). The profiler replays every launch in isolation with the
caches flushed, so its durations include the launch's ramp but not the overlap of a CUDA graph:
read them for where the time goes (stall reasons, memory throughput), not as the benchmark's times.
`--cases` picks a subset of `CASES`.
"""

from __future__ import annotations

import argparse

import torch

from ..checkpoint.fp8 import quantize_fp8_blocks
from ..config import MHC_POST_MULT
from ..kernels.boundary import mhc_boundary
from ..kernels.linear import gate_up_swiglu, skinny_linear, skinny_linear_multi
from .sweep import SHAPES, VARIANTS

CASES = ("dsa_group:1", "dsa_group:16", "dense_gate_up:1", "dense_down:1", "dsa_o_proj:1", "boundary:1", "boundary:8")
"""`name:rows` of the profiled launches: a projection of `sweep.SHAPES` at that many rows, or the boundary at
that many tokens (a plain launch: the profiler serialises kernels, so a programmatic one gains nothing)."""


def _projection(name: str, m: int, device, variant: str = "heuristic"):
    shapes, gated, storage = SHAPES[name]
    if storage != "fp8":
        raise ValueError(f"{name}: only the FP8 cases are profiled")
    ws = [quantize_fp8_blocks(torch.randn(n, k, device=device)) for n, k in shapes]
    ups = [quantize_fp8_blocks(torch.randn(n, k, device=device)) for n, k in shapes] if gated else None
    x = torch.randn(m, shapes[0][1], device=device).to(torch.bfloat16) * 0.1
    kw = VARIANTS[variant]
    if gated:
        return lambda: gate_up_swiglu(x, *ws[0], *ups[0], 10.0, **kw)
    if len(ws) > 1:
        return lambda: skinny_linear_multi(x, ws, **kw)
    return lambda: skinny_linear(x, *ws[0], **kw)


def _boundary(T: int, device):
    D, n = 4096, 4
    w = (2 + n) * n
    fn = torch.randn(w, n * D, device=device) * 0.015
    base, scale = torch.randn(w, device=device) * 0.5, torch.rand(3, device=device) + 0.5
    norm = torch.ones(D, device=device, dtype=torch.bfloat16)
    out = torch.randn(T, D, device=device).to(torch.bfloat16)
    streams = torch.randn(T, n, D, device=device).to(torch.bfloat16)
    post = torch.rand(T, n, device=device) * 2
    comb = torch.full((T, n, n), 1.0 / n, device=device)
    kw = dict(hc_eps=1e-6, rms_eps=1e-5, norm_eps=1e-5, sinkhorn_iters=20, post_mult=MHC_POST_MULT, pdl=False)
    return lambda: mhc_boundary(out, streams, post, comb, fn, base, scale, norm, **kw)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated name:rows")
    p.add_argument("--variant", default="heuristic", help="launch variant of the projections (sweep.VARIANTS)")
    a = p.parse_args(argv)
    if a.variant not in VARIANTS:
        p.error(f"unknown variant {a.variant!r}")
    device = torch.device("cuda")
    torch.manual_seed(0)
    for case in a.cases.split(","):
        name, _, rows = case.partition(":")
        if not rows.isdigit() or (name != "boundary" and name not in SHAPES):
            p.error(f"bad case {case!r}: want name:rows with name 'boundary' or one of {', '.join(SHAPES)}")
        fn = _boundary(int(rows), device) if name == "boundary" else _projection(name, int(rows), device, a.variant)
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        print(f"profiled {case}", flush=True)


if __name__ == "__main__":
    main()
