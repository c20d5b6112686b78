"""Each engine step of N concurrent short requests on the real-width slice, built as `glm5next bench`'s end to
end builds it: what the scheduler put in the step (requests, tokens, decodes, preemptions), its wall time, the Triton
kernel variants it compiled or loaded (each with its arguments' specialisation) and, for a slow step, where
the host spent it (cProfile's top entries). A first round of the same shape generates
`--cold-gen` tokens a request (it compiles what the shape needs), the second `--gen`, as the benchmark does.

    python benchmarks/engine_steps.py --concurrency 64 --out steps.json
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import time

import torch
from triton import knobs

from glm5next.bench.slice import build_slice_model, slice_config
from glm5next.runtime.engine_core import LLMEngine
from glm5next.runtime.sampler import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--capture-sizes", default="1,4,16,64")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--cold-gen", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=32785 + 16, help="the benchmark's, for 32K prompts")
    ap.add_argument("--slow-ms", type=float, default=300.0, help="profile steps slower than this")
    ap.add_argument("--policy", default=None)
    ap.add_argument("--small", action="store_true", help="the small slice (a check of this script on the CPU)")
    ap.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                    help="the engine's startup warm-up (default: the engine's, on a GPU)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model = build_slice_model(slice_config(8, small=args.small), device, seed=0)
    n, bs = args.concurrency, 16
    sizes = tuple(int(x) for x in args.capture_sizes.split(","))
    blocks = max(n * -(-(args.prompt_len + args.gen + bs) // bs), 8 * -(-(args.max_model_len) // bs))
    loads = []  # each kernel variant the process compiles or loads from Triton's cache, with its arguments' kinds

    def on_load(*, repr, fn, **_):
        loads.append(f"{fn.module}.{fn.name}: {repr}")

    knobs.runtime.jit_cache_hook = on_load
    warm = {}
    warm_up = LLMEngine._warm_up

    def timed_warm_up(self):  # the engine's startup warm-up, timed with the kernel variants it loads
        t, loaded = time.perf_counter(), len(loads)
        warm_up(self)
        warm.update(seconds=round(time.perf_counter() - t, 2), kernels_loaded=len(loads) - loaded)

    LLMEngine._warm_up = timed_warm_up
    t = time.perf_counter()
    engine = LLMEngine.from_model(model, max_model_len=args.max_model_len, max_num_seqs=max(n, 8),
                                  num_blocks=blocks + 4, block_size=bs, capture_sizes=sizes, enforce_eager=not cuda,
                                  decode_backend="specialized" if cuda else "stock", policy=args.policy,
                                  warmup=args.warmup)
    startup = {"seconds": round(time.perf_counter() - t, 2), "warm_up": warm or None}
    print(f"engine built in {startup['seconds']} s; warm-up {warm or 'not run'}", flush=True)
    plans = []
    schedule = engine.scheduler.schedule

    def recorded():
        out = schedule()
        plans.append({"requests": len(out.scheduled), "tokens": sum(k for _, k in out.scheduled),
                      "decodes": len(out.decodes), "preempted": len(out.preempted)})
        return out

    engine.scheduler.schedule = recorded
    rng = random.Random(0)
    vocab = model.config.vocab_size
    rounds = []
    for rnd, gen in enumerate((args.cold_gen, args.gen)):
        for i in range(n):
            engine.add_request(f"r{rnd}-{i}", [rng.randrange(vocab) for _ in range(args.prompt_len)],
                               SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=gen))
        steps = []
        while engine.has_unfinished_requests():
            prof, before, graphs, loaded = cProfile.Profile(), len(plans), engine.stats["graph_steps"], len(loads)
            t = time.perf_counter()
            prof.enable()
            outs = engine.step()
            prof.disable()
            ms = 1e3 * (time.perf_counter() - t)
            row = {"ms": round(ms, 2), "outputs": len(outs), "graph": engine.stats["graph_steps"] - graphs,
                   "scheduled": plans[before:], "kernels_loaded": loads[loaded:]}
            if ms > args.slow_ms:
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(25)
                row["profile"] = buf.getvalue()
            steps.append(row)
            if len(steps) <= 6 or ms > args.slow_ms:
                print(f"round {rnd} step {len(steps)}: {ms:9.2f} ms, {len(outs)} outputs, graph {row['graph']}, "
                      f"scheduled {row['scheduled']}, {len(row['kernels_loaded'])} kernel variants loaded", flush=True)
                for k in row["kernels_loaded"][:40]:
                    print("    " + k[:300], flush=True)
            if "profile" in row:
                print(row["profile"][-6000:], flush=True)
        rounds.append(steps)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if cuda else "cpu", "concurrency": n,
                       "prompt_len": args.prompt_len, "startup": startup, "rounds": rounds}, f, indent=1)


if __name__ == "__main__":
    main()
