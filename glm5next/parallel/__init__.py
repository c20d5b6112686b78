"""Tensor parallelism over `torch.distributed`: groups, collectives, sharded layers, rank-0 driving."""

from .collectives import all_gather, all_gather_object, all_reduce, broadcast_object, min_int
from .group import SINGLE, TP_ENV, TensorParallel, check_divisible, init_tensor_parallel, sharded_dimensions

__all__ = ["SINGLE", "TP_ENV", "TensorParallel", "all_gather", "all_gather_object", "all_reduce",
           "broadcast_object", "check_divisible", "init_tensor_parallel", "min_int", "sharded_dimensions"]
