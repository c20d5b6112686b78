"""Kimi delta attention (KDA): the linear-attention layer of GLM-5.3-Flash.

Per token: q/k/v projections through a causal depthwise short conv and SiLU, a
bounded per-channel log-decay gate, a per-head write strength beta, the delta
rule on an fp32 state [H, K, V] per sequence (see `kda_recurrence`), then a
sigmoid-gated RMSNorm per head and the output projection. Under tensor parallelism each rank
holds a contiguous range of heads (their projections, convs, gates and states) and the output
projection's partial sums are all-reduced.

Decode rows run as one fixed-shape step over all decode sequences (CUDA-graph
safe); prefill sequences run eagerly one at a time through the chunked delta
rule. Casting points follow transformers' eager module: the conv runs with fp32
weights and its SiLU output returns to the model dtype; beta is a sigmoid in
the model dtype; the delta rule and the output norm run in fp32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint.specs import TensorSpec, set_param
from ..config import KDA_L2_EPS, Glm5NextConfig
from ..forward import AttnMetadata, KdaState, to_device
from ..kernels.kda.prefill import gated_norm, kda_prefill, kda_prefill_inputs
from ..parallel.group import SINGLE, TensorParallel
from ..parallel.layers import ColumnParallelLinear, Linear, RowParallelLinear
from .kda_recurrence import kda_chunked, kda_step

_LINEARS = ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj", "o_proj")
_CONVS = ("q_conv1d", "k_conv1d", "v_conv1d")


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """`x / sqrt(sum(x^2) + 1e-6)` over the last dim, in fp32 (eps inside the root, as the checkpoint was trained)."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + KDA_L2_EPS)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x * rsqrt(mean(x^2) + eps) * sigmoid(gate)` over the last dim, all fp32, in x's dtype.

    x, gate: [..., head_dim] (any float dtype); weight: [head_dim].
    """
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y * torch.sigmoid(gate.float())).to(x.dtype)


class KdaProjections(NamedTuple):
    """The projections of a KDA layer's input x [T, hidden], each [T, width] in x's dtype."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    b: torch.Tensor
    """The write-strength logits [T, H]."""
    f: torch.Tensor
    """The decay projection f_b(f_a(x)) [T, H * K]."""
    g: torch.Tensor
    """The output gate g_b(g_a(x)) [T, H * V]."""


class KimiDeltaAttention(nn.Module):
    """One KDA layer: `[T, hidden] -> [T, hidden]` over a step's decode and prefill sequences."""

    def __init__(self, config: Glm5NextConfig, layer_idx: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        hidden, dim = config.hidden_size, config.linear_head_dim
        heads_what = "linear_attn_config.num_heads"
        heads = tp.split(config.linear_num_heads, heads_what)
        full = config.linear_num_heads * dim
        self.layer_idx = layer_idx
        self.prefix = f"layers.{layer_idx}.self_attn"
        self.hidden_size = hidden
        self.num_heads = heads
        """This rank's heads (all of them on one process)."""
        self.head_dim = dim
        self.tp = tp
        self.conv_kernel = config.linear_conv_kernel_dim
        self.lower_bound = config.linear_lower_bound
        self.norm_eps = config.rms_norm_eps
        # Heads split over the ranks: every per-head projection is column-parallel, o_proj row-parallel;
        # the low-rank f_a / g_a projections (one head_dim-wide latent shared by all heads) are replicated.
        self.q_proj = ColumnParallelLinear(hidden, full, tp, heads_what)
        self.k_proj = ColumnParallelLinear(hidden, full, tp, heads_what)
        self.v_proj = ColumnParallelLinear(hidden, full, tp, heads_what)
        self.b_proj = ColumnParallelLinear(hidden, config.linear_num_heads, tp, heads_what)
        self.f_a_proj = Linear(hidden, dim)
        self.f_b_proj = ColumnParallelLinear(dim, full, tp, heads_what)
        self.g_a_proj = Linear(hidden, dim)
        self.g_b_proj = ColumnParallelLinear(dim, full, tp, heads_what)
        self.o_proj = RowParallelLinear(full, hidden, tp, heads_what)
        width = heads * dim
        meta = dict(device="meta", dtype=torch.float32)
        for name in _CONVS:
            setattr(self, name, nn.Parameter(torch.empty(width, 1, self.conv_kernel, **meta), requires_grad=False))
        self.A_log = nn.Parameter(torch.empty(heads, **meta), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(width, **meta), requires_grad=False)
        self.o_norm_weight = nn.Parameter(torch.empty(dim, device="meta"), requires_grad=False)

    def tensor_specs(self, prefix: str) -> dict[str, TensorSpec]:
        """Every checkpoint tensor of the layer under `prefix` (e.g. `layers.0.self_attn`)."""
        specs: dict[str, TensorSpec] = {}
        for name in _LINEARS:
            specs.update(getattr(self, name).tensor_specs(f"{prefix}.{name}"))

        def setter(attr: str):
            return lambda t, scale: set_param(self, attr, t)

        heads = self.num_heads * self.tp.size
        width = heads * self.head_dim
        by_head = self.tp.shard(0)
        for name in _CONVS:
            specs[f"{prefix}.{name}.weight"] = TensorSpec((width, 1, self.conv_kernel), setter(name), keep_fp32=True,
                                                         shard=by_head)
        specs[f"{prefix}.A_log"] = TensorSpec((heads,), setter("A_log"), keep_fp32=True, shard=by_head)
        specs[f"{prefix}.dt_bias"] = TensorSpec((width,), setter("dt_bias"), keep_fp32=True, shard=by_head)
        specs[f"{prefix}.o_norm.weight"] = TensorSpec((self.head_dim,), setter("o_norm_weight"))
        return specs

    # ------------------------------------------------------------ per-token maths
    def log_decay(self, f: torch.Tensor) -> torch.Tensor:
        """The per-channel log-decay `lower_bound * sigmoid(exp(A_log) * (f + dt_bias))` [T, H, K] fp32 of
        the decay projection `f = f_b(f_a(x))` [T, H * K]."""
        raw = f.float() + self.dt_bias.float()
        raw = raw.view(f.shape[0], self.num_heads, self.head_dim)
        rate = self.A_log.float().exp().view(self.num_heads, 1)
        return self.lower_bound * torch.sigmoid(rate * raw)

    def conv_weight(self) -> torch.Tensor:
        """The q|k|v depthwise conv taps [3 * H * K, conv_kernel] fp32."""
        return torch.cat([getattr(self, name).float() for name in _CONVS]).squeeze(1)

    def conv_silu(self, window: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """SiLU of the causal conv [N, 3HK, L] in `dtype`, of pre-conv rows [N, 3HK, conv_kernel - 1 + L].

        The conv and the SiLU run in fp32 (the taps are fp32), as in transformers.
        """
        taps = self.conv_weight()
        out = F.conv1d(window.float(), taps.unsqueeze(1), groups=taps.shape[0])
        return F.silu(out).to(dtype)

    def heads(self, act: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The delta-rule inputs (scaled unit q, unit k, v), each [..., H, K] fp32, of conv outputs [..., 3HK]."""
        shape = (*act.shape[:-1], self.num_heads, self.head_dim)
        q, k, v = (t.reshape(shape) for t in act.chunk(3, dim=-1))
        return l2_normalize(q) * self.head_dim**-0.5, l2_normalize(k), v.float()

    # ------------------------------------------------------------ forward
    def project(self, x: torch.Tensor) -> KdaProjections:
        """The projections of the step's tokens x [T, hidden] (the layer's first piece)."""
        return KdaProjections(self.q_proj(x), self.k_proj(x), self.v_proj(x), self.b_proj(x),
                              self.f_b_proj(self.f_a_proj(x)), self.g_b_proj(self.g_a_proj(x)))

    def mix(self, p: KdaProjections, md: AttnMetadata, state: KdaState) -> torch.Tensor:
        """The gated, normalised delta-rule outputs [T, H * V] (the projections' dtype), the o_proj's input,
        of the step's projections `p`: conv, gates, recurrence and output norm; updates `state`. A 16-bit
        step with prefill rows on a GPU runs their inputs, the delta rule and every row's output norm on the
        prefill kernels (`runs_prefill_kernels`)."""
        nd = md.num_decodes
        q_per = md.num_decode_tokens // nd if nd else 1
        if md.num_decode_tokens != nd * q_per:
            raise ValueError(f"{md.num_decode_tokens} decode tokens over {nd} sequences: a verify step is uniform")
        kernels = self.runs_prefill_kernels(p.q, md)
        rows = md.num_decode_tokens if kernels else p.q.shape[0]  # the rows whose inputs are built here
        if rows:
            mixed = torch.cat([p.q[:rows], p.k[:rows], p.v[:rows]], dim=-1)  # [rows, 3HK]
            decay = self.log_decay(p.f[:rows])
            # transformers takes this sigmoid in the model dtype; the delta rule then upcasts it.
            beta = torch.sigmoid(p.b[:rows]).float()
        parts = []
        if nd:
            slots = state.slots(md.state_indices[:nd])
            if q_per == 1:
                parts.append(self._decode(mixed[:nd], decay[:nd], beta[:nd], slots, state))
            else:
                nt = nd * q_per
                parts.append(self._verify(mixed[:nt], decay[:nt], beta[:nt], slots, state, q_per))
        if md.num_prefills and kernels:
            parts.append(self._prefill_on_kernels(p, md, state))
        elif md.num_prefills:
            a, b = md.query_start_loc_cpu[nd], md.query_start_loc_cpu[nd + md.num_prefills]
            parts.append(self._prefill(mixed[a:b], decay[a:b], beta[a:b], md, state))
        core = torch.cat(parts).to(p.q.dtype)  # [T, H, V]
        if kernels:
            y = gated_norm(core.reshape(-1, core.shape[-1]), p.g.reshape(-1, core.shape[-1]), self.o_norm_weight,
                           self.norm_eps)
        else:
            y = gated_rms_norm(core, p.g.view_as(core), self.o_norm_weight, self.norm_eps)
        return y.reshape(core.shape[0], -1)

    @staticmethod
    def runs_prefill_kernels(x: torch.Tensor, md: AttnMetadata) -> bool:
        """Whether `mix` runs a step's prefill rows on the prefill kernels: a step with prefill rows, 16-bit
        projections on a GPU (fla's products are 16-bit; an fp32 model keeps the fp32 PyTorch form)."""
        return bool(md.num_prefills) and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)

    def _prefill_on_kernels(self, p: KdaProjections, md: AttnMetadata, state: KdaState) -> torch.Tensor:
        """Delta-rule outputs [L, H, V] (the projections' dtype) of the step's prefill rows: their inputs in one
        launch (`kda_prefill_inputs`, reading each sequence's conv window), every sequence's delta rule in one
        fla call; advances the conv windows and the recurrent states."""
        keep = self.conv_kernel - 1
        nd, n = md.num_decodes, md.num_prefills
        starts = [int(x) for x in md.query_start_loc_cpu[nd : nd + n + 1]]
        a, b = starts[0], starts[-1]
        rel = [x - a for x in starts]
        slot_ids = state.slots(md.state_indices[nd : nd + n])
        fresh_host = [bool(md.context_lens_cpu[s] == 0) for s in range(nd, nd + n)]
        fresh = to_device(fresh_host, torch.bool, slot_ids.device)
        history = torch.where(fresh, torch.full_like(slot_ids, -1), slot_ids)
        q, k, v, g, beta = kda_prefill_inputs(p.q[a:b], p.k[a:b], p.v[a:b], p.f[a:b], p.b[a:b],
                                              self.conv_weight().contiguous(), state.conv, self.A_log, self.dt_bias,
                                              rel, history, self.num_heads, self.lower_bound, KDA_L2_EPS, p.q.dtype)
        # The conv windows after each sequence: its last `keep` pre-conv rows (some from the old window when
        # the sequence is shorter); read by the launch above, so written after it.
        for i in range(n):
            lo, hi = max(starts[i], starts[i + 1] - keep), starts[i + 1]
            slot = slot_ids[i : i + 1]
            old = state.conv.new_zeros(1, state.conv.shape[1], keep) if fresh_host[i] else state.conv[slot]
            tail = torch.cat([p.q[lo:hi], p.k[lo:hi], p.v[lo:hi]], dim=-1).t().unsqueeze(0).to(old.dtype)
            state.conv.index_copy_(0, slot, torch.cat([old, tail], dim=-1)[..., -keep:])
        initial = torch.where(fresh[:, None, None, None], 0.0, state.recurrent[slot_ids])
        cu_host = torch.tensor(rel, dtype=torch.int64)
        cu = to_device(cu_host, torch.int64, q.device)
        out, final = kda_prefill(q, k, v, g, beta, initial, cu, cu_host, self.lower_bound, p.q.dtype)
        state.recurrent.index_copy_(0, slot_ids, final)
        return out

    def forward(self, x: torch.Tensor, md: AttnMetadata, state: KdaState) -> torch.Tensor:
        """The layer output [T, hidden] (x's dtype) of the step's tokens x [T, hidden]; updates `state`:
        `o_proj(mix(project(x)))`."""
        return self.o_proj(self.mix(self.project(x), md, state))

    def _decode(
        self, mixed: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor, slots: torch.Tensor, state: KdaState
    ) -> torch.Tensor:
        """Delta-rule outputs [N, H, V] fp32 of one token per decode row; fixed shapes, no host syncs.

        mixed: [N, 3HK] pre-conv rows; decay: [N, H, K] fp32; beta: [N, H] fp32;
        slots: [N] int64 state slots (padding already redirected to the scratch slot).
        """
        window = torch.cat([state.conv[slots], mixed.unsqueeze(-1).to(state.conv.dtype)], dim=-1)
        act = self.conv_silu(window, mixed.dtype)[..., -1]  # [N, 3HK]
        # index_copy_ writes exactly the rows named by `slots`, so a padding row only ever lands in scratch.
        state.conv.index_copy_(0, slots, window[..., 1:])
        q, k, v = self.heads(act)
        out, new_state = kda_step(q, k, v, decay, beta, state.recurrent[slots])
        state.recurrent.index_copy_(0, slots, new_state)
        return out

    def _verify(
        self, mixed: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor, slots: torch.Tensor, state: KdaState,
        q: int,
    ) -> torch.Tensor:
        """Delta-rule outputs [N * q, H, V] fp32 of q tokens per decode row (a speculative verify).

        The conv window and the recurrent state are only read: what `runtime.kda_commit` needs to advance
        them over the accepted tokens is left in `state.verify`, so rejected tokens never touch them.
        """
        if state.verify is None or state.verify["k"].shape[1] < q:
            raise RuntimeError(f"a {q}-token verify needs a cache built with verify_tokens >= {q}")
        n = slots.shape[0]
        rows = mixed.view(n, q, -1).transpose(1, 2).to(state.conv.dtype)  # [N, 3HK, q]
        window = torch.cat([state.conv[slots], rows], dim=-1)  # [N, 3HK, keep + q]
        act = self.conv_silu(window, mixed.dtype).transpose(1, 2)  # [N, q, 3HK]
        qh, kh, vh = self.heads(act)
        g = decay.view(n, q, *decay.shape[1:])
        b = beta.view(n, q, -1)
        s, outs = state.recurrent[slots], []
        for j in range(q):
            o, s = kda_step(qh[:, j], kh[:, j], vh[:, j], g[:, j], b[:, j], s)
            outs.append(o)
        saved = state.verify
        saved["window"][:, :, : window.shape[-1]].index_copy_(0, slots, window)
        for name, value in (("k", kh), ("v", vh), ("g", g), ("beta", b)):
            saved[name][:, :q].index_copy_(0, slots, value.float())
        return torch.stack(outs, 1).reshape(n * q, *outs[0].shape[1:])

    def _prefill(
        self, mixed: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor, md: AttnMetadata, state: KdaState
    ) -> torch.Tensor:
        """Delta-rule outputs [L, H, V] of the step's prefill chunks, laid end to end; eager.

        mixed: [L, 3HK] pre-conv rows; decay: [L, H, K] fp32; beta: [L, H] fp32. A sequence with no cached
        tokens starts from zeros (its slot's old contents are ignored), any other from its slot. Each chunk
        runs the fp32 chunked form (16-bit steps on a GPU take `_prefill_on_kernels` instead).
        """
        keep = self.conv_kernel - 1
        nd, n = md.num_decodes, md.num_prefills
        starts = md.query_start_loc_cpu
        base = starts[nd]
        acts, slots, fresh = [], [], []
        for s in range(nd, nd + n):
            a, b = starts[s] - base, starts[s + 1] - base
            slot = state.slots(md.state_indices[s : s + 1])
            fresh.append(bool(md.context_lens_cpu[s] == 0))
            history = state.conv.new_zeros(1, mixed.shape[1], keep) if fresh[-1] else state.conv[slot]
            window = torch.cat([history, mixed[a:b].t().unsqueeze(0).to(history.dtype)], dim=-1)  # [1, 3HK, keep+L]
            acts.append(self.conv_silu(window, mixed.dtype)[0].t())  # [L, 3HK]
            # The last `keep` pre-conv rows; for a chunk shorter than `keep` some come from the old window.
            state.conv.index_copy_(0, slot, window[..., window.shape[-1] - keep :])
            slots.append(slot)
        q, k, v = self.heads(torch.cat(acts))
        slot_ids = torch.cat(slots)
        initial = state.recurrent[slot_ids]
        for i, f in enumerate(fresh):
            if f:
                initial[i].zero_()
        outs, finals = [], []
        for i in range(n):
            a, b = starts[nd + i] - base, starts[nd + i + 1] - base
            o, f = kda_chunked(q[a:b], k[a:b], v[a:b], decay[a:b], beta[a:b], initial[i])
            outs.append(o)
            finals.append(f)
        state.recurrent.index_copy_(0, slot_ids, torch.stack(finals))
        return torch.cat(outs)

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}, heads={self.num_heads}, head_dim={self.head_dim}, conv={self.conv_kernel}"
