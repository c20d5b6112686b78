"""Host time of a captured step's inputs: `_StaticInputs.load` (the items written straight into the pinned
mirror, block-table rows rewritten only where they changed) against building the step's `AttnMetadata`
with `build_metadata` (the path it replaced, which then copied every field into the mirror), per rows and
context. CPU only: this is the engine's Python work before each replay.

    python benchmarks/host_inputs.py [--rows 1,16,64] [--contexts 128,8192,32768] [--out inputs.json]

Three cases per point: a steady step (the same rows as the step before: what a decode step mostly sees), a
moved step (the same sequences one row further: a sequence before them finished) and a changed step
(every sequence's table new: the worst case, as after a whole new batch).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from glm5next.runtime.metadata import build_metadata
from glm5next.runtime.runner import _StaticInputs

BLOCK = 16


def items_of(rows: int, context: int, shift: int = 0) -> list:
    n = context // BLOCK + 1
    return [([1] * (context + 1), context, 1, r, list(range(shift + r * n, shift + (r + 1) * n))) for r in range(rows)]


def median_ms(fn, iters: int = 30) -> float:
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--contexts", default="128,8192,32768")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = []
    for context in (int(c) for c in args.contexts.split(",")):
        max_blocks = context // BLOCK + 2
        for rows in (int(r) for r in args.rows.split(",")):
            size = max(64, rows)
            st = _StaticInputs(size, max_blocks, torch.device("cpu"))
            steady = items_of(rows, context)
            other = [items_of(rows, context, shift=1), steady]
            flip = [0]

            def changed():
                flip[0] ^= 1
                st.load(other[flip[0]], size, 1, BLOCK)

            turn = [0]

            def moved():
                turn[0] = (turn[0] + 1) % rows
                st.load(steady[turn[0]:] + steady[:turn[0]], size, 1, BLOCK)

            row = {"rows": rows, "context": context,
                   "steady_ms": median_ms(lambda: st.load(steady, size, 1, BLOCK)),
                   "moved_ms": median_ms(moved),
                   "changed_ms": median_ms(changed),
                   "build_metadata_ms": median_ms(lambda: build_metadata(
                       [1] * rows, [context] * rows, rows, list(range(rows)), [b for *_, b in steady], BLOCK, "cpu",
                       max_blocks=max_blocks))}
            out.append(row)
            print(f"rows {rows:3d} context {context:6d}: load {row['steady_ms']:.3f} ms steady, "
                  f"{row['moved_ms']:.3f} ms moved, {row['changed_ms']:.3f} ms changed; build_metadata alone {row['build_metadata_ms']:.3f} ms",
                  flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
