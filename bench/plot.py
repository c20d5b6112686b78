"""Plot a `glm5next bench` result: step time vs tokens (eager, CUDA graph, floor), engine throughput, the
steady decode's time by part, prefill tokens/s by prompt length and the mixed rows' stalls;
for a speculative result, tokens/s vs concurrency per assumed accepted length and verify-step time vs tokens.

    python bench/plot.py bench/results/RESULT.json [-o RESULT.png]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402


def _series(rows: list, x: str, y: str) -> tuple[list, list]:
    pts = [(r[x], r[y]) for r in rows if r.get(y) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_speculative(result: dict, out: str) -> str:
    """Tokens/s vs concurrency at each assumed mean accepted length L (the best q per request count),
    stock vs specialized, with the non-speculative baseline; and verify-step time vs tokens per q
    against the floor."""
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8))
    best, base = result.get("best") or [], result.get("baseline") or []
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, length in enumerate(result["assumed_acceptance"]["accepted_lengths"]):
        rows = [b for b in best if b["accepted_length"] == length]
        for path, style in (("stock", "s--"), ("specialized", "o-")):
            pts = [(b["requests"], b[path]["tokens_per_s"]) for b in rows if path in b]
            if pts:
                ax.plot(*zip(*pts), style, color=colors[i % len(colors)], label=f"{path}, L = {length:g} (assumed)")
    for path, style in (("stock", "s--"), ("specialized", "o-")):
        xs, ys = _series(base, "requests", f"{path}_tokens_per_s")
        if xs:
            ax.plot(xs, ys, style, color="gray", label=f"{path}, no speculation")
    reqs = result.get("requests") or sorted({b["requests"] for b in base})
    ax.set_xscale("log", base=2)
    ax.set_xticks(reqs, [str(r) for r in reqs])
    ax.set_xlabel("concurrent requests R")
    ax.set_ylabel("output tokens/s (slice)")
    ax.set_title("tokens/s = R·L / (verify + draft), best q; L ASSUMED (random weights accept nothing)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    for i, q in enumerate(sorted({r["q"] for r in result.get("verify", [])} | ({1} if base else set()))):
        rows = [r for r in base + result.get("verify", []) if r["q"] == q]
        c = colors[i % len(colors)]
        for key, style, label in (("stock_ms", "s--", "stock"), ("specialized_ms", "o-", "specialized"),
                                  ("floor_ms", "x:", "floor")):
            xs, ys = _series(rows, "tokens", key)
            if xs:
                bx.plot(xs, ys, style, color=c, label=f"q={q} {label}")
    ticks = sorted({r["tokens"] for r in base + result.get("verify", [])})
    bx.set_xscale("log", base=2)
    bx.set_yscale("log")
    bx.set_xticks(ticks, [str(t) for t in ticks])
    bx.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    bx.set_xlabel("tokens per step (R requests x q tokens; q = 1: plain decode)")
    bx.set_ylabel("step time (ms)")
    bw = result.get("bandwidth", {}).get("bytes_per_s")
    bx.set_title("verify step vs floor" + (f"; read BW {bw / 1e9:.1f} GB/s" if bw else "")
                 + ("" if result.get("graphs") else "; eager, no CUDA graphs"), fontsize=9)
    bx.grid(True, which="both", alpha=0.3)
    bx.legend(fontsize=7, ncol=2)
    fig.suptitle(f"MTP speculative decoding, {result.get('slice', '?')} slice, {result.get('device', '?')}, context "
                 f"{result.get('context', '?')} (torch {result.get('torch', '?')}, {result.get('date', '?')[:10]})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot(result: dict, out: str) -> str:
    """Write the figure of `result` to `out` (PNG); returns `out`."""
    if result.get("mode") == "speculative":
        return plot_speculative(result, out)
    steps = result.get("steps") or []
    e2e = [r for r in result.get("e2e") or [] if not r.get("prefill") and not r.get("mixed")]
    split = [r for r in e2e if r.get("host_ms_per_step")]
    prefill = [r for r in result.get("e2e") or [] if r.get("prefill")]
    mixed = [r for r in result.get("e2e") or [] if r.get("mixed")]
    panels = sum(1 for part in (steps, e2e, split, prefill, mixed) if part)
    if not panels:
        raise ValueError("the result holds neither step times nor end-to-end rows")
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.8), squeeze=False)
    axes = list(axes[0])
    title = (f"{result.get('mode', '?')} runtime, {result.get('slice', '?')} slice, {result.get('device', '?')}, "
             f"context {result.get('context', '?')} (torch {result.get('torch', '?')}, {result.get('date', '?')[:10]})")
    if steps:
        ax = axes.pop(0)
        for key, label, style in (("eager_ms", "stock eager", "o-"), ("graph_ms", "stock CUDA graph", "s-"),
                                  ("specialized_ms", "specialized CUDA graph", "^-"),
                                  ("floor_ms", "floor (bytes / read BW)", "k--")):
            xs, ys = _series(steps, "tokens", key)
            if xs:
                ax.plot(xs, ys, style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks([r["tokens"] for r in steps], [str(r["tokens"]) for r in steps])
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("decode tokens per step (M sequences, one token each)")
        ax.set_ylabel("step time (ms)")
        bw = result.get("bandwidth", {}).get("bytes_per_s")
        ax.set_title("decode step" + (f"; read BW {bw / 1e9:.1f} GB/s" if bw else ""))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    if e2e:
        ax = axes.pop(0)
        xs, ys = _series(e2e, "concurrency", "output_tokens_per_s")
        ax.plot(xs, ys, "o-", color="tab:green", label="output tokens/s (whole run)")
        for key, label, style in (("decode_tokens_per_s", "steady decode tokens/s", "^-"),
                                  ("step_tokens_per_s", "the captured step's tokens/s", "k:")):
            dx, dy = _series(e2e, "concurrency", key)
            if dx:
                ax.plot(dx, dy, style, label=label)
        ax.legend(fontsize=7, loc="upper left")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("output tokens/s", color="tab:green")
        ax.grid(True, alpha=0.3)
        tx, ty = _series(e2e, "concurrency", "tpot_ms")
        if tx:
            ax2 = ax.twinx()
            ax2.plot(tx, ty, "s--", color="tab:red", label="time per output token")
            ax2.set_ylabel("mean time per output token (ms)", color="tab:red")
        graphs = any(r.get("graph_steps") for r in e2e)
        ax.set_title(f"engine end to end (greedy, CUDA graphs {'on' if graphs else 'off'})")
    if split:
        # The steady decode's wall time a step, as shares of the engine's parts (stacked to 100 %), and the
        # captured step's own time as a share of it (the rest is what the serial loop adds).
        ax = axes.pop(0)
        labels = [str(r["concurrency"]) for r in split]
        walls = [r["decode_step_ms"] for r in split]
        bottom = [0.0] * len(split)
        for part in split[0]["host_ms_per_step"]:
            ys = [100 * r["host_ms_per_step"][part] / w for r, w in zip(split, walls)]
            ax.bar(labels, ys, bottom=bottom, label=part + (" (holds the GPU wait)" if part == "sample" else ""))
            bottom = [b + y for b, y in zip(bottom, ys)]
        steps_ms = [(i, 100 * r["captured_step_ms"] / w) for i, (r, w) in enumerate(zip(split, walls))
                    if "captured_step_ms" in r]
        if steps_ms:
            ax.plot([i for i, _ in steps_ms], [v for _, v in steps_ms], "k_", markersize=30, mew=2,
                    label="captured step alone")
        for i, w in enumerate(walls):
            ax.annotate(f"{w:.2f} ms", (i, 101), ha="center", fontsize=8)
        ax.set_ylim(0, 110)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("% of a decode step's wall time")
        ax.set_title("steady decode: engine time a step by part")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    if prefill:
        # Prompt tokens/s by prompt length, one line per number of prompts sent together; each point's time to
        # first token beside it (the shape's first run, which compiles, is not in the line).
        ax = axes.pop(0)
        for n in sorted({r["concurrency"] for r in prefill}):
            rows = sorted((r for r in prefill if r["concurrency"] == n), key=lambda r: r["prompt_len"])
            xs = [r["prompt_len"] for r in rows]
            ax.plot(xs, [r["prefill_tokens_per_s"] / 1e3 for r in rows], "o-", label=f"{n} prompt{'s' * (n > 1)}")
            for r in rows:
                ax.annotate(f"{r['ttft_ms']:.0f} ms", (r["prompt_len"], r["prefill_tokens_per_s"] / 1e3),
                            textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
        lens = sorted({r["prompt_len"] for r in prefill})
        ax.set_xscale("log", base=2)
        ax.set_xticks(lens, [str(x) for x in lens])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("prompt tokens/s (thousands)")
        ax.set_title("prefill (labels: time to first token)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    if mixed:
        # One prompt prefilled in chunks beside decoding requests, per step token budget: its time to first
        # token against the decodes' longest step while it runs (their steady step as the dashed line).
        ax = axes.pop(0)
        labels = [str(r["budget"]) for r in mixed]
        pos = list(range(len(mixed)))
        ax.bar([p - 0.2 for p in pos], [r["ttft_ms"] for r in mixed], 0.4, label="prompt's time to first token")
        ax.bar([p + 0.2 for p in pos], [r["max_step_ms"] for r in mixed], 0.4, label="decodes' longest step")
        ax.plot(pos, [r["steady_step_ms"] for r in mixed], "k--", label="decodes' steady step")
        ax.set_xticks(pos, labels)
        ax.set_yscale("log")
        ax.set_xlabel("step token budget")
        ax.set_ylabel("ms")
        r0 = mixed[0]
        ax.set_title(f"a {r0['prompt_len']}-token prompt beside {r0['decodes']} decodes")
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", help="a result JSON written by `glm5next bench`")
    ap.add_argument("-o", "--out", default=None, help="PNG path (default: the result path with .png)")
    args = ap.parse_args(argv)
    with open(args.result) as f:
        result = json.load(f)
    out = args.out or os.path.splitext(args.result)[0] + ".png"
    print(plot(result, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
