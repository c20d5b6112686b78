"""The KDA stage against its floor and its peers: one KDA layer of GLM-5.3-Flash at real shapes (64
heads of 128, conv kernel 4), between the projections and the o_proj.

Per step shape (rows x q tokens per row; q > 1 is a verify): the bytes the stage must move (each row's
fp32 state read, and written where the step writes it; the conv window; the projection rows it reads;
the output; a verify's scratch) over the read bandwidth measured in this process; the stage; the stock
`KimiDeltaAttention.mix` (graph); and flash-linear-attention's `fused_recurrent_kda` (the recurrence with
its gate and beta in the kernel, L2 norms in the kernel: less work than the stage, which also runs the
conv and the output norm). Every time is the median of CUDA-graph replays, each graph holding
`--rotate` calls on different state slots so that the states come from HBM. Accuracy: the stage's
and the stock module's bf16 outputs and states against the fp32 reference.

    python benchmarks/kda_stage.py [--tokens 1,2,4,8,16,32,64] [--verify 2x4,4x4,16x4] [--out kda.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from glm5next.bench.floor import measure_read_bandwidth
from glm5next.bench.slice import build_slice_model, slice_config
from glm5next.config import KDA_L2_EPS
from glm5next.forward import AttnMetadata, KdaState
from glm5next.kernels.kda import KdaScratch, KdaWeights, kda_decode, kda_decode_reference, plan_kda
from glm5next.model.kda import KdaProjections
from moe_stage import log, median_us

ROTATE_BYTES = 256 * 2**20


def metadata(rows: int, q: int, index: torch.Tensor) -> AttnMetadata:
    dev = index.device
    z = torch.zeros(rows * q, dtype=torch.int64, device=dev)
    return AttnMetadata(0, 0, rows, rows * q, z, z, z, index, torch.zeros(rows, 1, dtype=torch.int64, device=dev),
                        torch.ones(rows, dtype=torch.int64, device=dev),
                        num_spec_decodes=rows if q > 1 else 0, num_spec_decode_tokens=rows * q if q > 1 else 0)


def one_kda_layer(dev: torch.device):
    """The slice's first KDA layer at real shapes (random weights) on `dev`, and its kernel weights."""
    model = build_slice_model(slice_config(num_layers=1), dev)
    attn = model.layers[0].self_attn
    return attn, KdaWeights.of(attn, KDA_L2_EPS)


def fla_chain_parts():
    """fla's conv update and gated RMSNorm: with its recurrence, the whole decode chain a vLLM-style KDA
    layer runs on fla's kernels (None where fla lacks them)."""
    try:
        from fla.modules.causal_conv1d.ops import causal_conv1d_update
        from fla.modules.norm.fused_norm_gate import rms_norm_gated
    except ImportError:
        return None
    return causal_conv1d_update, rms_norm_gated


def fla_peer():
    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except ImportError as e:  # the peer is optional
        return None, f"fla not importable: {e}"
    return fused_recurrent_kda_fwd, None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64", help="decode steps: rows of one token")
    ap.add_argument("--verify", default="2x4,4x4,16x4", help="verify steps: ROWSxQ")
    ap.add_argument("--block-v", default=None, help="also time these value blocks, e.g. 32,64,128")
    ap.add_argument("--warps", default="4", help="with --block-v: these warp counts, e.g. 4,8")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    attn, w = one_kda_layer(dev)
    h, d, keep = attn.num_heads, attn.head_dim, attn.conv_kernel - 1
    hk = h * d
    bw = measure_read_bandwidth(dev)["bytes_per_s"]
    fla, fla_why = fla_peer()
    log(f"read bandwidth {bw / 1e12:.2f} TB/s; {h} heads of {d}; fla: {fla_why or 'yes'}")
    shapes = [(int(t), 1) for t in args.tokens.split(",")]
    shapes += [tuple(int(x) for x in s.split("x")) for s in args.verify.split(",") if s]
    state_bytes = h * d * d * 4
    max_rows = max(r for r, _ in shapes)
    n_slots = max(2 * max_rows, ROTATE_BYTES // state_bytes + max_rows)
    gen = torch.Generator(device=dev).manual_seed(0)
    conv = (torch.randn(n_slots + 1, 3 * hk, keep, generator=gen, device=dev)).to(torch.bfloat16)
    recurrent = torch.randn(n_slots + 1, h, d, d, generator=gen, device=dev) * 0.05
    qmax = max(q for _, q in shapes)
    f32 = dict(dtype=torch.float32, device=dev)
    verify = {"window": torch.zeros(n_slots + 1, 3 * hk, keep + qmax, dtype=torch.bfloat16, device=dev),
              "k": torch.zeros(n_slots + 1, qmax, h, d, **f32), "g": torch.zeros(n_slots + 1, qmax, h, d, **f32),
              "v": torch.zeros(n_slots + 1, qmax, h, d, **f32), "beta": torch.zeros(n_slots + 1, qmax, h, **f32)}
    state = KdaState(conv, recurrent, verify)
    result = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "bandwidth": bw,
              "date": time.strftime("%Y-%m-%d"), "fla": fla_why or "fla-core", "rows": []}
    scratch = KdaScratch()
    for rows, q in shapes:
        t = rows * q
        rotate = max(2, min(16, n_slots // rows, -(-ROTATE_BYTES // (rows * state_bytes))))
        perm = torch.randperm(n_slots, generator=torch.Generator().manual_seed(rows * 100 + q))
        indices = [perm[i * rows:(i + 1) * rows].to(dev) for i in range(rotate)]

        def proj():
            return KdaProjections(*(torch.randn(t, width, generator=gen, device=dev).to(torch.bfloat16)
                                    for width in (hk, hk, hk, h, hk, hk)))

        ps = [proj() for _ in range(rotate)]
        outs = [torch.empty(t, hk, dtype=torch.bfloat16, device=dev) for _ in range(rotate)]
        plan = plan_kda(d)
        ver = verify if q > 1 else None
        writes_state = q == 1
        nbytes = (rows * state_bytes * (2 if writes_state else 1) + rows * 3 * hk * keep * 2 * (2 if writes_state else 1)
                  + t * (5 * hk + h) * 2 + t * hk * 2
                  + (0 if writes_state else t * (3 * hk + h) * 4 + rows * 3 * hk * (keep + q) * 2))
        floor_us = nbytes / bw * 1e6

        def stage(plan=plan):
            for p, idx, o in zip(ps, indices, outs):
                kda_decode(*p, conv, recurrent, idx, w, q, plan, ver, out=o, scratch=scratch)

        row = {"rows": rows, "q": q, "bytes": nbytes, "floor_us": floor_us, "plan": plan.describe(),
               "rotate": rotate}
        row["stage_us"] = median_us(stage, rotate)
        row["stage_bw_fraction"] = floor_us / row["stage_us"]
        mds = [metadata(rows, q, idx) for idx in indices]
        row["stock_us"] = median_us(lambda: [attn.mix(p, md, state) for p, md in zip(ps, mds)], rotate)
        if args.block_v:
            row["block_v"] = {}
            for bv in (int(x) for x in args.block_v.split(",")):
                for nw in (int(x) for x in args.warps.split(",")):
                    alt = plan_kda(d, block_v=bv, num_warps=nw)
                    row["block_v"][f"{bv}/{nw}w"] = round(median_us(lambda alt=alt: stage(alt), rotate), 2)
        if fla is not None and q == 1:  # (its verify form takes per-token state indices: not compared)
            try:
                cu = torch.arange(0, t + 1, q, dtype=torch.int64, device=dev)

                def peer():
                    for p, idx in zip(ps, indices):
                        fla(p.q.view(1, t, h, d), p.k.view(1, t, h, d), p.v.view(1, t, h, d), p.f.view(1, t, h, d),
                            p.b.view(1, t, h), A_log=attn.A_log, dt_bias=attn.dt_bias, initial_state=recurrent,
                            scale=d**-0.5, inplace_final_state=True, cu_seqlens=cu, ssm_state_indices=idx,
                            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                            lower_bound=attn.lower_bound)

                row["fla_us"] = median_us(peer, rotate)
            except Exception as e:  # noqa: BLE001 - the peer's limits are part of the result
                row["fla_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            parts = fla_chain_parts()
            if parts is not None:
                try:  # conv update of q, k, v (SiLU), the recurrence, the sigmoid-gated RMSNorm
                    conv_update, norm_gated = parts
                    taps = attn.conv_weight().float()
                    taps = [taps[i * hk:(i + 1) * hk].contiguous() for i in range(3)]
                    windows = [[torch.zeros(rows, hk, keep + 1, dtype=torch.bfloat16, device=dev) for _ in range(3)]
                               for _ in range(rotate)]

                    def chain():
                        for p, idx, win in zip(ps, indices, windows):
                            qc, kc, vc = (conv_update(x.view(t, hk), win[i], weight=taps[i], activation="silu")[0]
                                          for i, x in enumerate((p.q, p.k, p.v)))
                            o, _ = fla(qc.view(1, t, h, d), kc.view(1, t, h, d), vc.view(1, t, h, d),
                                       p.f.view(1, t, h, d), p.b.view(1, t, h), A_log=attn.A_log,
                                       dt_bias=attn.dt_bias, initial_state=recurrent, scale=d**-0.5,
                                       inplace_final_state=True, cu_seqlens=cu, ssm_state_indices=idx,
                                       use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                       use_beta_sigmoid_in_kernel=True, lower_bound=attn.lower_bound)
                            norm_gated(o.view(t * h, d), p.g.view(t * h, d), attn.o_norm_weight, None,
                                       activation="sigmoid", eps=attn.norm_eps)

                    row["fla_chain_us"] = median_us(chain, rotate)
                except Exception as e:  # noqa: BLE001
                    row["fla_chain_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        # Accuracy on fresh copies of the first rotation's slots: stage and stock against fp32.
        p, idx = ps[0], indices[0]
        c0, s0 = conv.clone(), recurrent.clone()
        ref_c, ref_s = c0.float(), s0.clone()
        ref_ver = {k: v.float().clone() for k, v in verify.items()} if ver is not None else None
        want = kda_decode_reference(*(x.float() for x in p), ref_c, ref_s, idx, w, q, ref_ver)
        got = kda_decode(*p, c0, s0, idx, w, q, plan, ver)
        den = want.abs().max()
        row["stage_rel_err"] = float((got.float() - want).abs().max() / den)
        c1, s1 = conv.clone(), recurrent.clone()
        stock_out = attn.mix(p, mds[0], KdaState(c1, s1, verify))
        row["stock_rel_err"] = float((stock_out.float() - want).abs().max() / den)
        if writes_state:
            sl = idx.long()
            sden = ref_s[sl].abs().max()
            row["stage_state_err"] = float((s0[sl] - ref_s[sl]).abs().max() / sden)
            row["stock_state_err"] = float((s1[sl] - ref_s[sl]).abs().max() / sden)
        result["rows"].append(row)
        peer_txt = f"{row['fla_us']:.1f}" if "fla_us" in row else row.get("fla_error", "-")[:80]
        log(f"rows={rows} q={q}: floor {floor_us:.1f} us, stage {row['stage_us']:.1f} us "
            f"({100 * row['stage_bw_fraction']:.0f} %, block_v {plan.block_v}), stock {row['stock_us']:.1f} us, "
            f"fla {peer_txt} (with conv and norm: {row.get('fla_chain_us', row.get('fla_chain_error', '-'))}); "
            f"rel err stage {row['stage_rel_err']:.1e} stock {row['stock_rel_err']:.1e}"
            + (f"; block_v {row['block_v']}" if "block_v" in row else ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
