"""The `glm5next bench` sub-command: `glm5next bench --mode stock [options]`."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time

import torch
import torch.distributed as dist

from ..runtime.speculative import MAX_SPECULATIVE_TOKENS
from ..specialized_decode.policy import POLICY_DIR, STAGES, Policy, PolicyError, gpu_slug
from .slice import build_slice_model, slice_config
from .specialized import format_targets, run_specialized, tune_policy
from .speculative import format_speculative, run_speculative
from .stock import StockOptions, _versions, run_stock

DEFAULT_LEVELS = "1,2,4,8,16,32,64"
DEFAULT_REQUESTS = "1,4,16"
DEFAULT_SPEC_TOKENS = "1,2,3"
DEFAULT_ACCEPTED = "2.5,3.0"


PREFILL = (1024, 8192, 32768)
SMALL_PREFILL = (32, 128)
"""The end-to-end prefill rows' prompt lengths by default: the real-width slice's, and the small one's
(which runs on a CPU)."""


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be a positive integer")
    return values


def _length_list(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not values or any(not math.isfinite(v) or v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every accepted length is a number >= 1 (the bonus token counts)")
    return values


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Register `bench` on `subparsers` (from `ArgumentParser.add_subparsers`)."""
    p = subparsers.add_parser(
        "bench", help="decode-step benchmark on the 8-layer slice of GLM-5.3-Flash",
        description="Times the decode step of the first layers of GLM-5.3-Flash (random weights in the "
                    "checkpoint's dtypes, random prior context) against its memory floor, and the engine end to end.",
    )
    p.add_argument("--mode", choices=["stock", "specialized", "speculative"], default="stock",
                   help="stock: the stock runtime (eager, CUDA graph, end to end); specialized: stock vs the "
                        "specialized executor, per-stage table, full-model estimate (needs a GPU); speculative: "
                        "MTP verify steps per q and request count against the floor, drafting, and tokens/s at "
                        "assumed mean accepted lengths")
    p.add_argument("--policy", default=None,
                   help="specialized and speculative modes: a policy JSON (default: the shipped one)")
    p.add_argument("--speculative-config", default=None,
                   help='end to end with MTP speculative decoding, e.g. \'{"method": "mtp", "num_speculative_tokens": 2}\'')
    p.add_argument("--small", action="store_true", help="a reduced-width slice that runs on a CPU in seconds")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="stock mode: shard the slice over N ranks, one process per GPU (under torchrun, or the "
                        "CLI starts them); the floor is per rank and rank 0 writes the results")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--layers", type=int, default=8, help="layers of the slice (default 8)")
    p.add_argument("--tokens", type=_int_list, default=_int_list(DEFAULT_LEVELS),
                   help=f"decode token counts M (default {DEFAULT_LEVELS}; empty: no step benchmark; "
                        f"not used in speculative mode)")
    p.add_argument("--requests", type=_int_list, default=_int_list(DEFAULT_REQUESTS),
                   help=f"speculative mode: concurrent requests R per verify step (default {DEFAULT_REQUESTS})")
    p.add_argument("--num-speculative-tokens", type=_int_list, default=_int_list(DEFAULT_SPEC_TOKENS),
                   help=f"speculative mode: draft tokens k per request, q = k + 1 verified (default {DEFAULT_SPEC_TOKENS})")
    p.add_argument("--accepted-lengths", type=_length_list, default=_length_list(DEFAULT_ACCEPTED),
                   help=f"speculative mode: ASSUMED mean accepted lengths L, tokens per verify step with the bonus "
                        f"token (default {DEFAULT_ACCEPTED}, as public measurements report; random weights accept nothing)")
    p.add_argument("--concurrency", type=_int_list, default=_int_list(DEFAULT_LEVELS),
                   help=f"end-to-end concurrencies (default {DEFAULT_LEVELS})")
    p.add_argument("--context", type=int, default=8192, help="cached tokens before the decoded one (default 8192)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--eager-iters", type=int, default=None,
                   help="timed eager steps per M, or draft calls (median; default 10, speculative mode 5)")
    p.add_argument("--eager-warmup", type=int, default=2)
    p.add_argument("--replays", type=int, default=None,
                   help="timed graph replays per M (median; default 50, speculative mode 15)")
    p.add_argument("--graph-warmup", type=int, default=5)
    p.add_argument("--skip-eager", action="store_true", help="no eager step timing")
    p.add_argument("--skip-graph", action="store_true", help="no CUDA-graph step timing")
    p.add_argument("--skip-e2e", action="store_true", help="no end-to-end engine throughput")
    p.add_argument("--prompt-len", type=int, default=64, help="end-to-end prompt tokens per request")
    p.add_argument("--gen-len", type=int, default=64, help="end-to-end output tokens per request")
    p.add_argument("--prefill-lens", type=_int_list, default=None,
                   help="prompt lengths of the end-to-end prefill rows (default 1024,8192,32768; with --small "
                        "32,128; empty: none)")
    p.add_argument("--prefill-requests", type=_int_list, default=_int_list("1,8"),
                   help="prompts of each length sent together (default 1,8)")
    p.add_argument("--mixed-budgets", type=_int_list, default=_int_list(""),
                   help="step token budgets (max_num_batched_tokens) to time a prompt prefilled beside decoding "
                        "requests under, e.g. 512,2048,8192 (default: none)")
    p.add_argument("--mixed-decodes", type=int, default=16, help="requests decoding in the mixed rows (default 16)")
    p.add_argument("--mixed-prompt", type=int, default=8192, help="the mixed rows' prompt tokens (default 8192)")
    p.add_argument("--bw-gib", type=float, default=1.0, help="GiB of the bandwidth probe buffer (>= 1 on a GPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="result JSON (default bench/results/<date>-<gpu>-<mode>.json)")
    p.set_defaults(func=cmd_bench)
    return p


def default_out_path(result: dict) -> str:
    """`bench/results/<date>-<gpu>-<mode>[-small].json` for a result."""
    name = re.sub(r"^nvidia-", "", re.sub(r"[^a-z0-9]+", "-", result["device"].lower()).strip("-")) or "device"
    small = "-small" if result["slice"] == "small" else ""
    tp = f"-tp{result['tensor_parallel_size']}" if result.get("tensor_parallel_size", 1) > 1 else ""
    return os.path.join("bench", "results", f"{time.strftime('%Y-%m-%d')}-{name}-{result['mode']}{tp}{small}.json")


def _clean(obj):
    """`obj` with non-finite floats as None (strict JSON)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def format_table(result: dict) -> str:
    """A readable summary of a result."""
    if result["mode"] == "speculative":
        return format_speculative(result)
    bw = result["bandwidth"]["bytes_per_s"]
    lines = [f"{result['mode']} runtime, {result['slice']} slice on {result['device']} (torch {result['torch']}, "
             f"triton {result['triton']}), {result['date']}",
             f"read bandwidth {bw / 1e12:.3f} TB/s; context {result['context']} tokens"]

    def cell(row, key, width, digits):
        value = row.get(key)
        return f"{value:>{width}.{digits}f}" if value is not None else f"{'-':>{width}}"

    if result["steps"]:
        spec = any("specialized_ms" in r for r in result["steps"])
        lines.append(f"{'M':>4} {'GB':>8} {'experts':>8} {'floor ms':>9} {'eager ms':>9} {'x floor':>8} "
                     f"{'graph ms':>9} {'x floor':>8}"
                     + (f" {'spec ms':>9} {'x floor':>8} {'45L spec':>9} {'45L stock':>9}" if spec else ""))
        for r in result["steps"]:
            lines.append(f"{r['tokens']:>4} {r['bytes']['total'] / 1e9:>8.3f} "
                         f"{sum(r['bytes']['distinct_experts'].values()):>8} {r['floor_ms']:>9.3f} "
                         f"{cell(r, 'eager_ms', 9, 2)} {cell(r, 'eager_over_floor', 8, 1)} "
                         f"{cell(r, 'graph_ms', 9, 2)} {cell(r, 'graph_over_floor', 8, 1)}"
                         + (f" {cell(r, 'specialized_ms', 9, 2)} {cell(r, 'specialized_over_floor', 8, 1)}"
                            f" {cell(r, 'full_model_specialized_ms', 9, 1)} {cell(r, 'full_model_stock_ms', 9, 1)}"
                            if "specialized_ms" in r else ""))
    for r in result["steps"]:
        for st in r.get("stages", []):
            lines.append(f"  M={r['tokens']:<3} {st['stage']:14s} {st['choice']:8s} "
                         + (f"{st['us']:9.1f} us {100 * st['bw_fraction']:5.1f} % | " if "us" in st else " " * 22)
                         + f"stock {st['stock_us']:9.1f} us {100 * st['stock_bw_fraction']:5.1f} %")
    if result.get("targets"):
        lines += format_targets(result["targets"])
    decode = [r for r in result.get("e2e", []) if not r.get("prefill") and not r.get("mixed")]
    prefill = [r for r in result.get("e2e", []) if r.get("prefill")]
    mixed = [r for r in result.get("e2e", []) if r.get("mixed")]
    if decode:
        parts = list(next((r["host_ms_per_step"] for r in decode if "host_ms_per_step" in r), {}))
        lines.append(f"{'conc':>4} {'out tok':>8} {'seconds':>8} {'tok/s':>9} {'TPOT ms':>8} {'TTFT ms':>8} "
                     f"{'1st TTFT':>8} {'dec tok/s':>9} {'step tok/s':>10} {'x step':>6} {'step ms':>8} "
                     + " ".join(f"{p[:8]:>8}" for p in parts) + "  (steady decode: host ms a step by part)")
        for r in decode:
            host = r.get("host_ms_per_step", {})
            lines.append(f"{r['concurrency']:>4} {r['output_tokens']:>8} {r['seconds']:>8.2f} "
                         f"{r['output_tokens_per_s']:>9.1f} {cell(r, 'tpot_ms', 8, 2)} {r['ttft_ms']:>8.1f} "
                         f"{cell(r, 'cold_ttft_ms', 8, 1)} "
                         f"{cell(r, 'decode_tokens_per_s', 9, 1)} {cell(r, 'step_tokens_per_s', 10, 1)} "
                         f"{cell(r, 'engine_over_step', 6, 2)} {cell(r, 'decode_step_ms', 8, 2)} "
                         + " ".join(cell(host, p, 8, 3) for p in parts))
    if prefill:
        lines.append(f"{'prompts':>7} {'tokens':>7} {'TTFT ms':>9} {'prefill tok/s':>13} {'steps':>6} "
                     f"{'1st TTFT':>9}  (1st: the shape's first run, compiling included)")
        for r in prefill:
            lines.append(f"{r['concurrency']:>7} {r['prompt_len']:>7} {r['ttft_ms']:>9.1f} "
                         f"{r['prefill_tokens_per_s']:>13.0f} {r['steps']:>6} {cell(r, 'cold_ttft_ms', 9, 1)}")
    if mixed:
        lines.append(f"{'budget':>7} {'decodes':>7} {'prompt':>7} {'TTFT ms':>9} {'prefill tok/s':>13} "
                     f"{'dec tok/s':>9} {'max step ms':>11} {'steady ms':>9} {'1st TTFT':>9}  (a prompt prefilled "
                     "beside decodes; 1st: the first such prompt, compiling included)")
        for r in mixed:
            lines.append(f"{r['budget']:>7} {r['decodes']:>7} {r['prompt_len']:>7} {r['ttft_ms']:>9.1f} "
                         f"{r['prefill_tokens_per_s']:>13.0f} {r['decode_tokens_per_s']:>9.1f} "
                         f"{r['max_step_ms']:>11.2f} {r['steady_step_ms']:>9.2f} {cell(r, 'cold_ttft_ms', 9, 1)}")
    lines += [f"note: {n}" for n in result.get("notes", [])]
    return "\n".join(lines)


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def cmd_bench(args) -> int:
    """Run the benchmark `args` describe, write the JSON, print the table; the exit status."""
    speculative = args.mode == "speculative"
    if args.tensor_parallel_size < 1 or (args.tensor_parallel_size > 1 and args.mode != "stock"):
        print("glm5next bench: --tensor-parallel-size must be >= 1, and above 1 only with --mode stock", file=sys.stderr)
        return 2
    eager_iters = args.eager_iters if args.eager_iters is not None else (5 if speculative else 10)
    replays = args.replays if args.replays is not None else (15 if speculative else 50)
    if args.context < 0 or args.layers < 1 or eager_iters < 1 or replays < 1:
        print("glm5next bench: --context must be >= 0, --layers, --eager-iters and --replays >= 1", file=sys.stderr)
        return 2
    if speculative and (not args.requests or not args.num_speculative_tokens
                        or max(args.num_speculative_tokens) > MAX_SPECULATIVE_TOKENS):
        print(f"glm5next bench: --requests must not be empty and --num-speculative-tokens must be 1 to "
              f"{MAX_SPECULATIVE_TOKENS}", file=sys.stderr)
        return 2
    if args.mixed_budgets and (args.mixed_decodes < 1 or args.mixed_prompt < 1
                               or min(args.mixed_budgets) <= args.mixed_decodes):
        print(f"glm5next bench: every --mixed-budgets value must exceed --mixed-decodes ({args.mixed_decodes}: each "
              "step holds every decode first), and --mixed-decodes and --mixed-prompt must be >= 1", file=sys.stderr)
        return 2
    opts = StockOptions(
        small=args.small, device=args.device, layers=args.layers, tokens=args.tokens,
        concurrency=args.concurrency, context=args.context, block_size=args.block_size,
        eager_iters=eager_iters, eager_warmup=args.eager_warmup, replays=replays,
        graph_warmup=args.graph_warmup, skip_eager=args.skip_eager, skip_graph=args.skip_graph,
        skip_e2e=args.skip_e2e, prompt_len=args.prompt_len, gen_len=args.gen_len,
        prefill_lens=args.prefill_lens if args.prefill_lens is not None else SMALL_PREFILL if args.small else PREFILL,
        prefill_requests=args.prefill_requests, mixed_budgets=args.mixed_budgets, mixed_decodes=args.mixed_decodes,
        mixed_prompt=args.mixed_prompt, bw_gib=args.bw_gib, seed=args.seed,
        speculative_config=args.speculative_config, tensor_parallel_size=args.tensor_parallel_size,
    )
    if args.mode == "specialized":
        result = _clean(run_specialized(opts, args.policy))
    elif speculative:
        result = _clean(run_speculative(opts, args.policy, args.requests, args.num_speculative_tokens,
                                        args.accepted_lengths))
    else:
        result = _clean(run_stock(opts))
        if not _is_rank0():
            return 0
    out = args.out or default_out_path(result)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(format_table(result))
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m glm5next.bench.cli [bench options]`: the sub-command without the `glm5next` entry point."""
    parser = argparse.ArgumentParser(prog="glm5next")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())


def add_tune_parser(subparsers) -> argparse.ArgumentParser:
    """Register `tune-policy`: measure every stage choice on this GPU and write the policy table."""
    p = subparsers.add_parser(
        "tune-policy", help="measure every stage choice (stock included) on this GPU and write the policy",
        description="Times every choice of every specialized stage, stock included, at every captured token "
                    "count on the 8-layer real-width slice (CUDA-graph replays, weights cycled past L2), and "
                    "writes the fastest per stage and token count as a policy JSON.",
    )
    p.add_argument("--out", default=None, help="the policy JSON (default: the package's file for this GPU)")
    p.add_argument("--sizes", type=_int_list, default=_int_list("1,2,4,8,16,24,32,48,64"))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stages", default=None, help="comma-separated stages to measure (default: every stage)")
    p.add_argument("--merge", action="store_true",
                   help="keep the token counts of an existing --out file that this run does not measure "
                        "(tune the sizes in parts)")
    p.set_defaults(func=cmd_tune)
    return p


def _load_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def merge_policy_docs(old: dict, new: dict) -> dict:
    """`new` (a tune-policy document) with the token counts it did not measure taken from `old` (an
    earlier policy document): tables and times, sorted by token count. A GPU other than `new`'s is an
    error (its tables would not apply)."""
    if old.get("gpu") not in (None, new.get("gpu")):
        raise PolicyError(f"it was measured on {old.get('gpu')!r}, this run on {new.get('gpu')!r}")
    measured = {stage: set(table) for stage, table in new["tables"].items()}
    merged = dict(new)
    for key in ("tables", "times_us"):
        out = {stage: dict(table) for stage, table in new.get(key, {}).items()}
        for stage, table in (old.get(key) or {}).items():
            if not isinstance(table, dict):
                raise PolicyError(f"{key}[{stage!r}] is not an object")
            for n, value in table.items():
                if n not in measured.get(stage, ()):
                    out.setdefault(stage, {})[n] = value
        merged[key] = {stage: dict(sorted(table.items(), key=lambda kv: int(kv[0]))) for stage, table in out.items()}
    Policy(merged["tables"], source="the merged policy")  # validates what was kept
    if old.get("measured") and old.get("measured") != new.get("measured"):
        what = "; ".join(f"{stage} at {', '.join(sorted(counts, key=int))}" for stage, counts in measured.items())
        merged["measured"] = f"{new.get('measured')} ({what}); the rest {old['measured']}"
    return merged


def cmd_tune(args) -> int:
    if not torch.cuda.is_available():
        print("glm5next tune-policy: needs a CUDA GPU (it measures CUDA-graph replays)", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    model = build_slice_model(slice_config(args.layers), device, seed=args.seed)
    stages = args.stages.split(",") if args.stages else None
    unknown = sorted(set(stages or ()) - set(STAGES))
    if unknown:
        print(f"glm5next tune-policy: unknown stages {unknown} (stages: {', '.join(STAGES)})", file=sys.stderr)
        return 2
    policy, times = tune_policy(model, [m for m in args.sizes if m <= 64], args.replays, stages)
    name = torch.cuda.get_device_name(device)
    out = args.out or os.path.join(POLICY_DIR, gpu_slug(name) + ".json")
    v = _versions(device)
    doc = policy.to_dict(gpu=name, measured=v["date"], torch=v["torch"], triton=v["triton"],
                         by="glm5next tune-policy on the real-width 8-layer slice", times_us=times)
    if args.merge and os.path.exists(out):
        try:
            Policy.from_file(out)  # a readable, valid policy file, or the error naming what is wrong
            doc = merge_policy_docs(_load_json(out), doc)
        except (PolicyError, ValueError) as e:
            print(f"glm5next tune-policy: cannot merge into {out}: {e}", file=sys.stderr)
            return 2
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(_clean(doc), f, indent=1)
        f.write("\n")
    print(f"wrote {out}: {policy}")
    return 0
