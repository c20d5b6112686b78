"""Where the GPU waits during a prefill: the idle time between kernels of the slice's prompt, and what the host
was doing then.

    python benchmarks/prefill_gaps.py [--tokens 8192] [--chunk 2048] [--min-gap-us 20] [--out gaps.json]

The prompt runs through the runner's eager step in chunks (as `profile_prefill.py`) once to compile, then
under `torch.profiler` with CPU and CUDA activities and Python stacks. GPU activity (kernels, copies, memsets)
merged into busy intervals; every idle interval of at least `--min-gap-us` between the first and the last
kernel is a gap. A gap whose start a host synchronisation ended at (a CPU event naming Synchronize, a
blocking cudaMemcpy, `aten::item` / `aten::_local_scalar_dense`, running when the GPU went idle) is charged to
that call's innermost glm5next frame: the host waited for the queue to drain and the GPU then waited for the
host. Other gaps are charged to the kernel that ended them (the host was slower than the GPU there). Reports
the idle total against the prefill's wall time, the largest causes, and where the host synchronised.
"""

from __future__ import annotations

import argparse
import bisect
import json
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from glm5next.bench.slice import build_slice_model, make_cache, slice_config
from glm5next.runtime.runner import Runner
from profile_prefill import prefill
from profile_step import short_name

SYNC_MARKERS = ("Synchronize", "aten::item", "aten::_local_scalar_dense")
"""CPU events that wait for the GPU (an asynchronous copy, cudaMemcpyAsync, does not; a pageable one is
followed by a stream synchronisation)."""


def own_frame(stack: list[str]) -> str:
    """The innermost frame of the project in a profiler stack (or its innermost frame)."""
    for frame in stack:
        if "glm5next/" in frame and "/bench/" not in frame:
            return frame[frame.index("glm5next/"):]
    return stack[0] if stack else "?"


def gaps_of(busy: list[tuple[float, float]], min_gap: float) -> list[tuple[float, float]]:
    """Idle intervals of at least `min_gap` between merged busy intervals (sorted by start)."""
    out, end = [], None
    for a, b in sorted(busy):
        if end is not None and a - end >= min_gap:
            out.append((end, a))
        end = b if end is None else max(end, b)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--min-gap-us", type=float, default=20.0)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    config = slice_config(8)
    model = build_slice_model(config, dev)
    cache = make_cache(config, 1, args.tokens, 16, model.embed_tokens.dtype, dev)
    prompts = [torch.randint(0, config.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()]
    blocks = [list(range(cache.num_blocks))]
    runner = Runner(model, cache, args.tokens + 16, capture_sizes=(1,))
    prefill(runner, prompts, blocks, args.chunk)  # compiles, allocates
    torch.cuda.synchronize()
    t = time.perf_counter()
    prefill(runner, prompts, blocks, args.chunk)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        prefill(runner, prompts, blocks, args.chunk)
        torch.cuda.synchronize()
    events = prof.events()
    gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = [(e.time_range.start, e.time_range.end) for e in gpu]
    first, last = min(a for a, _ in busy), max(b for _, b in busy)
    gaps = gaps_of(busy, args.min_gap_us)
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    syncs = [e for e in cpu if any(m in e.name for m in SYNC_MARKERS) or e.name == "cudaMemcpy"]
    framed = sorted((e for e in cpu if e.stack), key=lambda e: e.time_range.start)
    framed_starts = [e.time_range.start for e in framed]

    def frame_of(e) -> str:
        """The innermost project frame of e, or of the innermost op with a stack around it (runtime calls
        such as cudaStreamSynchronize carry none)."""
        if e.stack:
            return own_frame(e.stack)
        i = bisect.bisect_right(framed_starts, e.time_range.start)
        around = [o for o in framed[max(0, i - 64):i] if o.time_range.end >= e.time_range.end]
        return own_frame(min(around, key=lambda o: o.time_range.end - o.time_range.start).stack) if around else "?"

    starts = sorted((e.time_range.start, short_name(e.name)) for e in gpu)
    by_cause: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    keys = [s for s, _ in starts]
    for g0, g1 in gaps:
        waiting = [e for e in syncs if e.time_range.start <= g0 + 1 and e.time_range.end >= g0 - 1]
        if waiting:
            e = max(waiting, key=lambda e: len(e.stack or []))
            cause = f"sync in {frame_of(e)} ({e.name})"
        else:
            i = bisect.bisect_left(keys, g1 - 0.5)
            cause = f"host slower than the GPU before {starts[min(i, len(starts) - 1)][1]}"
        by_cause[cause][0] += g1 - g0
        by_cause[cause][1] += 1
    idle = sum(b - a for a, b in gaps)
    span = last - first
    print(f"{args.tokens} tokens in chunks of {args.chunk}: wall {wall * 1e3:.1f} ms (unprofiled); profiled GPU span "
          f"{span / 1e3:.1f} ms, idle {idle / 1e3:.1f} ms in {len(gaps)} gaps of >= {args.min_gap_us:.0f} us; "
          f"{len(syncs)} host syncs")
    top = sorted(by_cause.items(), key=lambda kv: -kv[1][0])[: args.top]
    for cause, (us, n) in top:
        print(f"  {us / 1e3:8.2f} ms {n:5d} gaps  {cause[:150]}")
    sites: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in syncs:
        site = sites[f"{frame_of(e)} ({e.name})"]
        site[0] += e.time_range.end - e.time_range.start
        site[1] += 1
    sync_sites = sorted(sites.items(), key=lambda kv: -kv[1][1])[: args.top]
    print("host syncs by site (count, host time blocked):")
    for site, (us, n) in sync_sites:
        print(f"  {n:5d} {us / 1e3:8.2f} ms  {site[:150]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(dev), "date": time.strftime("%Y-%m-%d"), "tokens": args.tokens,
                       "chunk": args.chunk, "wall_s": wall, "span_s": span / 1e6, "idle_s": idle / 1e6,
                       "gaps": len(gaps), "syncs": len(syncs),
                       "causes": [{"cause": c, "s": us / 1e6, "gaps": n} for c, (us, n) in top],
                       "sync_sites": [{"site": c, "s": us / 1e6, "count": n} for c, (us, n) in sync_sites]}, f,
                      indent=1)


if __name__ == "__main__":
    main()
