"""The fused mHC boundary: one Triton launch between two sublayers.

In a decode step the work between two sublayers is the previous sublayer's mHC post
(`hc_post`), the next sublayer's pre (mixer GEMV, sigmoid/softmax, Sinkhorn, collapse) and the
next RMSNorm. `mhc_boundary` does all of it in one launch; `mhc_first` is the first layer's
expand + pre + norm and `mhc_last` the last layer's post + mean of the streams + final norm.

All three are CUDA-graph safe: static shapes, no host syncs, outputs written into the given
buffers (`new_streams` must not be `streams`: a program writes stream j before it has read
them all). The per-token-block ticket counters live in one zeroed int32 buffer per device, reset by
the kernel itself; it is allocated on the first call, so call once eagerly before capturing.
One boundary at a time per device (launches on one stream).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .. import pdl as _pdl
from .kernel import mhc_kernel

__all__ = ["BoundaryPlan", "mhc_boundary", "mhc_first", "mhc_last", "plan"]

MAX_TICKETS = 4096
_TICKETS: dict[torch.device, torch.Tensor] = {}


def _tickets(device: torch.device) -> torch.Tensor:
    t = _TICKETS.get(device)
    if t is None:
        t = _TICKETS[device] = torch.zeros(MAX_TICKETS, dtype=torch.int32, device=device)
    return t


def _p2(x: int) -> int:
    return triton.next_power_of_2(max(1, int(x)))


NUM_WARPS = 4
"""Warps per program (the finisher's collapse and norm spread over them; Sinkhorn runs on every thread)."""


@dataclass(frozen=True)
class BoundaryPlan:
    """Launch parameters of one boundary launch: grid (chunks, token_blocks), program (c, tb) owning columns
    [c * chunk, (c + 1) * chunk) of the hidden size for tokens [tb * block_t, (tb + 1) * block_t); the last
    program of each token block finishes it. A deterministic function of the shapes, the device and the
    overrides (`plan`)."""

    rows: int
    """Workspace rows of n slots per token and chunk: the (2 + n) mixer outputs and the sum of squares, padded to
    a power of two (the kernel's ROWS)."""
    block_t: int
    """Tokens per program (BT)."""
    sub: int
    """Columns of one sub-tile, the unit of a chunk program's loads and products (SUB)."""
    n_sub: int
    """Sub-tiles per chunk (NSUB)."""
    chunks: int
    """Chunk programs per token block, the grid's first axis (NC)."""
    token_blocks: int
    """Token blocks, the grid's second axis (one ticket counter each)."""
    finisher_chunks: int
    """Chunks whose partial products the finisher sums at a time (NCB)."""
    finisher_tile: int
    """Columns of the finisher's collapse and norm tile; a row wider than one is stored and read back (FIN)."""
    sinkhorn_in_registers: bool
    """n = 4 Sinkhorn as 16 register values (the GPU's form) or as [n, n] tiles (the interpreter's: far fewer
    operations)."""
    approximate_rcp: bool
    """Each normalisation of the register form by the hardware's approximate reciprocal `rcp`, within 1 ulp (GPUs
    only: the interpreter has no inline assembly). The H200 sweep of 2026-12-04 timed 64 boundaries in a row at
    8.13 -> 7.55 us each at 1 token against the division sequence."""

    def __post_init__(self) -> None:
        if self.approximate_rcp and not self.sinkhorn_in_registers:
            raise ValueError("approximate_rcp needs sinkhorn_in_registers")

    @property
    def chunk(self) -> int:
        """Columns of the hidden size per chunk program."""
        return self.sub * self.n_sub

    @property
    def grid(self) -> tuple[int, int]:
        """The launch grid: (chunks, token_blocks)."""
        return self.chunks, self.token_blocks

    @property
    def sinkhorn(self) -> str:
        """Sinkhorn's form: "tiles", "registers" or "registers+rcp"."""
        return ("registers+rcp" if self.approximate_rcp else "registers") if self.sinkhorn_in_registers else "tiles"

    def constexprs(self) -> dict[str, int]:
        """The kernel's compile-time tile parameters (SK4: Sinkhorn's form, 0 tiles, 1 registers, 2 registers
        with the approximate reciprocal)."""
        return dict(ROWS=self.rows, BT=self.block_t, SUB=self.sub, NSUB=self.n_sub, NC=self.chunks,
                    NCB=self.finisher_chunks, FIN=self.finisher_tile,
                    SK4=(2 if self.approximate_rcp else 1) if self.sinkhorn_in_registers else 0)


def plan(T: int, D: int, n: int, on_gpu: bool, block_t: int | None = None, chunk: int | None = None,
         sinkhorn_in_registers: bool | None = None) -> BoundaryPlan:
    """The launch of T tokens of width D with n streams; `block_t`, `chunk` and `sinkhorn_in_registers` (None:
    registers on a GPU, tiles in the interpreter; the tests ask for registers there too) override the device's
    choices."""
    rows = _p2(n + 3)
    w = rows * n
    regs = on_gpu if sinkhorn_in_registers is None else bool(sinkhorn_in_registers)
    if block_t is None:
        # On an H200 one token per program is fastest up to 16 tokens (the finisher's work is per
        # token block and runs on one SM; at 16 with deferred Sinkhorn, 12.2 us against 14.5 on
        # two-token blocks), two from 17 (the sweep of 2026-12-04 at 24 / 32 tokens: 14.98 -> 14.52,
        # 22.65 -> 15.94 us); the interpreter wants few, large programs.
        # Past a decode step's 64 tokens (prefill rows) eight a program: each chunk program reads its columns of
        # the mixer once for eight tokens (H100, 2048 rows: 434 us against 745 with two, 566 with sixteen;
        # bench/results/2026-12-06-h100-boundary-rows.log).
        block_t = (1 if T <= 16 else 2 if T <= 64 else 8) if on_gpu else min(_p2(T), 8)
    bt = _p2(block_t)
    if chunk is None:
        # H200 sweep of 2026-12-04 (64 boundaries in a row, programmatic launch, one token per
        # program): chunk 32 at 2-4 tokens (8.22 us against 8.91 with 64 at T = 4), 64 at 5-8 (10.53 us
        # with 32 at T = 5: 640 programs no longer fit one wave; at T = 8 the kernel compiled without
        # contraction took 0.5 us less with 64 than with 128, in two runs). At 1 token 32 as well, with the
        # scalar finisher (the sweep of 2026-12-05: 6.80 us against 7.65 with 64; 7.81 / 7.82 without it).
        # Two-token blocks: chunk 128 up to 24 tokens, 256 at 25-32 (T = 32: 15.94 us against 20.02 with
        # 128), 128 at 33-48 (T = 48: 20.78 us against 23.94 with 256), 256 at 64 (24.80 against 26.38).
        chunk = (32 if T <= 4 else 64 if T <= 8 else 128 if T <= 24 else 256 if T <= 32
                 else 128 if T <= 48 else 256) if on_gpu \
            else min(_p2(D), 1024)
    chunk = _p2(chunk)
    # Registers bound the GPU's sub-tile; the interpreter pays per operation, so one sub-tile per chunk.
    sub = min(chunk, max(16, min(64, 2048 // (bt * w)))) if on_gpu else chunk
    nc = triton.cdiv(D, chunk)
    # The finisher of a block of several tokens takes the whole block in FIN-wide tiles (the collapsed rows
    # stored, then read back for the norm).
    return BoundaryPlan(
        rows=rows, block_t=bt, sub=sub, n_sub=chunk // sub, chunks=nc, token_blocks=triton.cdiv(T, bt),
        finisher_chunks=min(_p2(nc), max(1, 1024 // (bt * w))), finisher_tile=min(_p2(D), max(16, 4096 // bt)),
        sinkhorn_in_registers=regs, approximate_rcp=regs and on_gpu,
    )


def finishes_by_scalars(p: BoundaryPlan, mode: int, n: int, D: int, defer: bool = False) -> bool:
    """Whether a launch of plan `p` finishes with the mixer's outputs as scalars in every thread
    (`kernel._finish_token`) instead of small tiles whose every sum is a cross-lane reduction: one token per
    block, n = 4, Sinkhorn in registers, the row in one finisher tile, a mixer (mode 0 the boundary, 1 the
    first layer; not 2, the last layer); where Sinkhorn is deferred (`defer`), only at chunks of at most 32
    columns. The H200 sweep of 2026-12-05 (64 boundaries in a row, one token per program) timed it at 1 / 4 /
    8 / 16 tokens, chunk 32: 7.81 -> 6.80, 8.71 -> 7.59, 11.64 -> 11.18, 19.33 -> 17.47 us; deferred, it won
    only at chunk 32 (0.5-0.9 us) and lost 0.1-0.6 us at 64 and 128."""
    return (mode != 2 and n == 4 and p.block_t == 1 and p.sinkhorn_in_registers and p.finisher_tile >= D
            and (not defer or p.chunk <= 32))


def _launch(mode, out, streams, post, comb, fn, base, scale, w, new_streams, new_post, new_comb, x,
            hc_eps, rms_eps, norm_eps, sinkhorn_iters, post_mult, block_t, chunk, pdl, defer=False, pending_iters=0,
            x16=None, sinkhorn_in_registers=None):
    """`defer`: the finisher leaves new_comb pending (one Sinkhorn iteration); `pending_iters`: the
    iterations `comb` still needs (0: it is final); `x16`: a buffer for x in fp16 as well; `block_t`, `chunk`
    and `sinkhorn_in_registers`: the plan's overrides (`plan`). `pdl` None launches
    as a programmatic dependent wherever the device supports it (the H200 sweep of 2026-12-04 timed 64
    boundaries in a row at 8.6 -> 8.2 us each at 1 token, 11.6 -> 10.1 us at 8). Compiled without
    floating-point contraction, so that every compiled form gives the same bits."""
    T, D = out.shape
    n = streams.shape[1] if new_streams is None else new_streams.shape[1]
    if not 1 <= T:
        raise ValueError("need at least one token")
    p = plan(T, D, n, out.is_cuda, block_t, chunk, sinkhorn_in_registers)
    if p.token_blocks > MAX_TICKETS:  # (long prefill rows) in pieces of rows, one launch each
        rows = MAX_TICKETS * p.block_t
        for a in range(0, T, rows):
            r = slice(a, min(T, a + rows))
            part = lambda t: None if t is None else t[r]  # noqa: E731
            _launch(mode, out[r], part(streams), part(post), part(comb), fn, base, scale, w, part(new_streams),
                    part(new_post), part(new_comb), x[r], hc_eps, rms_eps, norm_eps, sinkhorn_iters, post_mult,
                    p.block_t, chunk, pdl, defer, pending_iters, part(x16), sinkhorn_in_registers)
        return
    for t in (new_streams, new_post, new_comb, x):
        if t is not None and not t.is_contiguous():
            raise ValueError("output buffers must be contiguous")
    if x16 is not None and (x16.dtype != torch.float16 or x16.shape != x.shape or not x16.is_contiguous()
                            or x16.device != x.device):
        raise ValueError(f"x16 must be a contiguous fp16 {tuple(x.shape)} buffer on {x.device}, got "
                         f"{tuple(x16.shape)} {x16.dtype} on {x16.device}")
    part = torch.empty(T * p.chunks * p.rows * n, dtype=torch.float32, device=out.device)
    dummy = out
    if pdl not in (None, False, True, "late"):
        raise ValueError(f"pdl must be a bool or 'late', got {pdl!r}")
    late = pdl == "late"
    pdl = pdl is not False and _pdl.enabled(out.device)  # None: wherever the device has it
    scalar = finishes_by_scalars(p, mode, n, D, defer)
    mhc_kernel[p.grid](
        out, dummy if streams is None else streams, dummy if post is None else post,
        dummy if comb is None else comb, dummy if fn is None else fn, dummy if base is None else base,
        dummy if scale is None else scale, w,
        dummy if new_streams is None else new_streams, dummy if new_post is None else new_post,
        dummy if new_comb is None else new_comb, x,
        part, _tickets(out.device),
        T, float(hc_eps), float(rms_eps), float(norm_eps), float(post_mult),
        x if x16 is None else x16,
        D=D, N=n, MODE=mode, ITERS=1 if defer else int(sinkhorn_iters), PDL=pdl, RELEASE_LATE=pdl and late,
        ITERS_IN=int(pending_iters), X16=x16 is not None, SCALAR=scalar, **p.constexprs(),
        num_warps=NUM_WARPS, enable_fp_fusion=False,
        **({"launch_pdl": True} if pdl else {}),
    )


def _c(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


def _buffers(like: torch.Tensor, dtype: torch.dtype, n: int, new_streams, new_post, new_comb, x):
    T, D = like.shape
    kw = dict(device=like.device)
    if new_streams is None:
        new_streams = torch.empty(T, n, D, dtype=dtype, **kw)
    if new_post is None:
        new_post = torch.empty(T, n, dtype=torch.float32, **kw)
    if new_comb is None:
        new_comb = torch.empty(T, n, n, dtype=torch.float32, **kw)
    if x is None:
        x = torch.empty(T, D, dtype=dtype, **kw)
    return new_streams, new_post, new_comb, x


def _check_mixer(fn, base, scale, n, D):
    w = (2 + n) * n
    if fn.shape != (w, n * D) or base.shape != (w,) or scale.shape != (3,):
        raise ValueError(f"mixer shapes {tuple(fn.shape)}, {tuple(base.shape)}, {tuple(scale.shape)} for n={n}, D={D}")
    if n & (n - 1):
        raise ValueError("the number of streams must be a power of two")


def mhc_boundary(
    out, streams, post, comb, fn, base, scale, norm_weight, *,
    hc_eps, rms_eps, norm_eps, sinkhorn_iters, post_mult,
    new_streams=None, new_post=None, new_comb=None, x=None, block_t=None, chunk=None,
    pdl=None, defer_sinkhorn=False, comb_pending=False, x16=None, sinkhorn_in_registers=None,
):
    """(new_streams [T, n, D], new_post [T, n] fp32, new_comb [T, n, n] fp32, x [T, D]).

    new_streams = hc_post(out, streams, post, comb) in the streams' dtype; (pre, new_post,
    new_comb) = the next mixer's weights of the cast new_streams; x = rms_norm(collapse,
    norm_weight, norm_eps) in the model dtype. `fn` [(2+n)n, nD], `base`, `scale` fp32.
    `pdl` (None: wherever the device supports it) launches it as a programmatic dependent; "late" does so and lets
    the kernel after it start only once the partial products are stored (before the finisher).
    `defer_sinkhorn`: new_comb is left pending, after the first of the Sinkhorn iterations, for the
    next boundary (or `mhc_last`) to finish with `comb_pending` (`reference.finish_sinkhorn`): the
    chain of iterations then runs in that launch's chunk programs instead of this one's finisher.
    `x16`: a contiguous fp16 [T, D] buffer that receives x in fp16 too (exact where x is within fp16's
    range), for FP8 projections whose fp16 products read it (`glm5next.kernels.linear`'s `x16`).
    `block_t`, `chunk`, `sinkhorn_in_registers`: the launch plan's overrides (`plan`; None: the device's choice).
    """
    T, n, D = streams.shape
    _check_mixer(fn, base, scale, n, D)
    if new_streams is not None and new_streams.data_ptr() == streams.data_ptr():
        raise ValueError("new_streams must not alias streams")
    new_streams, new_post, new_comb, x = _buffers(out, streams.dtype, n, new_streams, new_post, new_comb, x)
    _launch(0, _c(out), _c(streams), _c(post), _c(comb), _c(fn), _c(base), _c(scale), _c(norm_weight),
            new_streams, new_post, new_comb, x, hc_eps, rms_eps, norm_eps, sinkhorn_iters, post_mult, block_t, chunk,
            pdl, defer_sinkhorn, sinkhorn_iters - 1 if comb_pending else 0, x16, sinkhorn_in_registers)
    return new_streams, new_post, new_comb, x


def mhc_first(
    embedded, fn, base, scale, norm_weight, *,
    hc_eps, rms_eps, norm_eps, sinkhorn_iters, post_mult,
    streams=None, post=None, comb=None, x=None, block_t=None, chunk=None, pdl=None, defer_sinkhorn=False,
    x16=None, sinkhorn_in_registers=None,
):
    """(streams [T, n, D], post, comb, x) of the first layer: n copies of `embedded` [T, D], pre, norm
    (`defer_sinkhorn`, `x16` and the plan's overrides as in `mhc_boundary`)."""
    T, D = embedded.shape
    n = fn.shape[1] // D
    _check_mixer(fn, base, scale, n, D)
    streams, post, comb, x = _buffers(embedded, embedded.dtype, n, streams, post, comb, x)
    _launch(1, _c(embedded), None, None, None, _c(fn), _c(base), _c(scale), _c(norm_weight),
            streams, post, comb, x, hc_eps, rms_eps, norm_eps, sinkhorn_iters, post_mult, block_t, chunk, pdl,
            defer_sinkhorn, x16=x16, sinkhorn_in_registers=sinkhorn_in_registers)
    return streams, post, comb, x


def mhc_last(out, streams, post, comb, final_norm_weight, *, norm_eps, hidden=None, block_t=None, chunk=None,
             pdl=None, comb_pending=False, hc_eps=0.0, sinkhorn_iters=1, sinkhorn_in_registers=None):
    """The post-final-norm hidden states [T, D]: hc_post, the mean of the (cast) streams, RMSNorm
    (`comb_pending`: `comb` still needs its Sinkhorn iterations after the first, with `hc_eps`, in the plan's
    Sinkhorn form; the plan's overrides as in `mhc_boundary`)."""
    T, n, D = streams.shape
    if hidden is None:
        hidden = torch.empty(T, D, dtype=streams.dtype, device=streams.device)
    elif not hidden.is_contiguous():
        raise ValueError("hidden must be contiguous")
    _launch(2, _c(out), _c(streams), _c(post), _c(comb), None, None, None, _c(final_norm_weight),
            None, None, None, hidden, hc_eps, 0.0, norm_eps, 1, 0.0, block_t, chunk, pdl,
            pending_iters=sinkhorn_iters - 1 if comb_pending else 0, sinkhorn_in_registers=sinkhorn_in_registers)
    return hidden
