"""The specialized executor on the slice: stock eager, stock CUDA graph and specialized CUDA graph
step times against the floor, the per-stage table, and the estimate for the full 45-layer model.

The estimate adds, to the slice's step (layers 0-7 and the head), the measured time of one
KDA+MoE layer and one DSA+MoE layer (each captured alone in a graph, planned and stock) times the
number of such layers the full model has beyond the slice.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from ..config import DSA, KDA
from ..forward import CUDAGraphMode, ForwardContext
from ..runtime.runner import Runner
from ..specialized_decode import Policy, SpecializedDecode
from ..specialized_decode.describe import merge_equal_choices
from .stages import stage_cases, time_choice
from .stock import StockOptions, _items, _release, _step_benchmarks, _versions, attach_step_rates, log, run_e2e
from .floor import capture, measure_read_bandwidth, time_replays
from .slice import build_slice_model, fill_context, make_cache, slice_config

FULL_LAYERS = {"kda_moe": 31, "dsa_moe": 11, "kda_dense": 3}
"""GLM-5.3-Flash's 45 layers by kind: DSA at i % 4 == 3, dense MLPs in layers 0-2."""


def _time_graph(fn, replays: int = 30) -> float:
    """Median milliseconds of replays of a graph capturing `fn` once."""
    return statistics.median(time_replays(capture(fn), replays, 3))


def _layer_times(model, executor: SpecializedDecode | None, runner: Runner, m: int, timer=_time_graph) -> dict:
    """Milliseconds of one KDA+MoE and one DSA+MoE layer at m tokens (the runner's q per sequence, over the
    inputs its static buffers hold), stock and, where the executor plans the step, planned. `timer(fn)`:
    the time of `fn` (default: a CUDA graph of it, replayed)."""
    cfg, dev, dt = model.config, model.embed_tokens.device, model.embed_tokens.dtype
    md = runner.static.metadata(m, runner.q)
    ctx = ForwardContext({p: md for p in runner.prefixes}, md.positions, CUDAGraphMode.FULL, True)
    step = executor.plan(ctx, m) if executor is not None else None
    out = {}
    for kind, name in ((KDA, "kda_moe"), (DSA, "dsa_moe")):
        layer = next(layer for layer in model.layers if layer.layer_kind == kind and layer.mlp_is_moe)
        x = torch.randn(m, cfg.hidden_size, device=dev).to(dt)
        streams = torch.randn(m, cfg.hc_mult, cfg.hidden_size, device=dev).to(dt)
        post = torch.rand(m, cfg.hc_mult, device=dev) * 2
        comb = torch.full((m, cfg.hc_mult, cfg.hc_mult), 1.0 / cfg.hc_mult, device=dev)

        def planned():
            executor.layer(layer, x, False, streams, post, comb, step)
            executor.copies.clear()

        def stock():
            layer(streams, ctx, runner.cache)

        out[name] = {"stock_ms": timer(stock)}
        if step is not None:
            out[name]["specialized_ms"] = timer(planned)
    return out


def full_model_ms(model, step_ms: float, layers: dict, path: str) -> float:
    """The 45-layer estimate of a slice step of `step_ms`: plus, for every layer of each kind the full model
    has beyond the slice, that kind's `path` ("stock" or "specialized") time in `layers` (`_layer_times`)."""
    extra = {k: FULL_LAYERS[k] - sum(1 for layer in model.layers if _kind(layer) == k) for k in FULL_LAYERS}
    return step_ms + sum(n * layers[k][f"{path}_ms"] for k, n in extra.items() if k in layers)


def run_specialized(opts: StockOptions, policy_path: str | None) -> dict:
    """Everything the module docstring names, as a JSON-ready dict."""
    device = torch.device(opts.device or "cuda")
    if device.type != "cuda":
        raise ValueError("the specialized benchmark needs a CUDA device (its steps run as CUDA graphs)")
    config = slice_config(opts.layers, small=opts.small)
    log(f"building the {'small' if opts.small else 'real-width'} {opts.layers}-layer slice")
    model = build_slice_model(config, device, seed=opts.seed)
    policy = Policy.from_file(policy_path) if policy_path else Policy.for_gpu(torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device))
    if policy is None:
        raise ValueError("no policy: pass --policy or run `glm5next tune-policy` first")
    bw = measure_read_bandwidth(device, opts.bw_gib)
    result = {"mode": "specialized", "slice": "small" if opts.small else "real", **_versions(device),
              "context": opts.context, "policy": {"source": policy.source, "tables": policy.to_dict()["tables"]},
              "bandwidth": bw, "notes": [], "e2e": []}
    tokens = sorted(set(opts.tokens))
    rows = {r["tokens"]: r for r in _step_benchmarks(model, config, device, tokens, opts, bw["bytes_per_s"],
                                                      result["notes"])}
    _release(device)
    cache = make_cache(config, tokens[-1], opts.context, opts.block_size, model.embed_tokens.dtype, device)
    blocks = fill_context(cache, tokens[-1], opts.context, seed=opts.seed)
    executor = SpecializedDecode(model, policy, tokens)
    runner = Runner(model, cache, len(blocks[0]) * opts.block_size, tokens, executor)
    t = time.perf_counter()
    runner.capture()
    log(f"specialized graphs captured in {time.perf_counter() - t:.1f} s")
    for m in tokens:
        items = _items(m, opts.context, blocks, config.vocab_size, opts.seed)
        snapshot = [x.clone() for x in cache.tensors()]
        runner.load_decode(items, m)
        graph, logits, _ = runner.graphs[m]
        # Exactness on this state: the planned replay against the stock eager step.
        graph.replay()
        got = logits[:m].clone()
        for x, s in zip(cache.tensors(), snapshot):
            x.copy_(s)
        want = runner.execute(items, m, allow_graph=False)
        rows[m]["specialized_vs_stock_rel_err"] = float((got - want).abs().max() / want.abs().max())
        rows[m]["top1_agree"] = float((got.argmax(-1) == want.argmax(-1)).float().mean())
        for x, s in zip(cache.tensors(), snapshot):
            x.copy_(s)
        del snapshot
        runner.load_decode(items, m)
        times = time_replays(graph, opts.replays, opts.graph_warmup)
        row = rows[m]
        row["specialized_ms"] = statistics.median(times)
        row["specialized_over_floor"] = row["specialized_ms"] / row["floor_ms"]
        row["specialized_bw_fraction"] = row["floor_ms"] / row["specialized_ms"]
        log(f"M={m}: specialized graph {row['specialized_ms']:.2f} ms ({row['specialized_over_floor']:.1f}x floor; "
            f"stock graph {row.get('graph_ms', float('nan')):.2f} ms)")
        row["stages"] = _stage_rows(model, m, policy, bw["bytes_per_s"])
        row["layers"] = _layer_times(model, executor, runner, m)
        for path, key in (("specialized", "specialized_ms"), ("stock", "graph_ms")):
            if key in row:
                row[f"full_model_{path}_ms"] = full_model_ms(model, row[key], row["layers"], path)
    result["steps"] = [rows[m] for m in tokens]
    result["targets"] = stage_targets(result["steps"])
    del runner, executor, cache, graph, logits
    _release(device)
    if not opts.skip_e2e:
        e2e = dataclasses.replace(opts, decode_backend="specialized", policy=policy_path)
        result["e2e"] = run_e2e(model, device, e2e, result["notes"])
        attach_step_rates(result["e2e"], result["steps"], "specialized_ms")
        _release(device)
    result["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device)
    return result


STAGE_TARGETS = (
    # (name, stage, token counts it applies to (None: all), value key, comparison, goal)
    ("boundary <= 8 us at up to 8 tokens", "boundary", 8, "us", "<=", 8.0),
    ("BF16 projections as fast as cuBLAS in the same graph (KDA stage against stock)", "kda_proj", None, "us",
     "<=", "stock_us"),
    ("dense MLP >= 80 % of the read bandwidth", "dense_mlp", None, "bw_fraction", ">=", 0.80),
)
"""The issue's H200 targets that a stage row measures: each its own launches in the graph of a step, against
the bandwidth measured in the same process. (The launch-level ones, a single FP8 projection or one
sublayer's projections in one launch at >= 85 %, are the sweep's: `benchmarks/sweep.py`.)"""


def stage_targets(steps: list[dict]) -> list[dict]:
    """Per target of `STAGE_TARGETS` and token count where its stage ran a specialized choice: the value, the
    goal and whether it is met (stages that ran stock are left out: no choice of ours reached them)."""
    out = []
    for name, stage, up_to, key, op, goal in STAGE_TARGETS:
        for step in steps:
            m = step["tokens"]
            row = next((st for st in step.get("stages", []) if st["stage"] == stage), None)
            if row is None or key not in row or (up_to is not None and m > up_to):
                continue
            g = row[goal] if isinstance(goal, str) else goal
            value = row[key]
            out.append(dict(target=name, stage=stage, tokens=m, value=value, goal=g,
                            met=value <= g if op == "<=" else value >= g))
    return out


def format_targets(targets: list[dict], key: str = "tokens") -> list[str]:
    """One line per target: the token counts (`key` of each row) where it is met, and where not with the value
    against the goal (fractions where the target is one of the read bandwidth, else µs)."""
    lines = []
    for name in dict.fromkeys(t["target"] for t in targets):
        rows = [t for t in targets if t["target"] == name]
        pct = "%" in name

        def show(v):
            return f"{100 * v:.1f} %" if pct else f"{v:.1f} us"

        met = [str(t[key]) for t in rows if t["met"]]
        missed = [f"{t[key]} ({show(t['value'])} against {show(t['goal'])})" for t in rows if not t["met"]]
        lines.append(f"target: {name}: " + (f"met at {', '.join(met)}" if met else "met nowhere")
                     + (f"; not at {', '.join(missed)}" if missed else ""))
    return lines


def _kind(layer) -> str:
    return ("kda" if layer.layer_kind == KDA else "dsa") + ("_moe" if layer.mlp_is_moe else "_dense")


def _subtracted(case) -> str:
    """A log line's note of what the case's times have subtracted: its boundaries alone (none: empty)."""
    return "" if case.before_us is None else f"  (less the boundary alone, {case.before_us:.1f} us)"


def _stage_rows(model, m: int, policy: Policy, bandwidth: float) -> list[dict]:
    rows = []
    for case in stage_cases(model, m):
        choice = policy(case.stage, m)
        stock_us = time_choice(case, "stock")
        row = {"stage": case.stage, "choice": choice or "stock", "bytes": case.bytes_per_call, "stock_us": stock_us,
               "stock_bw_fraction": case.bytes_per_call / (stock_us * 1e-6) / bandwidth}
        if choice is not None:
            us = time_choice(case, choice)
            row.update(us=us, bw_fraction=case.bytes_per_call / (us * 1e-6) / bandwidth)
        if case.before_us is not None:  # what the row subtracts: the boundaries before the stage, alone
            row["before_us"] = case.before_us
        rows.append(row)
        log(f"  M={m} {case.stage:14s} {row['choice']:8s} "
            + (f"{row['us']:8.1f} us ({100 * row['bw_fraction']:5.1f} %)  " if "us" in row else "")
            + f"stock {stock_us:8.1f} us ({100 * row['stock_bw_fraction']:5.1f} %)" + _subtracted(case))
    return rows


def tune_policy(model, sizes, replays: int = 20, stages=None) -> tuple[Policy, dict]:
    """Time every choice (stock included) of every stage (of `stages`, when given) at every size; the fastest
    wins, named by the first choice whose launches equal its own (`merge_equal_choices`)."""
    tables, times = {}, {}
    for m in sizes:
        for case in stage_cases(model, m, stages):
            measured = {}
            for c in case.runs:
                try:
                    measured[c] = time_choice(case, c, replays)
                except Exception as e:  # a choice that fails here is never picked; say why
                    log(f"M={m} {case.stage}: {c} failed: {type(e).__name__}: {e}")
                    torch.cuda.synchronize()
            best = min(measured, key=measured.get)
            tables.setdefault(case.stage, {})[str(m)] = best
            times.setdefault(case.stage, {})[str(m)] = measured
            log(f"M={m} {case.stage:14s} -> {best:8s} " + "  ".join(f"{c} {t:.1f} us" for c, t in measured.items())
                + _subtracted(case))
    # Choices whose launches are equal at a size are one: the first of them (in `STAGES` order) is kept,
    # so timing noise between equal launches never becomes a choice.
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    tables = merge_equal_choices(tables, model.config, sms)
    return Policy(tables, source="tuned"), times
