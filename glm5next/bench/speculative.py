"""MTP speculative decoding on the slice: verify-step times per q and request count (stock and
specialized) against the floor, the draft layer's time, and tokens per second at assumed acceptance.

For each q = k + 1 and each request count R, R requests of `context` cached tokens verify q tokens
each in one step of R * q tokens: the runner's CUDA graph of that size, stock and planned by the
specialized executor (built with q), replayed and timed replay by replay. The floor is the step's
bytes (`floor.step_bytes` with the routing an eager verify step took; the q tokens of a request share
their reads) over the read bandwidth measured in the same process. Drafting is what follows a verify
step: on the GPU the post-verify CUDA graph (`DraftGraphs`: KDA commit, the MTP layer over the q
verified positions, k draft steps), replayed; on the CPU the eager `MtpDrafter.draft` (catch-up over
the accepted positions, then k - 1 further draft steps).

Random weights accept no draft, so the throughput assumes a mean accepted length L (tokens per
verify step, the bonus token included) from public measurements of GLM-5.3-Flash with MTP (2.5-3):
a step emits R * L tokens in verify + draft time, tokens/s = R * L / (verify_ms + draft_ms) * 1000,
with the draft timed at catch-ups of whole lengths around L and interpolated. L above q is capped at
q (every draft accepted). The baseline is R / (decode step of R tokens). The 45-layer estimate adds
one measured layer of each kind per layer the full model has beyond the slice (as `specialized`).

Without CUDA (`--small --device cpu`, for tests) every step runs eagerly as its capture would and is
timed call by call; the result says so.
"""

from __future__ import annotations

import functools
import math
import random
import statistics
import time

import torch

from ..runtime.draft_graph import DraftGraphs, DraftRequest
from ..forward import CUDAGraphMode, ForwardContext
from ..runtime.runner import Runner
from ..runtime.sampler import SamplingParams
from ..runtime.speculative import DraftRow, MtpDrafter
from ..specialized_decode import STAGES, Policy, SpecializedDecode
from .floor import floor_seconds, measure_read_bandwidth, record_routing, step_bytes, time_replays
from .slice import build_slice_model, fill_context, make_cache, slice_config
from .specialized import _layer_times, _time_graph, full_model_ms
from .stock import _START, StockOptions, _config_summary, _release, _sync, _versions, log, time_eager

PATHS = ("stock", "specialized")

ASSUMED = ("assumed, not measured: random weights accept no draft. L is the mean accepted length (tokens per "
           "verify step, bonus token included) that public measurements of GLM-5.3-Flash with MTP report (2.5-3); "
           "tokens/s = R * L / (verify_ms + draft_ms) * 1000")


def time_draft(drafter: MtpDrafter, rows: list[DraftRow], device: torch.device, iters: int, warmup: int) -> list[float]:
    """Milliseconds of eager drafting for `rows` (`MtpDrafter.draft`, its host syncs included): the CPU's path."""
    return time_eager(lambda: drafter.draft(rows), device, iters, warmup)


def time_draft_graph(graphs: DraftGraphs, size: int, requests: list[DraftRequest], replays: int,
                     warmup: int) -> list[float]:
    """Milliseconds of replays of the post-verify graph of `size` tokens (KDA commit, MTP catch-up over
    the verified positions, k draft steps; greedy) for `requests`, by CUDA events."""
    graphs.load(size, requests)
    return time_replays(graphs.graphs[(size, False)][0], replays, warmup)


DRAFT_TIMING = ("GPU: replays of the post-verify CUDA graph (KDA commit + MTP catch-up + k draft steps), median; "
                "CPU: eager MtpDrafter.draft calls, wall clock, median")

NO_POLICY = "no measured policy for this device (pass --policy, or run `glm5next tune-policy`)"


def _policy(path: str | None, device: torch.device) -> Policy | None:
    if path:
        return Policy.from_file(path)
    return Policy.for_gpu(torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)) if device.type == "cuda" else None


def _items(r: int, q: int, context: int, blocks: list[list[int]], vocab: int, rng: random.Random) -> list:
    """R verify items: request i (KDA slot i) runs q random tokens from position `context`."""
    return [([0] * context + [rng.randrange(vocab) for _ in range(q)], context, q, i, blocks[i]) for i in range(r)]


def _declined(executor: SpecializedDecode | None, runner: Runner, size: int) -> str | None:
    """Why the specialized path runs `size`-token steps stock, or None where the executor plans them."""
    if executor is None:
        return NO_POLICY
    if size not in executor.batches:
        return f"{size} tokens is no planned size (planned: {executor.batches}; at most 64, multiples of q={executor.q})"
    runner._ensure_static()
    md = runner.static.metadata(size, runner.q)
    ctx = ForwardContext({p: md for p in runner.prefixes}, md.positions, CUDAGraphMode.FULL, True)
    return None if executor.plan(ctx, size) is not None else "the executor's plan() declined the step (see its log)"


def _time_step(runner: Runner, items: list, size: int, opts: StockOptions, device: torch.device) -> list[float]:
    """Milliseconds of the step of `items`: graph replays where captured, else eager calls of the path a
    capture records."""
    if runner.graphs:
        runner.load_decode(items, size)
        return time_replays(runner.graphs[size][0], opts.replays, opts.graph_warmup)
    return time_eager(lambda: runner.verify_graph(items), device, opts.eager_iters, opts.eager_warmup)


def _interp(times: dict[int, float], length: float) -> float:
    """The time at fractional catch-up `length`, linear between the whole lengths around it."""
    lo, hi = math.floor(length), math.ceil(length)
    return times[lo] + (length - lo) * (times[hi] - times[lo])


def _measure_q(model, device, q: int, requests: list[int], lengths: list[float], opts: StockOptions,
               policy: Policy | None, bandwidth: float, notes: list) -> list[dict]:
    """Rows of every request count at q tokens per request (q = 1: plain decode steps, the baseline)."""
    config, cuda, k = model.config, device.type == "cuda", q - 1
    sizes = [r * q for r in requests]
    extra = 2 * q  # the verified tokens and the draft positions past them
    cache = make_cache(config, requests[-1], opts.context, opts.block_size, model.embed_tokens.dtype, device,
                       extra_tokens=extra, include_mtp=q > 1, verify_tokens=q if q > 1 else 0)
    blocks = fill_context(cache, requests[-1], opts.context, seed=opts.seed, extra_tokens=extra)
    max_len = len(blocks[0]) * opts.block_size
    executor = SpecializedDecode(model, policy, sizes, q) if policy is not None else None
    runners = {"stock": Runner(model, cache, max_len, sizes, verify_tokens=q)}
    if executor is not None:
        runners["specialized"] = Runner(model, cache, max_len, sizes, executor, verify_tokens=q)
    for path, runner in runners.items():
        if cuda:
            t = time.perf_counter()
            runner.capture()
            log(f"q={q}: {path} graphs of {sizes} tokens captured in {time.perf_counter() - t:.1f} s")
        else:
            runner.graph_mode = True  # eager, through the static buffers and plan a capture would use
    drafters = {}
    if q > 1:
        drafters["stock"] = MtpDrafter(model, cache, k)
        if executor is not None:
            drafters["specialized"] = MtpDrafter(model, cache, k, executor.draft_stages)
        if cuda:
            for path, drafter in list(drafters.items()):
                graphs = DraftGraphs(runners[path], drafter, k)
                t = time.perf_counter()
                graphs.capture()
                log(f"q={q}: {path} drafting graphs captured in {time.perf_counter() - t:.1f} s")
                drafters[path] = graphs
    if cuda:
        timer = functools.partial(_time_graph, replays=opts.replays)
    else:
        def timer(fn):
            with torch.inference_mode():
                return statistics.median(time_eager(fn, device, opts.eager_iters, opts.eager_warmup))
    rng = random.Random(opts.seed + q)
    greedy = SamplingParams(temperature=0.0)
    rows = []
    for r, m in zip(requests, sizes):
        items = _items(r, q, opts.context, blocks, config.vocab_size, rng)
        eager = []
        routing = record_routing(model, lambda: eager.append(runners["stock"].execute_verify(items, r, q)))
        hidden = eager[0][0]
        nbytes = step_bytes(model, cache, routing, m, opts.context, q)
        row = {"k": k, "q": q, "requests": r, "tokens": m, "bytes": nbytes,
               "floor_ms": floor_seconds(nbytes["total"], bandwidth) * 1e3}
        if policy is not None:
            row["policy_choices"] = {s: policy(s, m) or "stock" for s in STAGES}
        logits = {}
        for path in PATHS:
            runner = runners.get(path)
            why = _declined(executor, runner, m) if path == "specialized" else None
            if why is not None:
                row["specialized_declined"] = why
                continue
            times = _time_step(runner, items, m, opts, device)
            row[f"{path}_ms"] = statistics.median(times)
            row[f"{path}_ms_min"] = min(times)
            row[f"{path}_over_floor"] = row[f"{path}_ms"] / row["floor_ms"]
            logits[path] = runner.verify_graph(items)[0].clone()
            row[f"{path}_logits_finite"] = bool(logits[path].isfinite().all())
        if len(logits) == 2:
            want, got = logits["stock"], logits["specialized"]
            row["specialized_vs_stock_rel_err"] = float((got - want).abs().max() / want.abs().max())
            row["top1_agree"] = float((got.argmax(-1) == want.argmax(-1)).float().mean())
        if drafters:
            row["draft"] = _draft_times(drafters, hidden, r, q, lengths, opts, blocks, config.vocab_size, rng, greedy,
                                        device, runners, items)
        runner = runners["specialized"] if "specialized_ms" in row else runners["stock"]
        runner.load_decode(items, m)
        row["layers"] = _layer_times(model, executor if "specialized_ms" in row else None, runner, m, timer)
        for path in PATHS:
            if f"{path}_ms" in row:
                row[f"full_model_{path}_ms"] = full_model_ms(model, row[f"{path}_ms"], row["layers"], path)
        rows.append(row)
        log(f"q={q} R={r}: {m} tokens, {nbytes['total'] / 1e9:.3f} GB, floor {row['floor_ms']:.3f} ms, "
            f"stock {row['stock_ms']:.2f} ms, specialized "
            + (f"{row['specialized_ms']:.2f} ms" if "specialized_ms" in row else f"declined: {row['specialized_declined']}")
            + "".join(f", draft L={n} {'/'.join(f'{t:.2f}' for t in d.values())} ms"
                      for n, d in row.get("draft", {}).get("catch_up", {}).items()))
        if not row["stock_logits_finite"]:
            notes.append(f"q={q} R={r}: non-finite logits in the stock step")
    _sync(device)
    return rows  # the runners, their graphs and the cache go with this frame


def _draft_times(drafters: dict, hidden: torch.Tensor, r: int, q: int, lengths: list[float], opts: StockOptions,
                 blocks: list[list[int]], vocab: int, rng: random.Random, params: SamplingParams,
                 device: torch.device, runners: dict, items: list) -> dict:
    """Draft milliseconds of R requests per path at every whole catch-up length n around the assumed
    lengths (capped at q): n accepted tokens from `context`, then k draft steps (on the GPU through the
    post-verify graph, which also commits the KDA states and runs the MTP layer over all q positions)."""
    whole = sorted({n for length in lengths for n in (math.floor(min(length, q)), math.ceil(min(length, q)))})
    out: dict = {"timing": DRAFT_TIMING, "catch_up": {}}
    seeded = SamplingParams(temperature=params.temperature, seed=0)
    for n in whole:
        times = {}
        for path, d in drafters.items():
            if isinstance(d, DraftGraphs):
                runners[path].load_decode(items, r * q)  # the verify step's metadata, which the graph reads
                reqs = [DraftRequest(str(i), [rng.randrange(vocab) for _ in range(n)], len(blocks[i]) * opts.block_size,
                                     seeded, 0) for i in range(r)]
                t = time_draft_graph(d, r * q, reqs, opts.replays, opts.graph_warmup)
            else:
                rows = [DraftRow(i, blocks[i], opts.context, hidden[i * q : i * q + n],
                                 [rng.randrange(vocab) for _ in range(n)], params) for i in range(r)]
                t = time_draft(d, rows, device, opts.eager_iters, opts.eager_warmup)
            times[f"{path}_ms"] = statistics.median(t)
        out["catch_up"][n] = times
    return out


def _throughput(verify: list[dict], baseline: list[dict], lengths: list[float]) -> list[dict]:
    """Tokens per second of every (q, R) row at every assumed mean accepted length."""
    base = {b["requests"]: b for b in baseline}
    out = []
    for row in verify:
        r, q = row["requests"], row["q"]
        for length in lengths:
            used = min(length, q)
            t = {"requests": r, "k": row["k"], "q": q, "accepted_length": length, "accepted_length_used": used,
                 "accepted_length_assumed": True, "capped_at_q": length > q,
                 "floor_tokens_per_s": r * used / row["floor_ms"] * 1e3}
            for path in PATHS:
                catch_up = {n: d[f"{path}_ms"] for n, d in row["draft"]["catch_up"].items() if f"{path}_ms" in d}
                if f"{path}_ms" not in row or not catch_up:
                    continue
                draft = _interp(catch_up, used)
                t[f"{path}_draft_ms"] = draft
                t[f"{path}_step_ms"] = row[f"{path}_ms"] + draft
                t[f"{path}_tokens_per_s"] = r * used / t[f"{path}_step_ms"] * 1e3
                t[f"full_model_{path}_tokens_per_s"] = r * used / (row[f"full_model_{path}_ms"] + draft) * 1e3
                b = base.get(r, {}).get(f"{path}_tokens_per_s")
                if b:
                    t[f"{path}_over_baseline"] = t[f"{path}_tokens_per_s"] / b
            out.append(t)
    return out


def _best(throughput: list[dict], baseline: list[dict]) -> list[dict]:
    """Per request count and assumed length: the q with the most tokens/s on each path (among the q that can
    reach the length: L <= q), and the baseline."""
    base = {b["requests"]: b for b in baseline}
    out = []
    for r, length in sorted({(t["requests"], t["accepted_length"]) for t in throughput}):
        rows = [t for t in throughput if t["requests"] == r and t["accepted_length"] == length and not t["capped_at_q"]]
        best = {"requests": r, "accepted_length": length, "accepted_length_assumed": True}
        for path in PATHS:
            key = f"{path}_tokens_per_s"
            have = [t for t in rows if key in t]
            if have:
                top = max(have, key=lambda t: t[key])
                best[path] = {"q": top["q"], "tokens_per_s": top[key],
                              "full_model_tokens_per_s": top[f"full_model_{key}"]}
            if base.get(r, {}).get(key):
                best[f"baseline_{path}_tokens_per_s"] = base[r][key]
                best[f"baseline_full_model_{path}_tokens_per_s"] = base[r][f"full_model_{key}"]
        out.append(best)
    return out


def run_speculative(opts: StockOptions, policy_path: str | None, requests, ks, accepted_lengths) -> dict:
    """Everything the module docstring names, as a JSON-ready dict."""
    _START[0] = time.perf_counter()
    device = torch.device(opts.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    requests, ks, lengths = sorted(set(requests)), sorted(set(ks)), sorted(set(accepted_lengths))
    config = slice_config(opts.layers, small=opts.small, with_mtp=True)
    log(f"building the {'small' if opts.small else 'real-width'} {opts.layers}-layer slice with its MTP layer on {device}")
    t = time.perf_counter()
    model = build_slice_model(config, device, seed=opts.seed, with_mtp=True)
    _sync(device)
    policy = _policy(policy_path, device)
    bw = measure_read_bandwidth(device, opts.bw_gib)
    log(f"read bandwidth: {bw['bytes_per_s'] / 1e12:.3f} TB/s ({bw['method']})")
    timing = (f"CUDA-graph replays, median of {opts.replays}" if cuda else
              f"eager steps (no CUDA device, no CUDA graphs): each step runs as its capture would, median of "
              f"{opts.eager_iters} calls; times say little")
    result = {"mode": "speculative", "slice": "small" if opts.small else "real", **_versions(device),
              "context": opts.context, "block_size": opts.block_size, "build_s": time.perf_counter() - t,
              "config": _config_summary(model, config), "graphs": cuda, "timing": timing,
              "draft_timing": DRAFT_TIMING, "requests": requests, "num_speculative_tokens": ks,
              "assumed_acceptance": {"accepted_lengths": lengths, "assumed": True, "note": ASSUMED},
              "policy": None if policy is None else {"source": policy.source, "tables": policy.to_dict()["tables"]},
              "bandwidth": bw, "notes": [], "steps": [], "e2e": []}
    notes = result["notes"]
    notes.append(f"tokens/s at mean accepted length L are {ASSUMED}")
    if policy is None:
        notes.append("no specialized path: " + NO_POLICY)
    if not cuda:
        notes.append("CUDA graphs skipped: no CUDA device; " + timing)
    if any(length > k + 1 for length in lengths for k in ks):
        notes.append("where L > q the tokens/s use L = q (every draft accepted): an upper bound for that q, "
                     "left out of the best q per request count")
    log(f"baseline: plain decode steps of {requests} tokens")
    result["baseline"] = _measure_q(model, device, 1, requests, lengths, opts, policy, bw["bytes_per_s"], notes)
    for b in result["baseline"]:
        for path in PATHS:
            if f"{path}_ms" in b:
                b[f"{path}_tokens_per_s"] = b["requests"] / b[f"{path}_ms"] * 1e3
                b[f"full_model_{path}_tokens_per_s"] = b["requests"] / b[f"full_model_{path}_ms"] * 1e3
    _release(device)
    result["verify"] = []
    for k in ks:
        log(f"k={k}: verify steps of q={k + 1} tokens for {requests} requests")
        result["verify"] += _measure_q(model, device, k + 1, requests, lengths, opts, policy, bw["bytes_per_s"], notes)
        _release(device)
    result["throughput"] = _throughput(result["verify"], result["baseline"], lengths)
    result["best"] = _best(result["throughput"], result["baseline"])
    for b in result["best"]:
        log(f"R={b['requests']} L={b['accepted_length']} (assumed): "
            + (", ".join(f"{p} {b[p]['tokens_per_s']:.1f} tok/s at q={b[p]['q']}" for p in PATHS if p in b) or "no q")
            + "; baseline " + ", ".join(f"{p} {b[f'baseline_{p}_tokens_per_s']:.1f}" for p in PATHS
                                        if f"baseline_{p}_tokens_per_s" in b))
    if cuda:
        result["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device)
    result["total_s"] = time.perf_counter() - _START[0]
    return result


def format_speculative(result: dict) -> str:
    """A readable summary of a speculative result."""
    def cell(value, width, digits):
        return f"{value:>{width}.{digits}f}" if value is not None else f"{'-':>{width}}"

    lines = [f"speculative decoding (MTP), {result['slice']} slice on {result['device']} (torch {result['torch']}, "
             f"triton {result['triton']}), {result['date']}",
             f"read bandwidth {result['bandwidth']['bytes_per_s'] / 1e12:.3f} TB/s; context {result['context']} "
             f"tokens; steps: {result['timing']}; drafting: {result['draft_timing']}",
             f"{'k':>2} {'q':>2} {'R':>3} {'tokens':>6} {'GB':>7} {'floor ms':>9} {'stock ms':>9} {'x floor':>8} "
             f"{'spec ms':>9} {'x floor':>8} {'45L stock':>9} {'45L spec':>9}  draft ms stock/spec by catch-up"]
    for r in result["baseline"] + result["verify"]:
        drafts = "  ".join(f"n={n}: {cell(d.get('stock_ms'), 0, 2)}/{cell(d.get('specialized_ms'), 0, 2)}"
                           for n, d in r.get("draft", {}).get("catch_up", {}).items())
        lines.append(f"{r['k']:>2} {r['q']:>2} {r['requests']:>3} {r['tokens']:>6} {r['bytes']['total'] / 1e9:>7.3f} "
                     f"{r['floor_ms']:>9.3f} {cell(r.get('stock_ms'), 9, 2)} {cell(r.get('stock_over_floor'), 8, 1)} "
                     f"{cell(r.get('specialized_ms'), 9, 2)} {cell(r.get('specialized_over_floor'), 8, 1)} "
                     f"{cell(r.get('full_model_stock_ms'), 9, 1)} {cell(r.get('full_model_specialized_ms'), 9, 1)}  "
                     + (drafts or ("baseline (no drafting)" if r["q"] == 1 else "")))
    lines.append("tokens/s at ASSUMED mean accepted lengths L (random weights accept nothing; L from public "
                 "measurements); * = L capped at q; vfy floor: R * L over the verify step's floor alone")
    lines.append(f"{'R':>3} {'L':>4} {'k':>2} {'stock':>9} {'spec':>9} {'45L stock':>9} {'45L spec':>9} "
                 f"{'vfy floor':>9} {'base stk':>9} {'base spec':>9}")
    base = {b["requests"]: b for b in result["baseline"]}
    for t in result["throughput"]:
        b = base.get(t["requests"], {})
        lines.append(f"{t['requests']:>3} {t['accepted_length']:>4.1f} {t['k']:>2} "
                     f"{cell(t.get('stock_tokens_per_s'), 9, 1)} {cell(t.get('specialized_tokens_per_s'), 9, 1)} "
                     f"{cell(t.get('full_model_stock_tokens_per_s'), 9, 1)} "
                     f"{cell(t.get('full_model_specialized_tokens_per_s'), 9, 1)} {t['floor_tokens_per_s']:>9.1f} "
                     f"{cell(b.get('stock_tokens_per_s'), 9, 1)} {cell(b.get('specialized_tokens_per_s'), 9, 1)}"
                     + (" *" if t["capped_at_q"] else ""))
    lines += [f"note: {n}" for n in result.get("notes", [])]
    return "\n".join(lines)
