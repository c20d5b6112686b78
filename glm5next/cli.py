"""The `glm5next` command: demo, generate, make-tiny."""

from __future__ import annotations

import argparse
import os
import sys
import time

from .bench.cli import add_bench_parser, add_tune_parser
from .bench.slice import GLM53_FLASH_TEXT
from .checkpoint.writer import TP_READY_OVERRIDES, make_tiny_checkpoint
from .config import Glm5NextConfig
from .parallel.group import check_divisible
from .parallel.launch import relaunch
from .runtime.engine import LLM, SamplingParams
from .runtime.engine_args import EngineArgs
from .server.cli import add_serve_parser
from .specialized_decode.describe import describe, format_rows
from .specialized_decode.policy import Policy


def _default_tiny_dir() -> str:
    root = os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
    return os.path.join(root, "glm5next", "tiny")


def _ensure_tiny(path: str) -> str:
    if not os.path.exists(os.path.join(path, "config.json")):
        print(f"writing the small random model to {path}", file=sys.stderr)
        make_tiny_checkpoint(path)
    return path


def cmd_make_tiny(args) -> int:
    make_tiny_checkpoint(args.dir, seed=args.seed, with_mtp=not args.no_mtp,
                         text_overrides=TP_READY_OVERRIDES if args.tp_ready else None)
    print(args.dir)
    return 0


def _run(model: str, prompts: list[str], args) -> int:
    llm = LLM(EngineArgs.from_cli(args, model=model, progress=False))
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        max_tokens=args.max_tokens, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
    )
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    if not llm.engine.tp.is_driver:  # every rank holds the outputs; rank 0 prints them
        return 0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    for o in outs:
        print(f"prompt: {o.prompt!r}\noutput: {o.outputs[0].text!r}\ntoken ids: {o.outputs[0].token_ids}")
    print(f"{n} tokens in {elapsed:.2f} s: {n / max(elapsed, 1e-9):.1f} tokens/s")
    if llm.engine.spec:
        m = llm.engine.spec_metrics()
        print(f"speculative (mtp, k={m['num_speculative_tokens']}): acceptance {m['acceptance_rate']:.1%}, mean accepted "
              f"length {m['mean_accepted_length']:.2f}, by position "
              + " ".join(f"{a:.1%}" for a in m["acceptance_by_position"]))
    return 0


def cmd_generate(args) -> int:
    return _run(args.model, args.prompt, args)


def cmd_demo(args) -> int:
    model = _ensure_tiny(args.model or _default_tiny_dir())
    return _run(model, args.prompt or ["Hello, GLM!", "The quick brown fox"], args)


def _sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    EngineArgs.add_cli_args(p)


def cmd_describe_plan(args) -> int:
    if args.model:
        config = Glm5NextConfig.from_file(args.model)
    else:
        config = Glm5NextConfig.from_dict(dict(GLM53_FLASH_TEXT))
    policy = Policy.from_file(args.policy) if args.policy else Policy.for_gpu("NVIDIA H200", (9, 0))
    try:
        tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--tokens={args.tokens!r}: give integers separated by commas")
    print(f"# {policy.source} on {'the model at ' + args.model if args.model else 'GLM-5.3-Flash shapes'}, "
          f"{args.sms} SMs, bf16")
    print("\n".join(format_rows(describe(config, policy, tokens, args.sms))))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="glm5next", description="GLM-5.3-Flash decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="generate with the built-in small random model")
    p.add_argument("--model", default=None, help="where the small model lives (written if missing)")
    p.add_argument("--prompt", action="append", default=None)
    _sampling_args(p, 32)
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("generate", help="generate from a checkpoint")
    p.add_argument("--model", required=True)
    p.add_argument("--prompt", action="append", required=True)
    _sampling_args(p, 64)
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser("make-tiny", help="write a small random checkpoint in the official layout")
    p.add_argument("dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-mtp", action="store_true")
    p.add_argument("--tp-ready", action="store_true",
                   help="widths that 2, 4 and 8 tensor-parallel ranks split (4 layers, 8 heads of each kind)")
    p.set_defaults(func=cmd_make_tiny)
    p = sub.add_parser("describe-plan", help="print each stage's chosen variant and launch parameters (no GPU)")
    p.add_argument("--tokens", default="1,8,64", help="token counts, e.g. 1,8,64")
    p.add_argument("--policy", default=None, help="a policy JSON (default: the shipped H200 policy over the Hopper default, as the runtime reads it)")
    p.add_argument("--model", default=None, help="a checkpoint folder or config.json (default: GLM-5.3-Flash shapes)")
    p.add_argument("--sms", type=int, default=132, help="SMs of the GPU the plans fill (default: 132, H100/H200)")
    p.set_defaults(func=cmd_describe_plan)

    add_serve_parser(sub)
    add_bench_parser(sub)
    add_tune_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    tp = getattr(args, "tensor_parallel_size", 1)
    try:
        if tp > 1 and "WORLD_SIZE" not in os.environ:  # not started by torchrun: start the ranks under it
            if getattr(args, "model", None):  # refuse a size the model cannot split once, not once per rank
                check_divisible(Glm5NextConfig.from_file(args.model), tp)
            return relaunch(tp, sys.argv[1:] if argv is None else list(argv))
        return args.func(args)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"glm5next: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
