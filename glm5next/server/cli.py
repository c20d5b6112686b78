"""The `glm5next serve` sub-command."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time

from ..runtime.async_engine import AsyncLLM
from ..runtime.engine_args import EngineArgs
from ..runtime.engine_core import LLMEngine
from .serving import Server
from .settings import SHUTDOWN_TIMEOUT_S, ServerSettings, is_loopback, split_list

logger = logging.getLogger("glm5next.server")

API_KEY_ENV = "GLM5NEXT_API_KEY"
"""The environment variable holding the API key when `--api-key` is not given."""
CONCURRENCY_PER_SEQ = 4
"""Default `--max-concurrent-requests`: this many times `--max-num-seqs`."""


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Register `serve` on an argparse sub-parser collection."""
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    p.add_argument("--model", required=True, help="the checkpoint folder")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    p.add_argument("--api-key", default=None, help=f"callers of /v1 must send 'Authorization: Bearer KEY' (default: "
                   f"${API_KEY_ENV}, which other users of the machine cannot read from the process list)")
    p.add_argument("--allowed-hosts", default=None, help="comma-separated Host names to accept besides IP addresses "
                   "and localhost, e.g. api.example.com,.internal (a leading dot: subdomains; *: any)")
    p.add_argument("--allowed-origins", default=None, help="comma-separated origins whose web pages may call the API "
                   "(CORS), e.g. https://app.example.com (default: none)")
    p.add_argument("--max-concurrent-requests", type=int, default=None, help="generation requests held at once; "
                   f"more are answered 503 (default: {CONCURRENCY_PER_SEQ} x --max-num-seqs)")
    p.add_argument("--shutdown-timeout", type=float, default=SHUTDOWN_TIMEOUT_S, help="seconds live requests may "
                   "run on after SIGTERM or Ctrl-C before they are ended (a second signal ends them at once)")
    p.add_argument("--no-access-log", action="store_true", help="do not log a line per request")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    EngineArgs.add_cli_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_serve)
    return p


def cmd_serve(args) -> int:
    """Load the engine, serve until SIGINT or SIGTERM, then drain and shut down cleanly."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    return asyncio.run(_serve(args))


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The warning due when the server listens beyond this machine without an API key, else None."""
    if is_loopback(host) or api_key is not None:
        return None
    return (f"listening on {host or 'every interface'} without an API key: anyone who can reach the port can use "
            f"the model; set {API_KEY_ENV} or --api-key")


def server_settings(args) -> ServerSettings:
    """The server's settings from the parsed `serve` options (the API key from the environment if not given)."""
    limit = args.max_concurrent_requests or CONCURRENCY_PER_SEQ * args.max_num_seqs
    return ServerSettings(args.served_model_name or args.model, args.api_key or os.environ.get(API_KEY_ENV) or None,
                          split_list(args.allowed_hosts), split_list(args.allowed_origins), limit,
                          access_log=not args.no_access_log)


def engine_args(args) -> EngineArgs:
    """The engine arguments of the parsed `serve` options: a server's (its smaller default step budget)."""
    return EngineArgs.from_cli(args, seed=args.seed, progress=True, serving=True)


async def _serve(args) -> int:
    settings = server_settings(args)  # refuse bad options before loading
    start = time.perf_counter()
    logger.info("loading %s", args.model)
    core = LLMEngine(engine_args(args))
    if not core.tp.is_driver:  # tensor parallelism: rank 0 serves and drives this rank's forwards
        for sig in (signal.SIGINT, signal.SIGTERM):  # rank 0 handles them, then releases this rank
            signal.signal(sig, signal.SIG_IGN)
        core.follow()
        return 0
    logger.info("loaded in %.1f s: %d cache blocks of %d tokens, context %d tokens, up to %d requests at once",
                time.perf_counter() - start, core.plan.num_blocks, core.args.block_size, core.max_model_len,
                core.args.max_num_seqs)
    warning = exposure_warning(args.host, settings.api_key)
    if warning:
        logger.warning(warning)
    engine = AsyncLLM(core)
    try:
        server = await Server(engine, settings, args.host, args.port).start()
    except BaseException:
        await engine.shutdown()
        raise
    signals = asyncio.Queue()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, signals.put_nowait, sig)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
            pass
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"glm5next: serving {settings.model_name!r} on http://{host}:{server.port}/v1 (Ctrl-C to stop)", flush=True)
    failed = asyncio.ensure_future(server.wait())
    first = asyncio.ensure_future(signals.get())
    await asyncio.wait({failed, first}, return_when=asyncio.FIRST_COMPLETED)
    first.cancel()
    code = 0
    try:
        if failed.done():
            logger.error("the HTTP server stopped: %r", failed.exception())
            code = 1
        else:
            logger.info("shutting down: live requests have %.0f s to finish", args.shutdown_timeout)
            closing = asyncio.ensure_future(server.close(args.shutdown_timeout))
            again = asyncio.ensure_future(signals.get())
            await asyncio.wait({closing, again}, return_when=asyncio.FIRST_COMPLETED)
            if again.done():
                logger.info("ending live requests now")
                server.api.hurry()
            again.cancel()
            await closing
    finally:
        await engine.shutdown()
        logger.info("stopped")
    return code
