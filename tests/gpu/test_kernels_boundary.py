"""On a GPU: the fused mHC boundary at the real width (D = 4096, n = 4, bf16) against its
reference, and captured in a CUDA graph and replayed with new inputs ≡ eager.

Run with `TRITON_INTERPRET=0` (tests/conftest.py selects the interpreter otherwise).
`pytest -s` prints the time per boundary inside a CUDA graph.
"""

import os

import pytest
import torch

from glm5next.config import MHC_POST_MULT
from glm5next.kernels import boundary as fused
from glm5next.kernels.boundary import mhc_boundary, mhc_first, mhc_last
from glm5next.kernels.boundary import reference as ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs TRITON_INTERPRET=0"),
]

D, N = 4096, 4
TOKENS = [1, 2, 4, 8, 16, 24, 32, 48, 64]
KW = dict(hc_eps=1e-6, rms_eps=1e-5, norm_eps=1e-5, sinkhorn_iters=20, post_mult=MHC_POST_MULT)


def _mixer(g):
    w = (2 + N) * N
    fn = (torch.randn(w, N * D, generator=g) * 0.015).cuda()
    base = (torch.randn(w, generator=g) * 0.5).cuda()
    scale = (torch.rand(3, generator=g) + 0.5).cuda()
    norm_w = (1 + 0.1 * torch.randn(D, generator=g)).to(torch.bfloat16).cuda()
    return fn, base, scale, norm_w


def _inputs(T, g, mixer):
    """A sublayer output, streams, and the (post, comb) weights those streams would get."""
    out = torch.randn(T, D, generator=g).to(torch.bfloat16).cuda()
    streams = torch.randn(T, N, D, generator=g).to(torch.bfloat16).cuda()
    fn, base, scale, _ = mixer
    _, post, comb = ref.hc_weights(streams, fn, base, scale, hc_eps=KW["hc_eps"], rms_eps=KW["rms_eps"],
                                   sinkhorn_iters=KW["sinkhorn_iters"], post_mult=KW["post_mult"])
    return out, streams, post.contiguous(), comb.contiguous()


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("T", TOKENS)
def test_boundary_first_last_match_reference(T):
    """Each token count against the reference (one-token blocks, up to 16 tokens, finish by scalars; the
    last layer and blocks of several tokens by tiles)."""
    g = torch.Generator().manual_seed(T)
    mixer, nxt = _mixer(g), _mixer(g)
    out, streams, post, comb = _inputs(T, g, mixer)
    got = mhc_boundary(out, streams, post, comb, *nxt, **KW)
    want = ref.mhc_boundary(out, streams, post, comb, *nxt, **KW)
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=8e-3, atol=1e-2)
    # The mixer reads the bf16 streams: one element rounded the other way at a tie moves the post
    # weights by ~1e-4, so the tight check applies the reference mixer to the kernel's own streams.
    fn, base, scale, _ = nxt
    _, own_post, own_comb = ref.hc_weights(got[0], fn, base, scale, hc_eps=KW["hc_eps"], rms_eps=KW["rms_eps"],
                                           sinkhorn_iters=KW["sinkhorn_iters"], post_mult=KW["post_mult"])
    torch.testing.assert_close(got[1], own_post, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[2], own_comb, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(got[1], want[1], rtol=2e-3, atol=1e-3)
    torch.testing.assert_close(got[2], want[2], rtol=1e-2, atol=1e-3)
    assert _rel(got[3], want[3]) <= 2e-2
    first = mhc_first(out, *nxt, **KW)
    first_ref = ref.mhc_first(out, *nxt, **KW)
    assert torch.equal(first[0], first_ref[0])
    torch.testing.assert_close(first[1], first_ref[1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(first[2], first_ref[2], rtol=1e-3, atol=1e-4)
    assert _rel(first[3], first_ref[3]) <= 2e-2
    hidden = mhc_last(out, streams, post, comb, nxt[3], norm_eps=KW["norm_eps"])
    assert _rel(hidden, ref.mhc_last(out, streams, post, comb, nxt[3], norm_eps=KW["norm_eps"])) <= 2e-2


@pytest.mark.parametrize("T", [1, 3, 8, 64])
def test_graph_replay_matches_eager(T):
    """Captured and replayed with new inputs: the same bits as eager launches (the ticket counters left
    reset for the next replay)."""
    g = torch.Generator().manual_seed(100 + T)
    mixer, nxt = _mixer(g), _mixer(g)
    static = _inputs(T, g, mixer)
    emb = static[0].clone()

    def step():
        b = mhc_boundary(*static, *nxt, **KW)
        f = mhc_first(emb, *nxt, **KW)
        h = mhc_last(*static, nxt[3], norm_eps=KW["norm_eps"])
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
        fresh = _inputs(T, g, mixer)
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        emb.copy_(torch.randn(T, D, generator=g).to(torch.bfloat16))
        graph.replay()
        eager = step()
        torch.cuda.synchronize()
        for a, b in zip(captured[0] + captured[1] + (captured[2],), eager[0] + eager[1] + (eager[2],)):
            assert torch.equal(a, b)
    assert not fused._tickets(emb.device).any()


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
    mixers = [_mixer(g) for _ in range(3)]
    emb = torch.randn(T, D, generator=g).to(torch.bfloat16).cuda()
    outs = [torch.randn(T, D, generator=g).to(torch.bfloat16).cuda() for _ in range(3)]

    def chain(mode):
        pdl, defer = (True, True) if mode == "deferred" else (mode, False)
        out_kw = dict(pdl=pdl, defer_sinkhorn=defer, **({"chunk": 32} if scalar is True else {}))
        res = [mhc_first(emb, *mixers[0], **KW, **out_kw)]
        for i in (1, 2):
            s, p, c, _ = res[-1]
            res.append(mhc_boundary(outs[i - 1], s, p, c, *mixers[i], **KW, **out_kw, comb_pending=defer))
        s, p, c, _ = res[-1]
        return [t for r in res for t in r] + [mhc_last(outs[2], s, p, c, mixers[2][3], norm_eps=KW["norm_eps"],
                                                       pdl=pdl, comb_pending=defer, hc_eps=KW["hc_eps"],
                                                       sinkhorn_iters=KW["sinkhorn_iters"])]

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain(mode)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain(mode)
    for _ in range(3):
        emb.copy_(torch.randn(T, D, generator=g).to(torch.bfloat16))
        for o in outs:
            o.copy_(torch.randn(T, D, generator=g).to(torch.bfloat16))
        graph.replay()
        plain = chain(False)
        torch.cuda.synchronize()
        for k, (got, want) in enumerate(zip(captured, plain)):
            if mode == "deferred" and k % 4 == 2 and k < 12:  # a pending comb
                got = ref.finish_sinkhorn(got, KW["hc_eps"], KW["sinkhorn_iters"])
                assert (got - want).abs().max() <= 1e-5, k
            else:
                assert torch.equal(got, want), k


@pytest.mark.parametrize("T", TOKENS)
def test_x16_is_x_in_fp16(T):
    """With an `x16` buffer (NaN-filled) the boundary and the first layer write x in fp16 as well: the
    same values as x converted, and x the same bits as without the buffer."""
    g = torch.Generator().manual_seed(40 + T)
    mixer, nxt = _mixer(g), _mixer(g)
    out, streams, post, comb = _inputs(T, g, mixer)
    x16 = torch.full((T, D), float("nan"), dtype=torch.float16, device="cuda")
    got = mhc_boundary(out, streams, post, comb, *nxt, **KW, x16=x16)
    plain = mhc_boundary(out, streams, post, comb, *nxt, **KW)
    for a, b in zip(got, plain):
        assert torch.equal(a, b)
    assert torch.equal(x16, got[3].to(torch.float16))
    x16 = torch.full((T, D), float("nan"), dtype=torch.float16, device="cuda")
    first = mhc_first(out, *nxt, **KW, x16=x16)
    assert torch.equal(first[3], mhc_first(out, *nxt, **KW)[3])
    assert torch.equal(x16, first[3].to(torch.float16))
