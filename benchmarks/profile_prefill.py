"""Where a prefill spends its time on the slice: prompts run through the runner's eager step in chunks
of the engine's token budget, each decoder sublayer timed with CUDA events around it (KDA and DSA
attention, dense and MoE MLPs; the rest — embedding, mHC boundaries, norms, the head — is the step less
their sum), and the kernels grouped by family (`profile_step.FAMILIES`) from `torch.profiler`.

    python benchmarks/profile_prefill.py [--tokens 8192] [--requests 1] [--chunk 2048] [--out prefill.json]

Reports prompt tokens/s for the whole prefill (the median of `--repeats` runs without timers), each sublayer
kind's share of a run with them and the kernels that take the most time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from glm5next.bench.slice import build_slice_model, make_cache, slice_config
from glm5next.runtime.runner import Runner
from profile_step import family, short_name


def sublayer_timers(model):
    """Forward hooks that record CUDA events around every layer's attention and MLP; returns (the list
    the events land in as (kind, start, end), the hook handles)."""
    events, handles = [], []
    for layer in model.layers:
        for module, kind in ((layer.self_attn, f"attention ({layer.layer_kind})"),
                             (layer.mlp, "mlp (moe)" if layer.mlp_is_moe else "mlp (dense)")):
            def pre(_m, _a, kind=kind):
                start = torch.cuda.Event(enable_timing=True)
                start.record()
                events.append([kind, start, None])

            def post(_m, _a, _o):
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                events[-1][2] = end

            handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    return events, handles


def prefill(runner, prompts: list[list[int]], blocks: list[list[int]], chunk: int) -> None:
    """Every prompt through the eager step, at most `chunk` tokens a step over all of them (as the
    scheduler's token budget cuts them)."""
    done = [0] * len(prompts)
    while any(d < len(p) for d, p in zip(done, prompts)):
        items, budget = [], chunk
        for i, p in enumerate(prompts):
            n = min(len(p) - done[i], budget)
            if n > 0:
                items.append((p, done[i], n, i, blocks[i]))
                budget -= n
        runner.execute(items, 0)
        for (_, c, n, i, _) in items:
            done[i] = c + n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--requests", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=2048, help="tokens a step (the engine's default budget)")
    ap.add_argument("--repeats", type=int, default=5, help="timed prefills (the median is reported)")
    ap.add_argument("--top", type=int, default=30, help="kernels listed by total time")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    config = slice_config(8)
    model = build_slice_model(config, dev)
    cache = make_cache(config, args.requests, args.tokens, 16, model.embed_tokens.dtype, dev)
    per = cache.num_blocks // args.requests
    blocks = [list(range(i * per, (i + 1) * per)) for i in range(args.requests)]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (args.tokens,), generator=g).tolist() for _ in range(args.requests)]
    runner = Runner(model, cache, args.tokens + 16, capture_sizes=(1,))
    prefill(runner, prompts, blocks, args.chunk)  # warm-up: compiles, allocates
    torch.cuda.synchronize()
    walls = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        prefill(runner, prompts, blocks, args.chunk)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t)
    seconds = statistics.median(walls)
    events, handles = sublayer_timers(model)
    t = time.perf_counter()
    prefill(runner, prompts, blocks, args.chunk)
    torch.cuda.synchronize()
    hooked = time.perf_counter() - t
    by_kind: dict[str, float] = defaultdict(float)
    for kind, start, end in events:
        by_kind[kind] += start.elapsed_time(end) / 1e3
    for h in handles:
        h.remove()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        prefill(runner, prompts, blocks, args.chunk)
        torch.cuda.synchronize()
    fams: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    names: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            for table, key in ((fams, family(ev.name)), (names, ev.name)):
                table[key][0] += ev.device_time_total / 1e6
                table[key][1] += 1
    top = sorted(names.items(), key=lambda kv: -kv[1][0])[: args.top]
    tokens = args.tokens * args.requests
    result = {"gpu": torch.cuda.get_device_name(dev), "date": time.strftime("%Y-%m-%d"), "tokens": args.tokens,
              "requests": args.requests, "chunk": args.chunk, "seconds": seconds, "tokens_per_s": tokens / seconds,
              "walls_s": walls, "sublayers_s": dict(by_kind), "hooked_s": hooked,
              "rest_s": hooked - sum(by_kind.values()),
              "families_s": {k: v[0] for k, v in sorted(fams.items(), key=lambda kv: -kv[1][0])},
              "launches": {k: v[1] for k, v in fams.items()},
              "top_kernels": [{"name": short_name(k), "s": v[0], "launches": v[1]} for k, v in top]}
    print(f"{args.requests} x {args.tokens} tokens in chunks of {args.chunk}: {seconds:.3f} s (median of "
          f"{len(walls)}: {', '.join(f'{w:.3f}' for w in walls)}), {tokens / seconds:.0f} tokens/s; sublayers of "
          f"a run with their timers ({hooked:.3f} s):")
    for kind, s in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"    {kind:22s} {s * 1e3:9.1f} ms {100 * s / hooked:5.1f} %")
    rest = result["rest_s"]
    print(f"    {'rest (boundaries, head)':22s} {rest * 1e3:9.1f} ms {100 * rest / hooked:5.1f} %")
    for k, s in result["families_s"].items():
        print(f"      {k:22s} {s * 1e3:9.1f} ms {result['launches'][k]:7d} launches")
    for k, (s, n) in top:
        print(f"        {short_name(k)[:60]:60s} {s * 1e3:9.1f} ms {n:7d}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
