"""The tensor-parallel group of one process: its rank, the group's size, and the process groups
its collectives run on.

Tensor parallelism runs one process per device under `torchrun` (or under the CLI's own
launcher, which sets the same environment). Model modules receive a `TensorParallel` when they
are built and size their sharded weights from it; a single-process model gets `SINGLE`, whose
collectives are no-ops.
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..checkpoint.specs import Shard
from ..config import Glm5NextConfig

TP_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
"""Environment every tensor-parallel process runs with: NVLink SHARP (multicast) stays off."""
CONTROL_TIMEOUT = timedelta(days=7)
"""How long a follower rank waits for rank 0's next step (a server may idle for long)."""


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in its tensor-parallel group."""

    rank: int = 0
    size: int = 1
    group: object = None
    """The process group of the activation collectives (NCCL on GPUs, gloo on the CPU); None alone."""
    control: object = None
    """A gloo group for rank 0's step broadcasts (host objects); None alone."""

    def split(self, n: int, what: str) -> int:
        """This rank's share of `n` heads or channels named `what`; a ValueError when it does not divide."""
        if n % self.size:
            raise ValueError(f"tensor_parallel_size={self.size} does not divide {what}={n}")
        return n // self.size

    def shard(self, dim: int) -> Shard | None:
        """This rank's part along `dim` of a sharded checkpoint tensor (None: one process holds all)."""
        return Shard(dim, self.rank, self.size) if self.size > 1 else None

    @property
    def is_driver(self) -> bool:
        """Whether this rank schedules and drives the others (rank 0)."""
        return self.rank == 0


SINGLE = TensorParallel()
"""One process holding the whole model."""


def sharded_dimensions(config: Glm5NextConfig) -> dict[str, int]:
    """Every config dimension tensor parallelism splits, by config field name."""
    return {
        "num_attention_heads": config.num_attention_heads,
        "linear_attn_config.num_heads": config.linear_num_heads,
        "index_n_heads": config.index_n_heads,
        "intermediate_size": config.intermediate_size,
        "moe_intermediate_size": config.moe_intermediate_size,
        "vocab_size": config.vocab_size,
    }


def check_divisible(config: Glm5NextConfig, size: int) -> None:
    """A ValueError naming every dimension of `config` that `size` ranks cannot split evenly."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size={size!r} must be a positive integer")
    bad = [f"{name}={n}" for name, n in sharded_dimensions(config).items() if n % size]
    if bad:
        raise ValueError(f"tensor_parallel_size={size} does not divide " + ", ".join(bad))


def init_tensor_parallel(size: int, device_type: str) -> TensorParallel:
    """This process's group of `size` ranks, joining the process group `torchrun` set up the
    environment for (or the one already initialised). `device_type` 'cuda' runs NCCL, else gloo."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size={size!r} must be a positive integer")
    if size == 1:
        return SINGLE
    if dist.is_initialized():
        world = dist.get_world_size()
        if world != size:
            raise ValueError(f"tensor_parallel_size={size}, but the process group has {world} processes; "
                             f"they must be equal")
    else:
        world = os.environ.get("WORLD_SIZE")
        if world is None:
            raise ValueError(f"tensor_parallel_size={size} needs {size} processes, one per device: launch with "
                             f"`torchrun --nproc-per-node {size} ...` (WORLD_SIZE is not set)")
        if int(world) != size:
            raise ValueError(f"tensor_parallel_size={size}, but torchrun started WORLD_SIZE={world} processes; "
                             f"they must be equal")
        os.environ.update(TP_ENV)
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            torch.cuda.set_device(local_rank())
        dist.init_process_group(backend=backend)
        # Tear the groups down before the interpreter does: a gloo group left to exit-time
        # destructors can abort the process after its work is done.
        atexit.register(_leave_process_group)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return TensorParallel(dist.get_rank(), size, dist.group.WORLD, control)


def _leave_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def local_rank() -> int:
    """This process's device index on its host (torchrun's LOCAL_RANK; 0 alone)."""
    return int(os.environ.get("LOCAL_RANK", "0"))
