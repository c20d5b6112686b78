"""Programmatic dependent launch (Hopper): the device side of a kernel launched with `launch_pdl`.

Such a kernel may start while the kernel before it on the stream is still running. It calls
`launch_dependents` first (so the kernel after it may start early in turn), then fetches the
constants it will read (weights: nothing the previous kernel writes) into L2 with `prefetch_l2`,
and then `wait_previous`, which returns once the previous kernel has finished and its writes are
visible. Every read of an activation and every write comes after the wait. Without the launch
attribute both calls are no-ops, so the kernel stays correct on any stream.

The host side: `enabled(device)` says whether a launch should ask for it (compute capability 9
or newer; never in the CPU interpreter, which has no inline assembly).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as tlcuda


_ENABLED: dict[int | None, bool] = {}


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` can be launched as programmatic dependents (asked once per GPU)."""
    if device.type != "cuda":
        return False
    if device.index not in _ENABLED:
        _ENABLED[device.index] = torch.cuda.get_device_capability(device)[0] >= 9
    return _ENABLED[device.index]


@triton.jit
def launch_dependents():
    tlcuda.gdc_launch_dependents()


@triton.jit
def wait_previous():
    tlcuda.gdc_wait()


@triton.jit
def prefetch_l2(ptrs, nbytes, mask):
    """Ask L2 to fetch `nbytes` (a multiple of 16) from each 16-byte aligned address in `ptrs` where
    `mask` (broadcast to `ptrs`) holds: one bulk prefetch per element; no data reaches the program."""
    addr = ptrs.to(tl.int64)
    size = tl.zeros(ptrs.shape, tl.int32) + nbytes
    on = (mask & (size > 0)).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r,r", [addr, size, on], dtype=tl.int32, is_pure=False, pack=1)
