"""Skinny projections: the linears of the KDA and DSA sublayers on the Triton GEMV kernels, called
explicitly by the layer loop in place of the stock projection piece (`KimiDeltaAttention.project`,
`SparseMLA.project`) and the o_proj.

`ProjectionStage.kda(attn, x, tokens)` / `.dsa(attn, x, tokens)` return what the stock piece returns
(`KdaProjections`, `DsaProjections`); the executor passes them to the stock middle (`mix`, `attention`)
and its output to `.kda_output` / `.dsa_output`. "grouped" runs the projections one sublayer applies to
the same input (KDA: q|k|v|b|f_a|g_a; DSA: q_a|kv_a|indexer wk) in one launch, and the rest one launch
each; "grouped-early" the same with the group launched as a programmatic dependent of the kernel before
it (in a step, the fused boundary, which releases its dependents as it starts), so the group's weights
stream into L2 while the boundary runs; "grouped-overlap" the same with the boundary releasing the group
only once its partial products are stored, so that prefetch runs beside the boundary's finisher rather
than its loads; "single" runs every projection in its own launch. A linear the kernels cannot run
(`routable`) runs its stock module. The weights stay where the backbone keeps them. A launch whose input
has an fp16 copy filed (`Fp16Copies`) reads that. The boundary writes one where the group reads it; in a
DSA layer the stage runs the latent norms as kernels (`NormKernel`), the q_a norm's writing a copy where
the q_b or the indexer's wq_b reads one, and the cast of the attention's values before the o_proj
(`CastKernel`) writing one where the o_proj reads it, and the indexer's head weights, gate logits and
key norm in one launch (`IndexerInputs`).
"""

from __future__ import annotations

import math

import torch

from ..checkpoint.fp8 import FP8_DTYPE
from ..config import DSA, KDA
from ..kernels import linear as linear_kernels
from ..kernels import producers
from ..kernels.dsa import DsaScratch, IndexerInputWeights, indexer_inputs
from ..model.dsa import DsaProjections
from ..model.kda import KdaProjections
from ..model.norm import RMSNorm
from ..model.norm import rms_norm as rms_norm_stock
from ..parallel.collectives import reduce_output
from ..parallel.layers import Linear, RowParallelLinear
from .copies import Fp16Copies

KDA_GROUP = ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj", "g_a_proj")
KDA_SINGLES = ("f_b_proj", "g_b_proj", "o_proj")
DSA_GROUP = ("q_a_proj", "kv_a_proj_with_mqa", "indexer.wk")
DSA_SINGLES = ("q_b_proj", "o_proj", "indexer.wq_b")
STAGE_OF = {KDA: "kda_proj", DSA: "dsa_proj"}
GROUPED = ("grouped", "grouped-early", "grouped-overlap")
EARLY = ("grouped-early", "grouped-overlap")
"""The choices that launch the group as a programmatic dependent of the boundary before it."""
RELEASE_LATE = ("grouped-overlap",)
"""The choices whose boundary releases the group only after its partial products."""


def _get(module, path: str):
    for part in path.split("."):
        module = getattr(module, part)
    return module


def routable(linear: Linear, dtype: torch.dtype) -> bool:
    """FP8 weights with block scales, or weights stored in the model's dtype `dtype` (fp32-kept
    weights of a bf16 model stay stock: the stock path rounds them to bf16 first)."""
    if linear.weight.dtype == FP8_DTYPE:
        return linear.weight_scale_inv is not None
    return linear.weight.dtype == dtype


class SingleLaunch:
    """One projection, one launch; a row-parallel one's output reduced as its stock forward reduces it."""

    def __init__(self, linear: Linear, copies: Fp16Copies | None = None) -> None:
        self.linear = linear
        self.copies = copies

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x16 = None if self.copies is None else self.copies.get(x)
        y = linear_kernels.skinny_linear(x, self.linear.weight, self.linear.weight_scale_inv, x16=x16)
        m = self.linear
        return reduce_output(y, m.tp) if isinstance(m, RowParallelLinear) and m.reduce else y


def _rows(t: torch.Tensor) -> bool:
    """A 2-D tensor with unit stride along its rows, as the norm kernels take."""
    return t.dim() == 2 and (t.stride(1) == 1 or t.shape[1] <= 1)


class NormKernel:
    """An RMSNorm in one kernel; with `copy`, the kernel also writes its output in fp16, filed in `copies`
    for the projections after it that read such a copy."""

    def __init__(self, norm: RMSNorm, copies: Fp16Copies | None = None, copy: bool = False) -> None:
        self.norm = norm
        self.copies = copies if copy else None

    def copy_for(self, x: torch.Tensor) -> torch.Tensor | None:
        """The buffer of the fp16 copy of the norm of `x`, where one is filed (else None)."""
        if self.copies is None or x.dtype != torch.bfloat16:
            return None
        return torch.empty(x.shape, dtype=torch.float16, device=x.device)

    def filed(self, out: torch.Tensor, out16: torch.Tensor | None) -> torch.Tensor:
        if out16 is not None:
            self.copies.put(out, out16)
        return out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not _rows(x):
            return rms_norm_stock(x, self.norm.weight, self.norm.eps)
        out16 = self.copy_for(x)
        return self.filed(producers.rms_norm(x, self.norm.weight, self.norm.eps, out16), out16)


class CastKernel:
    """The cast of the DSA attention's values before the o_proj (`SparseMLA.output`) as one kernel that
    writes the result contiguous, flattened to [T, -1] (the o_proj's input is that view of it), and its
    fp16 copy, filed in `copies` for the o_proj's launch."""

    def __init__(self, copies: Fp16Copies) -> None:
        self.copies = copies

    def __call__(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if x.dim() not in (2, 3) or dtype != torch.bfloat16:
            return x.to(dtype)
        out16 = torch.empty(x.shape[0], math.prod(x.shape[1:]), dtype=torch.float16, device=x.device)
        out = producers.cast(x, dtype, out16)
        self.copies.put(out, out16)
        return out.view(x.shape)


class IndexerInputs:
    """The rest of a DSA indexer's projections (`Indexer.outputs` after its linears) in one launch: the
    fp32 head weights and the KPool gate logits of the sublayer's input, and the key's LayerNorm."""

    def __init__(self, indexer, dtype: torch.dtype) -> None:
        self.indexer = indexer
        self.weights = IndexerInputWeights.of(indexer, dtype)
        self.scratch = DsaScratch()

    def __call__(self, x: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor):
        """`Indexer.outputs(x, qi, ki)`: (queries [T, H, d], head weights, keys, gate logits)."""
        ix = self.indexer
        if not (_rows(x) and _rows(ki)):
            return ix.outputs(x, qi, ki)
        wi, gi, k = indexer_inputs(x, ki, self.weights, self.scratch)
        return qi.view(-1, ix.n_heads, ix.head_dim), wi, k, gi


class GroupLaunch:
    """Projections of one input in one launch: their outputs, in `members` order."""

    def __init__(self, members: list[Linear], copies: Fp16Copies | None = None) -> None:
        self.members = members
        self.copies = copies
        self.projections = [(m.weight, m.weight_scale_inv) for m in members]

    def __call__(self, x: torch.Tensor, early: bool = False) -> list[torch.Tensor]:
        x16 = None if self.copies is None else self.copies.get(x)
        return linear_kernels.skinny_linear_multi(x, self.projections, pdl=True if early else None, x16=x16)


class ProjectionStage:
    """The KDA and DSA projection stages of a set of layers, per token count as the policy picks."""

    def __init__(self, layers, policy, dtype: torch.dtype, copies: Fp16Copies | None = None) -> None:
        self.policy = policy
        self.dtype = dtype
        self.copies = copies
        self.groups: dict[str, list[GroupLaunch]] = {"kda_proj": [], "dsa_proj": []}
        self.grouped_layers: dict[int, tuple[str, GroupLaunch]] = {}
        """layer index -> the stage of its projection group, and the group."""
        self.stage_of: dict[int, str] = {}
        """layer index -> the stage of its projections, for the layers whose stage the policy enables."""
        self.launches: dict[int, dict[str, SingleLaunch]] = {}
        """layer index -> its projections the kernels can run (by path in the attention module), one launch each."""
        self.indexer_inputs: dict[int, IndexerInputs] = {}
        """DSA layer index -> its indexer's head weights, gate logits and key norm in one launch."""
        for layer in layers:
            stage = STAGE_OF[layer.layer_kind]
            if not policy.enabled(stage):
                continue
            attn = layer.self_attn
            self.stage_of[layer.layer_idx] = stage
            group_names, single_names = (KDA_GROUP, KDA_SINGLES) if layer.layer_kind == KDA else (DSA_GROUP, DSA_SINGLES)
            group = [_get(attn, n) for n in group_names]
            if all(routable(m, dtype) for m in group) and len({m.weight.dtype for m in group}) == 1:
                self.groups[stage].append(GroupLaunch(group, copies))
                self.grouped_layers[layer.layer_idx] = (stage, self.groups[stage][-1])
            self.launches[layer.layer_idx] = {n: SingleLaunch(_get(attn, n), copies) for n in group_names + single_names
                                              if routable(_get(attn, n), dtype)}
            if layer.layer_kind == DSA:
                self.indexer_inputs[layer.layer_idx] = IndexerInputs(attn.indexer, dtype)

    def runs(self, layer, tokens: int) -> bool:
        """Whether the stage runs `layer`'s projections at this token count (else its stock sublayer runs)."""
        stage = self.stage_of.get(layer.layer_idx)
        return stage is not None and self.policy(stage, tokens) in GROUPED + ("single",)

    def _linear(self, attn, name: str):
        """The call of `attn`'s projection `name` in a step the stage runs: its launch, or its stock module."""
        return self.launches[attn.layer_idx].get(name) or _get(attn, name)

    def _group(self, attn, x: torch.Tensor, tokens: int) -> list[torch.Tensor] | None:
        """The outputs of `attn`'s projection group on `x` in one launch, where the choice groups it (else None)."""
        stage, group = self.grouped_layers.get(attn.layer_idx, (None, None))
        choice = None if stage is None else self.policy(stage, tokens)
        return group(x, early=choice in EARLY) if choice in GROUPED else None

    def kda(self, attn, x: torch.Tensor, tokens: int) -> KdaProjections:
        """`attn.project(x)` (a KDA layer's) on the kernels: x [T, hidden]."""
        outs = self._group(attn, x, tokens) or [self._linear(attn, n)(x) for n in KDA_GROUP]
        q, k, v, b, f_a, g_a = outs
        return KdaProjections(q, k, v, b, self._linear(attn, "f_b_proj")(f_a), self._linear(attn, "g_b_proj")(g_a))

    def kda_output(self, attn, y: torch.Tensor, tokens: int) -> torch.Tensor:
        """The KDA layer's o_proj of `y` [T, H * V]."""
        return self._linear(attn, "o_proj")(y)

    def _reads_x16(self, attn, name: str, tokens: int) -> bool:
        """Whether the launch of `attn`'s projection `name` reads an fp16 copy of its input at this token count."""
        launch = self.launches[attn.layer_idx].get(name)
        return launch is not None and linear_kernels.reads_x16(tokens, [launch.linear.weight], self.dtype)

    def dsa(self, attn, x: torch.Tensor, tokens: int) -> DsaProjections:
        """`attn.project(x)` (a DSA layer's) on the kernels, in its order: the group (or q_a), the q_a norm
        (one kernel, writing the fp16 copy where the q_b or the wq_b launch reads one), the q_b, the kv_a
        norm, the indexer's wq_b and wk, then its head weights, gate logits and key norm (one launch)."""
        group = self._group(attn, x, tokens)
        q_a = group[0] if group else self._linear(attn, "q_a_proj")(x)
        copy = self._reads_x16(attn, "q_b_proj", tokens) or self._reads_x16(attn, "indexer.wq_b", tokens)
        cq = NormKernel(attn.q_a_layernorm, self.copies, copy)(q_a)
        q = self._linear(attn, "q_b_proj")(cq)
        kv_a = group[1] if group else self._linear(attn, "kv_a_proj_with_mqa")(x)
        c = NormKernel(attn.kv_a_layernorm)(kv_a)
        qi = self._linear(attn, "indexer.wq_b")(cq)
        ki = group[2] if group else self._linear(attn, "indexer.wk")(x)
        qi, wi, ki, gi = self.indexer_inputs[attn.layer_idx](x, qi, ki)
        return DsaProjections(q.view(x.shape[0], attn.num_heads, attn.nope_dim), c, qi, wi, ki, gi)

    def dsa_output(self, attn, values: torch.Tensor, dtype: torch.dtype, tokens: int) -> torch.Tensor:
        """`attn.output(values, dtype)` on the kernels: the cast (one kernel writing the o_proj's fp16 copy,
        where its launch reads one), then the o_proj. `values` [T, H, v] fp32."""
        if self.copies is not None and self._reads_x16(attn, "o_proj", tokens):
            cast = CastKernel(self.copies)(values, dtype)
        else:
            cast = values.to(dtype)
        return self._linear(attn, "o_proj")(cast.reshape(values.shape[0], -1))

    def release_late(self, layer, tokens: int) -> bool:
        """Whether the boundary before `layer`'s attention releases the next launch only after its
        partial products: its projection group runs "grouped-overlap" at this token count."""
        stage, _ = self.grouped_layers.get(layer.layer_idx, (None, None))
        return stage is not None and self.policy(stage, tokens) in RELEASE_LATE

    def reads_x16(self, layer, tokens: int) -> bool:
        """Whether a launch of `layer`'s projection group (or with "single", of one of its members) at this
        token count reads an fp16 copy of its input."""
        stage, group = self.grouped_layers.get(layer.layer_idx, (None, None))
        choice = None if stage is None else self.policy(stage, tokens)
        weights = [] if group is None else [w for w, _ in group.projections]
        if choice in GROUPED:
            return linear_kernels.reads_x16(tokens, weights, self.dtype)
        return choice == "single" and any(linear_kernels.reads_x16(tokens, [w], self.dtype) for w in weights)
