"""The fused mHC boundary kernels against their references and the stock modules (`HyperConnection.pre`,
`hc_post`, `rms_norm`, `hc_expand`, `hc_contract`). CPU cases run the Triton interpreter at small shapes; GPU
cases (marked `gpu`) run the real width (D = 4096, n = 4, bf16) against the reference, and capture in a CUDA
graph and replay with new inputs ≡ eager."""

from types import SimpleNamespace

import pytest
import torch

from glm5next.config import MHC_POST_MULT
from glm5next.kernels import boundary as fused
from glm5next.kernels.boundary import reference as ref
from glm5next.model.mhc import HyperConnection, hc_contract, hc_expand, hc_post
from glm5next.model.norm import rms_norm
from glm5next.checkpoint.specs import install_random, set_param

CUDA = torch.cuda.is_available()
N = 4
HC_EPS, RMS_EPS, NORM_EPS, ITERS = 1e-6, 1e-5, 1e-5, 20
KW = dict(hc_eps=HC_EPS, rms_eps=RMS_EPS, norm_eps=NORM_EPS, sinkhorn_iters=ITERS, post_mult=MHC_POST_MULT)
SIZES = [(1, 64), (3, 100), (7, 130)]
DTYPES = [torch.float32, torch.bfloat16]


def _stock_hc(D, seed):
    """A stock HyperConnection with seeded fp32 parameters (scale made large enough to matter)."""
    cfg = SimpleNamespace(hc_mult=N, hidden_size=D, hc_eps=HC_EPS, rms_norm_eps=RMS_EPS, hc_sinkhorn_iters=ITERS)
    hc = HyperConnection(cfg)
    install_random(hc.tensor_specs("hc"), torch.float32, seed=seed, std=1.0 / (N * D) ** 0.5)
    set_param(hc, "base", hc.base * 20)
    set_param(hc, "scale", torch.tensor([1.5, 0.7, 2.0]))
    return hc


def _case(T, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    hc_prev, hc = _stock_hc(D, seed), _stock_hc(D, seed + 1)
    streams = torch.randn(T, N, D, generator=g).to(dtype)
    _, post, comb = hc_prev.weights(streams)
    out = torch.randn(T, D, generator=g).to(dtype)
    norm_w = (1 + 0.2 * torch.randn(D, generator=g)).to(dtype)
    return out, streams, post, comb, hc, norm_w


def _mixer(hc):
    return hc.fn, hc.base, hc.scale


def _nan_buffers(T, D, dtype):
    f = float("nan")
    return dict(
        new_streams=torch.full((T, N, D), f, dtype=dtype), new_post=torch.full((T, N), f),
        new_comb=torch.full((T, N, N), f), x=torch.full((T, D), f, dtype=dtype),
    )


def _close(got, want, tol):
    """Elementwise `|got - want| <= tol * max|want|` (relative to the tensor's scale)."""
    got, want = got.float(), want.float()
    assert torch.isfinite(got).all()
    err = (got - want).abs().max().item()
    assert err <= tol * want.abs().max().item(), err


def _check_weights_and_x(got, streams, hc, norm_w, dtype):
    """`got` = (post, comb, x) against the stock pre + norm applied to `streams`."""
    collapsed, post, comb = hc.pre(streams)
    x = rms_norm(collapsed, norm_w, NORM_EPS)
    tight = dtype == torch.float32
    _close(got[0], post, 1e-5)
    _close(got[1], comb, 1e-5)
    # bf16: the interpreter truncates instead of rounding (collapse, y and weight * y).
    _close(got[2], x, 1e-5 if tight else 3 * 2.0**-7)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,D", SIZES)
def test_boundary_matches_reference_and_stock(T, D, dtype):
    out, streams, post, comb, hc, norm_w = _case(T, D, dtype, seed=T * 1000 + D)
    bufs = _nan_buffers(T, D, dtype)
    got = fused.mhc_boundary(out, streams, post, comb, *_mixer(hc), norm_w, **KW, **bufs)
    assert all(g is b for g, b in zip(got, bufs.values()))
    want = ref.mhc_boundary(out, streams, post, comb, *_mixer(hc), norm_w, **KW)
    stock_streams = hc_post(out, streams, post, comb)
    assert torch.equal(want[0], stock_streams)
    _close(got[0], stock_streams, 1e-6 if dtype == torch.float32 else 2.0**-7)
    # The weights and x of the kernel's own new streams, through the stock modules.
    _check_weights_and_x(got[1:], got[0], hc, norm_w, dtype)
    if dtype == torch.float32:
        for g, w in zip(got, want):
            _close(g, w, 1e-5)
    else:
        _close(got[1], want[1], 5e-3)
        _close(got[2], want[2], 5e-3)
        _close(got[3], want[3], 4 * 2.0**-7)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,D", SIZES)
def test_first_matches_reference_and_stock(T, D, dtype):
    emb, _, _, _, hc, norm_w = _case(T, D, dtype, seed=7 + T + D)
    bufs = _nan_buffers(T, D, dtype)
    got = fused.mhc_first(emb, *_mixer(hc), norm_w, **KW, streams=bufs["new_streams"], post=bufs["new_post"],
                          comb=bufs["new_comb"], x=bufs["x"])
    assert torch.equal(got[0], hc_expand(emb, N))
    _check_weights_and_x(got[1:], got[0], hc, norm_w, dtype)
    want = ref.mhc_first(emb, *_mixer(hc), norm_w, **KW)
    for g, w in zip(got, want):
        _close(g, w, 1e-5 if dtype == torch.float32 else 3 * 2.0**-7)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,D", SIZES)
def test_last_matches_reference_and_stock(T, D, dtype):
    out, streams, post, comb, _, norm_w = _case(T, D, dtype, seed=11 + T + D)
    hidden = torch.full((T, D), float("nan"), dtype=dtype)
    got = fused.mhc_last(out, streams, post, comb, norm_w, norm_eps=NORM_EPS, hidden=hidden)
    assert got is hidden
    stock = rms_norm(hc_contract(hc_post(out, streams, post, comb)), norm_w, NORM_EPS)
    want = ref.mhc_last(out, streams, post, comb, norm_w, norm_eps=NORM_EPS)
    assert torch.equal(want, stock)
    _close(got, stock, 1e-5 if dtype == torch.float32 else 3 * 2.0**-7)


@pytest.mark.parametrize("block_t,chunk", [(1, 32), (2, 16), (8, 16)])
def test_many_programs_and_token_blocks(block_t, chunk):
    """Forced small tiles: several token blocks, many chunks, a multi-step partial reduction."""
    T, D = 7, 130
    out, streams, post, comb, hc, norm_w = _case(T, D, torch.float32, seed=3)
    got = fused.mhc_boundary(out, streams, post, comb, *_mixer(hc), norm_w, **KW, block_t=block_t, chunk=chunk)
    want = ref.mhc_boundary(out, streams, post, comb, *_mixer(hc), norm_w, **KW)
    for g, w in zip(got, want):
        _close(g, w, 1e-5)
    hidden = fused.mhc_last(out, streams, post, comb, norm_w, norm_eps=NORM_EPS, block_t=block_t, chunk=chunk)
    _close(hidden, ref.mhc_last(out, streams, post, comb, norm_w, norm_eps=NORM_EPS), 1e-5)


def test_rows_past_the_ticket_counters_run_in_pieces(monkeypatch):
    """More token blocks than ticket counters (long prefill rows): launches over pieces of rows, each piece's
    outputs where one launch would put them."""
    T, D = 21, 130
    monkeypatch.setattr(fused, "MAX_TICKETS", 4)  # pieces of 4 blocks of 2 tokens: 8, 8 and 5 rows
    out, streams, post, comb, hc, norm_w = _case(T, D, torch.float32, seed=21)
    bufs = _nan_buffers(T, D, torch.float32)
    got = fused.mhc_boundary(out, streams, post, comb, *_mixer(hc), norm_w, **KW, block_t=2, **bufs)
    for g, w in zip(got, ref.mhc_boundary(out, streams, post, comb, *_mixer(hc), norm_w, **KW)):
        _close(g, w, 1e-5)
    first = fused.mhc_first(out, *_mixer(hc), norm_w, **KW, block_t=2)
    for g, w in zip(first, ref.mhc_first(out, *_mixer(hc), norm_w, **KW)):
        _close(g, w, 1e-5)
    hidden = fused.mhc_last(out, streams, post, comb, norm_w, norm_eps=NORM_EPS, block_t=2)
    _close(hidden, ref.mhc_last(out, streams, post, comb, norm_w, norm_eps=NORM_EPS), 1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_register_sinkhorn_of_the_gpu_path(dtype):
    """The GPU runs n = 4 Sinkhorn as 16 register values; check that path here too (asked of the plan)."""
    T, D = 3, 100
    out, streams, post, comb, hc, norm_w = _case(T, D, dtype, seed=5)
    got = fused.mhc_boundary(out, streams, post, comb, *_mixer(hc), norm_w, **KW, sinkhorn_in_registers=True)
    want = ref.mhc_boundary(out, streams, post, comb, *_mixer(hc), norm_w, **KW)
    for g, w in zip(got, want):
        _close(g, w, 1e-5 if dtype == torch.float32 else 3 * 2.0**-7)
    first = fused.mhc_first(out, *_mixer(hc), norm_w, **KW, sinkhorn_in_registers=True)
    for g, w in zip(first, ref.mhc_first(out, *_mixer(hc), norm_w, **KW)):
        _close(g, w, 1e-5 if dtype == torch.float32 else 3 * 2.0**-7)


def test_replay_is_identical_and_tickets_reset():
    out, streams, post, comb, hc, norm_w = _case(5, 100, torch.bfloat16, seed=5)
    args = (out, streams, post, comb, *_mixer(hc), norm_w)
    first = fused.mhc_boundary(*args, **KW, block_t=2, chunk=32)
    assert not fused._tickets(out.device).any()
    second = fused.mhc_boundary(*args, **KW, block_t=2, chunk=32)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    assert not fused._tickets(out.device).any()


def test_new_streams_may_not_alias_streams():
    out, streams, post, comb, hc, norm_w = _case(3, 130, torch.float32, seed=9)
    with pytest.raises(ValueError):
        fused.mhc_boundary(out, streams, post, comb, *_mixer(hc), norm_w, **KW, new_streams=streams)


def test_launch_modes():
    """`pdl` takes None, a bool or "late" (a programmatic launch on a GPU; the CPU runs plainly, the
    same values); anything else is refused naming it."""
    out, streams, post, comb, hc, norm_w = _case(2, 64, torch.float32, seed=11)
    args = (out, streams, post, comb, *_mixer(hc), norm_w)
    base = fused.mhc_boundary(*args, **KW)
    for mode in (False, True, "late"):
        for a, b in zip(base, fused.mhc_boundary(*args, **KW, pdl=mode)):
            assert torch.equal(a, b)
    with pytest.raises(ValueError, match="pdl"):
        fused.mhc_boundary(*args, **KW, pdl="early")


@pytest.mark.parametrize("registers", [False, True])
@pytest.mark.parametrize("T, D", [(1, 64), (3, 100)])
def test_deferred_sinkhorn_chain_equals_the_plain_chain(T, D, registers):
    """first -> boundary -> boundary -> last with every comb left pending (one Sinkhorn iteration) and
    finished by the next launch's chunk programs: the same streams, post, x and hidden states as the
    plain chain (bit for bit on the register path, which runs the same iterations on the same values, at
    chunks of 32 columns, where one-token blocks finish by scalars deferred or not), each pending comb the
    reference's, and finishing it gives the plain comb."""
    g = torch.Generator().manual_seed(300 + T)
    hcs = [_stock_hc(D, 40 + i) for i in range(3)]
    emb = torch.randn(T, D, generator=g)
    outs = [torch.randn(T, D, generator=g) for _ in range(3)]
    norm_w = 1 + 0.2 * torch.randn(D, generator=g)

    def chain(mod, deferred):
        # The kernels' plan: Sinkhorn's form, and chunks of 32 on the register path.
        form = dict(sinkhorn_in_registers=registers) if mod is fused else {}
        tiles = dict(form, **({"chunk": 32} if registers else {})) if mod is fused else {}
        defer = dict(defer_sinkhorn=True) if deferred else {}
        pend = dict(comb_pending=True) if deferred else {}
        res = [mod.mhc_first(emb, *_mixer(hcs[0]), norm_w, **KW, **tiles, **defer)]
        for i in (1, 2):
            s, p, c, _ = res[-1]
            bufs = _nan_buffers(T, D, torch.float32) if mod is fused else {}  # every output written
            res.append(mod.mhc_boundary(outs[i - 1], s, p, c, *_mixer(hcs[i]), norm_w, **KW, **tiles, **pend, **bufs,
                                        **defer))
        s, p, c, _ = res[-1]
        last_kw = dict(comb_pending=True, hc_eps=HC_EPS, sinkhorn_iters=ITERS) if deferred else {}
        return res, mod.mhc_last(outs[2], s, p, c, norm_w, norm_eps=NORM_EPS, **form, **last_kw)

    plain, plain_last = chain(fused, False)
    deferred, deferred_last = chain(fused, True)
    want, want_last = chain(ref, True)
    same = torch.equal if registers else (lambda a, b: torch.allclose(a, b, rtol=1e-6, atol=1e-7))
    for a, b, r in zip(plain, deferred, want):
        for k in (0, 1, 3):  # streams, post, x
            assert same(a[k], b[k]), k
        assert not torch.allclose(a[2], b[2])  # the comb is pending
        _close(b[2], r[2], 1e-5)
        _close(ref.finish_sinkhorn(b[2], HC_EPS, ITERS), a[2], 1e-5)
    assert same(plain_last, deferred_last)
    _close(deferred_last, want_last, 1e-5)


def test_perturbing_one_stream_changes_only_its_token():
    T, D = 3, 100
    out, streams, post, comb, hc, norm_w = _case(T, D, torch.float32, seed=13)
    base = fused.mhc_boundary(out, streams, post, comb, *_mixer(hc), norm_w, **KW)
    bumped = streams.clone()
    bumped[1, 2, 17] += 1.0
    moved = fused.mhc_boundary(out, bumped, post, comb, *_mixer(hc), norm_w, **KW)
    for a, b in zip(base, moved):
        assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])
        assert not torch.equal(a[1], b[1])


def test_two_streams_use_the_generic_sinkhorn():
    """n = 2 (the tile Sinkhorn path; n = 4 has a register-resident one)."""
    T, D, n = 3, 40, 2
    g = torch.Generator().manual_seed(17)
    fn = torch.randn((2 + n) * n, n * D, generator=g) / (n * D) ** 0.5
    base, scale = torch.randn((2 + n) * n, generator=g), torch.tensor([1.5, 0.7, 2.0])
    streams, out = torch.randn(T, n, D, generator=g), torch.randn(T, D, generator=g)
    post, comb = torch.rand(T, n, generator=g), torch.rand(T, n, n, generator=g)
    w = 1 + 0.2 * torch.randn(D, generator=g)
    got = fused.mhc_boundary(out, streams, post, comb, fn, base, scale, w, **KW, chunk=16)
    want = ref.mhc_boundary(out, streams, post, comb, fn, base, scale, w, **KW)
    for a, b in zip(got, want):
        _close(a, b, 1e-5)


def test_rows_wider_than_one_finisher_tile():
    """Token blocks of 2 give a 2048-wide finisher tile: a 4100-wide row is collapsed, stored and
    normalised tile by tile (the path of the GPU's larger token counts)."""
    T, D = 3, 4100
    assert fused.plan(T, D, N, False, block_t=2).finisher_tile < D
    out, streams, post, comb, hc, norm_w = _case(T, D, torch.float32, seed=5)
    got = fused.mhc_boundary(out, streams, post, comb, *_mixer(hc), norm_w, **KW, block_t=2,
                             **_nan_buffers(T, D, torch.float32))
    want = ref.mhc_boundary(out, streams, post, comb, *_mixer(hc), norm_w, **KW)
    for g, w in zip(got, want):
        _close(g, w, 1e-5)
    hidden = fused.mhc_last(out, streams, post, comb, norm_w, norm_eps=NORM_EPS, block_t=2,
                            hidden=torch.full((T, D), float("nan")))
    _close(hidden, ref.mhc_last(out, streams, post, comb, norm_w, norm_eps=NORM_EPS), 1e-5)


class _RecordedKernel:
    """The boundary kernel, recording each launch's Sinkhorn form (SK4) before it runs."""

    def __init__(self, kernel):
        self.kernel, self.forms = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.forms.append(kwargs["SK4"])
            return self.kernel[grid](*args, **kwargs)
        return launch


def test_sinkhorn_form_by_device(monkeypatch):
    """Tiles in the interpreter, registers on the GPU with the approximate reciprocal; the plan's override
    picks either form on either device (the interpreter, asked for registers, has no inline assembly: no
    `rcp`), and reaches the kernel from each entry point."""
    forms = {}
    for on_gpu in (False, True):
        for regs in (None, True, False):
            p = fused.plan(3, 100, N, on_gpu=on_gpu, sinkhorn_in_registers=regs)
            forms[on_gpu, regs] = (p.sinkhorn, p.constexprs()["SK4"])
    assert forms == {(False, None): ("tiles", 0), (False, True): ("registers", 1), (False, False): ("tiles", 0),
                     (True, None): ("registers+rcp", 2), (True, True): ("registers+rcp", 2),
                     (True, False): ("tiles", 0)}
    with pytest.raises(ValueError, match="approximate_rcp"):
        fused.BoundaryPlan(8, 1, 32, 1, 4, 1, 4, 128, sinkhorn_in_registers=False, approximate_rcp=True)
    recorded = _RecordedKernel(fused.mhc_kernel)
    monkeypatch.setattr(fused, "mhc_kernel", recorded)
    out, streams, post, comb, hc, norm_w = _case(2, 64, torch.float32, seed=19)
    for regs in (None, True, False):
        fused.mhc_boundary(out, streams, post, comb, *_mixer(hc), norm_w, **KW, sinkhorn_in_registers=regs)
        fused.mhc_first(out, *_mixer(hc), norm_w, **KW, sinkhorn_in_registers=regs)
        fused.mhc_last(out, streams, post, comb, norm_w, norm_eps=NORM_EPS, sinkhorn_in_registers=regs)
    assert recorded.forms == [0, 0, 0, 1, 1, 1, 0, 0, 0]


def test_gpu_chunk_by_token_count():
    """On the GPU one token per program up to 16 tokens and two from 17, and the chunk of the hidden
    size the H200 sweep chose per token count; an explicit chunk wins."""
    sizes = (1, 2, 4, 5, 6, 7, 8, 9, 16, 17, 24, 25, 32, 33, 48, 49, 64)
    plans = {T: fused.plan(T, 4096, N, on_gpu=True) for T in sizes}
    chunk = {T: p.chunk for T, p in plans.items()}
    assert chunk == {1: 32, 2: 32, 4: 32, 5: 64, 6: 64, 7: 64, 8: 64, 9: 128, 16: 128, 17: 128, 24: 128,
                     25: 256, 32: 256, 33: 128, 48: 128, 49: 256, 64: 256}
    assert {T: p.block_t for T, p in plans.items()} == {T: 1 if T <= 16 else 2 for T in sizes}
    p = fused.plan(4, 4096, N, on_gpu=True, chunk=128)
    assert p.chunk == 128 and p.chunks == 32 and p.grid == (32, 4)


@pytest.mark.parametrize("form", ["one-tile", "wide-rows"])
def test_x16_is_x_in_fp16(form):
    """With an `x16` buffer the boundary and the first layer also write x in fp16: the same values as x
    converted, NaN-filled buffers, in each finisher form (whole rows, rows wider than one tile), and x
    itself unchanged by it."""
    T, D, block_t = {"one-tile": (3, 100, None), "wide-rows": (3, 4100, 2)}[form]
    p = fused.plan(T, D, N, False, block_t=block_t)
    assert (p.finisher_tile < D) == (form == "wide-rows")
    dtype = torch.bfloat16
    out, streams, post, comb, hc, norm_w = _case(T, D, dtype, seed=31)
    plain = fused.mhc_boundary(out, streams, post, comb, *_mixer(hc), norm_w, **KW, block_t=block_t)
    x16 = torch.full((T, D), float("nan"), dtype=torch.float16)
    got = fused.mhc_boundary(out, streams, post, comb, *_mixer(hc), norm_w, **KW, block_t=block_t, x16=x16,
                             **_nan_buffers(T, D, dtype))
    for g, w in zip(got, plain):
        assert torch.equal(g, w)
    assert torch.equal(x16, got[3].to(torch.float16))
    x16 = torch.full((T, D), float("nan"), dtype=torch.float16)
    first = fused.mhc_first(out, *_mixer(hc), norm_w, **KW, block_t=block_t, x16=x16)
    assert torch.equal(first[3], fused.mhc_first(out, *_mixer(hc), norm_w, **KW, block_t=block_t)[3])
    assert torch.equal(x16, first[3].to(torch.float16))


def test_x16_buffer_is_checked():
    out, streams, post, comb, hc, norm_w = _case(2, 64, torch.bfloat16, seed=3)
    for bad in (torch.empty(2, 64), torch.empty(2, 63, dtype=torch.float16),
                torch.empty(64, 2, dtype=torch.float16).t()):
        with pytest.raises(ValueError, match="x16 must be a contiguous fp16"):
            fused.mhc_boundary(out, streams, post, comb, *_mixer(hc), norm_w, **KW, x16=bad)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("T, D", [(1, 64), (3, 130)])
def test_scalar_finisher_of_one_token_blocks(T, D, dtype):
    """One-token blocks (the GPU's form up to 16 tokens) on the register path finish with the mixer's
    outputs as scalars: the boundary and the first layer match the reference with NaN-filled outputs (and
    their x16 is x in fp16), and the tile finisher of two-token blocks within rounding; the last layer and
    blocks of several tokens keep the tile finisher, deferred Sinkhorn does at chunks above 32; Sinkhorn in
    tiles never does."""
    regs = dict(sinkhorn_in_registers=True)
    out, streams, post, comb, hc, norm_w = _case(T, D, dtype, seed=61)
    tile = fused.mhc_boundary(out, streams, post, comb, *_mixer(hc), norm_w, **KW, block_t=2, **regs)
    p = fused.plan(T, D, N, False, block_t=1, **regs)
    assert fused.finishes_by_scalars(p, 0, N, D) and fused.finishes_by_scalars(p, 1, N, D)
    assert not fused.finishes_by_scalars(p, 2, N, D) and not fused.finishes_by_scalars(p, 0, 2, D)
    assert not fused.finishes_by_scalars(fused.plan(T, D, N, False, block_t=2, **regs), 0, N, D)
    assert not fused.finishes_by_scalars(fused.plan(T, D, N, False, block_t=1, chunk=64, **regs), 0, N, D, defer=True)
    assert fused.finishes_by_scalars(fused.plan(T, D, N, False, block_t=1, chunk=32, **regs), 0, N, D, defer=True)
    assert not fused.finishes_by_scalars(fused.plan(T, D, N, False, block_t=1), 0, N, D)
    tol = 1e-5 if dtype == torch.float32 else 3 * 2.0**-7
    x16 = torch.full((T, D), float("nan"), dtype=torch.float16)
    got = fused.mhc_boundary(out, streams, post, comb, *_mixer(hc), norm_w, **KW, block_t=1, x16=x16, **regs,
                             **_nan_buffers(T, D, dtype))
    want = ref.mhc_boundary(out, streams, post, comb, *_mixer(hc), norm_w, **KW)
    for g, w, t in zip(got, want, tile):
        _close(g, w, tol)
        _close(g, t, 1e-5 if dtype == torch.float32 else 2.0**-7)
    assert torch.equal(x16, got[3].to(torch.float16))
    bufs = _nan_buffers(T, D, dtype)
    first = fused.mhc_first(out, *_mixer(hc), norm_w, **KW, block_t=1, **regs, streams=bufs["new_streams"],
                            post=bufs["new_post"], comb=bufs["new_comb"], x=bufs["x"])
    for g, w in zip(first, ref.mhc_first(out, *_mixer(hc), norm_w, **KW)):
        _close(g, w, tol)


# GPU cases: the real width in bf16 at every decode size.
REAL_D = 4096
DECODE_SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64]


def _real_mixer(g):
    """A random mixer (fn, base, scale) and norm weight of the real width on the GPU."""
    w = (2 + N) * N
    fn = (torch.randn(w, N * REAL_D, generator=g) * 0.015).cuda()
    base = (torch.randn(w, generator=g) * 0.5).cuda()
    scale = (torch.rand(3, generator=g) + 0.5).cuda()
    norm_w = (1 + 0.1 * torch.randn(REAL_D, generator=g)).to(torch.bfloat16).cuda()
    return fn, base, scale, norm_w


def _real_inputs(T, g, mixer):
    """A sublayer output, streams, and the (post, comb) weights those streams would get."""
    out = torch.randn(T, REAL_D, generator=g).to(torch.bfloat16).cuda()
    streams = torch.randn(T, N, REAL_D, generator=g).to(torch.bfloat16).cuda()
    fn, base, scale, _ = mixer
    _, post, comb = ref.hc_weights(streams, fn, base, scale, hc_eps=HC_EPS, rms_eps=RMS_EPS, sinkhorn_iters=ITERS,
                                   post_mult=MHC_POST_MULT)
    return out, streams, post.contiguous(), comb.contiguous()


def _rel(a, b):
    """The error's norm relative to the norm of `b`."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("T", DECODE_SIZES)
def test_boundary_first_last_match_reference(T):
    """Each token count against the reference (one-token blocks, up to 16 tokens, finish by scalars; the
    last layer and blocks of several tokens by tiles)."""
    g = torch.Generator().manual_seed(T)
    mixer, nxt = _real_mixer(g), _real_mixer(g)
    out, streams, post, comb = _real_inputs(T, g, mixer)
    got = fused.mhc_boundary(out, streams, post, comb, *nxt, **KW)
    want = ref.mhc_boundary(out, streams, post, comb, *nxt, **KW)
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=8e-3, atol=1e-2)
    # The mixer reads the bf16 streams: one element rounded the other way at a tie moves the post
    # weights by ~1e-4, so the tight check applies the reference mixer to the kernel's own streams.
    fn, base, scale, _ = nxt
    _, own_post, own_comb = ref.hc_weights(got[0], fn, base, scale, hc_eps=HC_EPS, rms_eps=RMS_EPS,
                                           sinkhorn_iters=ITERS, post_mult=MHC_POST_MULT)
    torch.testing.assert_close(got[1], own_post, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[2], own_comb, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(got[1], want[1], rtol=2e-3, atol=1e-3)
    torch.testing.assert_close(got[2], want[2], rtol=1e-2, atol=1e-3)
    assert _rel(got[3], want[3]) <= 2e-2
    first = fused.mhc_first(out, *nxt, **KW)
    first_ref = ref.mhc_first(out, *nxt, **KW)
    assert torch.equal(first[0], first_ref[0])
    torch.testing.assert_close(first[1], first_ref[1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(first[2], first_ref[2], rtol=1e-3, atol=1e-4)
    assert _rel(first[3], first_ref[3]) <= 2e-2
    hidden = fused.mhc_last(out, streams, post, comb, nxt[3], norm_eps=NORM_EPS)
    assert _rel(hidden, ref.mhc_last(out, streams, post, comb, nxt[3], norm_eps=NORM_EPS)) <= 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("T", [1, 3, 8, 64])
def test_graph_replay_matches_eager(T):
    """Captured and replayed with new inputs: the same bits as eager launches (the ticket counters left
    reset for the next replay)."""
    g = torch.Generator().manual_seed(100 + T)
    mixer, nxt = _real_mixer(g), _real_mixer(g)
    static = _real_inputs(T, g, mixer)
    emb = static[0].clone()

    def step():
        b = fused.mhc_boundary(*static, *nxt, **KW)
        f = fused.mhc_first(emb, *nxt, **KW)
        h = fused.mhc_last(*static, nxt[3], norm_eps=NORM_EPS)
        return b, f, h

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up: compiles the kernel and allocates the ticket counters
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(4):
        fresh = _real_inputs(T, g, mixer)
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        emb.copy_(torch.randn(T, REAL_D, generator=g).to(torch.bfloat16))
        graph.replay()
        eager = step()
        torch.cuda.synchronize()
        for a, b in zip(captured[0] + captured[1] + (captured[2],), eager[0] + eager[1] + (eager[2],)):
            assert torch.equal(a, b)
    assert not fused._tickets(emb.device).any()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("mode", [True, "late", "deferred"])
@pytest.mark.parametrize("T, scalar", [(1, False), (24, False), (64, False), (1, True), (5, True)])
def test_programmatic_chain_in_a_graph_equals_the_plain_chain(T, scalar, mode):
    """first -> boundary -> boundary -> last with every launch a programmatic dependent of the one before
    (each reads what the previous wrote, and prefetches its mixer before waiting for it; "late": each
    releases the next only after its partial products; "deferred": each comb left pending for the next
    launch to finish), captured and replayed with new inputs: every output equals the eager chain of
    plain launches bit for bit (a pending comb, once finished, the plain comb to 1e-5); `scalar`: at
    chunks of 32 columns (the default at up to 4 tokens), where deferred one-token launches finish by
    scalars as plain ones do, so both chains take the same finisher; from 17 tokens both finish by tiles."""
    g = torch.Generator().manual_seed(200 + T)
    mixers = [_real_mixer(g) for _ in range(3)]
    emb = torch.randn(T, REAL_D, generator=g).to(torch.bfloat16).cuda()
    outs = [torch.randn(T, REAL_D, generator=g).to(torch.bfloat16).cuda() for _ in range(3)]

    def chain(mode):
        pdl, defer = (True, True) if mode == "deferred" else (mode, False)
        out_kw = dict(pdl=pdl, defer_sinkhorn=defer, **({"chunk": 32} if scalar is True else {}))
        res = [fused.mhc_first(emb, *mixers[0], **KW, **out_kw)]
        for i in (1, 2):
            s, p, c, _ = res[-1]
            res.append(fused.mhc_boundary(outs[i - 1], s, p, c, *mixers[i], **KW, **out_kw, comb_pending=defer))
        s, p, c, _ = res[-1]
        return [t for r in res for t in r] + [fused.mhc_last(outs[2], s, p, c, mixers[2][3], norm_eps=NORM_EPS,
                                                             pdl=pdl, comb_pending=defer, hc_eps=HC_EPS,
                                                             sinkhorn_iters=ITERS)]

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain(mode)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain(mode)
    for _ in range(3):
        emb.copy_(torch.randn(T, REAL_D, generator=g).to(torch.bfloat16))
        for o in outs:
            o.copy_(torch.randn(T, REAL_D, generator=g).to(torch.bfloat16))
        graph.replay()
        plain = chain(False)
        torch.cuda.synchronize()
        for k, (got, want) in enumerate(zip(captured, plain)):
            if mode == "deferred" and k % 4 == 2 and k < 12:  # a pending comb
                got = ref.finish_sinkhorn(got, HC_EPS, ITERS)
                assert (got - want).abs().max() <= 1e-5, k
            else:
                assert torch.equal(got, want), k


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("T", DECODE_SIZES)
def test_x16_is_x_in_fp16_at_the_real_width(T):
    """With an `x16` buffer (NaN-filled) the boundary and the first layer write x in fp16 as well: the
    same values as x converted, and x the same bits as without the buffer."""
    g = torch.Generator().manual_seed(40 + T)
    mixer, nxt = _real_mixer(g), _real_mixer(g)
    out, streams, post, comb = _real_inputs(T, g, mixer)
    x16 = torch.full((T, REAL_D), float("nan"), dtype=torch.float16, device="cuda")
    got = fused.mhc_boundary(out, streams, post, comb, *nxt, **KW, x16=x16)
    plain = fused.mhc_boundary(out, streams, post, comb, *nxt, **KW)
    for a, b in zip(got, plain):
        assert torch.equal(a, b)
    assert torch.equal(x16, got[3].to(torch.float16))
    x16 = torch.full((T, REAL_D), float("nan"), dtype=torch.float16, device="cuda")
    first = fused.mhc_first(out, *nxt, **KW, x16=x16)
    assert torch.equal(first[3], fused.mhc_first(out, *nxt, **KW)[3])
    assert torch.equal(x16, first[3].to(torch.float16))
