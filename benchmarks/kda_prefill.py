"""KDA prefill: the delta rule of one KDA layer over prompt chunks at real shapes (64 heads of 128),
the stock chunked form (`kda_chunked`, PyTorch) against flash-linear-attention's `chunk_kda` (bounded
gate, `safe_gate`), and the whole KDA sublayer (projections, conv, gates, recurrence, norm, o_proj) as the
stock module runs it, for one 8192-token prompt and for 8 prompts of 1024. fla's call also with its chunk list
built on the device (`use_graph=True`) and with it sized on the host from the lengths the caller already
holds (`cu_seqlens_cpu`): their times, whether they equal the default call, and whether each synchronises
the stream. Run it again with FLA_INTRACARD_CP=1 for fla's split of long sequences over the SMs.

    python benchmarks/kda_prefill.py [--shapes 1x8192,8x1024] [--out kda-prefill.json]

Times are medians of CUDA events over eager calls under inference mode, as the runtime calls them (prefill
is not captured). Accuracy: each form's
outputs and final states against the fp32 chunked reference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from glm5next.bench.slice import build_slice_model, slice_config
from glm5next.model.kda_recurrence import kda_chunked


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def median_ms(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def synchronises(fn) -> bool:
    """Whether a call of `fn` (already compiled) synchronises the stream."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as e:
        if "synchroniz" not in str(e):
            raise
        return True
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return False


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1x8192,8x1024", help="SEQSxTOKENS")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    try:
        from fla.ops.kda import chunk_kda
    except ImportError as e:
        chunk_kda, why = None, str(e)
    else:
        why = None
    config = slice_config(num_layers=1)
    model = build_slice_model(config, dev)
    attn = model.layers[0].self_attn
    h, d = attn.num_heads, attn.head_dim
    result = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "fla": why or "fla-core", "intracard_cp": os.environ.get("FLA_INTRACARD_CP", "0"), "rows": []}
    gen = torch.Generator(device=dev).manual_seed(0)
    for shape in args.shapes.split(","):
        n, length = (int(x) for x in shape.split("x"))
        t = n * length
        x = torch.randn(t, config.hidden_size, generator=gen, device=dev).to(torch.bfloat16) * 0.5
        with torch.no_grad():
            p = attn.project(x)
            mixed = torch.cat([p.q, p.k, p.v], dim=-1)
            keep = attn.conv_kernel - 1
            act = torch.cat([attn.conv_silu(torch.cat([mixed.new_zeros(1, mixed.shape[1], keep),
                                                       mixed[i * length:(i + 1) * length].t().unsqueeze(0)], -1),
                                            x.dtype)[0].t()
                             for i in range(n)])  # fresh prompts: zero history
            q, k, v = attn.heads(act)  # [t, H, K] fp32
            g = attn.log_decay(p.f)
            beta = torch.sigmoid(p.b).float()
        s0 = torch.zeros(h, d, d, device=dev)

        def stock():
            return [kda_chunked(q[i * length:(i + 1) * length], k[i * length:(i + 1) * length],
                                v[i * length:(i + 1) * length], g[i * length:(i + 1) * length],
                                beta[i * length:(i + 1) * length], s0) for i in range(n)]

        row = {"seqs": n, "tokens": length, "stock_ms": median_ms(stock, 3)}
        want = stock()
        want_o = torch.cat([o for o, _ in want])
        want_s = torch.stack([s for _, s in want])
        den_o, den_s = want_o.abs().max(), want_s.abs().max()
        if chunk_kda is not None:
            cu = torch.arange(0, t + 1, length, dtype=torch.int64, device=dev)
            qb, kb, vb = (z.to(torch.bfloat16).unsqueeze(0) for z in (q, k, v))
            init = torch.zeros(n, h, d, d, device=dev)

            cu_host = cu.cpu()

            def fla(use_graph=False, host=None):
                return chunk_kda(qb, kb, vb, g.unsqueeze(0), beta.to(torch.bfloat16).unsqueeze(0), scale=1.0,
                                 initial_state=init, output_final_state=True, safe_gate=True,
                                 lower_bound=attn.lower_bound, cu_seqlens=cu, cu_seqlens_cpu=host,
                                 use_graph=use_graph)

            try:
                row["fla_ms"] = median_ms(fla)
                o, s = fla()
                row["fla_out_err"] = float((o[0].float() - want_o).abs().max() / den_o)
                row["fla_state_err"] = float((s.float() - want_s).abs().max() / den_s)
                row["fla_syncs"] = synchronises(fla)
                # use_graph: fla builds its chunk list on the device (fixed slots, unused ones skipped) instead of
                # sizing it on the host from the device's cu_seqlens, which synchronises the stream each call.
                row["fla_device_list_ms"] = median_ms(lambda: fla(True))
                o2, s2 = fla(True)
                row["fla_device_list_same"] = bool(torch.equal(o2, o) and torch.equal(s2, s))
                row["fla_device_list_syncs"] = synchronises(lambda: fla(True))
                row["fla_host_list_ms"] = median_ms(lambda: fla(host=cu_host))
                o3, s3 = fla(host=cu_host)
                row["fla_host_list_same"] = bool(torch.equal(o3, o) and torch.equal(s3, s))
                row["fla_host_list_syncs"] = synchronises(lambda: fla(host=cu_host))
            except Exception as e:  # noqa: BLE001 - the peer's limits are part of the result
                row["fla_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        result["rows"].append(row)
        log(f"{n}x{length}: stock {row['stock_ms']:.2f} ms, fla {row.get('fla_ms', row.get('fla_error', why))}; "
            f"fla err out {row.get('fla_out_err', float('nan')):.1e} state {row.get('fla_state_err', float('nan')):.1e}"
            f", syncs {row.get('fla_syncs')}; with its chunk list on the device {row.get('fla_device_list_ms')} ms, "
            f"the same outputs {row.get('fla_device_list_same')}, syncs {row.get('fla_device_list_syncs')}; sized from "
            f"host lengths {row.get('fla_host_list_ms')} ms, the same {row.get('fla_host_list_same')}, syncs "
            f"{row.get('fla_host_list_syncs')}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
