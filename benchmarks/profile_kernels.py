"""One launch of each kernel worth a hardware profile, at the slice's real shapes, for Nsight Compute.

    ncu --clock-control none --set full -k regex:'skinny|mhc' -o REPORT python -m benchmarks.profile_kernels

Each case runs twice (the first call compiles and allocates the split-K counters; both launches are
profiled, the second is the one to read). The profiler replays every launch in isolation with the
caches flushed, so its durations include the launch's ramp but not the overlap of a CUDA graph:
read them for where the time goes (stall reasons, memory throughput), not as the benchmark's times.
`--cases` picks a subset of `CASES`.
"""

from __future__ import annotations

import argparse

import torch

from glm5next.kernels.boundary import mhc_boundary
from benchmarks.sweep import BOUNDARY_KW, SHAPES, VARIANTS, boundary_mixer, boundary_state, project, shape_weights

CASES = ("dsa_group:1", "dsa_group:16", "dense_gate_up:1", "dense_down:1", "dsa_o_proj:1", "boundary:1", "boundary:8")
"""`name:rows` of the profiled launches: a projection of `sweep.SHAPES` at that many rows, or the boundary at
that many tokens (a plain launch: the profiler serialises kernels, so a programmatic one gains nothing)."""


def _projection(name: str, m: int, device, variant: str = "heuristic"):
    shapes, _, storage = SHAPES[name]
    if storage != "fp8":
        raise ValueError(f"{name}: only the FP8 cases are profiled")
    ws, ups = shape_weights(name, device)
    x = torch.randn(m, shapes[0][1], device=device).to(torch.bfloat16) * 0.1
    return lambda: project(x, ws, ups, **VARIANTS[variant])


def _boundary(T: int, device):
    state, mixer = boundary_state(T, device), boundary_mixer(device)
    return lambda: mhc_boundary(*state, *mixer, **BOUNDARY_KW, sinkhorn_iters=20, pdl=False)


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
