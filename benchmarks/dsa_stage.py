"""The DSA stage against its floor and the stock module: one DSA layer of GLM-5.3-Flash at real shapes
(64 heads, latent 512, indexer 32 x 128, top-512 pools of 4), between the projections and the o_proj.

Per context and step shape (rows x q tokens per row; q > 1 is a verify): the bytes the stage must move
over the read bandwidth measured in this process — every visible pool's pooled key, the selected latent
rows (one token's selection per row: a lower bound on a verify row's union), W_UK and W_UV (as the
stage reads them, with their block scales: the checkpoint's FP8; `floor_fp8_us` counts them as FP8 in
any case), the step's latent, indexer key
and gate rows written, and the pools its tokens complete; the stage (cache writes, scores, selection,
attention, value-up; its indexer and attention launches also alone); the stock `SparseMLA.attention`
(graph). Every time is the median of CUDA-graph replays, each graph holding `rotate` calls on different
sequences and different W_UK/W_UV copies so that the step's bytes come from HBM. Accuracy: the stage's
values against the stock module's, and the share of rows whose selected pools are equal.

    python benchmarks/dsa_stage.py [--contexts 8192,131072] [--tokens 1,2,4,8,16,32,64] [--verify 16x4]
                                   [--attend 64/32/8,...] [--plans 'block_v=64;...'] [--out dsa.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import glm5next
from glm5next.bench.floor import capture, measure_read_bandwidth, time_replays
from glm5next.bench.slice import GLM53_FLASH_TEXT, build_slice_model
from glm5next.config import Glm5NextConfig
from glm5next.forward import DsaCache
from glm5next.kernels.dsa import DsaWeights, index_scores, plan_dsa, select_pools, sparse_attention
from glm5next.model.dsa import DsaProjections
from glm5next.runtime.metadata import build_metadata
from glm5next.specialized_decode.dsa import DsaStage

ROTATE_BYTES = 256 * 2**20
BLOCK_SIZE = 64


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def median_us(fn, calls: int, replays: int = 20) -> float:
    graph = capture(fn)
    us = statistics.median(time_replays(graph, replays, 3)) * 1e3 / calls
    del graph
    return us


def one_dsa_layer_config() -> Glm5NextConfig:
    """GLM-5.3-Flash cut to one DSA layer (with a dense MLP, unused here)."""
    raw = {**GLM53_FLASH_TEXT, "num_hidden_layers": 1, "layer_types": ["deepseek_sparse_attention"],
           "mlp_layer_types": ["dense"], "num_nextn_predict_layers": 0}
    return Glm5NextConfig.from_dict(raw)


def random_cache(config: Glm5NextConfig, seqs: int, context: int, q: int, dev) -> tuple[DsaCache, int]:
    """One layer's paged caches for `seqs` sequences of `context` random tokens plus q new ones, and the
    blocks per sequence."""
    per = -(-(context + q) // BLOCK_SIZE)
    blocks = seqs * per
    r, d, kp = config.kv_lora_rank, config.index_head_dim, config.index_kpool
    gen = torch.Generator(device=dev).manual_seed(0)

    def filled(width, std, rows=BLOCK_SIZE):
        t = torch.empty(blocks + 1, rows, width, dtype=torch.bfloat16, device=dev)
        for b in range(0, blocks + 1, 4096):
            e = min(blocks + 1, b + 4096)
            t[b:e] = torch.randn(e - b, rows, width, generator=gen, device=dev).mul_(std)
        return t

    cache = DsaCache(filled(r, 1.0), filled(d, 1.0), filled(d, 1.0), filled(d, 0.5, BLOCK_SIZE // kp))
    return cache, per


def launch_times(fn, calls: int) -> list[tuple[str, float]]:
    """The kernels of one of `calls` equal calls in launch order, each the median of its time over the calls
    and three replays of their graph (under the profiler)."""
    graph = capture(fn)
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
    evs = sorted((ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda ev: ev.time_range.start)
    per = len(evs) // (3 * calls)
    times = [[] for _ in range(per)]
    for i, ev in enumerate(evs[: per * 3 * calls]):
        times[i % per].append(ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total)
    del graph
    return [(evs[i].name.split("(")[0][:40], statistics.median(times[i])) for i in range(per)]


def step_bytes(config: Glm5NextConfig, rows: int, q: int, context: int, w: DsaWeights) -> tuple[int, int]:
    """The stage's bytes floor of one step (W_UK/W_UV as the stage reads them), and the same with them as
    the checkpoint's FP8 with 128 x 128 block scales."""
    kp, d, r = config.index_kpool, config.index_head_dim, config.kv_lora_rank
    positions = range(context, context + q)
    visible = (positions[-1] + 1) // kp
    lat_rows = max(min(config.index_topk_pools, (p + 1) // kp) * kp + (p + 1) % kp for p in positions)
    completes = sum(1 for p in positions if p % kp == kp - 1)
    per_row = visible * d * 2 + lat_rows * r * 2 + q * (r + 2 * d) * 2 + completes * (kp * 2 * d * 2 + d * 2)
    weights = sum(x.numel() * x.element_size() for x in (w.w_uk, w.w_uv_t, w.w_uk_scale, w.w_uv_t_scale)
                  if x is not None)
    elems = w.w_uk.numel() + w.w_uv_t.numel()
    fp8 = elems + elems // (128 * 128) * 4
    return rows * per_row + weights, rows * per_row + fp8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="8192,131072")
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64", help="decode steps: rows of one token")
    ap.add_argument("--verify", default="16x4", help="verify steps: ROWSxQ")
    ap.add_argument("--no-stock", action="store_true", help="skip the stock module")
    ap.add_argument("--attend", default="", help="also time the attention alone at these plans: HEADS/BLOCK_N/WARPS[/SPLITS],...")
    ap.add_argument("--plans", default="", help="and at these plan overrides, ';' between plans, e.g. "
                    "'block_v=64;block_r=64,up_block_k=128'")
    ap.add_argument("--profile", action="store_true", help="the stage's kernels in launch order (torch.profiler over "
                    "graph replays: each launch's time, the median over the rotated calls)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    config = one_dsa_layer_config()
    model = build_slice_model(config, dev)
    attn = model.layers[0].self_attn
    h, n, hi, d = attn.num_heads, attn.nope_dim, attn.indexer.n_heads, attn.indexer.head_dim
    bw = measure_read_bandwidth(dev)["bytes_per_s"]
    log(f"read bandwidth {bw / 1e12:.2f} TB/s; package {os.path.relpath(os.path.dirname(glm5next.__file__))}")
    shapes = [(int(t), 1) for t in args.tokens.split(",")]
    shapes += [tuple(int(x) for x in s.split("x")) for s in args.verify.split(",") if s]
    result = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "bandwidth": bw,
              "package": os.path.relpath(os.path.dirname(glm5next.__file__)),  # the checkout's or a base's
              "date": time.strftime("%Y-%m-%d"), "rows": []}
    base = DsaStage(attn, torch.bfloat16)
    qmax = max(q for _, q in shapes)
    for context in (int(c) for c in args.contexts.split(",")):
        fp = step_bytes(config, 1, 1, context, base.weights)[0]
        rotations = {(rows, q): max(2, min(8, -(-ROTATE_BYTES // max(1, step_bytes(config, rows, q, context,
                                                                                     base.weights)[0]))))
                     for rows, q in shapes}
        n_seqs = max(rows * rotations[(rows, q)] for rows, q in shapes)
        cache, per = random_cache(config, n_seqs, context, qmax, dev)
        stages = [base] + [DsaStage(attn, torch.bfloat16) for _ in range(max(rotations.values()) - 1)]
        log(f"context {context}: {n_seqs} sequences cached, {fp / 1e6:.1f} MB floor per row")
        for rows, q in shapes:
            t = rows * q
            rotate = rotations[(rows, q)]
            gen = torch.Generator(device=dev).manual_seed(rows * 100 + q)
            mds, ps = [], []
            for k in range(rotate):
                tables = [list(range((k * rows + i) * per, (k * rows + i + 1) * per)) for i in range(rows)]
                mds.append(build_metadata([q] * rows, [context] * rows, rows, list(range(rows)), tables, BLOCK_SIZE,
                                          dev))

                def rnd(*shape, dtype=torch.bfloat16):
                    return torch.randn(*shape, generator=gen, device=dev).to(dtype)

                ps.append(DsaProjections(rnd(t, h, n), rnd(t, config.kv_lora_rank), rnd(t, hi, d),
                                         rnd(t, hi, dtype=torch.float32) * 0.1, rnd(t, d), rnd(t, d)))
            nbytes, nbytes_fp8 = step_bytes(config, rows, q, context, base.weights)
            row = {"context": context, "rows": rows, "q": q, "bytes": nbytes, "floor_us": nbytes / bw * 1e6,
                   "floor_fp8_us": nbytes_fp8 / bw * 1e6, "rotate": rotate,
                   "plan": base.plan(t, mds[0].block_tables.shape[1] * cache.pooled_key.shape[1]).describe()}
            row["stage_us"] = median_us(lambda: [stages[k](ps[k], mds[k], cache) for k in range(rotate)], rotate)
            row["stage_bw_fraction"] = row["floor_us"] / row["stage_us"]

            def indexer_only():
                for k in range(rotate):
                    md, s, w = mds[k], stages[k], stages[k].weights
                    plan = s.plan(t, md.block_tables.shape[1] * cache.pooled_key.shape[1])
                    sc = s.scratch.get("scores", (t, md.block_tables.shape[1] * cache.pooled_key.shape[1]),
                                       torch.float32, dev)
                    index_scores(ps[k].qi, ps[k].wi, md.positions, md.slot_mapping, md.token_to_seq, md.block_tables,
                                 cache.pooled_key, w.kpool, w.index_scale, plan, sc)
                    select_pools(sc, md.positions, md.slot_mapping, w.kpool, w.topk_pools, plan,
                                 s.scratch.get("sel", (t, w.topk_pools), torch.int64, dev),
                                 s.scratch.get("count", (t,), torch.int32, dev), s.scratch)

            def attention_only():
                for k in range(rotate):
                    md, s, w = mds[k], stages[k], stages[k].weights
                    plan = s.plan(t, md.block_tables.shape[1] * cache.pooled_key.shape[1])
                    sparse_attention(ps[k].q, s.scratch.get("sel", (t, w.topk_pools), torch.int64, dev),
                                     s.scratch.get("count", (t,), torch.int32, dev), md.positions, md.slot_mapping,
                                     md.token_to_seq, md.block_tables, cache.latent, w, plan, scratch=s.scratch)

            if args.profile:
                try:
                    row["stage_kernels"] = launch_times(
                        lambda: [stages[k](ps[k], mds[k], cache) for k in range(rotate)], rotate)
                    log(f"ctx={context} rows={rows} q={q} kernels: " + ", ".join(f"{n} {us:.1f}"
                                                                                 for n, us in row["stage_kernels"]))
                except Exception as e:  # noqa: BLE001 - the profile is an extra: the row's timings still count
                    log(f"ctx={context} rows={rows} q={q}: no kernel profile ({type(e).__name__}: {e})")
            row["indexer_us"] = median_us(indexer_only, rotate)
            row["attention_us"] = median_us(attention_only, rotate)
            variants = {}
            overrides = {}
            for v in filter(None, args.attend.split(",")):
                hp, bn, wp, *sp = (int(x) for x in v.split("/"))
                overrides[v] = dict(heads_per_program=hp, block_n=bn, attend_warps=wp, **({"kv_splits": sp[0]} if sp else {}))
            for v in filter(None, args.plans.split(";")):
                overrides[v] = {k: int(x) for k, x in (kv.split("=") for kv in v.split(","))}
            for v, over in overrides.items():
                w0 = base.weights
                vplan = plan_dsa(t, h, mds[0].block_tables.shape[1] * cache.pooled_key.shape[1], w0.topk_pools, w0.kpool,
                                 torch.cuda.get_device_properties(dev).multi_processor_count, **over)

                def attention_variant(vplan=vplan):
                    for k in range(rotate):
                        md, s, w = mds[k], stages[k], stages[k].weights
                        sparse_attention(ps[k].q, s.scratch.get("sel", (t, w.topk_pools), torch.int64, dev),
                                         s.scratch.get("count", (t,), torch.int32, dev), md.positions,
                                         md.slot_mapping, md.token_to_seq, md.block_tables, cache.latent, w, vplan,
                                         scratch=s.scratch)

                try:
                    variants[v] = round(median_us(attention_variant, rotate), 1)
                except Exception as e:  # a tile that does not fit this GPU's registers or shared memory
                    variants[v] = f"{type(e).__name__}"
            if variants:
                row["attention_variants_us"] = variants
            # Accuracy on the first rotation: the stage's values and pools against the stock module's.
            got, got_sel = stages[0](ps[0], mds[0], cache, return_selection=True)
            want, want_sel = attn.attention(ps[0], mds[0], cache, return_selection=True, graph_safe=True)
            row["rel_err_vs_stock"] = float((got - want).abs().max() / want.abs().max())
            same = [set(a.tolist()) - {-1} == set(b.tolist()) - {-1} for a, b in zip(got_sel, want_sel)]
            row["same_selection"] = sum(same) / len(same)
            if not args.no_stock:
                row["stock_us"] = median_us(
                    lambda: [attn.attention(ps[k], mds[k], cache, graph_safe=True) for k in range(rotate)], rotate,
                    replays=5)
            result["rows"].append(row)
            stock = f"{row['stock_us']:.1f}" if "stock_us" in row else "-"
            log(f"ctx={context} rows={rows} q={q}: floor {row['floor_us']:.1f} us (fp8 W {row['floor_fp8_us']:.1f}), "
                f"stage {row['stage_us']:.1f} us ({100 * row['stage_bw_fraction']:.0f} %; indexer "
                f"{row['indexer_us']:.1f}, attention {row['attention_us']:.1f}), stock {stock} us; rel err "
                f"{row['rel_err_vs_stock']:.1e}, same pools {100 * row['same_selection']:.0f} %"
                + (f"; attention plans {row['attention_variants_us']}" if "attention_variants_us" in row else ""))
        cache = stages = None  # free this context's caches before the next one's
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
