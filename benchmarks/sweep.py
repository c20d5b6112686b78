"""Launch-variant sweep of the skinny projections and the fused boundary at the slice's real shapes.

`python -m benchmarks.sweep --out sweep.json` times every variant in `VARIANTS` (keyword
overrides of the skinny entry points) on each FP8 projection shape of a DSA layer, the dense MLP
and the shared expert, and the boundary's (block_t, chunk) tilings, each through CUDA-graph replays
over weight copies that together exceed the L2 four times. It informs `plan_launch`'s and the
boundary plan's defaults; the stage-level numbers come from `glm5next bench --mode specialized`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from glm5next.checkpoint.fp8 import quantize_fp8_blocks
from glm5next.config import MHC_POST_MULT
from glm5next.kernels import boundary as boundary_kernels
from glm5next.kernels import linear as linear_plans
from glm5next.kernels.boundary import mhc_boundary, mhc_last
from glm5next.kernels.linear import gate_up_swiglu, skinny_linear, skinny_linear_multi
from glm5next.kernels.linear import kernel as linear_kernel
from glm5next.bench.floor import capture, measure_read_bandwidth, time_replays
from glm5next.bench.specialized import format_targets
from glm5next.bench.stages import ROTATE_BYTES

VARIANTS = {
    "heuristic": {},
    "bk256": dict(block_k=256),
    "bn128": dict(block_n=128),
    "bk256-bn128": dict(block_k=256, block_n=128),
    "split-2x": dict(split_factor=2),
    "split-half": dict(split_factor=0.5),
    "fp16": dict(half=True),
    "bf16": dict(half=False),
    "x16": dict(x16=True),
    "x16-bn128": dict(x16=True, block_n=128),
    "fp16-x16": dict(half=True, x16=True),
    "fp16-convert": dict(half=True, x16="convert"),
    "pdl": dict(pdl=True),
    "pdl-split-half": dict(pdl=True, split_factor=0.5),
    "pdl-split-2x": dict(pdl=True, split_factor=2),
    "pdl-no-prefetch": dict(pdl=True),
    "pdl-prefetch-8mb": dict(pdl=True),
    "pdl-late": dict(pdl="late"),
    "bn32": dict(block_n=32),
    "bn16": dict(block_n=16),
    **{f"split-{k}": dict(split_k=k) for k in (1, 2, 3, 4, 5, 6, 7, 8, 11, 16)},
    "warps-8": dict(num_warps=8),
    **{f"stages-{k}": dict(num_stages=k) for k in (2, 3, 4)},
}
"""Keyword overrides of the skinny kernels; "heuristic" is the default launch, "fp16"/"bf16" force the
product type at every row count (FP8 weights only: skipped for BF16 cases), "x16" gives the products an
fp16 copy of x made beforehand (FP8 cases only), "fp16-x16" fp16 products from such a copy at every row
count, "fp16-convert" the same with the copy made inside the timed graph before each call, "pdl*" launch as
programmatic dependents (the weight prefetch capped by `SETTINGS`; "pdl-late" releases the next launch only
after the products), "bn*" narrower or wider output tiles, "split-N" exactly N K splits, "warps-8" 8 warps
per program, "stages-N" N pipeline stages."""
SETTINGS = {
    "pdl-no-prefetch": (linear_kernel, "PREFETCH_BYTES", 0),
    "pdl-prefetch-8mb": (linear_kernel, "PREFETCH_BYTES", 8 << 20),
}
"""Variants that also change a module setting while they are captured: (module, name, value)."""


def _with(mod, name: str, value, fn):
    """`fn` with `mod.name` set to `value` during each call (a graph captures what the call launches)."""
    def call(*args):
        old = getattr(mod, name)
        setattr(mod, name, value)
        try:
            return fn(*args)
        finally:
            setattr(mod, name, old)
    return call


def _setting(variant: str, fn):
    """`fn` with the variant's module setting (if any) in force during the call."""
    return _with(*SETTINGS[variant], fn) if variant in SETTINGS else fn


SHAPES = {
    # name: (list of [N, K] weights in one call, gated, storage)
    "kda_group": ([(8192, 4096)] * 3 + [(64, 4096), (128, 4096), (128, 4096)], False, "bf16"),
    "kda_o_proj": ([(4096, 8192)], False, "bf16"),
    "dsa_group": ([(1536, 4096), (576, 4096), (128, 4096)], False, "fp8"),
    "dsa_q_b": ([(20480, 1536)], False, "fp8"),
    "dsa_o_proj": ([(4096, 16384)], False, "fp8"),
    "dense_gate_up": ([(12288, 4096)], True, "fp8"),
    "dense_down": ([(4096, 12288)], False, "fp8"),
    "shared_gate_up": ([(2048, 4096)], True, "fp8"),
    "shared_down": ([(4096, 2048)], False, "fp8"),
}


def _weight(n: int, k: int, device, storage: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    w = torch.randn(n, k, device=device)
    if storage == "bf16":
        return (w * 0.02).to(torch.bfloat16), None
    return quantize_fp8_blocks(w)


def shape_weights(name: str, device):
    """Random weights of the `SHAPES` case `name`: ([(w, scale_inv) per projection], the up weights of a
    gated case or None)."""
    shapes, gated, storage = SHAPES[name]
    ws = [_weight(n, k, device, storage) for n, k in shapes]
    return ws, [_weight(n, k, device, storage) for n, k in shapes] if gated else None


def project(x, ws, ups, **kw):
    """The skinny entry point of a `SHAPES` case: the gated gate|up (clamp 10), the grouped call or one
    projection, with launch overrides `kw`."""
    if ups is not None:
        return gate_up_swiglu(x, *ws[0], *ups[0], 10.0, **kw)
    if len(ws) > 1:
        return skinny_linear_multi(x, ws, **kw)
    return skinny_linear(x, *ws[0], **kw)


def _time(fn, calls: int, replays: int) -> float:
    graph = capture(fn)
    return statistics.median(time_replays(graph, replays, 2)) * 1e3 / calls


def sweep_linear(device, m_values, bandwidth: float, replays: int, variants=None, cases=None,
                 resident: bool = False) -> list[dict]:
    """Each case and variant at each row count: µs per call over a graph of calls on rotated weights (past
    L2), or with `resident` on one instance called as often (its weights stay in L2: what the launch takes
    when its bytes need not come from HBM)."""
    rows = []
    for name, (shapes, gated, storage) in SHAPES.items():
        if cases is not None and name not in cases:
            continue
        per = sum(n * k for n, k in shapes) * (2 if gated else 1) * (2 if storage == "bf16" else 1)
        copies = max(1, -(-ROTATE_BYTES // per))
        insts = [shape_weights(name, device)] * copies if resident else [
            shape_weights(name, device) for _ in range(copies)]
        for m in m_values:
            x = torch.randn(m, shapes[0][1], device=device).to(torch.bfloat16) * 0.1
            x16 = x.to(torch.float16)  # for the "x16" variants, made once outside the timed graph
            for variant, kw in VARIANTS.items():
                if variants is not None and variant not in variants:
                    continue
                if storage == "bf16" and ("half" in kw or "x16" in kw):
                    continue
                convert = kw.get("x16") == "convert"
                if kw.get("x16"):
                    kw = dict(kw, x16=x16)

                def run(kw=kw, insts=insts, x=x, convert=convert):
                    for ws, ups in insts:
                        project(x, ws, ups, **(dict(kw, x16=x.to(torch.float16)) if convert else kw))

                try:
                    us = _time(_setting(variant, run), len(insts), replays)
                except Exception as e:  # a variant that fails to compile here is reported, not fatal
                    print(f"{name} M={m} {variant}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    torch.cuda.synchronize()
                    continue
                frac = per / (us * 1e-6) / bandwidth
                rows.append(dict(case=name, m=m, variant=variant, us=us, bytes=per, bw_fraction=frac,
                                 resident=resident))
                print(f"{name:15s} M={m:2d} {variant:20s} {us:8.1f} us {100 * frac:5.1f} %"
                      + (" (weights in L2)" if resident else ""), flush=True)
        insts.clear()
        torch.cuda.empty_cache()
    return rows


@triton.jit
def _read_probe(w_ptr, out_ptr, K, ITERS, SPLIT, BN: tl.constexpr, BK: tl.constexpr, WIDEN: tl.constexpr,
                TMA: tl.constexpr, STAGES: tl.constexpr):
    """Streams [BN, BK] tiles of an FP8 [N, K] weight over this program's K range and sums them: as
    raw bytes (WIDEN False: the load path alone) or widened to bf16 then fp32 (the conversion too);
    with TMA `w_ptr` is a tensor descriptor of [BN, BK] blocks (bulk copies instead of thread loads)."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_n * BN + tl.arange(0, BN)
    if WIDEN:
        acc = tl.zeros([BN, BK], dtype=tl.float32)
    else:
        acc = tl.zeros([BN, BK], dtype=tl.int32)
    for i in tl.range(ITERS, num_stages=STAGES):  # a plain loop is not pipelined without a dot
        k0 = (pid_k * ITERS + i) * BK
        if TMA:
            t = w_ptr.load([pid_n * BN, k0])
        else:
            t = tl.load(w_ptr + rows[:, None] * K + k0 + tl.arange(0, BK)[None, :])
        if WIDEN:
            acc += t.to(tl.bfloat16).to(tl.float32)
        else:
            acc += t.to(tl.int32)
    tl.store(out_ptr + pid_n * SPLIT + pid_k, tl.sum(tl.sum(acc, axis=1), axis=0).to(tl.float32))


def probe_reads(device, bandwidth: float, replays: int) -> list[dict]:
    """The read ceiling of FP8 tiles in a Triton loop, without (bytes) and with the bf16 widening, by
    thread loads and (BK <= 128) by tensor-descriptor bulk copies."""
    rows = []
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    for n, k in ((12288, 4096), (4096, 12288), (2048, 4096)):
        copies = max(1, -(-ROTATE_BYTES // (n * k)))
        ws = [torch.randint(-100, 100, (n, k), device=device, dtype=torch.int8).view(torch.float8_e4m3fn)
              for _ in range(copies)]
        for bn, bk in ((64, 128), (128, 128), (32, 256), (16, 512)):
            k_iters = k // bk
            split = max(1, min(k_iters, -(-2 * sms // (n // bn))))
            while k_iters % split:
                split -= 1
            out = torch.empty(n // bn * split, device=device)
            for widen in (False, True):
                for tma in (False, True) if bk <= 128 else (False,):
                    srcs = [w if widen else w.view(torch.uint8) for w in ws]
                    if tma:
                        srcs = [TensorDescriptor.from_tensor(w, [bn, bk]) for w in srcs]

                    def run(bn=bn, bk=bk, widen=widen, split=split, tma=tma, srcs=srcs):
                        for src in srcs:
                            _read_probe[(n // bn, split)](src, out, k, k_iters // split, split, BN=bn, BK=bk,
                                                          WIDEN=widen, TMA=tma, STAGES=4, num_warps=4)
                    us = _time(run, len(ws), replays)
                    frac = n * k / (us * 1e-6) / bandwidth
                    name = f"bn{bn}-bk{bk}-{'widen' if widen else 'bytes'}{'-tma' if tma else ''}"
                    rows.append(dict(case=f"probe_{n}x{k}", m=0, variant=name, us=us, bytes=n * k, bw_fraction=frac))
                    print(f"probe {n}x{k} {name}: {us:7.1f} us {100 * frac:5.1f} %", flush=True)
    return rows


BOUNDARY_D, BOUNDARY_N = 4096, 4
"""The slice's hidden size and number of mHC streams."""
BOUNDARY_KW = dict(hc_eps=1e-6, rms_eps=1e-5, norm_eps=1e-5, post_mult=MHC_POST_MULT)
"""The boundary's epsilons and post multiplier (Sinkhorn's iteration count is each caller's)."""


def boundary_mixer(device):
    """(fn, base, scale, norm weight) of one random mHC mixer and the next sublayer's RMSNorm."""
    D, n = BOUNDARY_D, BOUNDARY_N
    w = (2 + n) * n
    return (torch.randn(w, n * D, device=device) * 0.015, torch.randn(w, device=device) * 0.5,
            torch.rand(3, device=device) + 0.5, torch.ones(D, device=device, dtype=torch.bfloat16))


def boundary_state(T: int, device):
    """(out, streams, post, comb) of T tokens entering a boundary: the sublayer output and the streams."""
    D, n = BOUNDARY_D, BOUNDARY_N
    return (torch.randn(T, D, device=device).to(torch.bfloat16), torch.randn(T, n, D, device=device).to(torch.bfloat16),
            torch.rand(T, n, device=device) * 2, torch.full((T, n, n), 1.0 / n, device=device))


def sweep_boundary(device, t_values, replays: int, block_ts=(1, 2, 4), chunks=(32, 64, 128, 256, 512),
                   warps=(4,), deferred=(False,)) -> list[dict]:
    """The boundary's tilings at each token count, 64 launches in a row (`deferred` True: each takes
    its comb as pending and leaves its own so, the "fused-deferred" choice)."""
    D, n = BOUNDARY_D, BOUNDARY_N
    rows = []
    copies = 64
    mixers = [boundary_mixer(device) for _ in range(copies)]
    kw = dict(BOUNDARY_KW, sinkhorn_iters=20)
    for T in t_values:
        out, streams, post, comb = boundary_state(T, device)
        bufs = [torch.empty(T, n, D, device=device, dtype=torch.bfloat16), torch.empty(T, n, device=device),
                torch.empty(T, n, n, device=device), torch.empty(T, D, device=device, dtype=torch.bfloat16)]
        for block_t in block_ts:
            if block_t > T:
                continue
            for chunk, nw, defer in itertools.product(chunks, warps, deferred):
                def run(block_t=block_t, chunk=chunk, defer=defer):
                    for mx in mixers:
                        mhc_boundary(out, streams, post, comb, *mx, **kw, new_streams=bufs[0], new_post=bufs[1],
                                     new_comb=bufs[2], x=bufs[3], block_t=block_t, chunk=chunk,
                                     defer_sinkhorn=defer, comb_pending=defer)
                label = f"bt={block_t} chunk={chunk:3d}" + (f" warps={nw}" if nw != 4 else "") + (
                    " deferred" if defer else "")
                fn = _with(boundary_kernels, "NUM_WARPS", nw, run)
                try:
                    us = _time(fn, copies, replays)
                except Exception as e:
                    print(f"boundary T={T} {label}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    torch.cuda.synchronize()
                    continue
                variant = f"bt{block_t}-c{chunk}{f'-w{nw}' if nw != 4 else ''}{'-deferred' if defer else ''}"
                rows.append(dict(case="boundary", m=T, variant=variant, us=us))
                print(f"boundary        T={T:2d} {label:32s} {us:8.2f} us", flush=True)
    return rows


@triton.jit
def _empty(x_ptr):
    pass


def boundary_parts(device, t_values, replays: int) -> list[dict]:
    """Where the boundary's time goes, with the default tiling: the whole boundary, the same with one
    Sinkhorn iteration (the other 19 are the difference), as a programmatic dependent launch (each copy
    prefetching its mixer while the one before finishes), the last layer's variant (hc_post, the mean and the final norm: the chunk phase without the mixer
    GEMV, and a finisher without Sinkhorn or collapse) and an empty launch (the graph's cost per kernel)."""
    D, n = BOUNDARY_D, BOUNDARY_N
    copies = 64
    mixers = [boundary_mixer(device) for _ in range(copies)]
    kw = BOUNDARY_KW
    rows = []
    for T in t_values:
        out, streams, post, comb = boundary_state(T, device)
        bufs = dict(new_streams=torch.empty(T, n, D, device=device, dtype=torch.bfloat16),
                    new_post=torch.empty(T, n, device=device), new_comb=torch.empty(T, n, n, device=device),
                    x=torch.empty(T, D, device=device, dtype=torch.bfloat16))
        parts = {
            "boundary": lambda mx: mhc_boundary(out, streams, post, comb, *mx, **kw, sinkhorn_iters=20, **bufs,
                                                pdl=False),
            "sinkhorn-1": lambda mx: mhc_boundary(out, streams, post, comb, *mx, **kw, sinkhorn_iters=1, **bufs,
                                                  pdl=False),
            "pdl": lambda mx: mhc_boundary(out, streams, post, comb, *mx, **kw, sinkhorn_iters=20, **bufs, pdl=True),
            "last": lambda mx: mhc_last(out, streams, post, comb, mx[3], norm_eps=kw["norm_eps"], hidden=bufs["x"],
                                          pdl=False),
            "empty": lambda mx: _empty[(1,)](out),
        }
        for name, fn in parts.items():
            def run(fn=fn):
                for mx in mixers:
                    fn(mx)
            us = _time(run, copies, replays)
            rows.append(dict(case="boundary_parts", m=T, variant=name, us=us))
            print(f"boundary parts  T={T:2d} {name:12s} {us:8.2f} us", flush=True)
    return rows


GROUPS = ("kda_group", "dsa_group")
"""The cases that are one sublayer's projections of one input in one launch (the rest are single FP8 or BF16
projections, or a gated pair)."""


def launch_targets(rows: list[dict]) -> list[dict]:
    """The issue's launch-level H200 targets on the default launch ("heuristic", weights past L2): one
    sublayer's projections in one launch (`GROUPS`) and each FP8 block-scaled projection at >= 85 % of the read
    bandwidth measured in the same process; per case and row count, the fraction, the goal and whether it is met."""
    out = []
    for r in rows:
        if (r.get("variant") != "heuristic" or r.get("resident") or r.get("case") not in SHAPES
                or "bw_fraction" not in r):
            continue
        if r["case"] in GROUPS:
            name = "one sublayer's projections in one launch >= 85 % of the read bandwidth"
        elif SHAPES[r["case"]][2] == "fp8":
            name = "FP8 block-scaled projections >= 85 % of the read bandwidth"
        else:
            continue
        out.append(dict(target=name, case=r["case"], m=r["m"], at=f"{r['case']} M={r['m']}", value=r["bw_fraction"],
                        goal=0.85, met=r["bw_fraction"] >= 0.85))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", default="1,8,64")
    p.add_argument("--t", default="1,4,8,16")
    p.add_argument("--replays", type=int, default=10)
    p.add_argument("--skip-linear", action="store_true")
    p.add_argument("--skip-boundary", action="store_true")
    p.add_argument("--skip-probe", action="store_true")
    p.add_argument("--boundary-parts", action="store_true", help="time the boundary's parts at --t")
    p.add_argument("--block-t", default="1,2,4", help="the boundary tilings' token blocks")
    p.add_argument("--chunks", default="32,64,128,256,512", help="the boundary tilings' chunks of the hidden size")
    p.add_argument("--warps", default="4", help="the boundary tilings' warps per program")
    p.add_argument("--deferred", action="store_true",
                   help="time each boundary tiling also with Sinkhorn deferred (the 'fused-deferred' choice)")
    p.add_argument("--resident", action="store_true",
                   help="time the projections on one weight instance, so its bytes stay in L2")
    p.add_argument("--variants", default=None, help=f"comma-separated subset of {', '.join(VARIANTS)}")
    p.add_argument("--cases", default=None, help=f"comma-separated subset of {', '.join(SHAPES)}")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    variants = None if a.variants is None else a.variants.split(",")
    cases = None if a.cases is None else a.cases.split(",")
    for bad in sorted(set(variants or []) - set(VARIANTS)) + sorted(set(cases or []) - set(SHAPES)):
        p.error(f"unknown variant or case {bad!r}")
    device = torch.device("cuda")
    bw = measure_read_bandwidth(device)
    print(f"read bandwidth {bw['bytes_per_s'] / 1e12:.2f} TB/s", flush=True)
    rows = []
    if not a.skip_probe:
        rows += probe_reads(device, bw["bytes_per_s"], a.replays)
    if a.boundary_parts:
        rows += boundary_parts(device, [int(t) for t in a.t.split(",")], a.replays)
    if not a.skip_boundary:
        rows += sweep_boundary(device, [int(t) for t in a.t.split(",")], a.replays,
                               [int(b) for b in a.block_t.split(",")], [int(c) for c in a.chunks.split(",")],
                               [int(w) for w in a.warps.split(",")], (False, True) if a.deferred else (False,))
    if not a.skip_linear:
        rows += sweep_linear(device, [int(m) for m in a.m.split(",")], bw["bytes_per_s"], a.replays, variants, cases,
                             a.resident)
    targets = launch_targets(rows)
    if targets:
        print("\n".join(format_targets(targets, key="at")), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device), "bandwidth": bw, "rows": rows,
                       "targets": targets}, f, indent=1)


if __name__ == "__main__":
    main()
