"""Starting the processes of a tensor-parallel run from the `glm5next` command itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from .group import TP_ENV


def torchrun_command(nproc: int, argv: list[str]) -> list[str]:
    """The command that runs `glm5next <argv>` as `nproc` processes on this host under torchrun."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "glm5next.cli", *argv]


def relaunch(nproc: int, argv: list[str]) -> int:
    """Run `glm5next <argv>` as `nproc` processes under torchrun, with `TP_ENV` set, forwarding
    SIGINT and SIGTERM to it; the exit status."""
    env = {**os.environ, **TP_ENV}
    child = subprocess.Popen(torchrun_command(nproc, argv), env=env)

    def forward(signum, frame) -> None:
        child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
