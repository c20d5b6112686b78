"""The KDA decode kernel against its fp32 reference and the stock module: decode and multi-token steps
that write state, verify steps that fill the commit's scratch and leave the state, padded rows, odd
head counts and widths, every value-block split, NaN-filled outputs. CPU cases run the Triton
interpreter in fp32; GPU cases (marked `gpu`) run real shapes in bf16."""

import pytest
import torch

from glm5next.config import KDA_L2_EPS
from glm5next.forward import AttnMetadata, KdaState
from glm5next.kernels.kda import KdaWeights, kda_commit, kda_decode, kda_decode_reference, plan_kda
from glm5next.kernels.kda.prefill import gated_norm, kda_prefill, kda_prefill_inputs
from glm5next.kernels.kda.reference import kda_prefill_reference
from glm5next.model.kda import KdaProjections, gated_rms_norm
from glm5next.model.kda_recurrence import kda_chunked
from glm5next.runtime.kda_commit import commit
from glm5next.specialized_decode.kda import KdaStage

CUDA = torch.cuda.is_available()


def random_weights(h, d, keep, device="cpu", seed=0) -> KdaWeights:
    g = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device=device)  # noqa: E731
    return KdaWeights(r(3 * h * d, keep + 1) * 0.5, r(h) * 0.3, r(h * d) * 0.5,
                      torch.rand(d, generator=g, device=device) + 0.5, h, d, -5.0, 1e-5, KDA_L2_EPS)


def random_step(tokens, h, d, dtype=torch.float32, device="cpu", seed=1):
    g = torch.Generator(device=device).manual_seed(seed)
    widths = (h * d, h * d, h * d, h, h * d, h * d)
    return [torch.randn(tokens, n, generator=g, device=device).to(dtype) for n in widths]


def random_cache(slots, h, d, keep, qmax=0, dtype=torch.float32, device="cpu", seed=2):
    g = torch.Generator(device=device).manual_seed(seed)
    conv = torch.randn(slots, 3 * h * d, keep, generator=g, device=device).to(dtype)
    state = torch.randn(slots, h, d, d, generator=g, device=device) * 0.1
    verify = None
    if qmax:
        f32 = dict(dtype=torch.float32, device=device)
        verify = {"window": torch.full((slots, 3 * h * d, keep + qmax), float("nan"), dtype=dtype, device=device),
                  "k": torch.zeros(slots, qmax, h, d, **f32), "g": torch.zeros(slots, qmax, h, d, **f32),
                  "v": torch.zeros(slots, qmax, h, d, **f32), "beta": torch.zeros(slots, qmax, h, **f32)}
    return conv, state, verify


def rel(got, want):
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("h,d,keep,q,rows,block_v", [
    (3, 16, 3, 1, 3, 16), (3, 16, 3, 1, 3, 4), (5, 32, 2, 1, 2, 8),  # decode, odd heads, conv kernel 3
    (3, 16, 3, 3, 2, 8), (2, 16, 3, 5, 1, 16),  # several tokens a row, written (fewer and more than the window)
])
def test_kernel_matches_reference_writing_state(h, d, keep, q, rows, block_v):
    w = random_weights(h, d, keep)
    p = random_step(rows * q, h, d)
    conv, state, _ = random_cache(6, h, d, keep)
    index = torch.tensor([4, -1, 1][:rows]) if rows > 1 else torch.tensor([2])
    c_want, s_want = conv.clone(), state.clone()
    want = kda_decode_reference(*p, c_want, s_want, index, w, q)
    out = torch.full_like(want, float("nan"))
    got = kda_decode(*p, conv, state, index, w, q, plan_kda(d, block_v), out=out)
    assert got is out and not got.isnan().any()
    assert rel(got, want) < 1e-5
    assert rel(state, s_want) < 1e-5 and torch.equal(conv, c_want)
    pad = [r for r in range(rows) if index[r] < 0]
    for r in pad:
        assert not got[r * q:(r + 1) * q].any()
    untouched = [s for s in range(6) if s not in index.tolist()]
    _, s0, _ = random_cache(6, h, d, keep)
    assert torch.equal(state[untouched], s0[untouched])


def test_kernel_matches_stock_module(tiny_fp32):
    """The stage ≡ `KimiDeltaAttention.mix` on the small model's first KDA layer: a decode step with a
    padded row, outputs and both caches."""
    attn = tiny_fp32.layers[0].self_attn
    h, d, keep = attn.num_heads, attn.head_dim, attn.conv_kernel - 1
    p = KdaProjections(*random_step(3, h, d, seed=5))
    conv, state, _ = random_cache(5, h, d, keep, seed=6)
    index = torch.tensor([2, -1, 0])
    z = torch.zeros(3, dtype=torch.int64)
    md = AttnMetadata(0, 0, 3, 3, z, z, z, index, torch.zeros(3, 1, dtype=torch.int64), z + 1)
    stock = KdaState(conv.clone(), state.clone())
    want = attn.mix(p, md, stock)
    mine = KdaState(conv.clone(), state.clone())
    got = KdaStage(attn)(p, md, mine)
    live = [0, 2]
    assert rel(got[live], want[live]) < 1e-4
    for s in (0, 2):
        assert rel(mine.recurrent[s], stock.recurrent[s]) < 1e-5 and torch.allclose(mine.conv[s], stock.conv[s])
    # the padded row touched nothing (stock sends it to the scratch slot, 4)
    assert torch.equal(mine.recurrent[[1, 3, 4]], state[[1, 3, 4]])


@pytest.mark.parametrize("block_v", [16, 8])
def test_verify_then_commit_equals_decoding_the_accepted_tokens(block_v):
    """A verify step fills the scratch exactly as the reference and leaves the caches; the runtime's commit
    over n accepted tokens then gives the caches of decoding those n tokens (kernel, one at a time)."""
    h, d, keep, q, rows = 3, 16, 3, 4, 2
    w = random_weights(h, d, keep, seed=3)
    p = random_step(rows * q, h, d, seed=4)
    conv, state, verify = random_cache(5, h, d, keep, qmax=6)
    index = torch.tensor([3, 0])
    c0, s0 = conv.clone(), state.clone()
    v_want = {k: v.clone() for k, v in verify.items()}
    want = kda_decode_reference(*p, conv.clone(), state.clone(), index, w, q, v_want)
    out = torch.full_like(want, float("nan"))
    got = kda_decode(*p, conv, state, index, w, q, plan_kda(d, block_v), verify, out=out)
    assert rel(got, want) < 1e-5
    assert torch.equal(conv, c0) and torch.equal(state, s0)
    for name in v_want:
        a, b = verify[name], v_want[name]
        assert torch.equal(a.isnan(), b.isnan()) and rel(a.nan_to_num(), b.nan_to_num()) < 1e-5, name
    accepted = [2, 4]
    decoded = []  # each row's caches after decoding its accepted tokens one at a time on the kernel
    for r, n in enumerate(accepted):
        c1, s1 = c0.clone(), s0.clone()
        for j in range(n):
            tok = r * q + j
            kda_decode(*(x[tok:tok + 1] for x in p), c1, s1, index[r:r + 1], w, 1, plan_kda(d, block_v))
        decoded.append((c1[int(index[r])], s1[int(index[r])]))
    # The commit kernel: bit for bit the decode's caches (rows with 0 accepted stay as they were).
    c2, s2 = conv.clone(), state.clone()
    kda_commit(c2, s2, verify, torch.tensor([3, 0, 2]), torch.tensor(accepted + [0]), block_v)
    # The runtime's PyTorch commit (host lists): the same within fp32 rounding.
    commit(KdaState(conv, state, verify), index.tolist(), accepted)
    assert torch.equal(c2[2], c0[2]) and torch.equal(s2[2], s0[2])
    for r, (c1, s1) in enumerate(decoded):
        slot = int(index[r])
        assert torch.equal(c2[slot], c1) and torch.equal(s2[slot], s1), r
        assert torch.equal(conv[slot], c1), r
        assert rel(state[slot], s1) < 1e-5, r


def test_bad_shapes_are_refused():
    h, d, keep = 2, 16, 3
    w = random_weights(h, d, keep)
    p = random_step(3, h, d)
    conv, state, _ = random_cache(4, h, d, keep)
    with pytest.raises(ValueError, match="whole rows"):
        kda_decode(*p, conv, state, torch.tensor([0]), w, 2, plan_kda(d))
    with pytest.raises(ValueError, match="state indices"):
        kda_decode(*p, conv, state, torch.tensor([0, 1]), w, 1, plan_kda(d))
    with pytest.raises(ValueError, match="block_v"):
        plan_kda(d, block_v=12)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("rows,q", [(1, 1), (7, 1), (64, 1), (3, 4)])
def test_real_shapes_bf16_against_fp32(rows, q):
    h, d, keep = 64, 128, 3
    dev = "cuda"
    w = random_weights(h, d, keep, device=dev)
    p = random_step(rows * q, h, d, torch.bfloat16, dev)
    conv, state, verify = random_cache(rows + 3, h, d, keep, qmax=q if q > 1 else 0, dtype=torch.bfloat16, device=dev)
    index = torch.randperm(rows + 3, device=dev)[:rows]
    c_want, s_want = conv.float(), state.clone()
    v_want = {k: v.float() for k, v in verify.items()} if verify else None
    want = kda_decode_reference(*(x.float() for x in p), c_want, s_want, index, w, q, v_want)
    out = torch.full((rows * q, h * d), float("nan"), dtype=torch.bfloat16, device=dev)
    for bv in (128, 64, 32, 16):
        c, s = conv.clone(), state.clone()
        got = kda_decode(*p, c, s, index, w, q, plan_kda(d, bv), verify, out=out)
        torch.cuda.synchronize()
        assert rel(got, want) < 2e-2, bv
        if q == 1:
            assert rel(s[index], s_want[index]) < 2e-2, bv
            assert torch.equal(c[index], c_want[index].to(torch.bfloat16)), bv
        else:
            assert torch.equal(s, state) and torch.equal(c, conv)
            assert rel(verify["k"][index, :q], v_want["k"][index, :q]) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_graph_replays_and_commit_bit_for_bit():
    """Captured decode steps replay like eager ones (the arrival counters are left at zero), and a verify
    then a commit gives the state of decoding the accepted tokens, bit for bit, at real shapes."""
    h, d, keep, rows, q = 64, 128, 3, 4, 3
    dev = "cuda"
    w = random_weights(h, d, keep, device=dev)
    plan = plan_kda(d)
    conv, state, verify = random_cache(rows + 2, h, d, keep, qmax=q, dtype=torch.bfloat16, device=dev)
    index = torch.arange(rows, device=dev) + 1
    steps = [random_step(rows, h, d, torch.bfloat16, dev, seed=10 + i) for i in range(3)]
    c_eager, s_eager = conv.clone(), state.clone()
    want = [kda_decode(*p, c_eager, s_eager, index, w, 1, plan).clone() for p in steps]
    c, s = conv.clone(), state.clone()
    live = [[x.clone() for x in steps[0]]]
    out = torch.empty(rows, h * d, dtype=torch.bfloat16, device=dev)
    kda_decode(*live[0], c.clone(), s.clone(), index, w, 1, plan, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kda_decode(*live[0], c, s, index, w, 1, plan, out=out)
    for p, o in zip(steps, want):
        for dst, src in zip(live[0], p):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, o)
    assert torch.equal(s, s_eager) and torch.equal(c, c_eager)
    # verify q tokens a row, commit 2 of them; against decoding those 2 one at a time
    p = random_step(rows * q, h, d, torch.bfloat16, dev, seed=20)
    c0, s0 = c.clone(), s.clone()
    kda_decode(*p, c, s, index, w, q, plan_kda(d), verify)
    accepted = torch.full((rows,), 2, device=dev)
    kda_commit(c, s, verify, index, accepted, plan.block_v)
    for j in range(2):
        kda_decode(*(x.view(rows, q, -1)[:, j].contiguous() for x in p), c0, s0, index, w, 1, plan)
    torch.cuda.synchronize()
    assert torch.equal(s[index], s0[index]) and torch.equal(c[index], c0[index])


# ---------------------------------------------------------------- prefill (several sequences in one launch)
def test_prefill_reference_matches_the_stock_chunked_form():
    g = torch.Generator().manual_seed(7)
    h, d, lens = 3, 16, (1, 70, 5)
    t = sum(lens)
    q = torch.nn.functional.normalize(torch.randn(t, h, d, generator=g), dim=-1) * d**-0.5
    k = torch.nn.functional.normalize(torch.randn(t, h, d, generator=g), dim=-1)
    v, beta = torch.randn(t, h, d, generator=g), torch.rand(t, h, generator=g)
    gate = -5.0 * torch.sigmoid(torch.randn(t, h, d, generator=g))
    init = torch.randn(len(lens), h, d, d, generator=g) * 0.3
    cu = torch.tensor([0, 1, 71, 76])
    out, final = kda_prefill_reference(q, k, v, gate, beta, init, cu, -5.0)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o, s = kda_chunked(q[a:b], k[a:b], v[a:b], gate[a:b], beta[a:b], init[i])
        assert rel(out[a:b], o) < 1e-5 and rel(final[i], s) < 1e-5


def test_prefill_inputs_and_norm_equal_the_stock_pieces(tiny_fp32):
    """The prefill launches on the small model's first KDA layer against the stock pieces they replace, for
    three sequences (a continuation shorter than the conv window, a fresh prompt, a continuation): q, k, v
    (conv + SiLU, l2-normalised heads), decay and beta from `_prefill`'s PyTorch steps, the state only read;
    the gated output norm against `gated_rms_norm`. Every element of every output is compared."""
    attn = tiny_fp32.layers[0].self_attn
    h, d, keep = attn.num_heads, attn.head_dim, attn.conv_kernel - 1
    lens, fresh = [2, 9, 6], [False, True, False]
    t = sum(lens)
    p = KdaProjections(*random_step(t, h, d, seed=11))
    conv, _, _ = random_cache(5, h, d, keep, seed=12)
    slots = torch.tensor([3, 0, 1])
    starts = [0, 2, 11, 17]
    before = conv.clone()
    q, k, v, g, beta = kda_prefill_inputs(p.q, p.k, p.v, p.f, p.b, attn.conv_weight().contiguous(), conv, attn.A_log,
                                          attn.dt_bias, starts, torch.where(torch.tensor(fresh), -1, slots), h,
                                          attn.lower_bound, KDA_L2_EPS, torch.float32)
    assert torch.equal(conv, before)
    mixed = torch.cat([p.q, p.k, p.v], dim=-1)
    for i, (a, b) in enumerate(zip(starts[:-1], starts[1:])):
        history = torch.zeros(1, 3 * h * d, keep) if fresh[i] else conv[slots[i : i + 1]]
        window = torch.cat([history, mixed[a:b].t().unsqueeze(0)], dim=-1)
        wq, wk, wv = attn.heads(attn.conv_silu(window, torch.float32)[0].t())
        for got, want in ((q, wq), (k, wk), (v, wv)):
            assert rel(got[a:b], want) < 1e-5
    assert rel(g, attn.log_decay(p.f)) < 1e-5 and rel(beta, torch.sigmoid(p.b)) < 1e-5
    core = torch.randn(t, h, d, generator=torch.Generator().manual_seed(13))
    want = gated_rms_norm(core, p.g.view_as(core), attn.o_norm_weight, attn.norm_eps)
    got = gated_norm(core.reshape(-1, d), p.g.reshape(-1, d), attn.o_norm_weight, attn.norm_eps)
    assert rel(got.view_as(want), want) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_prefill_real_shapes_bf16_against_fp32():
    """Three sequences (one token, an odd length past a chunk, a longer one), two with a cached state, at
    64 heads of 128, bf16 inputs: outputs and final states against the fp32 reference; bad shapes refused."""

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(3)
    h, d, lens = 64, 128, (1, 77, 300)
    t = sum(lens)
    q = torch.nn.functional.normalize(torch.randn(t, h, d, generator=g, device=dev), dim=-1) * d**-0.5
    k = torch.nn.functional.normalize(torch.randn(t, h, d, generator=g, device=dev), dim=-1)
    v = torch.randn(t, h, d, generator=g, device=dev)
    beta = torch.sigmoid(torch.randn(t, h, generator=g, device=dev))
    gate = -5.0 * torch.sigmoid(torch.randn(t, h, d, generator=g, device=dev) * 3 - 3)
    init = torch.randn(3, h, d, d, generator=g, device=dev) * 0.1
    init[1] = 0
    q, k, v, beta = (x.to(torch.bfloat16) for x in (q, k, v, beta))
    cu_host = torch.tensor([0, 1, 78, 378])
    cu = cu_host.to(dev)
    before = init.clone()
    kda_prefill(q, k, v, gate, beta, init, cu, cu_host, -5.0)  # compiles (fla's autotuning synchronises)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # the call sizes its chunk list from the host's lengths
    try:
        out, final = kda_prefill(q, k, v, gate, beta, init, cu, cu_host, -5.0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want_o, want_s = kda_prefill_reference(q, k, v, gate, beta, init, cu, -5.0)
    assert out.dtype == torch.bfloat16 and out.shape == (t, h, d)
    assert rel(out, want_o) < 2e-2 and rel(final, want_s) < 2e-2
    assert torch.equal(init, before)
    with pytest.raises(ValueError, match="initial state"):
        kda_prefill(q, k, v, gate, beta, init[:2], cu, cu_host, -5.0)
    with pytest.raises(ValueError, match="lengths"):
        kda_prefill(q, k, v, gate, beta, init, cu, cu_host[:3], -5.0)
