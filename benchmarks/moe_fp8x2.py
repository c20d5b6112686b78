"""Experiment: the prefill experts on FP8 tensor cores with each activation split into two e4m3 terms.

FP8 products (w8a8: activations quantised to e4m3 per row and 128 channels) ran the experts 1.9-2.4x faster
than the widened weights but missed the accuracy bar (docs/decisions.md, s36): e4m3 keeps 3 mantissa bits,
an RMS error of 4.3e-2 on the layer against 2.3e-3 for bf16 activations. Here each 128-channel group v of an
activation is written as v ~ s1 * q1 + s2 * q2: q1 = e4m3(v / s1) with s1 = max|v| / 448, then the
remainder r = v - s1 * q1 quantised the same way (s2 = max|r| / 448), about 8 significant bits together,
near bf16's. A product is then two FP8 products against the same weight tile, which the weights (the
bytes that bound a prefill chunk) still reach as stored, never widened.

    python benchmarks/moe_fp8x2.py --check            # the interpreter against the fp32 reference (CPU)
    python benchmarks/moe_fp8x2.py [--tokens 2048,8192] [--out moe-fp8x2.json]    # on a GPU
    python benchmarks/moe_fp8x2.py --agreement [--out agreement.json]              # on a GPU

On a GPU: one MoE layer of the slice (real shapes), the production plan (widened weights) and the one- and
two-term forms timed (medians of 7 eager calls) and their RMS error against the same experts in fp32.
`--agreement`: the bar the form must pass to be used (issue 26): the small model with every expert routed
(no routing near-ties), 256 prompts of 1-300 tokens prefilled in bf16 with the experts on each form and in
fp32; the last-position top-1 against fp32's over all rows and over the clear rows (fp32's lead over its
runner-up above 5x the RMS logit error of the widened bf16 prefill); a form may be used at >= 99.5 %.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if "--check" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import triton
import triton.language as tl

from glm5next.kernels.moe import ExpertWeights, Routing, group_rows, moe_prefill, prefill_plan
from glm5next.kernels.moe.experts import _offset, combine_kernel

FP8 = torch.float8_e4m3fn


@triton.jit
def _to_e4m3(v):
    """v (fp32, |v| <= 448) rounded to nearest even on the e4m3 grid, as an exact fp32 value (the
    interpreter's own conversion truncates)."""
    bits = v.to(tl.int32, bitcast=True)
    exp = tl.maximum((bits >> 23) & 0xFF, 127 - 6)
    ulp = ((exp - 3) << 23).to(tl.float32, bitcast=True)
    magic = 12582912.0
    return ((v / ulp + magic) - magic) * ulp


@triton.jit
def _quantize(v, mask):
    amax = tl.max(tl.where(mask, tl.abs(v), 0.0), axis=1)
    s = tl.maximum(amax, 1e-30) / 448.0
    return _to_e4m3(tl.minimum(tl.maximum(v / s[:, None], -448.0), 448.0)), s


@triton.jit
def _quantize2(v, mask, TERMS: tl.constexpr):
    """Rows of v [R, 128] as (q1, s1, q2, s2): v ~ s1 q1 + s2 q2 (q2 = 0 with one term)."""
    q1, s1 = _quantize(v, mask)
    if TERMS == 2:
        q2, s2 = _quantize(v - q1 * s1[:, None], mask)
    else:
        q2, s2 = q1 * 0.0, s1 * 0.0
    return q1, s1, q2, s2


@triton.jit
def quantize_kernel(x_ptr, q1_ptr, q2_ptr, s_ptr, T, K, stride_x, TERMS: tl.constexpr, BLOCK_T: tl.constexpr):
    """q1, q2 [T, K] e4m3 and s [T, ceil(K / 128), 2] fp32 of x [T, K]."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    g = tl.program_id(1)
    k = g * 128 + tl.arange(0, 128)
    mask = (t < T)[:, None] & (k < K)[None, :]
    x = tl.load(x_ptr + t[:, None] * stride_x + k[None, :], mask=mask, other=0.0).to(tl.float32)
    q1, s1, q2, s2 = _quantize2(x, mask, TERMS)
    tl.store(q1_ptr + t[:, None] * K + k[None, :], q1.to(q1_ptr.dtype.element_ty), mask=mask)
    tl.store(q2_ptr + t[:, None] * K + k[None, :], q2.to(q2_ptr.dtype.element_ty), mask=mask)
    base = (t * tl.cdiv(K, 128) + g) * 2
    tl.store(s_ptr + base, s1, mask=t < T)
    tl.store(s_ptr + base + 1, s2, mask=t < T)


@triton.jit
def _dot(a, w, F32: tl.constexpr):
    if F32:
        return tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    return tl.dot(a, tl.trans(w))


@triton.jit
def _product(q1_ptr, q2_ptr, s_ptr, rows, rmask, K, kb, ks, w, w_s, F32: tl.constexpr, TERMS: tl.constexpr):
    """Rows' activations (two terms) over K block kb times the weight tile w [BN, 128] (scale w_s, [BN] or
    scalar): [BM, BN] fp32."""
    k = kb * 128 + tl.arange(0, 128)
    amask = rmask[:, None] & (k < K)[None, :]
    a1 = tl.load(q1_ptr + rows[:, None] * K + k[None, :], mask=amask, other=0.0)
    s1 = tl.load(s_ptr + (rows * ks + kb) * 2, mask=rmask, other=0.0)
    acc = _dot(a1, w, F32) * s1[:, None]
    if TERMS == 2:
        a2 = tl.load(q2_ptr + rows[:, None] * K + k[None, :], mask=amask, other=0.0)
        s2 = tl.load(s_ptr + (rows * ks + kb) * 2 + 1, mask=rmask, other=0.0)
        acc += _dot(a2, w, F32) * s2[:, None]
    return acc * w_s


@triton.jit
def gate_up_kernel(q1_ptr, q2_ptr, s_ptr, wg_ptr, wu_ptr, sg_ptr, su_ptr, h1_ptr, h2_ptr, hs_ptr,
                   slot_expert_ptr, slot_start_ptr, slot_count_ptr, rows_ptr, n_slots_ptr,
                   shared_wg, shared_wu, shared_sg, shared_su, T, N, K, limit,
                   TOP_K: tl.constexpr, F32: tl.constexpr, TERMS: tl.constexpr, BLOCK_M: tl.constexpr):
    """The SwiGLU output of the slot's rows, tile pid_n (128 columns: one group), stored in two terms."""
    slot = tl.program_id(1)
    if slot >= tl.load(n_slots_ptr):
        return
    pid_n = tl.program_id(0)
    ks = tl.cdiv(K, 128)
    ns = tl.cdiv(N, 128)
    e = tl.load(slot_expert_ptr + slot)
    start = tl.load(slot_start_ptr + slot)
    count = tl.load(slot_count_ptr + slot)
    wg_off = _offset(e, N * K, shared_wg)
    wu_off = _offset(e, N * K, shared_wu)
    sg_off = _offset(e, ns * ks, shared_sg) + pid_n * ks
    su_off = _offset(e, ns * ks, shared_su) + pid_n * ks
    n = pid_n * 128 + tl.arange(0, 128)
    nmask = n < N
    for m0 in range(0, count, BLOCK_M):
        r = m0 + tl.arange(0, BLOCK_M)
        rmask = r < count
        p = tl.load(rows_ptr + start + r, mask=rmask, other=0)
        tok = tl.where(p >= T * TOP_K, p - T * TOP_K, p // TOP_K)
        acc_g = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
        for kb in range(0, ks):
            k = kb * 128 + tl.arange(0, 128)
            wmask = nmask[:, None] & (k < K)[None, :]
            wg = tl.load(wg_ptr + wg_off + n[:, None] * K + k[None, :], mask=wmask, other=0.0)
            wu = tl.load(wu_ptr + wu_off + n[:, None] * K + k[None, :], mask=wmask, other=0.0)
            acc_g += _product(q1_ptr, q2_ptr, s_ptr, tok, rmask, K, kb, ks, wg, tl.load(sg_ptr + sg_off + kb), F32, TERMS)
            acc_u += _product(q1_ptr, q2_ptr, s_ptr, tok, rmask, K, kb, ks, wu, tl.load(su_ptr + su_off + kb), F32, TERMS)
        g = tl.minimum(acc_g, limit)
        u = tl.minimum(tl.maximum(acc_u, -limit), limit)
        mask = rmask[:, None] & nmask[None, :]
        h1, s1, h2, s2 = _quantize2(g * tl.sigmoid(g) * u, mask, TERMS)
        tl.store(h1_ptr + p[:, None] * N + n[None, :], h1.to(h1_ptr.dtype.element_ty), mask=mask)
        tl.store(h2_ptr + p[:, None] * N + n[None, :], h2.to(h2_ptr.dtype.element_ty), mask=mask)
        tl.store(hs_ptr + (p * ns + pid_n) * 2, s1, mask=rmask)
        tl.store(hs_ptr + (p * ns + pid_n) * 2 + 1, s2, mask=rmask)


@triton.jit
def down_kernel(h1_ptr, h2_ptr, hs_ptr, w_ptr, s_ptr, weights_ptr, y_ptr,
                slot_expert_ptr, slot_start_ptr, slot_count_ptr, rows_ptr, n_slots_ptr,
                shared_w, shared_s, T, N, K,
                TOP_K: tl.constexpr, F32: tl.constexpr, TERMS: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """y[p, n] = weight(p) * (h[p] @ Wd[e].T)[n] in fp32 from the two-term h."""
    slot = tl.program_id(1)
    if slot >= tl.load(n_slots_ptr):
        return
    pid_n = tl.program_id(0)
    ks = tl.cdiv(K, 128)
    e = tl.load(slot_expert_ptr + slot)
    start = tl.load(slot_start_ptr + slot)
    count = tl.load(slot_count_ptr + slot)
    w_off = _offset(e, N * K, shared_w)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    s_row = _offset(e, tl.cdiv(N, 128) * ks, shared_s) + (n // 128) * ks
    for m0 in range(0, count, BLOCK_M):
        r = m0 + tl.arange(0, BLOCK_M)
        rmask = r < count
        p = tl.load(rows_ptr + start + r, mask=rmask, other=0)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kb in range(0, ks):
            k = kb * 128 + tl.arange(0, 128)
            w = tl.load(w_ptr + w_off + n[:, None] * K + k[None, :], mask=nmask[:, None] & (k < K)[None, :], other=0.0)
            w_s = tl.load(s_ptr + s_row + kb, mask=nmask, other=0.0)
            acc += _product(h1_ptr, h2_ptr, hs_ptr, p, rmask, K, kb, ks, w, w_s[None, :], F32, TERMS)
        wt = tl.load(weights_ptr + p, mask=rmask & (p < T * TOP_K), other=1.0)
        tl.store(y_ptr + p[:, None] * N + n[None, :], acc * wt[:, None], mask=rmask[:, None] & nmask[None, :])


def experts(x: torch.Tensor, w: ExpertWeights, r: Routing, limit: float, terms: int = 2, block_m: int = 128,
            down_block_n: int = 128, warps: int = 8, stages: int = 4) -> torch.Tensor:
    """The routed and shared experts of routing `r` over x [T, D] with `terms`-term FP8 activations,
    combined: [T, D] in x's dtype."""
    t, d = x.shape
    top_k = r.ids.shape[1]
    n_inter = w.gate.shape[1]
    dev = x.device
    interp = dev.type == "cpu"
    offs = w.shared_offsets()
    pairs = t * top_k + t
    q1, q2 = (torch.empty(t, d, dtype=FP8, device=dev) for _ in range(2))
    s = torch.empty(t, triton.cdiv(d, 128), 2, dtype=torch.float32, device=dev)
    quantize_kernel[(triton.cdiv(t, 16), triton.cdiv(d, 128))](x, q1, q2, s, t, d, x.stride(0), TERMS=terms, BLOCK_T=16)
    h1, h2 = (torch.empty(pairs, n_inter, dtype=FP8, device=dev) for _ in range(2))
    hs = torch.empty(pairs, triton.cdiv(n_inter, 128), 2, dtype=torch.float32, device=dev)
    gate_up_kernel[(triton.cdiv(n_inter, 128), r.max_slots)](
        q1, q2, s, w.gate, w.up, w.gate_scale, w.up_scale, h1, h2, hs, r.slot_expert, r.slot_start, r.slot_count,
        r.rows, r.n_slots, offs[0], offs[1], offs[3], offs[4], t, n_inter, d, float(limit),
        TOP_K=top_k, F32=interp, TERMS=terms, BLOCK_M=block_m, num_warps=warps, num_stages=stages)
    y = torch.empty(pairs, d, dtype=torch.float32, device=dev)
    down_kernel[(triton.cdiv(d, down_block_n), r.max_slots)](
        h1, h2, hs, w.down, w.down_scale, r.weights, y, r.slot_expert, r.slot_start, r.slot_count, r.rows, r.n_slots,
        offs[2], offs[5], t, d, n_inter, TOP_K=top_k, F32=interp, TERMS=terms, BLOCK_M=block_m,
        BLOCK_N=down_block_n, num_warps=warps, num_stages=stages)
    out = torch.empty(t, d, dtype=x.dtype, device=dev)
    combine_kernel[(t, triton.cdiv(d, 1024))](y, y, out, t, d, out.stride(0), TOP_K=top_k, HAS_SLOTS=False,
                                               BLOCK_N=1024)
    return out


def split_reference(v: torch.Tensor, terms: int) -> torch.Tensor:
    """v [R, C] through the `terms`-term quantisation and back, fp32 (0 terms: v itself)."""
    if terms == 0:
        return v.float()
    rows, c = v.shape
    groups = torch.nn.functional.pad(v.float(), (0, -c % 128)).view(rows, -1, 128)
    out = torch.zeros_like(groups)
    for _ in range(terms):
        rest = groups - out
        s = rest.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 448.0
        out = out + (rest / s).clamp(-448, 448).to(FP8).float() * s
    return out.view(rows, -1)[:, :c]


def reference(x, w, ids, weights, limit, terms):
    """The layer in fp32 with the activations (x and each SwiGLU output) through `split_reference`."""

    def widen(t, scale):
        n, k = t.shape
        return t.float() * scale.float().repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]

    xs = split_reference(x, terms)
    out = torch.zeros(x.shape[0], w.down.shape[1])
    for i in range(x.shape[0]):
        pairs = [(int(e), float(wt), w.gate[e], w.gate_scale[e], w.up[e], w.up_scale[e], w.down[e], w.down_scale[e])
                 for e, wt in zip(ids[i].tolist(), weights[i].tolist())]
        pairs.append((-1, 1.0, w.shared_gate, w.shared_gate_scale, w.shared_up, w.shared_up_scale, w.shared_down,
                      w.shared_down_scale))
        for _, wt, g, gs, u, us, dn, ds in pairs:
            a = (widen(g, gs) @ xs[i]).clamp(max=limit)
            b = (widen(u, us) @ xs[i]).clamp(-limit, limit)
            h = split_reference((a * torch.sigmoid(a) * b)[None], terms)[0]
            out[i] += wt * (widen(dn, ds) @ h)
    return out


def check() -> None:
    """The interpreter against the reference at odd sizes, one and two terms; two terms much closer to the
    unquantised layer than one."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from test_kernels_moe import random_weights  # noqa: PLC0415 - the tests' random experts

    e, d, i, k = 13, 192, 200, 3
    w = random_weights(e, d, i, seed=3)
    x = torch.randn(21, d, generator=torch.Generator().manual_seed(3))
    ids = torch.stack([torch.randperm(e, generator=torch.Generator().manual_seed(j))[:k] for j in range(21)])
    weights = torch.rand(21, k, generator=torch.Generator().manual_seed(4))
    exact = reference(x, w, ids, weights, 10.0, 0)
    for terms in (1, 2):
        r = group_rows(ids, weights, e, 16)
        got = experts(x, w, r, 10.0, terms, block_m=16, down_block_n=64, warps=4, stages=1)
        want = reference(x, w, ids, weights, 10.0, terms)
        err = float((got - want).abs().max() / want.abs().max())
        rms = float((got - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt())
        print(f"{terms} term(s): against its reference {err:.1e}, RMS against the unquantised layer {rms:.1e}")
        assert err < 1e-4, err


def agreement(out_path: str | None) -> None:
    """`--agreement` (see the module's text)."""
    import tempfile  # noqa: PLC0415

    from glm5next.checkpoint.writer import make_tiny_checkpoint  # noqa: PLC0415
    from glm5next.model import moe as moe_module  # noqa: PLC0415
    from glm5next.model.backbone import Glm5NextModel  # noqa: PLC0415
    from glm5next.runtime.cache import allocate_cache  # noqa: PLC0415
    from glm5next.runtime.runner import Runner, Sequence  # noqa: PLC0415

    path = tempfile.mkdtemp()
    make_tiny_checkpoint(path, seed=3, text_overrides={"index_topk": 1024, "num_experts_per_tok": 16})
    bf16 = Glm5NextModel.from_pretrained(path, torch.bfloat16, "cuda", progress=False)
    fp32 = Glm5NextModel.from_pretrained(path, torch.float32, "cuda", progress=False)

    def logits(model, prompts):
        cache = allocate_cache(model.config, len(prompts) * 24, 16, 64, model.embed_tokens.dtype, "cuda",
                               include_mtp=False)
        runner = Runner(model, cache, max_model_len=384)
        seqs = [Sequence(list(p), i, list(range(24 * i, 24 * i + 24))) for i, p in enumerate(prompts)]
        return runner.step(seqs).float()

    def with_terms(terms):
        def prefill(x, ids, weights, w, limit, plan=None):
            return experts(x, w, group_rows(ids, weights, w.gate.shape[0], 128), limit, terms)
        return prefill

    stock_prefill = moe_module.moe_prefill
    g = torch.Generator().manual_seed(17)
    counts = {name: {"hits": 0, "clear_hits": 0} for name in ("widened", "1 term", "2 terms")}
    clear_rows = total = 0
    for _ in range(4):
        prompts = [torch.randint(0, 256, (int(n),), generator=g).tolist() for n in torch.randint(1, 301, (64,), generator=g)]
        exact = logits(fp32, prompts)
        got = {"widened": logits(bf16, prompts)}
        for name, terms in (("1 term", 1), ("2 terms", 2)):
            moe_module.moe_prefill = with_terms(terms)
            try:
                got[name] = logits(bf16, prompts)
            finally:
                moe_module.moe_prefill = stock_prefill
        want = exact.argmax(-1)
        top2 = exact.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 5 * (got["widened"] - exact).pow(2).mean(-1).sqrt()
        clear_rows += int(clear.sum())
        total += len(prompts)
        for name, lg in got.items():
            hit = lg.argmax(-1) == want
            counts[name]["hits"] += int(hit.sum())
            counts[name]["clear_hits"] += int((hit & clear).sum())
    result = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "rows": total,
              "clear_rows": clear_rows, "forms": {}}
    for name, c in counts.items():
        result["forms"][name] = {"top1_all": c["hits"] / total, "top1_clear": c["clear_hits"] / max(clear_rows, 1)}
        print(f"{name}: top-1 against fp32 {c['hits'] / total:.4f} of {total} rows, "
              f"{c['clear_hits'] / max(clear_rows, 1):.4f} of the {clear_rows} clear rows")
    if out_path:
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--agreement", action="store_true")
    ap.add_argument("--tokens", default="2048,8192")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.check:
        check()
        return
    if args.agreement:
        agreement(args.out)
        return
    from glm5next.bench.slice import build_slice_model, slice_config  # noqa: PLC0415 - GPU runs only
    from kda_prefill import log, median_ms  # noqa: PLC0415

    dev = torch.device("cuda")
    model = build_slice_model(slice_config(num_layers=4), dev)
    moe = model.layers[3].mlp
    w = ExpertWeights.of(moe)
    limit = moe.experts.swiglu_limit
    result = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "rows": []}
    gen = torch.Generator(device=dev).manual_seed(0)
    for t in (int(v) for v in args.tokens.split(",")):
        x = (torch.randn(t, w.gate.shape[2], generator=gen, device=dev) * 0.5).to(torch.bfloat16)
        with torch.no_grad():
            ids, weights = moe.gate(x)
        exact = moe_prefill(x.float(), ids, weights, w, limit, prefill_plan(dev)).float()
        row = {"tokens": t, "forms": {}}

        def note(name, fn):
            ms = median_ms(fn, 7)
            got = fn().float()
            rms = float((got - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt())
            row["forms"][name] = {"ms": ms, "rms_vs_fp32": rms}
            log(f"T={t} {name}: {ms:.2f} ms, RMS vs fp32 {rms:.1e}")

        note("widened (production)", lambda: moe_prefill(x, ids, weights, w, limit, prefill_plan(dev)))
        for terms in (1, 2):
            for bm, dn, warps, stages in ((128, 128, 8, 4), (64, 128, 4, 4), (128, 128, 8, 3)):
                def run():
                    r = group_rows(ids, weights, w.gate.shape[0], bm)
                    return experts(x, w, r, limit, terms, bm, dn, warps, stages)
                try:
                    note(f"{terms} term(s) m{bm} n128/{dn} w{warps} s{stages}", run)
                except Exception as exc:  # noqa: BLE001 - a plan the compiler refuses is part of the result
                    log(f"T={t} {terms} term(s) m{bm}: {type(exc).__name__}: {str(exc)[:200]}")
        result["rows"].append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
