"""The other ranks of `LLM(..., tensor_parallel_size=N)` built in an ordinary process.

Outside torchrun, `LLM` starts N - 1 worker processes on this host before it builds its own engine: each
runs `python -m glm5next.runtime.tp_workers ARGS` with torchrun's environment for its rank, builds the same
engine from the same `EngineArgs` (read from a file the parent wrote) and follows rank 0's steps, one
`generate` after another, until rank 0 releases it with `SHUTDOWN`. This process becomes rank 0 for the
process group's set-up only: its torchrun variables are restored once the group is joined. `shutdown()`
(also at exit, or when the `LLM` is collected) ends the workers (one that does not exit within `GRACE_S` is
killed) and takes this process out of the group, so a later `LLM` starts afresh.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile

import torch.distributed as dist

from ..parallel.launch import free_port, rank_env
from .engine_args import EngineArgs
from .engine_core import LLMEngine

SHUTDOWN = "tp-workers-shutdown"
"""The payload rank 0 releases its followers with when they are to exit."""
GRACE_S = 30.0
_RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class Workers:
    """Ranks 1..N-1 of one engine, as processes of this host."""

    def __init__(self, args: EngineArgs) -> None:
        n = args.tensor_parallel_size
        if not isinstance(args.model, str):
            raise ValueError("tensor_parallel_size > 1 outside torchrun needs the model as a checkpoint folder "
                             "(the worker processes load it themselves)")
        fd, self.path = tempfile.mkstemp(prefix="glm5next-tp-", suffix=".args")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(args, f)
        port = free_port()
        self.procs = [subprocess.Popen([sys.executable, "-m", "glm5next.runtime.tp_workers", self.path],
                                       env=rank_env(rank, n, port)) for rank in range(1, n)]
        self._saved = {k: os.environ.get(k) for k in _RANK_VARS}
        env = rank_env(0, n, port)
        os.environ.update({k: env[k] for k in _RANK_VARS})

    def joined(self) -> None:
        """The process group is set up: this process's torchrun variables go back to what they were."""
        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def shutdown(self, engine=None) -> None:
        """Release the workers (through `engine`, rank 0's, when it was built) and wait for them to exit."""
        if engine is not None and any(p.poll() is None for p in self.procs):
            try:
                engine.release_followers(SHUTDOWN)
            except Exception:  # noqa: BLE001 - a broken group: the workers are killed below
                pass
        for p in self.procs:
            try:
                p.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.joined()
        if engine is not None and dist.is_initialized():  # rank 0 leaves the group: a later LLM starts afresh
            dist.destroy_process_group()
        if os.path.exists(self.path):
            os.unlink(self.path)


def main(path: str) -> int:
    """A worker: build the engine of the arguments in `path`, follow rank 0 until it shuts the workers down."""
    with open(path, "rb") as f:
        args = pickle.load(f)
    engine = LLMEngine(args)
    while engine.follow() != SHUTDOWN:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
