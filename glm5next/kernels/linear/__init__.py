"""Skinny projections for decode steps of 1-64 tokens: `x[M, K] @ dequant(W[N, K]).T`.

At such M a projection is memory-bound, so these kernels aim to read every weight byte once
at close to HBM bandwidth. Weights stay as the checkpoint stores them (BF16/fp32 `[N, K]`, or
FP8 e4m3 `[N, K]` with fp32 128x128 block scales) and are never copied or concatenated.

- `skinny_linear`: one projection, split-K when the output has too few tiles to fill the GPU.
- `skinny_linear_multi`: up to six projections of the same input in one launch (storage
  dtypes may differ per projection).
- `gate_up_swiglu`: `silu(min(g, limit)) * clamp(u, -limit, limit)` with both projections
  streamed by the same programs.

Launch parameters come from `plan_launch`, a deterministic function of the shapes, dtypes
and device (no autotuning: the kernels are captured in CUDA graphs). Callers may override
`split_k`, `block_n`, `split_factor` and a few more; `CANDIDATES` names the overrides worth timing
per call site.
Every entry point is CUDA-graph safe after one eager call (which compiles the kernel and
creates the split-K tile counters): no host syncs and only static-shape allocations.
"""

from __future__ import annotations

import torch
import triton

from .kernel import MAX_PROJECTIONS, LaunchPlan, launch, tile_counters
from .reference import gate_up_swiglu_reference, linear_multi_reference, linear_reference

__all__ = [
    "CANDIDATES", "LaunchPlan", "MAX_ROWS", "gate_up_swiglu", "gate_up_swiglu_reference", "linear_multi_reference",
    "linear_reference", "plan_launch", "reads_x16", "skinny_linear", "skinny_linear_multi", "tile_counters",
]

MAX_ROWS = 64
"""Most rows (tokens) one call takes."""
CPU_SMS = 4
"""SM count the heuristics assume on CPU (the Triton interpreter), so split-K is exercised on small shapes."""
CANDIDATES: dict[str, dict] = {
    "heuristic": dict(),
    "no-split": dict(split_k=1),
    "split-half": dict(split_factor=0.5),
    "split-2x": dict(split_factor=2),
    "block-n-32": dict(block_n=32),
    "block-n-128": dict(block_n=128),
    "block-k-256": dict(block_k=256),
    "fp16-products": dict(half=True),
    "bf16-products": dict(half=False),
    "pdl": dict(pdl=True),
    "pdl-late": dict(pdl="late"),
    "warps-8": dict(num_warps=8),
}
"""Launch parameters worth timing per call site (keyword overrides of every entry point). `split_factor`
scales the heuristic's split (rounded, at least 1); `block_k` 256 streams two FP8 scale blocks per step;
"fp16-products" / "bf16-products" multiply FP8 weights in fp16 / bf16 whatever the row count (see
`LaunchPlan.half`); "pdl" launches as a programmatic dependent that prefetches its weights into L2 (see
`LaunchPlan.pdl`), "pdl-late" the same letting the next kernel start only once its products are done
(`LaunchPlan.pdl_late`); "warps-8" runs 8 warps per program."""
_SMS: dict[int | None, int] = {}
_FLOAT = (torch.bfloat16, torch.float16, torch.float32)


def _sm_count(device: torch.device) -> int:
    if device.type == "cpu":
        return CPU_SMS
    if device.index not in _SMS:
        _SMS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device.index]


def plan_launch(M: int, ns: list[int], K: int, weight_bytes: int, device_type: str = "cuda", sms: int = 132,
                gated: bool = False, split_k: int | None = None, block_n: int | None = None,
                split_factor: float = 1, x_bytes: int = 2, widest_bytes: int | None = None,
                block_k: int | None = None, half: bool | None = None, pdl: bool | str | None = None,
                num_warps: int | None = None, num_stages: int | None = None, x16: bool = False) -> LaunchPlan:
    """Launch parameters for M rows against weights with output widths `ns` and depth K
    (`weight_bytes`: the smallest weight element size; `widest_bytes`: the largest, default the same).

    GPU: `tl.dot` with M padded to 16/32/64, BLOCK_K 128 (256 B of BF16 or 128 B of FP8 per weight
    row and step), BLOCK_N 64; split-K until about 2 programs per SM, keeping at least 4 K steps
    per split (so the pipeline fills) and the fp32 partial traffic within 1/4 of the weight bytes
    (partials mostly stay in L2), rounded down for BF16 weights (one wave), or for FP8 weights at up to
    16 rows about 3 programs per SM, rounded down; as many pipeline stages (2-5; at most 4 for FP8
    weights at up to 16 rows) as fit about 100 KB of shared memory, so two or more programs share an
    SM. FP8 weights meet 16-bit activations in fp16 products at BLOCK_M 16 (up to 16 rows; `half`
    None), where the H200 sweep measured them 1.3x faster than bf16 products, and at BLOCK_M 32 for
    weights of at least 24 Mi elements (gate and up counted both); ungated FP8 launches at 17-64 rows take
    them where an fp16 copy of x is given (`x16`: the caller has one; without, at 64 rows they were slower).
    Ungated FP8 weights against 16-bit activations at 17-64 rows split down to at most one wave, of 3
    programs per SM at 17-32 rows (BLOCK_M 32: 64 KB of shared memory and at most 168 registers a thread
    each) and of 2 at 33-64 rows (BLOCK_M 64: 96-112 KB each), with 128-column tiles at 33-64 rows where
    64-column ones alone would pass a wave; at 33-64 rows every FP8 call's split may also carry fp32 partials
    up to half the weight bytes (instead of a quarter). Where all weights are FP8 and the products fp16,
    the weight tiles come through tensor descriptors (`LaunchPlan.tma`) and a gated call takes half the
    split: the H200 sweep of 2026-12-04 measured the dense gate|up at 1-16 rows 37 -> 33 us, the other
    shapes equal or up to 4 % faster.
    CPU: the same rules with BLOCK_K 64, 4 "SMs" and 1 K step per split. `pdl` (None: False) asks for a
    programmatic dependent launch where the device has one (`LaunchPlan.pdl`); "late" does so with the next
    kernel released only after the products (`LaunchPlan.pdl_late`). `num_warps` (4 or 8) overrides the
    warps per program (default 4, 8 for gated calls at 64 rows); `num_stages` (2-5) the pipeline stages.
    """
    gpu = device_type != "cpu"
    if pdl not in (None, False, True, "late"):
        raise ValueError(f"pdl must be a bool or 'late', got {pdl!r}")
    if num_warps not in (None, 4, 8):
        raise ValueError(f"num_warps must be 4 or 8, got {num_warps}")
    if num_stages not in (None, 2, 3, 4, 5):
        raise ValueError(f"num_stages must be 2 to 5, got {num_stages}")
    bm = max(16, triton.next_power_of_2(M))
    bk = 128 if gpu else 64
    if block_k is not None:
        if block_k not in (32, 64, 128, 256):
            raise ValueError(f"block_k must be 32, 64, 128 or 256, got {block_k}")
        bk = block_k
    # FP8 weights at 17-64 rows against 16-bit activations: 3 or 2 programs per SM, and a second, partial
    # wave would leave the machine to its last few programs.
    fp8_wave = gpu and weight_bytes == 1 and x_bytes == 2 and bm >= 32
    if block_n is None:
        block_n = 64
        if fp8_wave and bm >= 64 and not gated and sum(triton.cdiv(n, 64) for n in ns) > 2 * sms:
            # e.g. the DSA q_b, 320 tiles of 64 (the H200 sweep of 2026-12-03 at 64 rows: 31.2 -> 28.8 us)
            block_n = 128
    elif block_n not in (16, 32, 64, 128):
        raise ValueError(f"block_n must be 16, 32, 64 or 128, got {block_n}")
    bn = min(block_n, max(16, triton.next_power_of_2(max(ns))))
    all_fp8 = (widest_bytes or weight_bytes) == 1
    if half is None:
        # FP8 weights: fp16 products at up to 16 rows, and at 17-32 rows for weights of at least 24 Mi
        # elements (the H200 sweeps of 2026-12-04 at 24 / 32 rows: dense gate|up 57.3 -> 44.2 and
        # 63.2 -> 43.9 us, the DSA q_b (30 Mi) 21.4 -> 19.8 and 20.1 -> 19.7, the other large weights
        # 4-10 % faster, the smaller ones even or slower). Ungated at 17-64 rows with an fp16 copy of x
        # given, every size (the H200 sweep of 2026-12-05, one-wave plans, bf16 products against fp16 ones
        # from a copy, 24 / 64 rows: DSA o_proj 35.2 -> 29.3 / 45.8 -> 40.3 us, dense down 27.7 -> 23.6 /
        # 36.0 -> 31.9, shared-expert down 11.2 -> 8.5 / 12.2 -> 10.6, DSA group 12.5 -> 10.7 / 16.0 -> 14.9;
        # gated ones lost at 48-64 rows: dense gate|up 75.5 -> 96.7 at 64, the shared expert's 21.0 -> 28.7).
        half = weight_bytes == 1 and (bm == 16 or (bm == 32 and K * sum(ns) * (2 if gated else 1) >= 24 << 20)
                                      or (bool(x16) and bm in (32, 64) and not gated))
    half = bool(half) and x_bytes == 2
    tma = half and all_fp8 and bk <= 128
    if tma and gated:
        split_factor = split_factor * 0.5
    k_iters = triton.cdiv(K, bk)
    fp8_skinny = gpu and weight_bytes == 1 and bm == 16  # FP8 weights at up to 16 rows: their own split and stages
    if split_k is None:
        tiles = sum(triton.cdiv(n, bn) for n in ns)
        if fp8_skinny:
            # FP8 weights at up to 16 rows: as many splits as keep about 3 programs per SM without
            # exceeding that (the H200 sweep of 2026-12-04: dense down and DSA o_proj 6 splits, 384
            # programs, against the 5 of a 2-per-SM round-up: 20.2 -> 18.6 and 25.2 -> 23.2 us at 1 row).
            want = max(1, 3 * sms // tiles)
        elif fp8_wave and not gated:
            # At most one wave: the H200 sweeps of 2026-12-03/04 at 64 rows timed the DSA o_proj and the dense
            # down, each 64 tiles of 64 split 5 (320 programs, 1.2 waves), at 66.6 / 50.7 us, and the same
            # weights in one wave (128-column tiles, 256 / 192 programs) at 45.7 / 42.0 us. At 17-32 rows the
            # same launches fit 3 programs per SM (6 splits, as at 1-16 rows, where 6 beat 5).
            want = max(1, (3 if bm == 32 else 2) * sms // tiles)
        elif gpu and weight_bytes == 2:
            # BF16 weights: about 2 programs per SM, rounded down. A round-up past the 2 per SM that
            # their shared memory allows starts a second wave: the H200 sweep of 2026-12-04 timed the KDA
            # o_proj ([4096, 8192], 64 tiles) at 24.8 us with 5 splits (320 programs) and 20.7 with 4 (256).
            want = max(1, 2 * sms // tiles)
        else:
            want = triton.cdiv(2 * sms, tiles)
        # fp32 partials within a quarter of the weight bytes (half for FP8 weights at 33-64 rows, where a
        # quarter left the DSA group 70 programs: twice its split took 18.5 -> 15.8 us in the 2026-12-03 sweep)
        traffic_cap = max(1, K * weight_bytes // ((16 if fp8_wave and bm >= 64 else 32) * M))
        split = max(1, round(max(1, min(want, k_iters // (4 if gpu else 1), traffic_cap, 16)) * split_factor))
    elif split_k < 1:
        raise ValueError(f"split_k must be positive, got {split_k}")
    else:
        split = split_k
    split = triton.cdiv(k_iters, triton.cdiv(k_iters, min(split, k_iters)))  # no empty splits
    # Shared memory: one x tile and the weight tile(s) per buffered stage; Triton keeps
    # num_stages - 1 buffers for mma.sync (BLOCK_M <= 32) and num_stages for wgmma (BLOCK_M 64).
    per_stage = bm * bk * x_bytes + (2 if gated else 1) * bn * bk * (widest_bytes or weight_bytes)
    buffers = 100_000 // per_stage
    # FP8 weights at up to 16 rows: at most 4 stages (the H200 sweep of 2026-12-04, 4 against 5 at 1 row:
    # dense gate|up 31.2 -> 30.4 us, down 18.6 -> 17.7, DSA o_proj 23.3 -> 22.1, q_b 14.0 -> 12.8).
    stages = num_stages or max(2, min(4 if fp8_skinny else 5, buffers if bm >= 64 else buffers + 1))
    warps = num_warps or (8 if (bm >= 64 and gated) else 4)
    return LaunchPlan(bm, bn, bk, split, num_warps=warps, num_stages=stages,
                      f32_sub_k=(32 if bm <= 16 else 16) if gpu else bk, tma=tma, half=half,
                      pdl=bool(pdl), pdl_late=pdl == "late", tiles=sum(triton.cdiv(n, bn) for n in ns))


def reads_x16(M: int, weights: list[torch.Tensor], x_dtype: torch.dtype, gated: bool = False) -> bool:
    """Whether the default launch of projections with these weights (`gated`: `gate_up_swiglu`, the gate's
    weight given) at M rows of `x_dtype` activations would read an `x16` copy: every weight FP8 and bf16
    activations that meet them in fp16 products, which each program would otherwise convert per K step."""
    if not weights or not 1 <= M <= MAX_ROWS or x_dtype != torch.bfloat16:
        return False
    if any(w.dtype != torch.float8_e4m3fn for w in weights) or len({w.shape[1] for w in weights}) != 1:
        return False
    dev = weights[0].device
    return plan_launch(M, [w.shape[0] for w in weights], weights[0].shape[1], 1, dev.type, _sm_count(dev),
                       gated, x16=True).half


def _check_x(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.dtype not in _FLOAT:
        raise ValueError(f"x must be a 2-D bf16/fp16/fp32 matrix, got {tuple(x.shape)} {x.dtype}")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"skinny projections take at most {MAX_ROWS} rows, got {x.shape[0]}")
    if x.stride(1) != 1 and x.shape[1] > 1:
        raise ValueError("x needs unit stride along K")


def _check_weight(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None) -> None:
    K = x.shape[1]
    if w.dim() != 2 or w.shape[1] != K or not w.is_contiguous() or w.device != x.device:
        raise ValueError(f"weight must be a contiguous [N, {K}] matrix on {x.device}, got {tuple(w.shape)}")
    if w.shape[0] * K >= 2**31:
        raise ValueError("weights of 2^31 or more elements are not supported")
    if w.dtype == torch.float8_e4m3fn:
        grid = (triton.cdiv(w.shape[0], 128), triton.cdiv(K, 128))
        if s is None or tuple(s.shape) != grid or s.dtype != torch.float32 or not s.is_contiguous():
            raise ValueError(f"an FP8 weight needs contiguous fp32 block scales of shape {grid}")
        if s.device != x.device:
            raise ValueError("scales must be on the weight's device")
    elif w.dtype not in _FLOAT or s is not None:
        raise ValueError(f"weight must be bf16/fp16/fp32 without scales or FP8 with scales, got {w.dtype}")


def _outputs(x: torch.Tensor, ns: list[int], outs) -> list[torch.Tensor]:
    M = x.shape[0]
    if outs is None:
        return [torch.empty((M, n), dtype=x.dtype, device=x.device) for n in ns]
    outs = list(outs)
    if len(outs) != len(ns):
        raise ValueError(f"{len(ns)} projections but {len(outs)} outputs")
    for o, n in zip(outs, ns):
        if tuple(o.shape) != (M, n) or o.device != x.device or o.dtype not in _FLOAT:
            raise ValueError(f"output must be a float [{M}, {n}] tensor on {x.device}, got {tuple(o.shape)}")
        if o.stride(1) != 1 and n > 1:
            raise ValueError("outputs need unit stride along N")
    return outs


def _check_x16(x: torch.Tensor, x16: torch.Tensor | None) -> None:
    if x16 is not None and (x16.dtype != torch.float16 or x16.shape != x.shape or x16.stride() != x.stride()
                            or x16.device != x.device):
        raise ValueError(f"x16 must be x in fp16 with x's shape and strides on {x.device}, got "
                         f"{tuple(x16.shape)} {x16.dtype} strides {x16.stride()} on {x16.device}")


def _check_out16(out: torch.Tensor, out16: torch.Tensor | None) -> None:
    if out16 is not None and (out16.dtype != torch.float16 or out16.shape != out.shape
                              or out16.stride() != out.stride() or out16.device != out.device):
        raise ValueError(f"out16 must be an fp16 {tuple(out.shape)} tensor with the output's strides "
                         f"{out.stride()} on {out.device}, got {tuple(out16.shape)} {out16.dtype} "
                         f"strides {out16.stride()} on {out16.device}")


def _run(x, projections, outs, up=None, limit=0.0, x16=None, out16=None, **overrides):
    _check_x(x)
    _check_x16(x, x16)
    projections = list(projections)
    if not 1 <= len(projections) <= MAX_PROJECTIONS:
        raise ValueError(f"1 to {MAX_PROJECTIONS} projections per launch, got {len(projections)}")
    for w, s in projections + ([up] if up is not None else []):
        _check_weight(x, w, s)
    ns = [w.shape[0] for w, _ in projections]
    outs = _outputs(x, ns, outs)
    if out16 is not None:  # one projection (skinny_linear, gate_up_swiglu)
        _check_out16(outs[0], out16)
    if x.shape[0] == 0:
        return outs
    sizes = [w.element_size() for w, _ in projections]
    plan = plan_launch(x.shape[0], ns, x.shape[1], min(sizes), x.device.type, _sm_count(x.device), up is not None,
                       x_bytes=x.element_size(), widest_bytes=max(sizes), x16=x16 is not None, **overrides)
    launch(x, [w for w, _ in projections], [s for _, s in projections], outs, plan, up, limit, x16, out16)
    return outs


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, *, x16: torch.Tensor | None = None,
                  out16: torch.Tensor | None = None, **overrides) -> torch.Tensor:
    """`x @ dequant(weight).T` in fp32 accumulation, in x's dtype (or written into `out`). `x16`: x already
    converted to fp16 (x's strides), which fp16 products against FP8 weights then read instead of
    converting x in every program; the result is the same. `out16`: an fp16 tensor with the output's
    shape and strides that receives the output converted to fp16 as well (for a next projection's `x16`).
    `overrides`: keyword overrides of `plan_launch` (split_k, block_n, split_factor, block_k, half, pdl,
    num_warps, num_stages)."""
    return _run(x, [(weight, scale_inv)], None if out is None else [out], x16=x16, out16=out16, **overrides)[0]


def skinny_linear_multi(x: torch.Tensor, projections, outs=None, *, x16: torch.Tensor | None = None,
                        **overrides) -> list[torch.Tensor]:
    """`[x @ dequant(w).T for w, scale_inv in projections]` (at most 6, equal K) in one launch (`x16` and
    `overrides` as for `skinny_linear`)."""
    return _run(x, projections, outs, x16=x16, **overrides)


def gate_up_swiglu(x: torch.Tensor, gate_w: torch.Tensor, gate_s: torch.Tensor | None, up_w: torch.Tensor,
                   up_s: torch.Tensor | None, limit: float, out: torch.Tensor | None = None, *,
                   x16: torch.Tensor | None = None, out16: torch.Tensor | None = None,
                   **overrides) -> torch.Tensor:
    """`silu(min(g, limit)) * clamp(u, -limit, limit)`, g = x @ gate.T, u = x @ up.T, in x's dtype (`x16`,
    `out16` and `overrides` as for `skinny_linear`)."""
    if up_w.shape != gate_w.shape or up_w.dtype != gate_w.dtype:
        raise ValueError("gate and up weights must share shape and dtype")
    return _run(x, [(gate_w, gate_s)], None if out is None else [out], up=(up_w, up_s), limit=limit, x16=x16,
                out16=out16, **overrides)[0]
