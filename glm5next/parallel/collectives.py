"""The collectives of tensor parallelism, over plain `torch.distributed`; each is the identity on
a single process."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
import torch.distributed as dist

from .group import TensorParallel

_deferred = threading.local()


def all_reduce(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The sum of `x` over the ranks (a row-parallel output made whole), in x's dtype."""
    if tp.size == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=tp.group)
    return x


@contextmanager
def partial_outputs():
    """Inside: `reduce_output` leaves sublayer outputs as this rank's partial sums, for a caller that
    reduces them itself (the executor's reduced boundary)."""
    before = getattr(_deferred, "on", False)
    _deferred.on = True
    try:
        yield
    finally:
        _deferred.on = before


def reduce_output(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """A sublayer's output made whole (`all_reduce`), unless inside `partial_outputs()`."""
    return x if getattr(_deferred, "on", False) else all_reduce(x, tp)


def all_gather(x: torch.Tensor, tp: TensorParallel, dim: int = -1) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim`, in rank order (vocab shards of logits made whole)."""
    if tp.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x, group=tp.group)
    return torch.cat(parts, dim=dim)


def broadcast_object(obj, tp: TensorParallel):
    """Rank 0's `obj` on every rank (other ranks pass anything, e.g. None), over the gloo control group."""
    if tp.size == 1:
        return obj
    box = [obj if tp.rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=tp.control)
    return box[0]


def all_gather_object(obj, tp: TensorParallel) -> list:
    """Every rank's `obj`, in rank order (checks that ranks agree)."""
    if tp.size == 1:
        return [obj]
    out = [None] * tp.size
    dist.all_gather_object(out, obj, group=tp.control)
    return out


def min_int(value: int, tp: TensorParallel) -> int:
    """The smallest of every rank's `value` (a cache size all ranks can hold)."""
    return min(all_gather_object(int(value), tp))
