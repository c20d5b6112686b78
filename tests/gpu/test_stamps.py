"""On a GPU: kernel timestamps (`glm5next.kernels.stamps`). A launch that writes them computes what one
that does not computes (the boundary bit for bit); every program writes its row in order (start, prefetch, wait, products,
end), the programs that finish a token block or a split-K tile say so, and rows past the launch stay
zero. Then the overlap benchmark on two pairs.

Run with `TRITON_INTERPRET=0` (tests/conftest.py selects the interpreter otherwise).
"""

import os

import pytest
import torch

from glm5next.bench import overlap
from glm5next.bench.sweep import BOUNDARY_KW, boundary_mixer, boundary_state, shape_weights
from glm5next.kernels import boundary as boundary_kernels
from glm5next.kernels import stamps
from glm5next.kernels.linear import kernel as linear_kernel
from glm5next.kernels.linear import plan_launch, skinny_linear_multi

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs TRITON_INTERPRET=0"),
]


def _ordered(rows: torch.Tensor, programmatic: bool) -> None:
    s = rows
    assert (s[:, stamps.START] > 0).all()
    if programmatic:
        assert (s[:, stamps.START] <= s[:, stamps.PREFETCHED]).all()
        assert (s[:, stamps.PREFETCHED] <= s[:, stamps.WAITED]).all()
        assert (s[:, stamps.WAITED] <= s[:, stamps.PRODUCTS]).all()
    else:
        assert (s[:, stamps.PREFETCHED] == 0).all() and (s[:, stamps.WAITED] == 0).all()
    assert (s[:, stamps.START] <= s[:, stamps.PRODUCTS]).all() and (s[:, stamps.PRODUCTS] <= s[:, stamps.END]).all()
    fin = s[:, stamps.FINISH] != 0
    assert (s[fin, stamps.PRODUCTS] <= s[fin, stamps.FINISH]).all()
    assert (s[fin, stamps.FINISH] <= s[fin, stamps.END]).all()
    mixed = s[:, stamps.MIXED] != 0  # the boundary's finishers only
    assert not (mixed & ~fin).any() and ((s[:, stamps.SINKHORN] != 0) == mixed).all()
    assert (s[mixed, stamps.FINISH] <= s[mixed, stamps.MIXED]).all()
    assert (s[mixed, stamps.MIXED] <= s[mixed, stamps.SINKHORN]).all()
    assert (s[mixed, stamps.SINKHORN] <= s[mixed, stamps.END]).all()
    for slot in (stamps.PREFETCHED, stamps.WAITED, stamps.PRODUCTS, stamps.FINISH, stamps.MIXED, stamps.SINKHORN,
                 stamps.END):
        wrote = s[:, slot] != 0  # its SM's cycle counter moved forward from START
        assert (s[wrote, stamps.CLOCK + slot] >= s[wrote, stamps.CLOCK + stamps.START]).all()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert (s[:, stamps.SM] >= 0).all() and (s[:, stamps.SM] < sms).all()


@pytest.mark.parametrize("pdl", [False, "late"])
@pytest.mark.parametrize("T", [1, 5])
def test_boundary_stamps(T, pdl, monkeypatch):
    dev = torch.device("cuda")
    state, mixer = boundary_state(T, dev), boundary_mixer(dev)
    kw = dict(BOUNDARY_KW, sinkhorn_iters=20, pdl=pdl)
    plain = boundary_kernels.mhc_boundary(*state, *mixer, **kw)
    p = boundary_kernels.plan(T, 4096, 4, True)
    programs = p["NC"] * p["NT"]
    buf = stamps.buffer(programs + 7, dev)
    monkeypatch.setattr(boundary_kernels, "STAMPS", buf)
    got = boundary_kernels.mhc_boundary(*state, *mixer, **kw)
    torch.cuda.synchronize()
    for a, b in zip(got, plain):
        assert torch.equal(a, b)
    rows = buf.cpu()
    assert (rows[programs:] == 0).all()
    _ordered(rows[:programs], pdl is not False)
    assert int((rows[:programs, stamps.FINISH] != 0).sum()) == p["NT"]  # one finisher per token block
    assert int((rows[:programs, stamps.MIXED] != 0).sum()) == p["NT"]


@pytest.mark.parametrize("pdl", [None, True])
def test_projection_group_stamps(pdl, monkeypatch):
    dev = torch.device("cuda")
    ws = shape_weights("dsa_group", dev)[0]
    x = (torch.randn(3, 4096, device=dev) * 0.1).to(torch.bfloat16)
    plain = skinny_linear_multi(x, ws, pdl=pdl)
    lp = plan_launch(3, [w.shape[0] for w, _ in ws], 4096, 1)
    tiles = sum(-(-w.shape[0] // lp.block_n) for w, _ in ws)
    assert lp.split_k > 1
    buf = stamps.buffer(tiles * 16 + 5, dev)
    monkeypatch.setattr(linear_kernel, "STAMPS", buf)
    got = skinny_linear_multi(x, ws, pdl=pdl)
    torch.cuda.synchronize()
    for a, b in zip(got, plain):
        # This kernel compiles with contraction, which ptxas may apply differently in the stamped
        # build: within one bf16 step of the plain launch.
        torch.testing.assert_close(a.float(), b.float(), rtol=8e-3, atol=1e-3)
    rows = buf.cpu()
    ran = rows[:, stamps.START] != 0
    programs = int(ran.sum())
    assert ran[:programs].all() and programs % tiles == 0  # tiles x splits, rows in order
    _ordered(rows[:programs], lp.pdl if pdl is None else True)
    assert int((rows[:programs, stamps.FINISH] != 0).sum()) == tiles  # one finisher per tile


@pytest.mark.parametrize("case,mode", [("dsa_group", "overlap"), ("dense_gate_up", "overlap"),
                                       ("dense_gate_up", "grouped")])
def test_overlap_benchmark_on_two_pairs(case, mode):
    r = overlap.run(torch.device("cuda"), 1, mode, case, layers=2, replays=3)
    assert boundary_kernels.STAMPS is None and linear_kernel.STAMPS is None
    assert len(r["pairs"]) == 2 and r["pair_us"] > 0 and r["pair_us_stamped"] > 0
    for pair in r["pairs"]:
        m = pair["met"]
        assert 0 <= m["group_prefetched_before_boundary_end"] <= m["group_programs"] == pair["group"]["programs"]
        assert pair["boundary"]["start"]["first"] == 0 and pair["boundary"]["end"]["last"] == m["boundary_us"]
        assert pair["group"]["end"]["count"] == m["group_programs"]
    assert r["timer_step_ns"] is None or r["timer_step_ns"] > 0
