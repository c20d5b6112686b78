"""The `glm5next serve` sub-command."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from ..runtime.async_engine import AsyncLLM
from ..runtime.engine_args import EngineArgs
from ..runtime.engine_core import LLMEngine
from .api import start_server


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Register `serve` on an argparse sub-parser collection."""
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    p.add_argument("--model", required=True, help="the checkpoint folder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    EngineArgs.add_cli_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_serve)
    return p


def cmd_serve(args) -> int:
    """Load the engine, serve until SIGINT or SIGTERM, then shut down cleanly."""
    return asyncio.run(_serve(args))


async def _serve(args) -> int:
    core = LLMEngine(EngineArgs.from_cli(args, seed=args.seed, progress=False))
    if not core.tp.is_driver:  # tensor parallelism: rank 0 serves and drives this rank's forwards
        for sig in (signal.SIGINT, signal.SIGTERM):  # rank 0 handles them, then releases this rank
            signal.signal(sig, signal.SIG_IGN)
        core.follow()
        return 0
    engine = AsyncLLM(core)
    name = args.served_model_name or args.model
    try:
        server = await start_server(engine, name, args.host, args.port)
    except BaseException:
        await engine.shutdown()
        raise
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
            pass
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"glm5next: serving {name!r} on http://{host}:{server.port}/v1 (Ctrl-C to stop)", flush=True)
    try:
        await stop.wait()
    finally:
        print("glm5next: shutting down", file=sys.stderr, flush=True)
        await server.close()
        await engine.shutdown()
    return 0
