"""Starting the processes of a tensor-parallel run from the `glm5next` command itself.

`glm5next generate|serve --tensor-parallel-size N`, when not already started by torchrun, starts
N copies of itself on this host with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR/PORT) and `TP_ENV`. SIGINT and SIGTERM go to rank 0, which shuts down cleanly and
releases the other ranks; if any rank fails, the rest are stopped.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from .group import TP_ENV

GRACE_S = 30.0
"""How long the other ranks may take to exit once rank 0 has, or one has failed."""
POLL_S = 0.2
"""How often the launcher looks at its children."""


def rank_env(rank: int, size: int, port: int) -> dict[str, str]:
    """The environment of rank `rank` of `size` processes on this host, as torchrun sets it."""
    return {**os.environ, **TP_ENV, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(size),
            "LOCAL_WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def relaunch(nproc: int, argv: list[str]) -> int:
    """Run `glm5next <argv>` as `nproc` processes, one per device; the exit status (rank 0's, or
    the first failure's)."""
    port = free_port()
    cmd = [sys.executable, "-m", "glm5next.cli", *argv]
    procs = [subprocess.Popen(cmd, env=rank_env(r, nproc, port)) for r in range(nproc)]

    def to_rank0(signum, frame) -> None:
        if procs[0].poll() is None:
            procs[0].send_signal(signum)

    previous = {sig: signal.signal(sig, to_rank0) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = next((c for c in codes if c not in (None, 0)), None)
            if failed is not None or codes[0] is not None:
                break
            time.sleep(POLL_S)
        deadline = time.monotonic() + GRACE_S
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        return next((p.returncode for p in procs if p.returncode != 0), 0)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
