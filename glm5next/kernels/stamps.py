"""Timestamps written from inside a kernel, to see how launches overlap on the GPU.

Nsight Compute replays each kernel alone, so it cannot show the programs of one kernel running beside
those of the kernel before it (a programmatic dependent launch), and Nsight Systems does not run on
our H200 machines. A kernel compiled with its STAMP flag instead writes, for each program, the GPU's
global nanosecond timer (`%globaltimer`, one clock for every SM) at fixed points of its work, and the
SM it ran on, into a [programs, SLOTS] int64 buffer; a program that skips a point leaves its slot 0.
Beside each timer value, in column CLOCK + slot, it writes its SM's cycle counter (`%clock64`): the
global timer may advance in steps coarser than the work between two stamps (`summarize` reports the
smallest step it saw), the cycle counter does not, but it is not shared between SMs.

The slots (the kernels write those they have):
  START       the program's first instruction
  PREFETCHED  its L2 prefetch issued (programmatic launch), just before it waits
  WAITED      the previous kernel finished: its wait returned
  PRODUCTS    its products stored (the split-K partial, or the boundary's chunk partial)
  FINISH      the program that arrived last at a tile / token block begins the finishing work
  MIXED       the boundary's finisher: the chunk partials summed and the mixer's weights computed
              (before the remaining Sinkhorn iterations)
  SINKHORN    the boundary's finisher: Sinkhorn done (before the collapse and the norm)
  END         its last instruction
  SM          the SM it ran on (`%smid`)
  CLOCK + s   the SM's cycle counter at slot s

The host side sets `STAMPS` of the kernel's module (`glm5next.kernels.boundary`,
`glm5next.kernels.linear.kernel`) to a buffer from `buffer()` before a launch, so each launch of a captured
graph can write its own. GPU only: the CPU interpreter has no inline assembly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

START, PREFETCHED, WAITED, PRODUCTS, FINISH, MIXED, SINKHORN, END, SM = range(9)
CLOCK = 16
SLOTS = 32
NAMES = ("start", "prefetched", "waited", "products", "finish", "mixed", "sinkhorn", "end")


@triton.jit
def _read_timer(x):
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [x], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _read_clock(x):
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [x], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _read_sm(x):
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def stamp(ptr, slot: tl.constexpr, STAMP: tl.constexpr):
    """Write the timer and the cycle counter into this program's `slot` (with the SM into column SM at
    START); nothing unless STAMP. (Literal columns: SLOTS 32, SM 8, CLOCK 16.)"""
    if STAMP:
        prog = tl.program_id(0) + tl.program_id(1) * tl.num_programs(0)
        tl.store(ptr + prog * 32 + 16 + slot, _read_clock(prog))
        tl.store(ptr + prog * 32 + slot, _read_timer(prog))
        if slot == 0:
            tl.store(ptr + prog * 32 + 8, _read_sm(prog).to(tl.int64))


def buffer(programs: int, device) -> torch.Tensor:
    """A zeroed [programs, SLOTS] buffer for one launch's stamps."""
    return torch.zeros(programs, SLOTS, dtype=torch.int64, device=device)


def check(buf: torch.Tensor | None, programs: int, device: torch.device) -> bool:
    """Whether a launch of `programs` programs on `device` writes stamps into `buf` (None: no stamps);
    a buffer that cannot take them is refused, naming the problem."""
    if buf is None:
        return False
    if device.type != "cuda":
        raise ValueError("kernel timestamps need a GPU (the CPU interpreter has no inline assembly)")
    if buf.dtype != torch.int64 or buf.device != device or not buf.is_contiguous() or buf.numel() < programs * SLOTS:
        raise ValueError(f"the stamp buffer must be a contiguous int64 tensor on {device} with at least "
                         f"{programs} x {SLOTS} elements, got {tuple(buf.shape)} {buf.dtype} on {buf.device}")
    return True


def ran(buf: torch.Tensor) -> torch.Tensor:
    """The rows (on the CPU) of the programs that ran: those with a START (rows past a launch's
    programs stay zero)."""
    rows = buf.cpu().to(torch.int64)
    return rows[rows[:, START] != 0]


def summarize(buf: torch.Tensor, origin: int) -> dict:
    """Per slot, over the programs that wrote it: the earliest, median and latest time in µs after
    `origin` (a timer value in ns), how many programs wrote it, and the median of its cycle count from
    the program's START; plus how many programs ran (rows with a START), on how many SMs, and the
    smallest step between two different timer values of the launch (`timer_step_ns`)."""
    rows = ran(buf)
    out = {"programs": rows.shape[0], "sms": int(rows[:, SM].unique().numel())}
    times = rows[:, :END + 1]
    values = times[times != 0].unique()  # sorted
    steps = values[1:] - values[:-1]
    out["timer_step_ns"] = int(steps.min()) if steps.numel() else None
    for slot, name in enumerate(NAMES):
        wrote = rows[:, slot] != 0
        if not wrote.any():
            continue
        us = (rows[wrote, slot] - origin).to(torch.float64) / 1000
        cycles = (rows[wrote, CLOCK + slot] - rows[wrote, CLOCK + START]).to(torch.float64)
        out[name] = dict(first=float(us.min()), median=float(us.median()), last=float(us.max()),
                         count=int(wrote.sum()), cycles=float(cycles.median()))
    return out
