"""How the boundary and the projection group launched after it overlap, from timestamps the kernels
write themselves (`glm5next.kernels.stamps`; the profilers cannot show two kernels side by side here).

    python -m glm5next.bench.overlap --t 1,8 --layers 8 --out overlap.json

A CUDA graph of `layers` pairs in a row, each a fused boundary followed by a launch of a `sweep.SHAPES`
case: a projection group (default the DSA group), one projection, or a gated gate|up (the dense MLP's or
the shared expert's first launch), every pair on its own weights so that the second launch's prefetch
reads HBM, launched as the executor launches them for a choice of the stage: "overlap"
("grouped-overlap" / "fused-overlap": the boundary releases the launch after it once its partial products
are stored, that launch is a programmatic dependent), "hold" ("grouped-hold", groups only: the same with
the group's first K steps of weights held in registers before its wait), "early" ("grouped-early":
released as the boundary starts) or "grouped" (each launch as the module's defaults have it; the MLP
stages' "fused"). "group" below is that second launch, whichever case it is. The graph is timed by CUDA events (median
of replays, per pair), then replayed once more with every launch writing its stamps.

Per pair, times in µs from the first start of any of the boundary's programs: for each kernel and
stamp, the first / median / last program (and the median cycles from each program's start); and how
the two met — how many of the group's programs had started, and issued their prefetch, before the
boundary's last program ended, and when the group's waits returned and its last program ended,
counted from that end; and the boundary's finishers, split at their MIXED and SINKHORN stamps
(median over the launch's finishers, in µs of the global timer and in cycles of their SM). The smallest
step the global timer took (`timer_step_ns`) says how fine those times are.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from ..kernels import boundary as _boundary
from ..kernels import stamps as _stamps
from ..kernels.boundary import mhc_boundary
from ..kernels.linear import kernel as _linear_kernel
from ..kernels.linear import reads_x16
from ..specialized_decode.linear import GROUP_HOLD
from .floor import capture, time_replays
from .sweep import BOUNDARY_KW, SHAPES, boundary_mixer, boundary_state, project, shape_weights

MODES = {"overlap": ("late", True, None), "hold": ("late", True, GROUP_HOLD["grouped-hold"]),
         "early": (None, True, None), "grouped": (None, None, None)}
"""Choice -> (the boundary's `pdl`, the group's `pdl`, the group's `hold`), as the executor launches them
(a gated gate|up under "overlap" is released late in turn, `pdl="late"`, as `DenseMlpStage` has it)."""

ROWS = 8192
"""Stamp rows per launch: more than any launch here has programs (unused rows stay zero)."""


def pair_report(boundary: torch.Tensor, group: torch.Tensor) -> dict:
    """The stamps of one boundary launch and the group launched after it, summarised (see the module)."""
    rows, grows = _stamps.ran(boundary), _stamps.ran(group)
    for name, r in (("boundary", rows), ("group", grows)):
        if r.shape[0] == 0:
            raise ValueError(f"the {name} launch wrote no stamps")
    origin = int(rows[:, _stamps.START].min())
    b = _stamps.summarize(boundary, origin)
    g = _stamps.summarize(group, origin)
    b_end = b["end"]["last"]
    pre = grows[:, _stamps.PREFETCHED]
    pre = pre[pre != 0]
    met = dict(
        boundary_us=b_end,
        group_started_before_boundary_end=int(((grows[:, _stamps.START] - origin) / 1000 <= b_end).sum()),
        group_prefetched_before_boundary_end=int(((pre - origin) / 1000 <= b_end).sum()),
        group_programs=g["programs"],
    )
    if "waited" in g:
        met["group_waited_after_boundary_end"] = dict(first=g["waited"]["first"] - b_end,
                                                      last=g["waited"]["last"] - b_end)
    met["group_end_after_boundary_end"] = g["end"]["last"] - b_end
    fin = finisher_phases(rows)
    if fin:
        met["finisher"] = fin
    return dict(boundary=b, group=g, met=met)


FINISHER_PHASES = (("mix", _stamps.FINISH, _stamps.MIXED), ("sinkhorn", _stamps.MIXED, _stamps.SINKHORN),
                   ("collapse", _stamps.SINKHORN, _stamps.END))
"""The boundary finisher's parts: the partial sums and mixer weights, the remaining Sinkhorn iterations,
the collapse, norm and stores."""


def finisher_phases(rows: torch.Tensor) -> dict:
    """Median µs (global timer) and cycles (the SM's counter) of each finisher phase over the programs that
    wrote every stamp of it; empty where no program did."""
    out = {}
    for name, a, b in FINISHER_PHASES:
        wrote = (rows[:, a] != 0) & (rows[:, b] != 0)
        if wrote.any():
            out[f"{name}_us"] = float(((rows[wrote, b] - rows[wrote, a]).to(torch.float64) / 1000).median())
            out[f"{name}_cycles"] = float((rows[wrote, _stamps.CLOCK + b] - rows[wrote, _stamps.CLOCK + a])
                                          .to(torch.float64).median())
    return out


def median_report(pairs: list[dict]) -> dict:
    """The median over pairs of every number in `pair_report`'s `met` (nested ones included)."""
    out = {}
    for key, v in pairs[0]["met"].items():
        if isinstance(v, dict):
            out[key] = {k: statistics.median(p["met"][key][k] for p in pairs) for k in v}
        else:
            out[key] = statistics.median(p["met"][key] for p in pairs)
    return out


def run(device, T: int, mode: str, case: str, layers: int, replays: int) -> dict:
    b_pdl, g_pdl, g_hold = MODES[mode]
    gated = SHAPES[case][1]
    if gated and g_hold:
        raise ValueError(f"{case}: a gated launch holds no weights ({mode!r} is for projection groups)")
    if gated and g_pdl:
        g_pdl = "late"
    state = boundary_state(T, device)
    D, n = state[1].shape[2], state[1].shape[1]
    outs = [torch.empty(T, n, D, device=device, dtype=torch.bfloat16), torch.empty(T, n, device=device),
            torch.empty(T, n, n, device=device), torch.empty(T, D, device=device, dtype=torch.bfloat16)]
    mixers = [boundary_mixer(device) for _ in range(layers)]
    weights = [shape_weights(case, device) for _ in range(layers)]
    # The boundary writes the fp16 copy of x that the group then reads, where the executor has it do so.
    x16 = torch.empty(T, D, device=device, dtype=torch.float16) if reads_x16(
        T, [w for w, _ in weights[0][0]], torch.bfloat16, gated=gated) else None
    kw = {} if gated else {"hold": g_hold}
    bufs = [(_stamps.buffer(ROWS, device), _stamps.buffer(ROWS, device)) for _ in range(layers)]

    def step(stamped: bool):
        for i in range(layers):
            _boundary.STAMPS = bufs[i][0] if stamped else None
            mhc_boundary(*state, *mixers[i], **BOUNDARY_KW, sinkhorn_iters=20, new_streams=outs[0],
                         new_post=outs[1], new_comb=outs[2], x=outs[3], pdl=b_pdl, x16=x16)
            _linear_kernel.STAMPS = bufs[i][1] if stamped else None
            project(outs[3], *weights[i], pdl=g_pdl, x16=x16, **kw)
        _boundary.STAMPS = _linear_kernel.STAMPS = None

    try:
        plain = capture(lambda: step(False))
        us = statistics.median(time_replays(plain, replays, 2)) * 1e3 / layers
        stamped = capture(lambda: step(True))
        us_stamped = statistics.median(time_replays(stamped, replays, 2)) * 1e3 / layers
        for b, g in bufs:
            b.zero_()
            g.zero_()
        stamped.replay()
        torch.cuda.synchronize()
    finally:
        _boundary.STAMPS = _linear_kernel.STAMPS = None
    pairs = [pair_report(b, g) for b, g in bufs]
    steps = [k["timer_step_ns"] for p in pairs for k in (p["boundary"], p["group"]) if k["timer_step_ns"]]
    return dict(t=T, mode=mode, case=case, layers=layers, pair_us=us, pair_us_stamped=us_stamped,
                timer_step_ns=min(steps, default=None), median=median_report(pairs[1:] or pairs), pairs=pairs)


def _print(r: dict) -> None:
    m = r["median"]
    waited = m.get("group_waited_after_boundary_end", {})
    w0, w1 = waited.get("first", float("nan")), waited.get("last", float("nan"))
    print(f"T={r['t']:2d} {r['mode']:8s} pair {r['pair_us']:6.2f} us ({r['pair_us_stamped']:6.2f} stamped) | "
          f"boundary {m['boundary_us']:5.2f} us | group: {m['group_started_before_boundary_end']:.0f} of "
          f"{m['group_programs']:.0f} started, {m['group_prefetched_before_boundary_end']:.0f} prefetched "
          f"before its end; waits return {w0:+.2f}..{w1:+.2f}, "
          f"ends {m['group_end_after_boundary_end']:+.2f} us after it (timer step {r.get('timer_step_ns')} ns)",
          flush=True)
    fin = m.get("finisher")
    if fin:
        print("      finisher: " + ", ".join(f"{name} {fin[name + '_us']:.2f} us ({fin[name + '_cycles']:.0f} cycles)"
                                          for name, _, _ in FINISHER_PHASES if name + "_us" in fin), flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--t", default="1,8", help="token counts")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {', '.join(MODES)}")
    p.add_argument("--case", default="dsa_group", help="the launch after the boundary, a case of sweep.SHAPES")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--finish-scalar", action="store_true",
                   help="boundaries of one-token blocks finish on scalars (`FINISH_SCALAR`)")
    p.add_argument("--finishers", action="store_true",
                   help="boundaries finish each token on a program of its own (`TOKEN_FINISHERS`)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    modes = a.modes.split(",")
    for bad in [m for m in modes if m not in MODES] + ([a.case] if a.case not in SHAPES else []):
        raise SystemExit(f"unknown mode or case: {bad}")
    if a.layers < 1:
        raise SystemExit("--layers must be at least 1")
    if not torch.cuda.is_available():
        raise SystemExit("the overlap benchmark needs a GPU (kernel timestamps)")
    device = torch.device("cuda")
    results = []
    shipped = _boundary.FINISH_SCALAR, _boundary.TOKEN_FINISHERS
    _boundary.FINISH_SCALAR = shipped[0] or a.finish_scalar
    _boundary.TOKEN_FINISHERS = shipped[1] or a.finishers
    try:
        for T in [int(t) for t in a.t.split(",")]:
            for mode in modes:
                results.append(dict(run(device, T, mode, a.case, a.layers, a.replays),
                                    finish_scalar=_boundary.FINISH_SCALAR, finishers=_boundary.TOKEN_FINISHERS))
                _print(results[-1])
    finally:
        _boundary.FINISH_SCALAR, _boundary.TOKEN_FINISHERS = shipped
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
