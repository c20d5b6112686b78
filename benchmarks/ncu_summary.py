"""Summarise Nsight Compute's per-instruction SASS counters (`gpu_run.sh ncu` writes them as ncu-sass.csv).

    python benchmarks/ncu_summary.py OUT/ncu-sass.csv [--every 2 --first 1] [--top 12]

For each profiled kernel (by default every second one from index 1: `profile_kernels` runs each case
twice and the second launch is the warm one): the stall samples by reason; the instructions grouped
by how many times each warp-level instruction executed (a group is one stretch of code that many warps
run equally often: a loop body, a prologue, the one program that finishes a split-K tile) with their
share of the executed instructions and of the stall samples; and the most sampled instructions.
Stall samples are taken per SM, so code that runs on a few SMs (a finisher) is under-represented
against its share of the kernel's critical path.
"""

from __future__ import annotations

import argparse
import collections
import csv

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def sections(path: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """(kernel name, header, rows) per profiled launch, in profile order."""
    out = []
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                out.append((row[1], None, []))
            elif out and out[-1][1] is None:
                out[-1] = (out[-1][0], row, [])
            elif out:
                out[-1][2].append(row)
    return out


def summarise(name: str, header: list[str], rows: list[list[str]], top: int) -> str:
    col = {h: i for i, h in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    samples = [int(r[col[SAMPLES]]) for r in rows]
    executed = [int(r[col[EXECUTED]]) for r in rows]
    total_s, total_e = max(1, sum(samples)), max(1, sum(executed))
    lines = [f"{name}: {len(rows)} SASS instructions, {sum(executed)} warp-instructions executed, "
             f"{sum(samples)} stall samples"]
    by_reason = collections.Counter()
    for r in rows:
        for h in reasons:
            by_reason[h[len("stall_"):]] += int(r[col[h]])
    lines.append("  stalls: " + ", ".join(f"{k} {100 * v / total_s:.1f} %" for k, v in by_reason.most_common(8)))
    groups: dict[int, list[int]] = collections.defaultdict(list)
    for i, e in enumerate(executed):
        if e:
            groups[e].append(i)
    lines.append("  by execution count (count: instructions, share of executed, share of samples, first index):")
    for e, idx in sorted(groups.items(), key=lambda kv: -kv[0] * len(kv[1]))[:8]:
        s = sum(samples[i] for i in idx)
        lines.append(f"    {e:8d}: {len(idx):5d} instr, {100 * e * len(idx) / total_e:5.1f} % executed, "
                     f"{100 * s / total_s:5.1f} % samples, from {idx[0]}")
    lines.append("  most sampled instructions:")
    for i in sorted(range(len(rows)), key=lambda i: -samples[i])[:top]:
        why = sorted(((int(rows[i][col[h]]), h[len("stall_"):]) for h in reasons), reverse=True)[:2]
        text = rows[i][col["Source"]].strip()[:56]
        lines.append(f"    {i:5d} {100 * samples[i] / total_s:5.1f} % x{executed[i]:<7d} {text:56s} "
                     + ", ".join(f"{k} {v}" for v, k in why if v))
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv")
    p.add_argument("--first", type=int, default=1, help="index of the first launch to summarise")
    p.add_argument("--every", type=int, default=2, help="summarise every N-th launch from --first")
    p.add_argument("--top", type=int, default=12)
    a = p.parse_args(argv)
    found = sections(a.csv)
    for k in range(a.first, len(found), a.every):
        name, header, rows = found[k]
        print(f"[launch {k}] " + summarise(name, header, rows, a.top) + "\n")


if __name__ == "__main__":
    main()
