"""An experiment: the KDA decode stage (one token a row) in two launches instead of one, so that the
recurrence can split a head's value columns over programs without the per-head arrival counter.

Launch 1, `recur_kernel`, grid (V // BV, H, rows): each program rebuilds the step's q and k (all K
channels) and its BV v channels with the short conv from the cached window and the step's projection
rows, normalises, forms the decay and beta, runs the delta rule on its fp32 state tile [K, BV] and
stores its block of the head's output (rounded to the model dtype) and that block's sum of squares in
scratch. It only reads the conv window. With BV = 32 a program holds 32 state registers a thread
(4 warps) instead of the production kernel's 128, and the grid has 4x the programs, as fla's recurrence.
(ptxas for sm_90 at K = V = 128, bf16, Triton 3.6, compiled without a GPU: BV 32 / 4 warps 123
registers, no spills; BV 32 / 2 warps 220; BV 64 228; BV 128 255 with ~720 bytes of spills; the
production kernel at one program a head 255 with a 920-byte stack frame; fla's recurrence 165.)

Launch 2, `norm_window_kernel`, grid (H, rows): the sigmoid-gated RMSNorm of the head's output from the
partial squares (summed in block order), and the advance of the head's conv window. The launch
boundary is the barrier that the single-launch split needed an atomic counter for: every program of
launch 1 has read the old window before any program of launch 2 writes the new one.

Same rounding points as `glm5next.kernels.kda.kernel.kda_decode_kernel` (conv SiLU, beta and the
delta-rule output rounded to the model dtype), the same delta-rule step (`_decay_write`).

    python benchmarks/kda_two_launch.py --check                 # CPU (Triton interpreter), tiny shapes
    python benchmarks/kda_two_launch.py [--tokens 1,8,64] [--variants 32/4,32/2,64/4,128/4] [--out F]
"""

from __future__ import annotations

import os
import sys

import torch

# The check runs Triton's interpreter where there is no GPU; that is chosen before triton is imported.
if "--check" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from glm5next.kernels.kda import KdaWeights, check_inputs, kda_decode, kda_decode_reference, plan_kda  # noqa: E402
from glm5next.kernels.kda.kernel import _advance_window, _conv_silu, _decay_write  # noqa: E402


@triton.jit
def recur_kernel(
    q_ptr, k_ptr, v_ptr, b_ptr, f_ptr, sq, sk, sv, sb, sf,
    conv_ptr, conv_w_ptr, a_log_ptr, dt_bias_ptr, state_ptr, index_ptr, o_ptr, part_ptr,
    H, lower_bound, scale, l2_eps,
    K: tl.constexpr, V: tl.constexpr, KEEP: tl.constexpr, TAPS: tl.constexpr, BV: tl.constexpr,
):
    """Grid (V // BV, H, rows), one token a row: the delta-rule step of value columns j*BV .. j*BV+BV-1
    of head h. Projections [rows, width] with row strides sq..sf; conv window [slots, 3HK, KEEP], read
    only; taps [3HK, KEEP + 1] fp32; state [slots, H, K, V] fp32, its [K, BV] tile read and written
    once; o [rows, H * V] (model dtype) and part [rows, H, V // BV] fp32 are scratch for launch 2.

    The value blocks are the fastest grid axis, then the heads: the V // BV programs that share each
    key row of a head's state (BV * 4 bytes apiece) run side by side, and consecutive programs walk a
    row's state [H, K, V] in address order, instead of a head's blocks landing a wave apart.

    q and k are rebuilt whole by each of the head's V // BV programs (the L2 norms need every channel);
    the repeated conv reads should come from L2 (fla's recurrence reads q and k per block alike). A
    padding row (negative index) does nothing here: launch 2 writes its zeros."""
    j = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.program_id(2)
    NV: tl.constexpr = V // BV
    HK = H * K
    index = tl.load(index_ptr + row).to(tl.int64)
    if index >= 0:
        dtype = o_ptr.dtype.element_ty
        kk = tl.arange(0, K)
        vv = j * BV + tl.arange(0, BV)
        # The state tile first: the one long read of the program, in flight while the conv is built.
        sp = state_ptr + index * HK * V + h * K * V + kk[:, None] * V + vv[None, :]
        s = tl.load(sp)
        conv_base = conv_ptr + index * (3 * HK) * KEEP
        aq = _conv_silu(conv_base, conv_w_ptr, q_ptr, sq, h * K + kk, h * K + kk, row, 0, 1, KEEP, TAPS, dtype)
        ak = _conv_silu(conv_base, conv_w_ptr, k_ptr, sk, HK + h * K + kk, h * K + kk, row, 0, 1, KEEP, TAPS, dtype)
        av = _conv_silu(conv_base, conv_w_ptr, v_ptr, sv, 2 * HK + h * V + vv, h * V + vv, row, 0, 1, KEEP, TAPS,
                        dtype)
        qn = aq / tl.sqrt(tl.sum(aq * aq, 0) + l2_eps) * scale
        kn = ak / tl.sqrt(tl.sum(ak * ak, 0) + l2_eps)
        rate = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
        raw = tl.load(f_ptr + row * sf + h * K + kk).to(tl.float32) + tl.load(dt_bias_ptr + h * K + kk).to(tl.float32)
        gk = lower_bound * tl.sigmoid(rate * raw)
        beta = tl.sigmoid(tl.load(b_ptr + row * sb + h).to(tl.float32)).to(dtype).to(tl.float32)

        s = _decay_write(s, kn, gk, beta, av)
        tl.store(sp, s)
        o = tl.sum(s * qn[:, None], 0).to(dtype)
        of = o.to(tl.float32)
        tl.store(o_ptr + row * H * V + h * V + vv, o)
        tl.store(part_ptr + (row * H + h) * NV + j, tl.sum(of * of, 0))


@triton.jit
def norm_window_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, sq, sk, sv, sg,
    conv_ptr, norm_w_ptr, index_ptr, o_ptr, part_ptr, out_ptr,
    H, eps,
    K: tl.constexpr, V: tl.constexpr, KEEP: tl.constexpr, TAPS: tl.constexpr, NV: tl.constexpr,
):
    """Grid (H, rows), after `recur_kernel`: the head's output `o * rstd * o_norm * sigmoid(g)` into out
    [rows, H * V] (model dtype), rstd from the NV partial sums of squares added in block order; then the
    head's conv window (q, k, v channels) advanced by the step's pre-conv rows. Launch 1 has finished,
    so no program still needs the old window. A padding row writes zeros and touches no window."""
    h = tl.program_id(0)
    row = tl.program_id(1)
    HK = H * K
    HV = H * V
    vall = tl.arange(0, V)
    dst = out_ptr + row * HV + h * V + vall
    index = tl.load(index_ptr + row).to(tl.int64)
    if index >= 0:
        part_base = part_ptr + (row * H + h) * NV
        ss = tl.load(part_base)
        for jj in tl.static_range(1, NV):
            ss += tl.load(part_base + jj)
        rstd = 1.0 / tl.sqrt(ss / V + eps)
        o = tl.load(o_ptr + row * HV + h * V + vall).to(tl.float32)
        w = tl.load(norm_w_ptr + vall).to(tl.float32)
        gate = tl.load(g_ptr + row * sg + h * V + vall).to(tl.float32)
        tl.store(dst, (o * rstd * w * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty))
        conv_base = conv_ptr + index * (3 * HK) * KEEP
        kk = tl.arange(0, K)
        _advance_window(conv_base, q_ptr, sq, h * K + kk, h * K + kk, row, 1, KEEP, TAPS)
        _advance_window(conv_base, k_ptr, sk, HK + h * K + kk, h * K + kk, row, 1, KEEP, TAPS)
        _advance_window(conv_base, v_ptr, sv, 2 * HK + h * V + vall, h * V + vall, row, 1, KEEP, TAPS)
    else:
        tl.store(dst, tl.zeros([V], dtype=out_ptr.dtype.element_ty))


class TwoLaunchScratch:
    """The launches' scratch per shape: the rounded outputs [rows, H * V] and the partial squares
    [rows, H, NV] fp32. A captured graph keeps using the tensors it was captured with."""

    def __init__(self) -> None:
        self._by_shape: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, rows: int, heads: int, v: int, nv: int, dtype: torch.dtype,
            device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (rows, heads, v, nv, dtype, str(device))
        if key not in self._by_shape:
            self._by_shape[key] = (torch.empty(rows, heads * v, dtype=dtype, device=device),
                                   torch.empty(rows, heads, nv, dtype=torch.float32, device=device))
        return self._by_shape[key]


_SCRATCH = TwoLaunchScratch()


def two_launch_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor, f: torch.Tensor,
                      g: torch.Tensor, conv: torch.Tensor, state: torch.Tensor, index: torch.Tensor, w: KdaWeights,
                      block_v: int = 32, num_warps: int = 4, norm_warps: int = 4, out: torch.Tensor | None = None,
                      scratch: TwoLaunchScratch | None = None, only: str | None = None) -> torch.Tensor:
    """`kda_decode(q, k, v, b, f, g, conv, state, index, w, 1, ...)` in two launches (see the module
    docstring): the gated, normalised outputs [rows, H * V] (q's dtype); advances `conv` and `state` of
    each row's slot. `block_v` value columns per recurrence program; `only` ('recur' or 'norm') runs one
    of the two launches (timing the parts)."""
    rows = q.shape[0]
    h, d = w.num_heads, w.head_dim
    check_inputs(q, k, v, b, f, g, conv, state, index, w, rows)  # one token a row
    keep = conv.shape[-1]
    if d % block_v or block_v & (block_v - 1):
        raise ValueError(f"block_v={block_v} must be a power of two dividing head_dim={d}")
    nv = d // block_v
    out = torch.empty(rows, h * d, dtype=q.dtype, device=q.device) if out is None else out
    o, part = (scratch or _SCRATCH).get(rows, h, d, nv, q.dtype, q.device)
    taps = triton.next_power_of_2(keep + 1)
    if only in (None, "recur"):
        recur_kernel[(nv, h, rows)](
            q, k, v, b, f, q.stride(0), k.stride(0), v.stride(0), b.stride(0), f.stride(0),
            conv, w.conv, w.a_log, w.dt_bias, state, index, o, part,
            h, w.lower_bound, d**-0.5, w.l2_eps,
            K=d, V=d, KEEP=keep, TAPS=taps, BV=block_v, num_warps=num_warps)
    if only in (None, "norm"):
        norm_window_kernel[(h, rows)](
            q, k, v, g, q.stride(0), k.stride(0), v.stride(0), g.stride(0),
            conv, w.norm, index, o, part, out,
            h, w.eps,
            K=d, V=d, KEEP=keep, TAPS=taps, NV=nv, num_warps=norm_warps)
    return out


# ----------------------------------------------------------------------------------------------- check


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


def check(h: int = 2, d: int = 16, keep: int = 3, block_vs: tuple[int, ...] = (8, 16), slots: int = 5,
          index: tuple[int, ...] = (3, -1, 0), seed: int = 0) -> bool:
    """The two launches against the production kernel (its plan: one program a head) and the fp32
    reference on fresh random fp32 inputs, outputs pre-filled with NaN: outputs and states within 1e-5
    relative, windows exactly equal; the padding row zeros, the slots no row names untouched. On the GPU
    where there is one (compiled kernels, fp32), else in the interpreter."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen).to(dev)  # noqa: E731
    w = KdaWeights(r(3 * h * d, keep + 1) * 0.5, r(h) * 0.3, r(h * d) * 0.5,
                   (torch.rand(d, generator=gen) + 0.5).to(dev), h, d, -5.0, 1e-5, 1e-6)
    rows = len(index)
    p = [r(rows, n) for n in (h * d, h * d, h * d, h, h * d, h * d)]
    conv0 = r(slots, 3 * h * d, keep)
    state0 = r(slots, h, d, d) * 0.1
    idx = torch.tensor(index, device=dev)
    nan = lambda: torch.full((rows, h * d), float("nan"), device=dev)  # noqa: E731

    runs = {}
    c, s = conv0.clone(), state0.clone()
    runs["production"] = (kda_decode(*p, c, s, idx, w, 1, plan_kda(d), out=nan()), c, s)
    c, s = conv0.clone(), state0.clone()
    runs["reference"] = (kda_decode_reference(*p, c, s, idx, w, 1, out=nan()), c, s)
    ok = True

    def verdict(name: str, good: bool, detail: str) -> None:
        nonlocal ok
        ok &= good
        print(f"{'PASS' if good else 'FAIL'} {name}: {detail}")

    pr_out, pr_c, pr_s = runs["production"]
    verdict("production vs reference (sanity)", _rel(pr_out, runs["reference"][0]) < 1e-5
            and _rel(pr_s, runs["reference"][2]) < 1e-5 and torch.equal(pr_c, runs["reference"][1]),
            f"out {_rel(pr_out, runs['reference'][0]):.1e}, state {_rel(pr_s, runs['reference'][2]):.1e}")
    live = [i for i, x in enumerate(index) if x >= 0]
    pad = [i for i, x in enumerate(index) if x < 0]
    untouched = [sl for sl in range(slots) if sl not in index]
    for bv in block_vs:
        c, s = conv0.clone(), state0.clone()
        out = nan()
        got = two_launch_decode(*p, c, s, idx, w, block_v=bv, out=out, scratch=TwoLaunchScratch())
        tag = f"BV={bv} (NV={d // bv})"
        verdict(f"{tag} output is out, no NaN", got is out and not got.isnan().any(), f"{int(got.isnan().sum())} NaN")
        verdict(f"{tag} padding rows zero", all(not got[i].any() for i in pad), f"rows {pad}")
        verdict(f"{tag} slots not named untouched", torch.equal(s[untouched], state0[untouched])
                and torch.equal(c[untouched], conv0[untouched]), f"slots {untouched}")
        for ref_name, (r_out, r_c, r_s) in runs.items():
            e_out = _rel(got[live], r_out[live])
            e_s = _rel(s, r_s)
            verdict(f"{tag} output vs {ref_name}", e_out < 1e-5, f"max rel {e_out:.1e}")
            verdict(f"{tag} state vs {ref_name}", e_s < 1e-5,
                    f"max rel {e_s:.1e}{' (bit for bit)' if torch.equal(s, r_s) else ''}")
            verdict(f"{tag} window vs {ref_name}", torch.equal(c, r_c), "exactly equal" if torch.equal(c, r_c)
                    else f"max abs diff {float((c - r_c).abs().max()):.1e}")
    return ok


# ------------------------------------------------------------------------------------------------ GPU


def bench(args) -> None:
    """The production kernel, the two launches (each variant, and their parts at the first variant) and
    fla's recurrence on one KDA layer at real shapes; CUDA-graph replays over rotated state slots (past
    the L2), medians, as benchmarks/kda_stage.py."""
    from glm5next.bench.floor import measure_read_bandwidth
    from glm5next.model.kda import KdaProjections
    from kda_stage import ROTATE_BYTES, fla_peer, one_kda_layer
    from moe_stage import log, median_us

    dev = torch.device("cuda")
    attn, w = one_kda_layer(dev)
    h, d, keep = attn.num_heads, attn.head_dim, attn.conv_kernel - 1
    hk = h * d
    bw = measure_read_bandwidth(dev)["bytes_per_s"]
    fla, fla_why = fla_peer()
    variants = [tuple(int(x) for x in v.split("/")) for v in args.variants.split(",")]
    log(f"{torch.cuda.get_device_name(dev)}; read bandwidth {bw / 1e12:.2f} TB/s; {h} heads of {d}, conv window "
        f"{keep}; fla: {fla_why or 'yes'}; two-launch variants (block_v/warps) {variants}")
    all_rows = [int(t) for t in args.tokens.split(",")]
    state_bytes = h * d * d * 4
    max_rows = max(all_rows)
    n_slots = max(2 * max_rows, ROTATE_BYTES // state_bytes + max_rows)
    gen = torch.Generator(device=dev).manual_seed(0)
    conv = torch.randn(n_slots + 1, 3 * hk, keep, generator=gen, device=dev).to(torch.bfloat16)
    recurrent = torch.randn(n_slots + 1, h, d, d, generator=gen, device=dev) * 0.05
    result = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "triton": triton.__version__,
              "bandwidth": bw, "date": time.strftime("%Y-%m-%d"), "fla": fla_why or "fla-core", "rows": []}
    plan = plan_kda(d)
    scratch = TwoLaunchScratch()
    for rows in all_rows:
        rotate = max(2, min(16, n_slots // rows, -(-ROTATE_BYTES // (rows * state_bytes))))
        perm = torch.randperm(n_slots, generator=torch.Generator().manual_seed(rows * 100 + 1))
        indices = [perm[i * rows:(i + 1) * rows].to(dev) for i in range(rotate)]
        ps = [KdaProjections(*(torch.randn(rows, width, generator=gen, device=dev).to(torch.bfloat16)
                               for width in (hk, hk, hk, h, hk, hk))) for _ in range(rotate)]
        outs = [torch.empty(rows, hk, dtype=torch.bfloat16, device=dev) for _ in range(rotate)]
        nbytes = rows * state_bytes * 2 + rows * 3 * hk * keep * 2 * 2 + rows * (5 * hk + h) * 2 + rows * hk * 2
        floor_us = nbytes / bw * 1e6
        row = {"rows": rows, "bytes": nbytes, "floor_us": floor_us, "rotate": rotate}

        def production():
            for p, idx, o in zip(ps, indices, outs):
                kda_decode(*p, conv, recurrent, idx, w, 1, plan, out=o)

        def two(bv, nw, only=None):
            for p, idx, o in zip(ps, indices, outs):
                two_launch_decode(*p, conv, recurrent, idx, w, block_v=bv, num_warps=nw, out=o, scratch=scratch,
                                  only=only)

        row["production_us"] = median_us(production, rotate)
        row["two_launch_us"] = {}
        for bv, nw in variants:
            row["two_launch_us"][f"{bv}/{nw}w"] = median_us(lambda bv=bv, nw=nw: two(bv, nw), rotate)
        bv0, nw0 = variants[0]
        row["parts_us"] = {"recur": median_us(lambda: two(bv0, nw0, "recur"), rotate),
                           "norm_window": median_us(lambda: two(bv0, nw0, "norm"), rotate)}
        if fla is not None:
            try:
                cu = torch.arange(0, rows + 1, dtype=torch.int64, device=dev)

                def peer():
                    for p, idx in zip(ps, indices):
                        fla(p.q.view(1, rows, h, d), p.k.view(1, rows, h, d), p.v.view(1, rows, h, d),
                            p.f.view(1, rows, h, d), p.b.view(1, rows, h), A_log=attn.A_log, dt_bias=attn.dt_bias,
                            initial_state=recurrent, scale=d**-0.5, inplace_final_state=True, cu_seqlens=cu,
                            ssm_state_indices=idx, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                            use_beta_sigmoid_in_kernel=True, lower_bound=attn.lower_bound)

                row["fla_us"] = median_us(peer, rotate)
            except Exception as e:  # noqa: BLE001 - the peer's limits are part of the result
                row["fla_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        # Accuracy on fresh copies of the caches: each variant against production (output, state, window).
        p, idx = ps[0], indices[0]
        sl = idx.long()
        c0, s0 = conv.clone(), recurrent.clone()
        want = kda_decode(*p, c0, s0, idx, w, 1, plan)
        row["rel_err"] = {}
        for bv, nw in variants:
            c1, s1 = conv.clone(), recurrent.clone()
            out = torch.full((rows, hk), float("nan"), dtype=torch.bfloat16, device=dev)
            got = two_launch_decode(*p, c1, s1, idx, w, block_v=bv, num_warps=nw, out=out, scratch=scratch)
            row["rel_err"][f"{bv}/{nw}w"] = {"out": _rel(got, want), "state": _rel(s1[sl], s0[sl]),
                                             "window_equal": bool(torch.equal(c1, c0)),
                                             "state_equal": bool(torch.equal(s1, s0))}
            del c1, s1
        del c0, s0
        result["rows"].append(row)
        times = ", ".join(f"{k} {v:.1f}" for k, v in row["two_launch_us"].items())
        errs = ", ".join(f"{k} {e['out']:.1e}/{e['state']:.1e}{'' if e['window_equal'] else ' WINDOW DIFFERS'}"
                         for k, e in row["rel_err"].items())
        peer_txt = f"{row['fla_us']:.1f}" if "fla_us" in row else row.get("fla_error", "-")[:80]
        log(f"rows={rows}: floor {floor_us:.1f} us, production {row['production_us']:.1f}, two-launch {times} "
            f"(at {bv0}/{nw0}w: recur {row['parts_us']['recur']:.1f} + norm/window "
            f"{row['parts_us']['norm_window']:.1f}), fla recurrence {peer_txt}; rel err vs production "
            f"(out/state) {errs}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="tiny shapes against production and the reference")
    ap.add_argument("--tokens", default="1,8,64", help="decode steps: rows of one token")
    ap.add_argument("--variants", default="32/4,32/2,64/4,128/4", help="two-launch BLOCK_V/num_warps to time")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.check:
        ok = check(h=2, d=16, keep=3, block_vs=(8, 16))
        ok &= check(h=2, d=32, keep=3, block_vs=(8,), index=(-1, 4, 1), seed=1)
        print("check:", "PASS" if ok else "FAIL")
        sys.exit(0 if ok else 1)
    if not torch.cuda.is_available():
        sys.exit("the timing needs a GPU (or run --check)")
    bench(args)


if __name__ == "__main__":
    main()
