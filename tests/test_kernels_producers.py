"""The producer kernels (`glm5next.kernels.producers`) against their PyTorch references: NaN-filled
outputs, odd sizes, strided inputs; the fp16 copy is the result converted, bit for bit."""

import pytest
import torch

from glm5next.kernels.producers import cast, cast_reference, rms_norm, rms_norm_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def nan(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,D", [(1, 48), (3, 200), (17, 2048), (64, 96)])
def test_rms_norm_equals_the_stock_norm(T, D, dtype):
    g = torch.Generator().manual_seed(T * 1000 + D)
    wide = (torch.randn(T, D + 40, generator=g) * 3).to(dtype).to(DEVICE)
    x = wide[:, 5:5 + D]  # rows strided past D, as a slice of a grouped launch's output
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype).to(DEVICE)
    out, out16 = nan((T, D), dtype), nan((T, D), torch.float16)
    got = rms_norm(x, w, 1e-6, out16, out)
    want = rms_norm_reference(x, w, 1e-6)
    assert got is out and not got.isnan().any()
    # fp32 statistics summed in another order (and on CPU the interpreter's bf16 casts, which truncate):
    # an element may land a few fp32 ulps, or in bf16 one rounding step, from the stock one
    tol = 1e-6 if dtype == torch.float32 else 2.0**-6
    over = (got.float() - want.float()).abs() > want.float().abs() * tol
    assert not over.any(), (got[over], want[over])
    assert torch.equal(out16, got.to(torch.float16))
    plain = rms_norm(x, w, 1e-6)  # no copy asked for: the same result
    assert torch.equal(plain, got)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T,H,V", [(1, 4, 32), (5, 3, 100), (33, 8, 129)])
def test_cast_equals_to_and_reshape(T, H, V, dtype):
    g = torch.Generator().manual_seed(T + H + V)
    base = torch.randn(H, T, V, generator=g).to(DEVICE) * 50
    x = base.permute(1, 0, 2)  # [T, H, V] as an einsum leaves it: heads outermost in memory
    out, out16 = nan((T, H * V), dtype), nan((T, H * V), torch.float16)
    got = cast(x, dtype, out16, out)
    assert got is out
    want = cast_reference(x, dtype)
    if DEVICE == "cuda" or dtype == torch.float32:
        assert torch.equal(got, want)
    else:  # the interpreter's fp32 -> bf16 cast truncates where PyTorch rounds to nearest: one step at most
        assert not ((got.float() - want.float()).abs() > want.float().abs() * 2.0**-7).any()
    assert torch.equal(out16, got.to(torch.float16))
    flat = cast(x.reshape(T, H * V), dtype)  # a 2-D input gives the same
    assert torch.equal(flat, got)


def test_producers_refuse_what_they_cannot_write():
    x = torch.randn(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight must be a \\[8\\] vector"):
        rms_norm(x, torch.ones(7, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="out16 must be a contiguous torch.float16 \\(3, 8\\)"):
        rms_norm(x, torch.ones(8, device=DEVICE), 1e-6, out16=torch.empty(3, 8, device=DEVICE))
    with pytest.raises(ValueError, match="unit stride"):
        rms_norm(x.t(), torch.ones(3, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="2-D or 3-D"):
        cast(torch.randn(2, 2, 2, 2, device=DEVICE), torch.bfloat16)
