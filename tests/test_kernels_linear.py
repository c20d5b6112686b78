"""Skinny projection kernels against their fp32 references. CPU cases run the Triton interpreter at odd
sizes; GPU cases (marked `gpu`) run the model's real shapes for every decode size, CUDA-graph capture and
replay of each equal to eager."""

import pytest
import torch
import triton

from glm5next.checkpoint.fp8 import quantize_fp8_blocks
from glm5next.kernels.linear import (
    CANDIDATES, gate_up_swiglu, gate_up_swiglu_reference, linear_multi_reference, linear_reference, plan_launch,
    reads_x16, skinny_linear, skinny_linear_multi, tile_counters,
)

CUDA = torch.cuda.is_available()

# The interpreter converts 1-element arrays to scalars in a way numpy deprecates; thousands of warnings.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::RuntimeWarning")

# storage kind -> activation dtype
KINDS = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp8": torch.bfloat16,
    "fp8-fp32x": torch.float32,
}


def make_weight(kind: str, n: int, k: int, g: torch.Generator):
    """A random [n, k] weight of `kind` and its scales (FP8 quantized on the host, with varied block scales)."""
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 4
    if kind.startswith("fp8"):
        return quantize_fp8_blocks(w)
    return w.to(KINDS[kind]), None


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest error relative to the largest reference magnitude (per-element for tiny outputs)."""
    y, ref = y.float(), ref.float()
    assert torch.isfinite(y).all()
    return ((y - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item()


def tol(x_dtype: torch.dtype) -> float:
    """fp32 is tight; bf16 outputs are truncated by the interpreter's store (1 ulp ~ 2^-8)."""
    return 1e-4 if x_dtype == torch.float32 else 1e-2


def nan_out(m: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((m, n), float("nan"), dtype=dtype)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("split_k", [1, 3], ids=["nosplit", "split3"])
@pytest.mark.parametrize("m", [1, 3, 17])
def test_linear_matches_reference(kind, split_k, m):
    g = torch.Generator().manual_seed(m * 7 + len(kind))
    dtype = KINDS[kind]
    shapes = [(n, k) for n in (1, 37, 130, 300) for k in (64, 200, 257)]
    if kind in ("fp32", "fp8-fp32x"):  # the same kernel code as bf16/fp8 activations: fewer sizes
        shapes = [(1, 257), (37, 200), (130, 64), (300, 257)]
    for n, k in shapes:
        w, s = make_weight(kind, n, k, g)
        x = torch.randn(m, k, generator=g).to(dtype)
        out = nan_out(m, n, dtype)
        y = skinny_linear(x, w, s, out=out, split_k=split_k)
        assert y is out
        assert rel_err(y, linear_reference(x, w, s)) <= tol(dtype), (n, k)


@pytest.mark.parametrize("kind", ["fp32", "fp8"])
@pytest.mark.parametrize("split_k", [1, 2])
def test_linear_into_strided_view_leaves_the_rest(kind, split_k):
    g = torch.Generator().manual_seed(3)
    dtype = KINDS[kind]
    w, s = make_weight(kind, 130, 257, g)
    x_big = torch.randn(5, 300, generator=g).to(dtype)
    x = x_big[:, 11:268]  # rows with a stride other than K
    buf = nan_out(5, 150, dtype)
    out = buf[:, 7:137]
    skinny_linear(x, w, s, out=out, split_k=split_k, block_n=32)
    assert rel_err(out, linear_reference(x, w, s)) <= tol(dtype)
    assert buf[:, :7].isnan().all() and buf[:, 137:].isnan().all()


VARIANTS = {
    "n16": dict(block_n=16), "n128": dict(block_n=128), "k256": dict(block_k=256),
    "k256-128": dict(block_k=256, block_n=128),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("kind", ["fp32", "fp8"])
def test_linear_variants(variant, kind):
    g = torch.Generator().manual_seed(4)
    dtype = KINDS[kind]
    for m in (1, 5):
        w, s = make_weight(kind, 130, 300, g)  # K = 300: a 256-wide step spans two scale blocks, then a ragged one
        x = torch.randn(m, 300, generator=g).to(dtype)
        for split_k in (1, 2):
            y = skinny_linear(x, w, s, out=nan_out(m, 130, dtype), split_k=split_k, **VARIANTS[variant])
            assert rel_err(y, linear_reference(x, w, s)) <= tol(dtype)


def test_no_read_past_the_scales():
    """K = 300 in 256-wide steps: the last step's second 128-chunk lies wholly past K and past the
    last scale block. NaNs stored right after the scales must not reach the output, plain, gated and
    split."""
    g = torch.Generator().manual_seed(14)

    def fenced(t: torch.Tensor) -> torch.Tensor:
        buf = torch.full((t.numel() + 64,), float("nan"), dtype=t.dtype)
        buf[: t.numel()] = t.flatten()
        return buf[: t.numel()].view(t.shape)

    w, s = make_weight("fp8", 130, 300, g)
    w2, s2 = make_weight("fp8", 130, 300, g)
    s, s2 = fenced(s), fenced(s2)
    for m in (1, 5):
        x = torch.randn(m, 300, generator=g).to(torch.bfloat16)
        for split_k in (1, 2):
            y = skinny_linear(x, w, s, out=nan_out(m, 130, torch.bfloat16), split_k=split_k, block_k=256)
            assert rel_err(y, linear_reference(x, w, s)) <= 1e-2
            z = gate_up_swiglu(x, w, s, w2, s2, 7.0, out=nan_out(m, 130, torch.bfloat16), split_k=split_k,
                               block_k=256, block_n=128)
            assert rel_err(z, gate_up_swiglu_reference(x, w, s, w2, s2, 7.0)) <= 1e-2


@pytest.mark.parametrize("name", list(CANDIDATES))
def test_every_candidate_runs(name):
    g = torch.Generator().manual_seed(5)
    w, s = make_weight("fp8", 37, 257, g)
    x = torch.randn(2, 257, generator=g).to(torch.bfloat16)
    assert rel_err(skinny_linear(x, w, s, **CANDIDATES[name]), linear_reference(x, w, s)) <= 1e-2


@pytest.mark.parametrize("split_k", [1, 2], ids=["nosplit", "split2"])
def test_tensor_descriptor_loads(split_k, monkeypatch):
    """FP8 weight tiles through tensor descriptors (zero-filled past the last row and column: N = 130,
    K = 304 leave ragged tiles), plain, gated, in a multi launch and with the bf16 fallback; a mixed-storage
    multi launch keeps pointer loads."""
    from glm5next.kernels.linear import kernel

    built = []
    make = kernel.TensorDescriptor.from_tensor
    monkeypatch.setattr(kernel.TensorDescriptor, "from_tensor",
                        staticmethod(lambda t, block: built.append(tuple(t.shape)) or make(t, block)))
    g = torch.Generator().manual_seed(13)
    w, s = make_weight("fp8", 130, 304, g)
    w2, s2 = make_weight("fp8", 130, 304, g)
    fp8s = [make_weight("fp8", n, 304, g) for n in (70, 37, 1)]
    mixed = [make_weight("fp8", 70, 304, g), make_weight("bf16", 37, 304, g)]
    for m in (1, 6, 16, 17):
        x = torch.randn(m, 304, generator=g)
        if m == 6:
            x[2, 250] = 2.0**17  # beyond fp16: the programs meeting it redo their share in bf16 products
        x = x.to(torch.bfloat16)
        built.clear()
        y = skinny_linear(x, w, s, out=nan_out(m, 130, torch.bfloat16), split_k=split_k, half=True)
        assert rel_err(y, linear_reference(x, w, s)) <= 1e-2
        z = gate_up_swiglu(x, w, s, w2, s2, 7.0, out=nan_out(m, 130, torch.bfloat16), split_k=split_k, half=True)
        assert rel_err(z, gate_up_swiglu_reference(x, w, s, w2, s2, 7.0)) <= 1e-2
        outs = [nan_out(m, pw.shape[0], torch.bfloat16) for pw, _ in fp8s]
        skinny_linear_multi(x, fp8s, outs, split_k=split_k, half=True)
        for y, ref in zip(outs, linear_multi_reference(x, fp8s)):
            assert rel_err(y, ref) <= 1e-2
        assert built == [(130, 304), (130, 304), (130, 304), (70, 304), (37, 304), (1, 304)]
        outs = [nan_out(m, pw.shape[0], torch.bfloat16) for pw, _ in mixed]
        skinny_linear_multi(x, mixed, outs, split_k=split_k, half=True)
        for y, ref in zip(outs, linear_multi_reference(x, mixed)):
            assert rel_err(y, ref) <= 1e-2
        assert len(built) == 6


def test_an_fp16_copy_of_x_gives_the_same_results():
    """`x16` (x converted to fp16 beforehand) in place of each program's conversion: the same bits,
    plain, gated and grouped, including a program whose fp16 products overflow (it redoes its share
    from the bf16 x) and a mixed-storage launch (which ignores x16); a copy that is not x in fp16 with
    x's strides is refused, naming it."""
    g = torch.Generator().manual_seed(15)
    K = 304
    w, s = make_weight("fp8", 130, K, g)
    w2, s2 = make_weight("fp8", 130, K, g)
    fp8s = [make_weight("fp8", n, K, g) for n in (70, 37)]
    mixed = [make_weight("fp8", 70, K, g), make_weight("bf16", 37, K, g)]
    for m in (1, 6, 17):
        x = torch.randn(m, K, generator=g)
        if m == 6:
            x[4, 11] = 2.0**17
        x = x.to(torch.bfloat16)
        x16 = x.to(torch.float16)
        for split_k in (1, 2):
            kw = dict(split_k=split_k, half=True)
            want = skinny_linear(x, w, s, out=nan_out(m, 130, torch.bfloat16), **kw)
            assert torch.equal(skinny_linear(x, w, s, out=nan_out(m, 130, torch.bfloat16), x16=x16, **kw), want)
            want = gate_up_swiglu(x, w, s, w2, s2, 7.0, **kw)
            assert torch.equal(gate_up_swiglu(x, w, s, w2, s2, 7.0, x16=x16, **kw), want)
            for group in (fp8s, mixed):
                want = skinny_linear_multi(x, group, **kw)
                for a, b in zip(skinny_linear_multi(x, group, x16=x16, **kw), want):
                    assert torch.equal(a, b)
    # The products read x16 where it applies: a copy holding 2x doubles the FP8 launch, not the mixed one.
    x = torch.randn(3, K, generator=g).to(torch.bfloat16)
    twice = (2 * x).to(torch.float16)
    kw = dict(half=True)
    assert rel_err(skinny_linear(x, w, s, x16=twice, **kw), 2 * linear_reference(x, w, s)) <= 1e-2
    for a, b in zip(skinny_linear_multi(x, mixed, x16=twice, **kw), skinny_linear_multi(x, mixed, **kw)):
        assert torch.equal(a, b)
    for bad in (x.to(torch.float32), x[:2].to(torch.float16), x.t().contiguous().t().to(torch.float16)):
        with pytest.raises(ValueError, match="x16 must be x in fp16"):
            skinny_linear(x, w, s, x16=bad)


def test_fp16_products_are_the_default_for_fp8_up_to_16_rows():
    """And at 17-32 rows for FP8 weights of at least 24 Mi elements (a gated call counts both)."""
    fp8 = dict(ns=[4096], K=4096, weight_bytes=1)
    assert plan_launch(1, **fp8).half and plan_launch(16, **fp8).half
    assert not plan_launch(17, **fp8).half and not plan_launch(64, **fp8).half
    large = dict(ns=[4096, 4096], K=4096, weight_bytes=1)  # 32 Mi elements
    assert plan_launch(17, **large).half and plan_launch(32, **large).half
    assert not plan_launch(33, **large).half and not plan_launch(64, **large).half
    assert plan_launch(24, [3072], 4096, 1, gated=True).half and not plan_launch(24, [3071], 4096, 1, gated=True).half
    assert plan_launch(24, [6144], 4096, 1).half and not plan_launch(24, [4096, 2047], 4096, 1).half
    assert not plan_launch(8, [4096], 4096, 2).half  # bf16 weights
    assert not plan_launch(8, **fp8, x_bytes=4).half  # fp32 activations
    assert not plan_launch(8, **fp8, half=False).half and plan_launch(64, **fp8, half=True).half


def test_fp16_products_from_a_given_copy_for_ungated_fp8_at_17_to_64_rows():
    """With an fp16 copy of x given (`x16`), ungated FP8 launches take fp16 products (and tensor
    descriptors) at 17-64 rows whatever their size; gated ones, BF16 weights, fp32 activations and
    `half=False` keep their plans. `skinny_linear` given a copy launches so, and equals the reference at
    40 rows with a NaN-filled output."""
    fp8 = dict(ns=[4096], K=4096, weight_bytes=1)
    for m in (17, 32, 33, 64):
        assert not plan_launch(m, **fp8).half and plan_launch(m, **fp8, x16=True).half
        assert plan_launch(m, **fp8, x16=True).tma and plan_launch(m, [64, 128], 4096, 1, x16=True).half
        assert not plan_launch(m, [1024], 4096, 1, gated=True, x16=True).half
        assert not plan_launch(m, [4096], 4096, 2, x16=True).half
        assert not plan_launch(m, **fp8, x16=True, half=False).half
    assert not plan_launch(m, **fp8, x16=True, x_bytes=4).half
    assert not plan_launch(33, [3072], 4096, 1, gated=True, x16=True).half  # 24 Mi gated: only up to 32 rows
    assert plan_launch(32, [3072], 4096, 1, gated=True).half
    g = torch.Generator().manual_seed(1740)
    w, s = make_weight("fp8", 150, 272, g)
    x = torch.randn(40, 272, generator=g).to(torch.bfloat16)
    import glm5next.kernels.linear as linear

    plans = []
    real = linear.launch
    try:
        linear.launch = lambda *a: plans.append(a[4]) or real(*a)
        y = skinny_linear(x, w, s, out=nan_out(40, 150, torch.bfloat16), x16=x.to(torch.float16))
        skinny_linear(x, w, s)
    finally:
        linear.launch = real
    assert [p.half for p in plans] == [True, False]
    assert rel_err(y, linear_reference(x, w, s)) <= tol(torch.bfloat16)


def test_tensor_descriptors_are_the_default_with_fp16_products():
    """Where FP8 weights meet fp16 products the tiles come through tensor descriptors and a gated call
    halves the heuristic's split; elsewhere pointer loads."""
    fp8 = dict(ns=[4096], K=4096, weight_bytes=1)
    assert plan_launch(1, **fp8).tma and plan_launch(16, **fp8).tma
    assert not plan_launch(17, **fp8).tma and not plan_launch(8, **fp8, half=False).tma
    assert plan_launch(32, [12288], 4096, 1).tma and not plan_launch(33, [12288], 4096, 1).tma
    assert plan_launch(64, **fp8, half=True).tma and not plan_launch(8, **fp8, block_k=256).tma
    assert not plan_launch(8, [4096], 4096, 2).tma and not plan_launch(8, **fp8, x_bytes=4).tma
    assert not plan_launch(8, **fp8, widest_bytes=2).tma  # a BF16 weight in the same launch
    plain = plan_launch(1, **fp8, gated=True, half=False).split_k
    assert plan_launch(1, **fp8, gated=True).split_k == max(1, round(plain * 0.5)) < plain
    assert plan_launch(1, **fp8).split_k == plan_launch(1, **fp8, half=False).split_k


@pytest.mark.parametrize("split_k", [1, 2], ids=["nosplit", "split2"])
def test_activations_beyond_fp16_fall_back_to_bf16_products(split_k):
    """An activation of 2^17 overflows fp16: the programs that meet it redo their share in bf16
    products, and the result is the reference's (finite), plain and gated, for every row."""
    g = torch.Generator().manual_seed(11)
    w, s = make_weight("fp8", 130, 257, g)
    w2, s2 = make_weight("fp8", 130, 257, g)
    x = torch.randn(3, 257, generator=g)
    x[1, 200] = 2.0**17  # only the programs whose K range holds column 200 meet it
    x = x.to(torch.bfloat16)
    for half in (None, True):
        y = skinny_linear(x, w, s, out=nan_out(3, 130, torch.bfloat16), split_k=split_k, half=half)
        assert torch.isfinite(y).all()
        assert rel_err(y, linear_reference(x, w, s)) <= 1e-2
        z = gate_up_swiglu(x, w, s, w2, s2, 1e9, out=nan_out(3, 130, torch.bfloat16), split_k=split_k, half=half)
        assert torch.isfinite(z).all()
        assert rel_err(z, gate_up_swiglu_reference(x, w, s, w2, s2, 1e9)) <= 1e-2


MULTI = {
    1: [("bf16", 130)],
    3: [("fp8", 300), ("fp8", 37), ("fp32", 1)],
    6: [("bf16", 70), ("bf16", 130), ("bf16", 20), ("bf16", 64), ("fp32", 1), ("fp32", 33)],
}


@pytest.mark.parametrize("count", sorted(MULTI))
@pytest.mark.parametrize("split_k", [1, None, 2], ids=["nosplit", "heuristic", "split2"])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["fp32x", "bf16x"])
def test_multi_matches_reference(count, split_k, x_dtype):
    g = torch.Generator().manual_seed(count)
    k = 257 if count == 3 else 200
    projections = [make_weight(kind, n, k, g) for kind, n in MULTI[count]]
    for m in (1, 17):
        x = torch.randn(m, k, generator=g).to(x_dtype)
        ys = skinny_linear_multi(x, projections, split_k=split_k)
        refs = linear_multi_reference(x, projections)
        assert len(ys) == count
        for y, ref in zip(ys, refs):
            assert y.dtype == x_dtype and y.shape == ref.shape
            assert rel_err(y, ref) <= tol(x_dtype)


def test_multi_into_views_of_one_buffer():
    g = torch.Generator().manual_seed(6)
    projections = [make_weight("fp8", n, 200, g) for n in (130, 37, 64)]
    x = torch.randn(3, 200, generator=g).to(torch.bfloat16)
    buf = nan_out(3, 240, torch.bfloat16)
    outs = [buf[:, 0:130], buf[:, 131:168], buf[:, 170:234]]
    for split_k in (1, 2):
        skinny_linear_multi(x, projections, outs, split_k=split_k)
        for o, ref in zip(outs, linear_multi_reference(x, projections)):
            assert rel_err(o, ref) <= 1e-2
        assert buf[:, [130, 168, 169, 234, 239]].isnan().all()


def test_multi_outputs_may_be_wider_than_x():
    """A bf16 step may ask for an fp32 output (the indexer's head weights): products of bf16 values are exact."""
    g = torch.Generator().manual_seed(11)
    projections = [make_weight("fp8", 130, 200, g), make_weight("bf16", 32, 200, g)]
    x = torch.randn(3, 200, generator=g).to(torch.bfloat16)
    outs = [nan_out(3, 130, torch.bfloat16), nan_out(3, 32, torch.float32)]
    skinny_linear_multi(x, projections, outs, split_k=2)
    refs = linear_multi_reference(x, projections)
    assert rel_err(outs[0], refs[0]) <= 1e-2
    assert rel_err(outs[1], x.float() @ projections[1][0].float().T) <= 1e-5


@pytest.mark.parametrize("kind", ["fp8", "bf16", "fp32"])
@pytest.mark.parametrize("split_k", [1, None, 3], ids=["nosplit", "heuristic", "split3"])
def test_gate_up_swiglu_matches_reference(kind, split_k):
    g = torch.Generator().manual_seed(7)
    dtype = KINDS[kind]
    for m, n, k in ((1, 37, 257), (3, 300, 200), (17, 130, 64)):
        gw, gs = make_weight(kind, n, k, g)
        uw, us = make_weight(kind, n, k, g)
        x = torch.randn(m, k, generator=g).to(dtype) * 0.3
        for limit in (3.0, 1e9):  # clamps engaged (|g|, |u| reach ~10) and not
            out = nan_out(m, n, dtype)
            y = gate_up_swiglu(x, gw, gs, uw, us, limit, out=out, split_k=split_k)
            assert y is out
            assert rel_err(y, gate_up_swiglu_reference(x, gw, gs, uw, us, limit)) <= tol(dtype), (m, n, k)


@pytest.mark.parametrize("variant", ["k256", "k256-128"])
def test_gate_up_swiglu_wide_steps(variant):
    g = torch.Generator().manual_seed(9)
    gw, gs = make_weight("fp8", 130, 300, g)
    uw, us = make_weight("fp8", 130, 300, g)
    for m in (1, 5):
        x = torch.randn(m, 300, generator=g).to(torch.bfloat16) * 0.3
        for split_k in (1, 2):
            y = gate_up_swiglu(x, gw, gs, uw, us, 3.0, out=nan_out(m, 130, torch.bfloat16), split_k=split_k,
                               **VARIANTS[variant])
            assert rel_err(y, gate_up_swiglu_reference(x, gw, gs, uw, us, 3.0)) <= 1e-2


def test_split_counters_return_to_zero():
    g = torch.Generator().manual_seed(8)
    w, s = make_weight("fp8", 300, 257, g)
    x = torch.randn(3, 257, generator=g)
    skinny_linear(x, w, s, split_k=4)
    gate_up_swiglu(x, w, s, w, s, 5.0, split_k=4)
    assert not tile_counters(x.device).any()


def test_split_is_deterministic():
    g = torch.Generator().manual_seed(9)
    w, s = make_weight("bf16", 130, 257, g)
    x = torch.randn(17, 257, generator=g).to(torch.bfloat16)
    first = skinny_linear(x, w, s, split_k=5)
    assert torch.equal(first, skinny_linear(x, w, s, split_k=5))


DECODE_SHAPES = {  # name: (output widths, K, weight bytes, gated): the real model's decode projections
    "kda_group": ([8192, 8192, 8192, 64, 128, 128], 4096, 2, False), "kda_o_proj": ([4096], 8192, 2, False),
    "dsa_group": ([1536, 576, 128], 4096, 1, False), "dsa_q_b": ([20480], 1536, 1, False),
    "dsa_o_proj": ([4096], 16384, 1, False), "dense_down": ([4096], 12288, 1, False),
    "shared_down": ([4096], 2048, 1, False), "dense_gate_up": ([12288], 4096, 1, True),
    "shared_gate_up": ([2048], 4096, 1, True)}
GPU_ROWS = (1, 2, 4, 8, 16, 17, 24, 32, 33, 48, 64)


def _programs(plan) -> int:
    return plan.tiles * plan.split_k


@pytest.mark.parametrize("m", GPU_ROWS)
def test_gpu_plans_keep_their_invariants(m):
    """The real decode shapes on 132 SMs: splits keep at least 4 K steps each (so the pipeline fills) and
    their fp32 partials within a quarter of the weight bytes (half for FP8 at 33-64 rows); a split launch of
    BF16 weights fits one wave of 2 programs per SM, of FP8 weights up to 16 rows 3 per SM, of ungated FP8
    weights at 17-32 / 33-64 rows 3 / 2 per SM (128-column tiles where 64-column ones alone pass 2 per SM);
    the pipeline stages fit about 100 KB of shared memory; a plan is a function of its arguments."""
    sms = 132
    for name, (ns, K, wb, gated) in DECODE_SHAPES.items():
        plan = plan_launch(m, ns, K, wb, "cuda", sms, gated)
        assert plan == plan_launch(m, ns, K, wb, "cuda", sms, gated), name
        assert plan.block_m == max(16, triton.next_power_of_2(m)) and plan.block_k == 128, name
        assert plan.tiles == sum(-(-n // plan.block_n) for n in ns), name
        steps = -(-K // plan.block_k)
        assert 1 <= plan.split_k <= 16 and (plan.split_k == 1 or -(-steps // plan.split_k) >= 4), name
        share = 16 if (wb == 1 and plan.block_m >= 64) else 32  # partial bytes written and read, per weight byte
        assert plan.split_k == 1 or plan.split_k * m * 4 * share <= K * wb * 4, name
        if plan.split_k > 1:
            per_sm = (2 if wb == 2 else 3 if plan.block_m == 16 else None if gated
                      else 3 if plan.block_m == 32 else 2)
            if per_sm:
                assert _programs(plan) <= per_sm * sms, name
        if wb == 1 and not gated and plan.block_m == 64:
            assert (plan.block_n == 128) == (sum(-(-n // 64) for n in ns) > 2 * sms), name
        per_stage = plan.block_m * plan.block_k * 2 + (2 if gated else 1) * plan.block_n * plan.block_k * wb
        buffers = plan.num_stages if plan.block_m >= 64 else plan.num_stages - 1
        assert plan.num_stages == 2 or buffers * per_stage <= 100_000, name


def test_plan_overrides_are_honoured_and_checked():
    """Explicit split, tiles, warps, stages and programmatic launch win over the heuristic; bad values are
    refused, naming the parameter; the CPU plan keeps the interpreter's shapes."""
    assert plan_launch(1, [4096], 8192, 2, split_k=1).split_k == 1
    assert plan_launch(3, [4096], 8192, 2, split_k=7, block_n=32).block_n == 32
    assert plan_launch(3, [4096], 8192, 2).num_warps == 4
    assert plan_launch(3, [4096], 8192, 2, num_warps=8).num_warps == 8
    with pytest.raises(ValueError, match="num_warps"):
        plan_launch(3, [4096], 8192, 2, num_warps=6)
    assert plan_launch(3, [4096], 8192, 1, num_stages=3).num_stages == 3
    with pytest.raises(ValueError, match="num_stages"):
        plan_launch(3, [4096], 8192, 1, num_stages=6)
    late = plan_launch(3, [4096], 8192, 2, pdl="late")
    assert late.pdl and late.pdl_late and not plan_launch(3, [4096], 8192, 2, pdl=True).pdl_late
    assert not plan_launch(3, [4096], 8192, 2).pdl
    with pytest.raises(ValueError, match="pdl"):
        plan_launch(3, [4096], 8192, 2, pdl="early")
    cpu = plan_launch(64, [20480], 1536, 1, device_type="cpu", sms=4)
    assert cpu.block_n == 64 and cpu.block_k == 64


def test_bad_arguments_are_refused():
    x = torch.randn(2, 64)
    w8, s8 = make_weight("fp8", 40, 64, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError):
        skinny_linear(x, w8)  # FP8 without scales
    with pytest.raises(ValueError):
        skinny_linear(x, w8, s8[:, :0])
    with pytest.raises(ValueError):
        skinny_linear(torch.randn(65, 64), w8, s8)
    with pytest.raises(ValueError):
        skinny_linear(x, torch.randn(64, 40).T, None)  # not contiguous
    with pytest.raises(ValueError):
        skinny_linear(x, w8, s8, out=torch.empty(2, 41))
    with pytest.raises(ValueError):
        skinny_linear_multi(x, [(w8, s8)] * 7)
    with pytest.raises(ValueError):
        gate_up_swiglu(x, w8, s8, w8.float(), None, 1.0)
    assert skinny_linear(torch.randn(0, 64), w8, s8).shape == (0, 40)


@pytest.mark.parametrize("kind", ["fp8-fp32x", "fp32"])
@pytest.mark.parametrize("gated", [False, True])
def test_fp32_products_in_chunks(kind, gated):
    """On the GPU fp32 products are fed 16-32 K at a time inside a step; the chunked loop agrees."""
    from glm5next.kernels.linear.kernel import LaunchPlan, launch

    g = torch.Generator().manual_seed(10)
    w, s = make_weight(kind, 70, 257, g)
    u, us = make_weight(kind, 70, 257, g)
    x = torch.randn(3, 257, generator=g) * 0.3
    out = nan_out(3, 70, torch.float32)
    plan = LaunchPlan(16, 32, 64, 2, f32_sub_k=16)
    launch(x, [w], [s], [out], plan, up=(u, us) if gated else None, limit=2.0)
    ref = gate_up_swiglu_reference(x, w, s, u, us, 2.0) if gated else linear_reference(x, w, s)
    assert rel_err(out, ref) <= 1e-4


def test_programmatic_launch_prefetches_what_fits_in_l2():
    """A programmatic-dependent launch prefetches every K step while its weights fit in PREFETCH_BYTES,
    the fitting share beyond, and nothing where the bulk prefetch's 16-byte pieces do not line up."""
    from glm5next.kernels.linear.kernel import PREFETCH_BYTES, _prefetch_iters

    def w(n, k, dtype=torch.float8_e4m3fn):
        return torch.empty(n, k, dtype=dtype, device="meta")

    small = [w(2048, 4096), w(576, 4096)]
    assert _prefetch_iters(small, 8) == 8
    big = [w(12288, 4096), w(12288, 4096)]  # 2 x 50 MB
    assert _prefetch_iters(big, 8) == 8 * PREFETCH_BYTES // (2 * 12288 * 4096)
    assert 0 < _prefetch_iters(big, 8) < 8
    assert _prefetch_iters([w(64, 4104)], 8) == 0  # rows of 4104 bytes
    assert _prefetch_iters([w(64, 2052, torch.bfloat16)], 8) == 0
    assert plan_launch(1, [64], 4096, 1, pdl=True).pdl and not plan_launch(1, [64], 4096, 1, pdl=False).pdl


@pytest.mark.parametrize("split_k", [1, 3])
def test_out16_is_the_output_in_fp16(split_k):
    """`out16` receives the output converted to fp16 (NaN-filled, ragged sizes, split or not), plain and
    gated, with the output itself unchanged; the down projection reading it as `x16` gives the same bits
    as from the bf16 output; a buffer of another shape, dtype or stride is refused."""
    g = torch.Generator().manual_seed(16)
    K = 272
    w, s = make_weight("fp8", 150, K, g)
    w2, s2 = make_weight("fp8", 150, K, g)
    down, down_s = make_weight("fp8", 70, 150, g)
    for m in (1, 5):
        x = torch.randn(m, K, generator=g).to(torch.bfloat16)
        kw = dict(split_k=split_k, half=True)
        out16 = torch.full((m, 150), float("nan"), dtype=torch.float16)
        want = skinny_linear(x, w, s, **kw)
        assert torch.equal(skinny_linear(x, w, s, out16=out16, **kw), want)
        assert torch.equal(out16, want.to(torch.float16))
        out16 = torch.full((m, 150), float("nan"), dtype=torch.float16)
        h = gate_up_swiglu(x, w, s, w2, s2, 7.0, out=nan_out(m, 150, torch.bfloat16), out16=out16, **kw)
        assert torch.equal(h, gate_up_swiglu(x, w, s, w2, s2, 7.0, **kw))
        assert torch.equal(out16, h.to(torch.float16))
        want = skinny_linear(h, down, down_s, half=True)
        assert torch.equal(skinny_linear(h, down, down_s, x16=out16, half=True), want)
    x = torch.randn(2, K, generator=g).to(torch.bfloat16)
    for bad in (torch.empty(2, 150), torch.empty(2, 149, dtype=torch.float16),
                torch.empty(150, 2, dtype=torch.float16).t()):
        with pytest.raises(ValueError, match="out16 must be an fp16"):
            skinny_linear(x, w, s, out16=bad)


def test_reads_x16_where_the_products_are_fp16():
    """An x16 copy is worth writing for bf16 activations against FP8 weights where the default plan takes
    fp16 products given the copy: up to 16 rows, ungated at 17-64 rows, gated at 17-32 rows for weights of
    24 Mi elements or more."""
    fp8 = torch.empty(4096, 4096, dtype=torch.float8_e4m3fn)
    bf16 = torch.empty(4096, 4096, dtype=torch.bfloat16)
    assert reads_x16(1, [fp8], torch.bfloat16) and reads_x16(16, [fp8, fp8], torch.bfloat16)
    assert reads_x16(17, [fp8], torch.bfloat16) and reads_x16(64, [fp8, fp8], torch.bfloat16)
    assert reads_x16(24, [fp8], torch.bfloat16, gated=True) and not reads_x16(33, [fp8], torch.bfloat16, gated=True)
    small = torch.empty(1024, 4096, dtype=torch.float8_e4m3fn)
    assert not reads_x16(24, [small], torch.bfloat16, gated=True) and reads_x16(24, [small], torch.bfloat16)
    assert not reads_x16(1, [fp8, bf16], torch.bfloat16) and not reads_x16(1, [bf16], torch.bfloat16)
    assert not reads_x16(1, [fp8], torch.float32) and not reads_x16(1, [fp8], torch.float16)
    assert not reads_x16(0, [fp8], torch.bfloat16) and not reads_x16(65, [fp8], torch.bfloat16)


# GPU cases: the real decode projections (about 1 GB of random weights) at every decode size.
DECODE_SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64]
HIDDEN = 4096


def real_weight(kind: str, n: int, k: int, g: torch.Generator):
    """A random [n, k] weight on the GPU at the model's scale and its scales: bf16 (no scales), or FP8
    quantized with block scales that differ."""
    w = torch.randn(n, k, generator=g, device="cuda") * 0.02
    if kind == "bf16":
        return w.to(torch.bfloat16), None
    w *= torch.rand(n, 1, generator=g, device="cuda") + 0.5
    return quantize_fp8_blocks(w)


@pytest.fixture(scope="module")
def real_weights():
    """Random weights of the real decode projections, name -> (weight, scales) or a group's list of them."""
    g = torch.Generator(device="cuda").manual_seed(0)
    return {
        "kda": [real_weight("bf16", n, HIDDEN, g) for n in (8192, 8192, 8192, 64, 128, 128)],
        "dsa": [real_weight("fp8", n, HIDDEN, g) for n in (1536, 512, 128)] + [real_weight("bf16", 32, HIDDEN, g)],
        "o_proj": real_weight("bf16", HIDDEN, 8192, g),
        "q_b": real_weight("fp8", 20480, 1536, g),  # DSA q_b with the indexer's wq_b: 128-column tiles at 33-64 rows
        "dense_gate": real_weight("fp8", 12288, HIDDEN, g),
        "dense_up": real_weight("fp8", 12288, HIDDEN, g),
        "dense_down": real_weight("fp8", HIDDEN, 12288, g),
        "shared_gate": real_weight("fp8", 2048, HIDDEN, g),
        "shared_up": real_weight("fp8", 2048, HIDDEN, g),
        "shared_down": real_weight("fp8", HIDDEN, 2048, g),
    }


def cuda_x(m: int, k: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    """Random [m, k] activations on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(m, k, generator=g, device="cuda").to(dtype)


def real_calls(w):
    """name -> (kernel call, reference call, K) over the real shapes of `real_weights` `w`."""
    sg, su = w["shared_gate"], w["shared_up"]
    dg, du = w["dense_gate"], w["dense_up"]
    return {
        "kda_multi": (lambda x, **kw: skinny_linear_multi(x, w["kda"], **kw),
                      lambda x: linear_multi_reference(x, w["kda"]), HIDDEN),
        "dsa_multi": (lambda x, **kw: skinny_linear_multi(x, w["dsa"], **kw),
                      lambda x: linear_multi_reference(x, w["dsa"]), HIDDEN),
        "o_proj": (lambda x, **kw: skinny_linear(x, *w["o_proj"], **kw),
                   lambda x: linear_reference(x, *w["o_proj"]), 8192),
        "q_b": (lambda x, **kw: skinny_linear(x, *w["q_b"], **kw),
                lambda x: linear_reference(x, *w["q_b"]), 1536),
        "dense_gate_up": (lambda x, **kw: gate_up_swiglu(x, *dg, *du, 10.0, **kw),
                          lambda x: gate_up_swiglu_reference(x, *dg, *du, 10.0), HIDDEN),
        "dense_down": (lambda x, **kw: skinny_linear(x, *w["dense_down"], **kw),
                       lambda x: linear_reference(x, *w["dense_down"]), 12288),
        "shared_gate_up": (lambda x, **kw: gate_up_swiglu(x, *sg, *su, 10.0, **kw),
                           lambda x: gate_up_swiglu_reference(x, *sg, *su, 10.0), HIDDEN),
        "shared_down": (lambda x, **kw: skinny_linear(x, *w["shared_down"], **kw),
                        lambda x: linear_reference(x, *w["shared_down"]), 2048),
    }


REAL_NAMES = ["kda_multi", "dsa_multi", "o_proj", "q_b", "dense_gate_up", "dense_down", "shared_gate_up",
              "shared_down"]


def as_list(y):
    return y if isinstance(y, list) else [y]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("name", REAL_NAMES)
def test_real_shapes_match_reference(real_weights, name):
    fn, ref_fn, k = real_calls(real_weights)[name]
    for m in DECODE_SIZES:
        x = cuda_x(m, k, seed=m)
        for y, ref in zip(as_list(fn(x)), as_list(ref_fn(x))):
            assert y.dtype == torch.bfloat16 and y.shape == ref.shape
            assert rel_err(y, ref) <= 2e-2, (name, m)
    assert not tile_counters(x.device).any()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("name", ["dsa_multi", "o_proj", "shared_gate_up"])
def test_fp32_activations_are_tight(real_weights, name):
    fn, ref_fn, k = real_calls(real_weights)[name]
    for m in (1, 16, 64):
        x = cuda_x(m, k, seed=100 + m, dtype=torch.float32)
        for y, ref in zip(as_list(fn(x)), as_list(ref_fn(x))):
            assert y.dtype == torch.float32
            assert rel_err(y, ref) <= 1e-4, (name, m)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("candidate", list(CANDIDATES))
@pytest.mark.parametrize("name", ["dsa_multi", "o_proj", "shared_gate_up"])
def test_every_candidate_matches_reference(real_weights, name, candidate):
    fn, ref_fn, k = real_calls(real_weights)[name]
    for m in (1, 8, 48):
        x = cuda_x(m, k, seed=200 + m)
        for y, ref in zip(as_list(fn(x, **CANDIDATES[candidate])), as_list(ref_fn(x))):
            assert rel_err(y, ref) <= 2e-2, (name, candidate, m)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("name", ["dense_gate_up", "dense_down", "shared_gate_up", "o_proj", "dsa_multi"])
def test_an_fp16_copy_of_x_matches(real_weights, name):
    """`x16` (x in fp16 beforehand) where the products are fp16: the reference's result, and the launch
    without it to one bf16 step (the two compiled forms may contract differently), including a row
    beyond fp16's range, whose programs redo their share from the bf16 x."""
    fn, ref_fn, k = real_calls(real_weights)[name]
    for m in (1, 16, 24, 32, 48, 64):
        x = cuda_x(m, k, seed=250 + m)
        if m == 16:
            x[3, 7] = 2.0**17
        x16 = x.to(torch.float16)
        for y, plain, ref in zip(as_list(fn(x, half=True, x16=x16)), as_list(fn(x, half=True)),
                                 as_list(ref_fn(x))):
            assert rel_err(y, ref) <= 2e-2, (name, m)
            torch.testing.assert_close(y.float(), plain.float(), rtol=8e-3, atol=1e-3 * ref.float().abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_the_dense_mlp_through_fp16_copies(real_weights):
    """The gate|up writing its output in fp16 as well (`out16`, NaN-filled), which the down then reads
    (`x16`), with the default plans, as the executor launches them (fp16 products from the copies up to 32
    rows; at 48-64 the gate|up in bf16 products, the down in fp16 ones from its copy): the copy is the
    output converted, the output and the down within one bf16 step of the launches without copies, and the
    down within the reference's tolerance."""
    (gw, gs), (uw, us), (dw, ds) = real_weights["dense_gate"], real_weights["dense_up"], real_weights["dense_down"]
    for m in (1, 7, 16, 24, 32, 48, 64):
        x = cuda_x(m, HIDDEN, seed=300 + m)
        x16 = x.to(torch.float16)
        h16 = torch.full((m, dw.shape[1]), float("nan"), dtype=torch.float16, device="cuda")
        h = gate_up_swiglu(x, gw, gs, uw, us, 7.0, x16=x16, out16=h16)
        assert torch.equal(h16, h.to(torch.float16))
        plain = gate_up_swiglu(x, gw, gs, uw, us, 7.0)
        torch.testing.assert_close(h.float(), plain.float(), rtol=8e-3, atol=1e-3 * plain.float().abs().max().item())
        y = skinny_linear(h, dw, ds, x16=h16)
        want = skinny_linear(h, dw, ds)
        torch.testing.assert_close(y.float(), want.float(), rtol=8e-3, atol=1e-3 * want.float().abs().max().item())
        assert rel_err(y, linear_reference(h, dw, ds)) <= 2e-2, m


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("name", REAL_NAMES)
def test_graph_replay_equals_eager(real_weights, name):
    """Captured once per size with split-K on, replayed on fresh inputs: bitwise equal to eager."""
    fn, _, k = real_calls(real_weights)[name]
    for m in (1, 16, 64):
        static_x = cuda_x(m, k, seed=300 + m)
        fn(static_x)  # compile and create the tile counters outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = as_list(fn(static_x))
        for seed in (1, 2):
            static_x.copy_(cuda_x(m, k, seed=400 + 10 * m + seed))
            graph.replay()
            eager = as_list(fn(static_x.clone()))
            torch.cuda.synchronize()
            for a, b in zip(static_y, eager):
                assert torch.equal(a, b), (name, m, seed)
        assert not tile_counters(static_x.device).any()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_split_k_is_deterministic_at_the_real_width(real_weights):
    x = cuda_x(7, 8192, seed=5)
    first = skinny_linear(x, *real_weights["o_proj"], split_k=8)
    for _ in range(5):
        assert torch.equal(first, skinny_linear(x, *real_weights["o_proj"], split_k=8))


def _widen_cases(device: str, dtype: torch.dtype) -> None:
    """`widen_fp8` against `dequantize_fp8` on `device`, every element written (NaN-filled output), at sizes off
    the tile and scale-block grid, with scales that are not powers of two."""
    from glm5next.checkpoint.fp8 import dequantize_fp8
    from glm5next.kernels.linear.widen import widen_fp8

    g = torch.Generator().manual_seed(5)
    for n, k in ((45, 200), (130, 300)):
        w, s = quantize_fp8_blocks(torch.randn(n, k, generator=g))
        s = s * (1.0 + torch.rand(s.shape, generator=g))
        w, s = w.to(device), s.to(device)
        out = torch.full((n, k), float("nan"), dtype=dtype, device=device)
        widen_fp8(w, s, dtype, out=out)
        want = dequantize_fp8(w, s, dtype)
        if dtype == torch.float32 or device == "cuda":
            assert torch.equal(out, want), (n, k)
        else:  # the interpreter's bf16 conversion truncates where the GPU's rounds: one bf16 step apart at most
            assert not out.isnan().any()
            assert ((out.float() - want.float()).abs() <= want.float().abs() * 2**-7).all(), (n, k)
    with pytest.raises(ValueError, match="block scales"):
        widen_fp8(w, s[:, :1], dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_widen_fp8_is_dequantize_fp8(dtype):
    _widen_cases("cpu", dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_cuda_widen_fp8_is_dequantize_fp8_bit_for_bit():
    _widen_cases("cuda", torch.bfloat16)
