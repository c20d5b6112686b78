"""KDA decode and verify in one launch per layer: the short conv, the gates, the delta rule on the fp32
state and the gated output norm, between the layer's projections and its o_proj (see `kernel`).

The launch has a static grid and needs no host sync, so a captured step can hold it. It keeps a small
scratch per token count (partial sums of squares, arrival counters that it leaves at zero).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .kernel import kda_commit_kernel, kda_decode_kernel
from .reference import kda_decode_reference

__all__ = ["KdaPlan", "KdaScratch", "KdaWeights", "check_inputs", "kda_commit", "kda_decode", "kda_decode_reference", "plan_kda"]


@dataclass(frozen=True)
class KdaWeights:
    """One KDA layer's per-head constants as the kernel reads them: the q | k | v conv taps
    `[3HK, conv_kernel]` fp32 (one contiguous copy), `A_log` [H], `dt_bias` [H * K], the output norm's
    weight [V], and the scalars of the layer."""

    conv: torch.Tensor
    a_log: torch.Tensor
    dt_bias: torch.Tensor
    norm: torch.Tensor
    num_heads: int
    head_dim: int
    lower_bound: float
    eps: float
    l2_eps: float

    @classmethod
    def of(cls, attn, l2_eps: float) -> "KdaWeights":
        """The constants of a `glm5next.model.kda.KimiDeltaAttention` layer (this rank's heads)."""
        return cls(attn.conv_weight().contiguous(), attn.A_log, attn.dt_bias, attn.o_norm_weight, attn.num_heads,
                   attn.head_dim, float(attn.lower_bound), float(attn.norm_eps), float(l2_eps))


@dataclass(frozen=True)
class KdaPlan:
    """The launch: value columns per program and warps."""

    block_v: int
    num_warps: int = 4

    def describe(self) -> dict:
        return {"block_v": self.block_v, "num_warps": self.num_warps}


def plan_kda(head_dim: int, block_v: int | None = None, num_warps: int | None = None) -> KdaPlan:
    """One program per (row, head): on the H100 (2026-12-06, bench/results/2026-12-06-h100-kda-stage-first.log)
    the whole head in one program was the fastest form at 2-64 rows and within noise at 1 row (latency-bound),
    against every split of the value columns, so the plan does not depend on the rows or the GPU.
    `block_v` / `num_warps` override (benchmarks, tests)."""
    block_v = head_dim if block_v is None else block_v
    if head_dim % block_v or block_v & (block_v - 1):
        raise ValueError(f"block_v={block_v} must be a power of two dividing head_dim={head_dim}")
    return KdaPlan(block_v, num_warps or 4)


def _scratch(rows: int, tokens: int, heads: int, nv: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(tokens, heads, nv, dtype=torch.float32, device=device),
            torch.zeros(rows, heads, dtype=torch.int32, device=device))


class KdaScratch:
    """Per-(token count, block) scratch of the kernel: partial sums of squares and arrival counters (zero
    between launches). A captured graph keeps using the tensors it was captured with."""

    def __init__(self) -> None:
        self._by_shape: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, rows: int, tokens: int, heads: int, nv: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (rows, tokens, heads, nv, str(device))
        if key not in self._by_shape:
            self._by_shape[key] = _scratch(rows, tokens, heads, nv, device)
        return self._by_shape[key]


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor, f: torch.Tensor,
                 g: torch.Tensor, conv: torch.Tensor, state: torch.Tensor, index: torch.Tensor, w: KdaWeights,
                 rows: int) -> None:
    """A ValueError naming the first of a KDA step's inputs (see `kda_decode`) that does not fit `w` and
    `rows` rows of q.shape[0] // rows tokens."""
    n_tok = q.shape[0]
    h, d = w.num_heads, w.head_dim
    if index.shape[0] != rows:
        raise ValueError(f"{index.shape[0]} state indices for {rows} rows")
    for name, t, width in (("q", q, h * d), ("k", k, h * d), ("v", v, h * d), ("b", b, h), ("f", f, h * d),
                           ("g", g, h * d)):
        if t.shape != (n_tok, width) or t.stride(1) != 1:
            raise ValueError(f"KDA {name} must be [{n_tok}, {width}] with unit column stride, got "
                             f"{tuple(t.shape)} strides {t.stride()}")
    keep = conv.shape[-1]
    if conv.shape[1:] != (3 * h * d, keep) or state.shape[1:] != (h, d, d) or state.dtype != torch.float32:
        raise ValueError(f"KDA caches: conv {tuple(conv.shape)}, state {tuple(state.shape)} {state.dtype} do not "
                         f"match {h} heads of {d}")
    if not (conv.is_contiguous() and state.is_contiguous()):
        raise ValueError("KDA caches must be contiguous")


def kda_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor, f: torch.Tensor, g: torch.Tensor,
               conv: torch.Tensor, state: torch.Tensor, index: torch.Tensor, w: KdaWeights, tokens_per_row: int,
               plan: KdaPlan, verify: dict[str, torch.Tensor] | None = None, out: torch.Tensor | None = None,
               scratch: KdaScratch | None = None) -> torch.Tensor:
    """The gated, normalised KDA outputs [rows * q, H * V] (q's dtype), the o_proj's input, of a step of
    `tokens_per_row` = q tokens per row.

    q, k, f: [rows * q, H * K]; v, g: [rows * q, H * V]; b: [rows * q, H] (the layer's projections,
    unit column stride); conv: [slots, 3HK, conv_kernel - 1] pre-conv window; state: [slots, H, K, V]
    fp32; index: [rows] state slot per row, negative for padding (zeros out, no state touched).
    Without `verify`, advances `conv` and `state` over the q tokens; with it (a speculative verify),
    leaves them and fills `verify` ('window', 'k', 'v', 'g', 'beta', see `KdaState.verify`).
    """
    n_tok = q.shape[0]
    if n_tok % tokens_per_row:
        raise ValueError(f"{n_tok} tokens are not whole rows of {tokens_per_row}")
    rows = n_tok // tokens_per_row
    h, d = w.num_heads, w.head_dim
    check_inputs(q, k, v, b, f, g, conv, state, index, w, rows)
    keep = conv.shape[-1]
    out = torch.empty(n_tok, h * d, dtype=q.dtype, device=q.device) if out is None else out
    nv = d // plan.block_v
    part, count = (scratch or KdaScratch()).get(rows, n_tok, h, nv, q.device)
    if verify is not None:
        win, vk, vv, vg, vb = (verify[n] for n in ("window", "k", "v", "g", "beta"))
        if vk.shape[1] < tokens_per_row:
            raise ValueError(f"a {tokens_per_row}-token verify needs a cache built with verify_tokens >= "
                             f"{tokens_per_row}")
        s_win, s_vq = win.shape[-1], vk.shape[1]
    else:
        win = vk = vv = vg = vb = state  # unused
        s_win = s_vq = 0
    kda_decode_kernel[(rows, h, nv)](
        q, k, v, b, f, g, q.stride(0), k.stride(0), v.stride(0), b.stride(0), f.stride(0), g.stride(0),
        conv, w.conv, w.a_log, w.dt_bias, w.norm, state, index, out, part, count,
        win, vk, vv, vg, vb, s_win, s_vq,
        h, w.lower_bound, w.eps, d**-0.5, w.l2_eps,
        Q=tokens_per_row, K=d, V=d, KEEP=keep, TAPS=triton.next_power_of_2(keep + 1), BLOCK_V=plan.block_v,
        VERIFY=verify is not None, num_warps=plan.num_warps)
    return out


def kda_commit(conv: torch.Tensor, state: torch.Tensor, verify: dict[str, torch.Tensor], slots: torch.Tensor,
               accepted: torch.Tensor, block_v: int | None = None) -> None:
    """Advance each row's conv window and fp32 state over its first `accepted` verified tokens (0 leaves
    the row as it is), from what `kda_decode`'s verify step left in `verify`; `slots` [rows] (no padding
    left: every entry a slot). With the decode's `block_v`, the state is the one decoding the accepted
    tokens one at a time writes, bit for bit. Static grid, no host sync."""
    rows = slots.shape[0]
    _, h, d, _ = state.shape
    keep = conv.shape[-1]
    win, vk = verify["window"], verify["k"]
    block_v = block_v or plan_kda(d).block_v
    kda_commit_kernel[(rows, h, d // block_v)](
        state, conv, slots, accepted, win, vk, verify["v"], verify["g"], verify["beta"], win.shape[-1], vk.shape[1],
        h, K=d, V=d, KEEP=keep, TAPS=triton.next_power_of_2(keep), BLOCK_V=block_v, num_warps=4)
