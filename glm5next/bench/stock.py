"""The stock runtime on the slice: decode-step times (eager and CUDA graph) against the floor, and
end-to-end throughput through the engine.

Per token count M, M sequences decode one token each after `context` cached
tokens of random context. The eager step is `Runner.execute` timed with CUDA
events (the GPU idle before each, median after warm-up); the graph step is
`graph.replay()` of the runner's captured size-M graph, timed replay by replay
with CUDA events. The floor is the step's bytes (`floor.step_bytes`, with the
routing of an eager step) over the read bandwidth measured in the same process.

With `tensor_parallel_size` N (one process per GPU, under torchrun or started by the CLI) every rank
builds its shards of the slice and runs the same steps; the floor is per rank (the bytes its shards,
its KDA states and the replicated DSA caches read) and rank 0 reports.
"""

from __future__ import annotations

import gc
import random
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import triton

from ..parallel.group import init_tensor_parallel, local_rank
from ..runtime.engine_core import LLMEngine
from ..runtime.runner import Runner
from ..runtime.sampler import SamplingParams
from .floor import floor_seconds, measure_read_bandwidth, record_routing, step_bytes, time_replays
from .slice import build_slice_model, fill_context, make_cache, slice_config


@dataclass
class StockOptions:
    small: bool = False
    device: str | None = None
    layers: int = 8
    tokens: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    context: int = 8192
    block_size: int = 16
    eager_iters: int = 10
    eager_warmup: int = 2
    replays: int = 50
    graph_warmup: int = 5
    skip_eager: bool = False
    skip_graph: bool = False
    skip_e2e: bool = False
    prompt_len: int = 64
    gen_len: int = 64
    prefill_lens: tuple[int, ...] = (1024, 8192, 32768)
    prefill_requests: tuple[int, ...] = (1, 8)
    mixed_budgets: tuple[int, ...] = ()
    """Step token budgets (`max_num_batched_tokens`) of the mixed rows: `mixed_decodes` requests decoding while
    one `mixed_prompt`-token prompt is prefilled in chunks beside them (none: no mixed rows)."""
    mixed_decodes: int = 16
    mixed_prompt: int = 8192
    decode_backend: str = "stock"
    """The engine's captured decode steps in the end-to-end part: "stock" or "specialized"."""
    policy: str | None = None
    bw_gib: float = 1.0
    seed: int = 0
    speculative_config: str | None = None
    tensor_parallel_size: int = 1


_START = [time.perf_counter()]
_QUIET = [False]
"""Set on tensor-parallel ranks other than 0: rank 0 alone reports."""


def log(msg: str) -> None:
    """A progress line on stderr with the wall time and the seconds since the run started."""
    if _QUIET[0]:
        return
    print(f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - _START[0]:7.1f}s] {msg}", file=sys.stderr, flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: torch.device) -> None:
    """Free what a finished part left (its cache, runner and graph pool) before the next one."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def time_eager(fn, device: torch.device, iters: int, warmup: int) -> list[float]:
    """Milliseconds of `iters` calls of `fn` after `warmup`, each from an idle device (CUDA events on CUDA)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        _sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def _items(m: int, context: int, blocks: list[list[int]], vocab: int, seed: int) -> list:
    """M decode items: sequence i (KDA slot i) at position `context`, a random token to feed."""
    rng = random.Random(seed + m)
    return [([0] * context + [rng.randrange(vocab)], context, 1, i, blocks[i]) for i in range(m)]


def _versions(device: torch.device) -> dict:
    triton_version = triton.__version__
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _config_summary(model, config) -> dict:
    by_dtype: dict[str, int] = {}
    for p in model.parameters():
        key = str(p.dtype).replace("torch.", "")
        by_dtype[key] = by_dtype.get(key, 0) + p.numel() * p.element_size()
    return {
        "layers": config.num_hidden_layers, "layer_kinds": list(config.layer_kinds),
        "moe_layers": [i for i, m in enumerate(config.moe_layers) if m], "hidden": config.hidden_size,
        "vocab": config.vocab_size, "experts": config.n_routed_experts, "top_k": config.num_experts_per_tok,
        "moe_width": config.moe_intermediate_size, "dense_width": config.intermediate_size,
        "kda_heads": config.linear_num_heads, "kda_head_dim": config.linear_head_dim,
        "mla_heads": config.num_attention_heads, "index_topk": config.index_topk,
        "weight_bytes": sum(by_dtype.values()), "weight_bytes_by_dtype": by_dtype,
    }


def run_stock(opts: StockOptions) -> dict:
    """Run every enabled part; the result as a JSON-ready dict."""
    _START[0] = time.perf_counter()
    device = torch.device(opts.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tp = init_tensor_parallel(opts.tensor_parallel_size, device.type)
    _QUIET[0] = not tp.is_driver
    if tp.size > 1 and device.type == "cuda":
        device = torch.device("cuda", local_rank())
    cuda = device.type == "cuda"
    tokens = sorted(set(opts.tokens))
    result: dict = {"mode": "stock", "slice": "small" if opts.small else "real", **_versions(device),
                    "context": opts.context, "block_size": opts.block_size, "notes": [],
                    "tensor_parallel_size": tp.size}
    config = slice_config(opts.layers, small=opts.small, with_mtp=bool(opts.speculative_config),
                          tensor_parallel=tp.size > 1)
    log(f"building the {'small' if opts.small else 'real-width'} {opts.layers}-layer slice on {device}")
    t = time.perf_counter()
    model = build_slice_model(config, device, seed=opts.seed, with_mtp=bool(opts.speculative_config), tp=tp)
    _sync(device)
    result["build_s"] = time.perf_counter() - t
    result["config"] = _config_summary(model, config)
    log(f"weights: {result['config']['weight_bytes'] / 1e9:.2f} GB in {result['build_s']:.1f} s")

    bw = measure_read_bandwidth(device, opts.bw_gib)
    result["bandwidth"] = bw
    log(f"read bandwidth: {bw['bytes_per_s'] / 1e12:.3f} TB/s ({bw['method']})")

    steps = []
    if tokens and not (opts.skip_eager and opts.skip_graph):
        steps = _step_benchmarks(model, config, device, tokens, opts, bw["bytes_per_s"], result["notes"])
        _release(device)
    result["steps"] = steps

    if tp.size > 1 and not opts.skip_e2e:
        result["notes"].append("end-to-end skipped: the engine's throughput under tensor parallelism is "
                               "measured with `glm5next serve --tensor-parallel-size`")
    if opts.skip_e2e or tp.size > 1:
        result["e2e"] = []
    else:
        result["e2e"] = run_e2e(model, device, opts, result["notes"])
        attach_step_rates(result["e2e"], steps, "graph_ms")
        _release(device)
    if cuda:
        result["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device)
    result["total_s"] = time.perf_counter() - _START[0]
    return result


def _step_benchmarks(model, config, device, tokens, opts: StockOptions, bandwidth: float, notes: list) -> list:
    cuda = device.type == "cuda"
    m_max = tokens[-1]
    cache = make_cache(config, m_max, opts.context, opts.block_size, model.embed_tokens.dtype, device,
                       tp_size=model.tp.size)
    blocks = fill_context(cache, m_max, opts.context, seed=opts.seed)
    runner = Runner(model, cache, max_model_len=len(blocks[0]) * opts.block_size, capture_sizes=tokens)
    cache_gb = sum(t.numel() * t.element_size() for t in cache.tensors()) / 1e9
    log(f"context: {opts.context} tokens x {m_max} sequences, cache {cache_gb:.2f} GB")
    rows = {}
    for m in tokens:
        items = _items(m, opts.context, blocks, config.vocab_size, opts.seed)
        logits = []
        routing = record_routing(model, lambda: logits.append(runner.execute(items, m)))
        nbytes = step_bytes(model, cache, routing, m, opts.context)
        floor_ms = floor_seconds(nbytes["total"], bandwidth) * 1e3
        row = {"tokens": m, "bytes": nbytes, "floor_ms": floor_ms, "logits_finite": bool(logits[0].isfinite().all())}
        if not row["logits_finite"]:
            notes.append(f"M={m}: non-finite logits in the eager step")
        if not opts.skip_eager:
            times = time_eager(lambda: runner.execute(items, m), device, opts.eager_iters, opts.eager_warmup)
            row["eager_ms"] = statistics.median(times)
            row["eager_ms_min"] = min(times)
            row["eager_over_floor"] = row["eager_ms"] / floor_ms
            row["eager_bw_fraction"] = floor_ms / row["eager_ms"]
        rows[m] = row
        log(f"M={m}: {nbytes['total'] / 1e9:.3f} GB, floor {floor_ms:.3f} ms, "
            f"experts {sum(nbytes['distinct_experts'].values())}"
            + (f", eager {row['eager_ms']:.2f} ms" if "eager_ms" in row else ""))
    if opts.skip_graph:
        pass
    elif not cuda:
        notes.append("CUDA graphs skipped: no CUDA device")
    else:
        log(f"capturing CUDA graphs for sizes {tokens}")
        t = time.perf_counter()
        runner.capture()
        log(f"captured in {time.perf_counter() - t:.1f} s")
        for m in tokens:
            items = _items(m, opts.context, blocks, config.vocab_size, opts.seed)
            runner.load_decode(items, m)
            graph, logits, _ = runner.graphs[m]
            times = time_replays(graph, opts.replays, opts.graph_warmup)
            row = rows[m]
            row["graph_ms"] = statistics.median(times)
            row["graph_ms_min"] = min(times)
            row["graph_over_floor"] = row["graph_ms"] / row["floor_ms"]
            row["graph_bw_fraction"] = row["floor_ms"] / row["graph_ms"]
            row["graph_logits_finite"] = bool(logits[:m].isfinite().all())
            log(f"M={m}: graph {row['graph_ms']:.2f} ms ({row['graph_over_floor']:.1f}x the floor)")
    return [rows[m] for m in tokens]  # the runner, its graphs and the cache go with this frame


def run_e2e(model, device: torch.device, opts: StockOptions, notes: list) -> list:
    """Through `LLMEngine` at each concurrency: that many requests of `prompt_len` random tokens, `gen_len`
    greedy tokens each (EOS ignored), CUDA graphs on. Per level: output tokens/s over the whole run, time per
    output token, time to first token, and the steady decode (the steps after every request has its first
    token): its tokens/s, its wall time per step and the engine's host time per step by part
    (`glm5next.runtime.host_times`). Then prefill: `prefill_requests` prompts of each of `prefill_lens`
    tokens at once, one output token each: time to first token and prompt tokens/s. Every shape runs once
    untimed before (its time to first token kept as `cold_ttft_ms`), so what it alone compiles is not timed."""
    levels = sorted(set(opts.concurrency))
    if not levels and not opts.prefill_lens and not opts.mixed_budgets:
        return []
    if opts.speculative_config and model.mtp is None:
        notes.append("end-to-end speculative decoding skipped: the slice has no MTP layer")
        return []
    cuda = device.type == "cuda"
    bs = opts.block_size
    decode_len = opts.prompt_len + opts.gen_len
    prefill_len = max(opts.prefill_lens, default=0) + 1
    max_len = max(decode_len, prefill_len) + bs
    blocks = max(max(levels, default=0) * -(-(decode_len + bs) // bs),
                 max(opts.prefill_requests, default=0) * -(-(prefill_len + bs) // bs))
    max_seqs = max(levels + list(opts.prefill_requests), default=1)
    log(f"end to end: building the engine (concurrency {levels}, graphs {'on' if cuda else 'off: no CUDA'}, "
        f"{opts.decode_backend} decode steps)")
    t = time.perf_counter()
    engine = LLMEngine.from_model(
        model, max_model_len=max_len, max_num_seqs=max_seqs, num_blocks=blocks + 4,
        block_size=bs, enforce_eager=not cuda, capture_sizes=levels or (1,),
        speculative_config=opts.speculative_config, decode_backend=opts.decode_backend, policy=opts.policy,
    )
    log(f"engine ready in {time.perf_counter() - t:.1f} s")
    if not cuda:
        notes.append("end-to-end ran eagerly: no CUDA device")
    rng = random.Random(opts.seed)
    vocab = model.config.vocab_size

    def run(tag: str, n: int, prompt_len: int, p: SamplingParams) -> dict:
        for i in range(n):
            engine.add_request(f"{tag}-{i}", [rng.randrange(vocab) for _ in range(prompt_len)], p)
        steps0, graph0 = engine.stats["steps"], engine.stats["graph_steps"]
        first, done, steps = {}, {}, []
        host = engine.host_times
        t0 = now = time.perf_counter()
        while engine.has_unfinished_requests():
            before = dict(host.seconds)
            outs = engine.step()
            start, now = now, time.perf_counter()  # step() ends in a host sync on the sampled tokens
            for o in outs:
                if o.outputs[0].token_ids and o.request_id not in first:
                    first[o.request_id] = now
                if o.finished:
                    done[o.request_id] = (now, len(o.outputs[0].token_ids))
            steps.append((start, now, len(outs), {k: host.seconds[k] - before[k] for k in before}))
        total = sum(k for _, k in done.values())
        tpot = [(end - first[r]) / (k - 1) for r, (end, k) in done.items() if k > 1]
        row = {"concurrency": n, "prompt_len": prompt_len, "prompt_tokens": n * prompt_len, "output_tokens": total,
               "seconds": now - t0, "output_tokens_per_s": total / max(now - t0, 1e-9),
               "tpot_ms": 1e3 * statistics.mean(tpot) if tpot else float("nan"),
               "ttft_ms": 1e3 * statistics.mean(f - t0 for f in first.values()),
               "steps": engine.stats["steps"] - steps0, "graph_steps": engine.stats["graph_steps"] - graph0}
        last_first = max(first.values(), default=now)
        steady = [s for s in steps if s[0] >= last_first]
        if steady:
            wall = sum(b - a for a, b, _, _ in steady)
            row["decode_steps"] = len(steady)
            row["decode_tokens_per_s"] = sum(k for _, _, k, _ in steady) / max(wall, 1e-9)
            row["decode_step_ms"] = 1e3 * wall / len(steady)
            row["host_ms_per_step"] = {part: 1e3 * sum(s[3][part] for s in steady) / len(steady)
                                       for part in steady[0][3]}
            row["host_work_ms_per_step"] = sum(v for k, v in row["host_ms_per_step"].items() if k != "sample")
        return row

    # Each shape runs once untimed first: its first run pays the compiling of kernels it is the first to need
    # (Triton's JIT, fla's autotuning), which a served model pays once per process. That run's time to first
    # token is kept beside the timed one as `cold_ttft_ms`.
    # The untimed run generates as many tokens as the timed one: its steps mix decodes and prompt chunks alike
    # (s42, H100: after an untimed run of 2 tokens a request, 64 requests' first tokens still took 24.8 s).
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=opts.gen_len)
    rows = []
    for n in levels:
        cold = run(f"c{n}-cold", n, opts.prompt_len, params)
        row = run(f"c{n}", n, opts.prompt_len, params)
        row["cold_ttft_ms"] = cold["ttft_ms"]
        rows.append(row)
        if engine.spec:
            row["speculative"] = engine.spec_metrics()
        log(f"concurrency {n}: {row['output_tokens_per_s']:.1f} output tokens/s, TPOT {row['tpot_ms']:.2f} ms, "
            f"TTFT {row['ttft_ms']:.1f} ms (first run {row['cold_ttft_ms']:.1f}), "
            f"{row['graph_steps']}/{row['steps']} steps from graphs"
            + (f"; steady decode {row['decode_tokens_per_s']:.1f} tokens/s, {row['decode_step_ms']:.2f} ms a step, "
               f"host work {row['host_work_ms_per_step']:.2f} ms" if "decode_steps" in row else "")
            + (f", mean accepted length {row['speculative']['mean_accepted_length']:.2f}" if engine.spec else ""))
    one = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1)
    for length in opts.prefill_lens:
        for n in opts.prefill_requests:
            cold = run(f"p{length}x{n}-cold", n, length, one)
            row = run(f"p{length}x{n}", n, length, one)
            row["prefill"] = True
            row["cold_ttft_ms"] = cold["ttft_ms"]
            row["prefill_tokens_per_s"] = n * length / max(row["seconds"], 1e-9)
            rows.append(row)
            log(f"prefill {n} x {length} tokens: {row['prefill_tokens_per_s']:.0f} tokens/s, "
                f"TTFT {row['ttft_ms']:.1f} ms (its first run {row['cold_ttft_ms']:.1f} ms), {row['steps']} steps")
    del engine
    _release(device)
    for budget in opts.mixed_budgets:
        row = run_mixed(model, device, opts, budget)
        rows.append(row)
        log(f"mixed, budget {budget}: a {row['prompt_len']}-token prompt beside {row['decodes']} decodes: "
            f"TTFT {row['ttft_ms']:.1f} ms ({row['prefill_tokens_per_s']:.0f} tokens/s), decodes "
            f"{row['decode_tokens_per_s']:.1f} tokens/s, longest step {row['max_step_ms']:.1f} ms "
            f"(steady {row['steady_step_ms']:.2f})")
    return rows


def run_mixed(model, device: torch.device, opts: StockOptions, budget: int) -> dict:
    """One mixed row: `opts.mixed_decodes` requests decoding (prompts of `prompt_len` tokens) when one prompt of
    `opts.mixed_prompt` tokens arrives, through an engine whose steps hold at most `budget` tokens (chunked
    prefill: each step runs every decode and up to the rest of the budget of the prompt). The prompt's time to
    first token and prefill tokens/s; the decodes' tokens/s and their longest step while it is prefilled,
    against their steady step before it. A larger budget prefills in fewer, longer steps: prompts come sooner,
    decodes stall longer. The same prompt runs once before, untimed but for its time to first token
    (`cold_ttft_ms`): the mixed steps' first run compiles the kernels they alone use."""
    n, long_len, bs = opts.mixed_decodes, opts.mixed_prompt, opts.block_size
    if n < 1 or long_len < 1 or budget <= n:
        raise ValueError(f"mixed rows: budget {budget} must exceed the {n} decoding requests, and the prompt "
                         f"({long_len} tokens) must not be empty")
    cuda = device.type == "cuda"
    chunks = -(-long_len // (budget - n))
    gen = 2 * chunks + 32  # the decodes outlast their own start, the steady steps and the prompts' chunks
    short_len = opts.prompt_len + gen + bs
    long_cached = long_len + bs
    engine = LLMEngine.from_model(
        model, max_model_len=max(short_len, long_cached) + bs, max_num_seqs=n + 1,
        num_blocks=n * -(-short_len // bs) + -(-long_cached // bs) + 4, block_size=bs, enforce_eager=not cuda,
        capture_sizes=(n,), max_num_batched_tokens=budget, decode_backend=opts.decode_backend, policy=opts.policy)
    rng = random.Random(opts.seed + budget)
    vocab = model.config.vocab_size
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=gen)
    for i in range(n):
        engine.add_request(f"d{i}", [rng.randrange(vocab) for _ in range(opts.prompt_len)], params)
    started: set[str] = set()
    steady = []
    while len(started) < n or len(steady) < 4:  # every decode under way, then a few steady steps timed
        t = time.perf_counter()
        outs = engine.step()
        if len(started) == n:
            steady.append(time.perf_counter() - t)
        started.update(o.request_id for o in outs if o.outputs[0].token_ids)

    def prompt(name: str) -> tuple[float, list[float], int]:
        engine.add_request(name, [rng.randrange(vocab) for _ in range(long_len)],
                           SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1))
        t0 = now = time.perf_counter()
        window, decoded, done = [], 0, False
        while not done:
            outs = engine.step()
            start, now = now, time.perf_counter()
            window.append(now - start)
            decoded += sum(1 for o in outs if o.request_id.startswith("d"))
            done = any(o.request_id == name and o.finished for o in outs)
        return now - t0, window, decoded

    cold, _, _ = prompt("long-cold")  # the mixed steps' first run compiles what they alone use
    ttft, window, decoded = prompt("long")
    if engine.num_unfinished() < n:
        raise RuntimeError(f"mixed row, budget {budget}: a decoding request finished before the prompt did")
    for i in range(n):
        engine.abort_request(f"d{i}")
    del engine
    _release(device)
    return {"mixed": True, "budget": budget, "decodes": n, "prompt_len": long_len, "ttft_ms": 1e3 * ttft,
            "prefill_tokens_per_s": long_len / max(ttft, 1e-9), "steps": len(window),
            "decode_tokens_per_s": decoded / max(ttft, 1e-9), "max_step_ms": 1e3 * max(window),
            "steady_step_ms": 1e3 * statistics.median(steady), "cold_ttft_ms": 1e3 * cold}


def attach_step_rates(e2e: list, steps: list, key: str) -> None:
    """Set each decode row of `e2e` beside the captured step of its concurrency (`key` of `steps`, ms): the
    step's own tokens/s and the engine's steady decode rate as a fraction of it."""
    by_tokens = {r["tokens"]: r for r in steps}
    for row in e2e:
        if row.get("prefill") or row.get("mixed"):
            continue
        step = by_tokens.get(row["concurrency"], {}).get(key)
        if step is None or "decode_tokens_per_s" not in row:
            continue
        row["captured_step_ms"] = step
        row["step_tokens_per_s"] = row["concurrency"] / (step / 1e3)
        row["engine_over_step"] = row["decode_tokens_per_s"] / row["step_tokens_per_s"]
