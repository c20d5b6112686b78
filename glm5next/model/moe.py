"""The MoE FFN: fp32 sigmoid router, top-k routed experts, one unscaled shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint.fp8 import FP8_DTYPE, dequantize_fp8
from ..checkpoint.specs import TensorSpec, set_param
from ..config import ROUTER_NORM_EPS, Glm5NextConfig
from ..kernels.moe import ExpertWeights, moe_prefill
from ..parallel.collectives import reduce_output
from ..parallel.group import SINGLE, TensorParallel
from .mlp import MLP, clamped_swiglu


class Router(nn.Module):
    """Expert choice: sigmoid scores, bias for selection only, renormalised top-k, routed scale."""

    def __init__(self, config: Glm5NextConfig) -> None:
        super().__init__()
        self.num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.hidden_size = config.hidden_size
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(self.num_experts, self.hidden_size, device="meta"), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.empty(self.num_experts, device="meta"), requires_grad=False)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Router logits [T, E] fp32."""
        return F.linear(x.float(), self.weight.float())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen experts [T, k] int64, by descending selection score, and their weights [T, k] fp32.

        Experts with equal selection scores are chosen in ascending index order (a stable sort), the
        rule the MoE kernels follow too."""
        scores = torch.sigmoid(self.logits(x))
        sel = scores + self.e_score_correction_bias.float()
        ids = torch.sort(sel, dim=-1, descending=True, stable=True).indices[:, : self.top_k]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + ROUTER_NORM_EPS)
        return ids, weights * self.routed_scaling_factor

    def tensor_specs(self, prefix: str) -> dict[str, TensorSpec]:
        """`{prefix}.weight` and `{prefix}.e_score_correction_bias`."""
        return {
            f"{prefix}.weight": TensorSpec(
                (self.num_experts, self.hidden_size), lambda t, s: set_param(self, "weight", t), keep_fp32=True
            ),
            f"{prefix}.e_score_correction_bias": TensorSpec(
                (self.num_experts,), lambda t, s: set_param(self, "e_score_correction_bias", t), keep_fp32=True
            ),
        }


class RoutedExperts(nn.Module):
    """Every routed expert's weights stacked: gate/up [E, I, D], down [E, D, I],
    FP8 with block scales [E, ., .] when the checkpoint stores them so.

    Under tensor parallelism every rank holds every expert, each on its slice of the intermediate
    width I (gate/up rows, down columns), so the output is a partial sum over the ranks.
    """

    NAMES = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, config: Glm5NextConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.num_experts = config.n_routed_experts
        self.swiglu_limit = config.swiglu_limit
        d, i = config.hidden_size, config.moe_intermediate_size
        self.shapes = {"gate_proj": (i, d), "up_proj": (i, d), "down_proj": (d, i)}
        """Checkpoint shapes of one expert's weights."""
        self.shards = {"gate_proj": tp.shard(0), "up_proj": tp.shard(0), "down_proj": tp.shard(1)}
        tp.split(i, "moe_intermediate_size")
        for name, shape in self.shapes.items():
            local = self.shards[name].local_shape(shape) if self.shards[name] is not None else shape
            setattr(self, name, nn.Parameter(torch.empty(self.num_experts, *local, device="meta"), requires_grad=False))
            setattr(self, f"{name}_scale_inv", None)

    def _install(self, name: str, expert: int, t: torch.Tensor, scale: torch.Tensor | None) -> None:
        stacked = getattr(self, name)
        if stacked.is_meta:
            stacked = nn.Parameter(torch.empty(self.num_experts, *t.shape, dtype=t.dtype, device=t.device),
                                   requires_grad=False)
            setattr(self, name, stacked)
            if scale is not None:
                grid = torch.empty(self.num_experts, *scale.shape, dtype=scale.dtype, device=scale.device)
                setattr(self, f"{name}_scale_inv", nn.Parameter(grid, requires_grad=False))
        if stacked.dtype != t.dtype or (scale is None) != (getattr(self, f"{name}_scale_inv") is None):
            raise ValueError(f"expert {expert} {name}: every expert must share one storage dtype")
        stacked.data[expert].copy_(t)
        if scale is not None:
            getattr(self, f"{name}_scale_inv").data[expert].copy_(scale)

    def tensor_specs(self, prefix: str) -> dict[str, TensorSpec]:
        """`{prefix}.{e}.{gate,up,down}_proj.weight` for every expert e (FP8 allowed)."""
        specs = {}
        for e in range(self.num_experts):
            for name, shape in self.shapes.items():
                install = (lambda n, e: lambda t, s: self._install(n, e, t, s))(name, e)
                specs[f"{prefix}.{e}.{name}.weight"] = TensorSpec(shape, install, fp8_ok=True, shard=self.shards[name])
        return specs

    def weight(self, name: str, expert: int | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """One expert's `name` weight as a plain `dtype` matrix."""
        w = getattr(self, name)[expert]
        if w.dtype == FP8_DTYPE:
            return dequantize_fp8(w, getattr(self, f"{name}_scale_inv")[expert], dtype)
        return w.to(dtype)

    def expert(self, e: int | torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Expert `e` applied to rows `x` [N, D]."""
        g = F.linear(x, self.weight("gate_proj", e, x.dtype))
        u = F.linear(x, self.weight("up_proj", e, x.dtype))
        return F.linear(clamped_swiglu(g, u, self.swiglu_limit), self.weight("down_proj", e, x.dtype))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, graph_safe: bool) -> torch.Tensor:
        """Σ_k weights[t, k] * expert_{ids[t, k]}(x[t]) for x [T, D], in x's dtype.

        `graph_safe` keeps shapes static and the host out of the loop: when the
        step has fewer (token, expert) pairs than experts, each pair gathers its
        expert's weights (in fixed chunks); otherwise every expert runs over every
        row with zero weight for the unselected ones. Eagerly, only the hit
        experts run, on their own rows.
        """
        out = torch.zeros_like(x)
        if graph_safe and ids.numel() < self.num_experts:
            return self._pairs(x, ids, weights)
        if graph_safe:
            for e in range(self.num_experts):
                w = (weights * (ids == e)).sum(-1, keepdim=True)
                out += (self.expert(e, x) * w).to(x.dtype)
            return out
        for e in torch.unique(ids).tolist():
            rows, slot = torch.nonzero(ids == e, as_tuple=True)
            y = self.expert(e, x[rows]) * weights[rows, slot, None]
            out.index_add_(0, rows, y.to(x.dtype))
        return out

    PAIR_CHUNK = 16
    """(token, expert) pairs whose dequantized weights the graph-safe path holds at once."""

    def _pairs(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The graph-safe sum over gathered (token, expert) pairs, in token order then k."""
        t, k = ids.shape
        flat_ids = ids.reshape(-1)
        rows = torch.arange(t, device=x.device).repeat_interleave(k)
        flat_w = weights.reshape(-1)
        acc = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
        for a in range(0, t * k, self.PAIR_CHUNK):
            e, r = flat_ids[a : a + self.PAIR_CHUNK], rows[a : a + self.PAIR_CHUNK]
            xr = x[r][:, None, :]  # [P, 1, D]
            g = (xr @ self.weight("gate_proj", e, x.dtype).transpose(1, 2)).squeeze(1)
            u = (xr @ self.weight("up_proj", e, x.dtype).transpose(1, 2)).squeeze(1)
            h = clamped_swiglu(g, u, self.swiglu_limit)[:, None, :]
            y = (h @ self.weight("down_proj", e, x.dtype).transpose(1, 2)).squeeze(1)
            acc.index_add_(0, r, y.float() * flat_w[a : a + self.PAIR_CHUNK, None])
        return acc.to(x.dtype)


class MoE(nn.Module):
    """Routed experts plus the shared expert (which is not scaled).

    Under tensor parallelism the router is replicated (every rank routes its identical input the
    same way), both expert kinds split their widths, and their summed partial outputs are
    all-reduced once.
    """

    def __init__(self, config: Glm5NextConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.gate = Router(config)
        self.experts = RoutedExperts(config, tp)
        width = config.moe_intermediate_size * config.n_shared_experts
        self.shared_experts = MLP(config.hidden_size, width, config.swiglu_limit, tp,
                                  "moe_intermediate_size * n_shared_experts", reduce=False)

    def forward(self, x: torch.Tensor, graph_safe: bool = False) -> torch.Tensor:
        grouped = self.grouped() if x.is_cuda and not graph_safe else None
        if grouped is not None:  # (`runs_grouped`)
            # Eager steps on a GPU (prefill, mixed steps): the grouped expert kernels, shared expert included.
            ids, weights = self.gate(x)
            return reduce_output(moe_prefill(x, ids, weights, grouped, self.experts.swiglu_limit), self.tp)
        # The shared expert first, as a planned decode step runs it (see `routed_experts`).
        shared = self.shared_experts(x)
        return reduce_output(self.routed_experts(x, graph_safe) + shared, self.tp)

    def routed_experts(self, x: torch.Tensor, graph_safe: bool = False) -> torch.Tensor:
        """The router and the routed experts of `x` [T, D]: this rank's partial sum [T, D] in x's dtype,
        to which the shared expert's output is added before the reduction. (A planned decode step runs
        its shared-expert stage before this, so the stage's kernels follow the boundary that produces x
        directly and fetch their weights while it finishes; the sum is the same whatever runs first.)"""
        ids, weights = self.gate(x)
        return self.experts(x, ids, weights, graph_safe)

    def runs_grouped(self, x: torch.Tensor, graph_safe: bool) -> bool:
        """Whether `forward` runs `x` through the grouped expert kernels, shared expert included (eager
        steps on a GPU), rather than as the shared expert plus `routed_experts`."""
        return x.is_cuda and not graph_safe and self.grouped() is not None

    def grouped(self) -> ExpertWeights | None:
        """The weights as the grouped expert kernels read them, or None where they cannot (a shared expert
        of another shape or storage type than the routed ones)."""
        try:
            weights = ExpertWeights.of(self)
            weights.shared_offsets()
        except ValueError:
            return None
        return weights

    def tensor_specs(self, prefix: str) -> dict[str, TensorSpec]:
        """Router, routed experts and shared expert tensors under `prefix` (e.g. `layers.3.mlp`)."""
        return {
            **self.gate.tensor_specs(f"{prefix}.gate"),
            **self.experts.tensor_specs(f"{prefix}.experts"),
            **self.shared_experts.tensor_specs(f"{prefix}.shared_experts"),
        }

