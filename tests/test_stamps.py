"""Kernel timestamps on the CPU: launches refuse them (the interpreter has no inline assembly) before
anything runs, a buffer that cannot take them is refused, and the overlap benchmark's summaries."""

import pytest
import torch

from glm5next.bench import overlap
from glm5next.kernels import boundary as boundary_kernels
from glm5next.kernels import stamps
from glm5next.kernels.linear import kernel as linear_kernel
from glm5next.kernels.linear import skinny_linear_multi


def test_slots_fit_the_rows_the_kernels_write():
    """The device side writes rows 32 wide: the timer at the slot, the SM at column 8, the cycle
    counter at 16 + slot (literals in `stamp`); the kernels write END at slot 7 and the boundary's
    finisher MIXED and SINKHORN at 5 and 6 (literals in the kernels)."""
    assert stamps.SLOTS == 32 and stamps.SM == 8 and stamps.CLOCK == 16 and stamps.END < stamps.SM
    assert (stamps.MIXED, stamps.SINKHORN, stamps.END) == (5, 6, 7)
    assert stamps.NAMES[stamps.START] == "start" and stamps.NAMES[stamps.END] == "end"


def test_buffers_are_checked():
    assert stamps.check(None, 10, torch.device("cpu")) is False
    with pytest.raises(ValueError, match="need a GPU"):
        stamps.check(stamps.buffer(10, "cpu"), 10, torch.device("cpu"))
    cuda = torch.device("cuda", 0)  # only compared with, never touched
    with pytest.raises(ValueError, match="at least 10 x 32"):
        stamps.check(torch.zeros(10, 32, dtype=torch.int64), 10, cuda)  # on the wrong device
    assert stamps.buffer(3, "cpu").shape == (3, stamps.SLOTS)


def test_launches_on_the_cpu_refuse_stamps(monkeypatch):
    T, D, n = 2, 64, 4
    out = torch.randn(T, D).to(torch.bfloat16)
    streams = torch.randn(T, n, D).to(torch.bfloat16)
    w = (2 + n) * n
    mixer = (torch.randn(w, n * D), torch.randn(w), torch.rand(3) + 0.5, torch.ones(D, dtype=torch.bfloat16))
    monkeypatch.setattr(boundary_kernels, "STAMPS", stamps.buffer(64, "cpu"))
    with pytest.raises(ValueError, match="need a GPU"):
        boundary_kernels.mhc_boundary(out, streams, torch.rand(T, n), torch.full((T, n, n), 0.25), *mixer,
                                      hc_eps=1e-6, rms_eps=1e-5, norm_eps=1e-5, sinkhorn_iters=3, post_mult=2.0)
    monkeypatch.setattr(linear_kernel, "STAMPS", stamps.buffer(64, "cpu"))
    x = torch.randn(2, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match="need a GPU"):
        skinny_linear_multi(x, [(torch.randn(32, 64).to(torch.bfloat16), None)])


def _rows(programs: int, **cols) -> torch.Tensor:
    """Stamps of `programs` programs (two more rows that no program wrote), each cycle counter at
    2 cycles per ns from 5000 + 1000 x the program's index."""
    buf = torch.zeros(programs + 2, stamps.SLOTS, dtype=torch.int64)
    for name, values in cols.items():
        col = getattr(stamps, name.upper())
        buf[:programs, col] = torch.tensor(values)
        if col <= stamps.END:
            start = torch.tensor(cols["start"])
            wrote = buf[:programs, col] != 0
            buf[:programs, stamps.CLOCK + col] = torch.where(
                wrote, 5000 + 1000 * torch.arange(programs) + 2 * (buf[:programs, col] - start), 0)
    return buf


def test_pair_report_counts_from_the_boundarys_first_start():
    """Times in µs from the boundary's first program start (ns stamps); the group's programs that
    started and prefetched before the boundary's last end; its waits and end after that end; the
    finisher's phases between its FINISH, MIXED, SINKHORN and END stamps."""
    t0 = 1_000_000
    b = _rows(3, start=[t0, t0 + 200, t0 + 400], products=[t0 + 3000, t0 + 3100, t0 + 3200],
              finish=[0, 0, t0 + 3300], mixed=[0, 0, t0 + 4100], sinkhorn=[0, 0, t0 + 4900],
              end=[t0 + 3050, t0 + 3150, t0 + 6000], sm=[0, 1, 2])
    g = _rows(4, start=[t0 + 500, t0 + 700, t0 + 5000, t0 + 7000],
              prefetched=[t0 + 2500, t0 + 6500, t0 + 5500, t0 + 7500],
              waited=[t0 + 6100, t0 + 6600, t0 + 6100, t0 + 7600], end=[t0 + 9000, t0 + 9500, t0 + 9100, t0 + 11000],
              sm=[3, 3, 4, 5])
    r = overlap.pair_report(b, g)
    assert r["boundary"]["programs"] == 3 and r["boundary"]["sms"] == 3
    assert r["boundary"]["finish"] == dict(first=3.3, median=3.3, last=3.3, count=1, cycles=5800.0)
    assert r["boundary"]["start"]["median"] == pytest.approx(0.2) and r["boundary"]["start"]["cycles"] == 0
    assert r["boundary"]["end"]["cycles"] == 6100.0  # 2 x the median of 3050, 2950, 5600 ns
    assert r["boundary"]["timer_step_ns"] == 50  # end 3050 against products 3000
    assert r["group"]["programs"] == 4 and r["group"]["sms"] == 3
    m = r["met"]
    assert m["boundary_us"] == pytest.approx(6.0)
    assert m["group_started_before_boundary_end"] == 3 and m["group_prefetched_before_boundary_end"] == 2
    assert m["group_programs"] == 4
    assert m["group_waited_after_boundary_end"] == pytest.approx(dict(first=0.1, last=1.6))
    assert m["group_end_after_boundary_end"] == pytest.approx(5.0)
    assert m["finisher"] == pytest.approx(dict(mix_us=0.8, mix_cycles=1600, sinkhorn_us=0.8, sinkhorn_cycles=1600,
                                               collapse_us=1.1, collapse_cycles=2200))
    later = [dict(r, met=dict(m, boundary_us=us, group_waited_after_boundary_end=dict(first=f, last=1.6)))
             for us, f in ((8.0, 0.5), (7.0, 0.3))]
    med = overlap.median_report([r] + later)
    assert med["boundary_us"] == 7.0 and med["group_waited_after_boundary_end"]["first"] == 0.3
    assert med["group_programs"] == 4 and med["finisher"]["collapse_us"] == pytest.approx(1.1)
    assert "finisher" not in overlap.pair_report(_rows(1, start=[t0], end=[t0 + 900], sm=[0]), g)["met"]
    with pytest.raises(ValueError, match="group launch wrote no stamps"):
        overlap.pair_report(b, torch.zeros(4, stamps.SLOTS, dtype=torch.int64))


def test_overlap_cli_refuses_unknown_modes_and_cases():
    with pytest.raises(SystemExit, match="unknown mode or case: sideways"):
        overlap.main(["--modes", "overlap,sideways"])
    with pytest.raises(SystemExit, match="unknown mode or case: dense_gate_upp"):
        overlap.main(["--case", "dense_gate_upp"])
    with pytest.raises(ValueError, match="a gated launch holds no weights"):
        overlap.run(torch.device("cpu"), 1, "hold", "dense_gate_up", layers=1, replays=1)
