"""On a GPU: the skinny projection kernels at the model's real shapes for every decode size against
their fp32 references, CUDA-graph capture and replay of each equal to eager, and a bandwidth report."""

import pytest
import torch

from glm5next.checkpoint.fp8 import quantize_fp8_blocks
from glm5next.kernels.linear import (
    CANDIDATES, gate_up_swiglu, gate_up_swiglu_reference, linear_multi_reference, linear_reference, skinny_linear,
    skinny_linear_multi, tile_counters,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64]
HIDDEN = 4096


def bf16(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, None]:
    return (torch.randn(n, k, generator=g, device="cuda") * 0.02).to(torch.bfloat16), None


def fp8(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=g, device="cuda") * 0.02
    w *= torch.rand(n, 1, generator=g, device="cuda") + 0.5  # block scales that differ
    return quantize_fp8_blocks(w)


@pytest.fixture(scope="module")
def weights():
    """Random weights of the real decode projections (about 1 GB)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    return {
        "kda": [bf16(8192, HIDDEN, g), bf16(8192, HIDDEN, g), bf16(8192, HIDDEN, g), bf16(64, HIDDEN, g),
                bf16(128, HIDDEN, g), bf16(128, HIDDEN, g)],
        "dsa": [fp8(1536, HIDDEN, g), fp8(512, HIDDEN, g), fp8(128, HIDDEN, g), bf16(32, HIDDEN, g)],
        "o_proj": bf16(HIDDEN, 8192, g),
        "q_b": fp8(20480, 1536, g),  # the DSA q_b with the indexer's wq_b: at 33-64 rows 128-column tiles
        "dense_gate": fp8(12288, HIDDEN, g),
        "dense_up": fp8(12288, HIDDEN, g),
        "dense_down": fp8(HIDDEN, 12288, g),
        "shared_gate": fp8(2048, HIDDEN, g),
        "shared_up": fp8(2048, HIDDEN, g),
        "shared_down": fp8(HIDDEN, 2048, g),
    }


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    y, ref = y.float(), ref.float()
    assert torch.isfinite(y).all()
    return ((y - ref).abs().max() / ref.abs().max()).item()


def make_x(m: int, k: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(m, k, generator=g, device="cuda").to(dtype)


def calls(w):
    """name -> (kernel call, reference call, K) over the real shapes."""
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


NAMES = ["kda_multi", "dsa_multi", "o_proj", "q_b", "dense_gate_up", "dense_down", "shared_gate_up", "shared_down"]


def as_list(y):
    return y if isinstance(y, list) else [y]


@pytest.mark.parametrize("name", NAMES)
def test_real_shapes_match_reference(weights, name):
    fn, ref_fn, k = calls(weights)[name]
    for m in SIZES:
        x = make_x(m, k, seed=m)
        for y, ref in zip(as_list(fn(x)), as_list(ref_fn(x))):
            assert y.dtype == torch.bfloat16 and y.shape == ref.shape
            assert rel_err(y, ref) <= 2e-2, (name, m)
    assert not tile_counters(x.device).any()


@pytest.mark.parametrize("name", ["dsa_multi", "o_proj", "shared_gate_up"])
def test_fp32_activations_are_tight(weights, name):
    fn, ref_fn, k = calls(weights)[name]
    for m in (1, 16, 64):
        x = make_x(m, k, seed=100 + m, dtype=torch.float32)
        for y, ref in zip(as_list(fn(x)), as_list(ref_fn(x))):
            assert y.dtype == torch.float32
            assert rel_err(y, ref) <= 1e-4, (name, m)


@pytest.mark.parametrize("candidate", list(CANDIDATES))
@pytest.mark.parametrize("name", ["dsa_multi", "o_proj", "shared_gate_up"])
def test_every_candidate_matches_reference(weights, name, candidate):
    fn, ref_fn, k = calls(weights)[name]
    for m in (1, 8, 48):
        x = make_x(m, k, seed=200 + m)
        for y, ref in zip(as_list(fn(x, **CANDIDATES[candidate])), as_list(ref_fn(x))):
            assert rel_err(y, ref) <= 2e-2, (name, candidate, m)


@pytest.mark.parametrize("name", ["dense_gate_up", "dense_down", "shared_gate_up", "o_proj", "dsa_multi"])
def test_an_fp16_copy_of_x_matches(weights, name):
    """`x16` (x in fp16 beforehand) where the products are fp16: the reference's result, and the launch
    without it to one bf16 step (the two compiled forms may contract differently), including a row
    beyond fp16's range, whose programs redo their share from the bf16 x."""
    fn, ref_fn, k = calls(weights)[name]
    for m in (1, 16, 24, 32, 48, 64):
        x = make_x(m, k, seed=250 + m)
        if m == 16:
            x[3, 7] = 2.0**17
        x16 = x.to(torch.float16)
        for y, plain, ref in zip(as_list(fn(x, half=True, x16=x16)), as_list(fn(x, half=True)),
                                 as_list(ref_fn(x))):
            assert rel_err(y, ref) <= 2e-2, (name, m)
            torch.testing.assert_close(y.float(), plain.float(), rtol=8e-3, atol=1e-3 * ref.float().abs().max().item())


def test_the_dense_mlp_through_fp16_copies(weights):
    """The gate|up writing its output in fp16 as well (`out16`, NaN-filled), which the down then reads
    (`x16`), with the default plans, as the executor launches them (fp16 products from the copies up to 32
    rows; at 48-64 the gate|up in bf16 products, the down in fp16 ones from its copy): the copy is the
    output converted, the output and the down within one bf16 step of the launches without copies, and the
    down within the reference's tolerance."""
    (gw, gs), (uw, us), (dw, ds) = weights["dense_gate"], weights["dense_up"], weights["dense_down"]
    for m in (1, 7, 16, 24, 32, 48, 64):
        x = make_x(m, HIDDEN, seed=300 + m)
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


@pytest.mark.parametrize("name", NAMES)
def test_graph_replay_equals_eager(weights, name):
    """Captured once per size with split-K on, replayed on fresh inputs: bitwise equal to eager."""
    fn, _, k = calls(weights)[name]
    for m in (1, 16, 64):
        static_x = make_x(m, k, seed=300 + m)
        fn(static_x)  # compile and create the tile counters outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = as_list(fn(static_x))
        for seed in (1, 2):
            static_x.copy_(make_x(m, k, seed=400 + 10 * m + seed))
            graph.replay()
            eager = as_list(fn(static_x.clone()))
            torch.cuda.synchronize()
            for a, b in zip(static_y, eager):
                assert torch.equal(a, b), (name, m, seed)
        assert not tile_counters(static_x.device).any()


def test_split_k_is_deterministic(weights):
    x = make_x(7, 8192, seed=5)
    first = skinny_linear(x, *weights["o_proj"], split_k=8)
    for _ in range(5):
        assert torch.equal(first, skinny_linear(x, *weights["o_proj"], split_k=8))
