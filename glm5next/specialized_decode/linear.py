"""Skinny projections: the stock linears of the KDA and DSA modules, routed through the Triton
GEMV kernels during planned steps.

"grouped" runs the projections one sublayer applies to the same input (KDA: q|k|v|b|f_a|g_a;
DSA: q_a|kv_a|indexer wk) in one launch, and the rest one launch each; "grouped-early" the same with
the group launched as a programmatic dependent of the kernel before it (in a step, the fused boundary,
which releases its dependents as it starts), so the group's weights stream into L2 while the boundary
runs; "grouped-overlap" the same with the boundary releasing the group only once its partial products
are stored, so that prefetch runs beside the boundary's finisher rather than its loads; "grouped-hold"
as "grouped-overlap" with every program of the group loading the weight tiles of its first `GROUP_HOLD`
K steps (at 1-16 rows, for the DSA group, all of its steps) into registers before its wait (`LaunchPlan.hold`), so that after the boundary only the
activations of those steps are read; "single" runs every projection in its own launch. The weights stay where the backbone keeps them. A launch whose
input has an fp16 copy filed (`Fp16Copies`) reads that. The boundary writes one where the group reads it;
in a DSA layer whose projections are routed, the q_a norm runs as one kernel (`NormRoute`, as does the
kv_a norm) that writes one where the q_b or the indexer's wq_b reads it, and the cast of the attention's
values before the o_proj (`CastRoute`) writes one where the o_proj reads it; where the group runs as one
launch, the q_a and kv_a norms can run as one kernel (`NormPair`, `NORM_PAIR`).
"""

from __future__ import annotations

import math

import torch

from ..checkpoint.fp8 import FP8_DTYPE
from ..config import DSA, KDA
from ..kernels import linear as linear_kernels
from ..kernels import producers
from ..model.norm import RMSNorm, rms_norm as rms_norm_stock
from ..parallel.layers import Linear
from .copies import Fp16Copies

KDA_GROUP = ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj", "g_a_proj")
KDA_SINGLES = ("f_b_proj", "g_b_proj", "o_proj")
DSA_GROUP = ("q_a_proj", "kv_a_proj_with_mqa", "indexer.wk")
DSA_SINGLES = ("q_b_proj", "o_proj", "indexer.wq_b")
STAGE_OF = {KDA: "kda_proj", DSA: "dsa_proj"}
GROUPED = ("grouped", "grouped-early", "grouped-overlap", "grouped-hold")
EARLY = ("grouped-early", "grouped-overlap", "grouped-hold")
"""The choices that launch the group as a programmatic dependent of the boundary before it."""
RELEASE_LATE = ("grouped-overlap", "grouped-hold")
"""The choices whose boundary releases the group only after its partial products."""
NORM_PAIR = False
"""Whether a DSA layer whose projection group runs as one launch normalises its q_a and kv_a outputs in one
kernel (`NormPair`) instead of one each. Off until the GPU tests have run it (the pair kernel gives each norm's
bits alone in the interpreter and compiles for sm_90, 32 registers)."""
GROUP_HOLD = {"grouped-hold": 4}
"""Choice -> K steps a group program holds in registers (fewer where its tiles would pass `HOLD_BYTES`).
The DSA group at 1-16 rows has 4 steps a program: all held, nothing streams after the wait, and an sm_90
compile of it takes 149 registers a thread (3 programs per SM: its 280 programs in one wave)."""


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


class SingleRoute:
    """One projection, one launch."""

    def __init__(self, linear: Linear, copies: Fp16Copies | None = None) -> None:
        self.linear = linear
        self.copies = copies

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x16 = None if self.copies is None else self.copies.get(x)
        return linear_kernels.skinny_linear(x, self.linear.weight, self.linear.weight_scale_inv, x16=x16)


def _rows(t: torch.Tensor) -> bool:
    """A 2-D tensor with unit stride along its rows, as the norm kernels take."""
    return t.dim() == 2 and (t.stride(1) == 1 or t.shape[1] <= 1)


class NormRoute:
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


class NormPair:
    """A DSA layer's q_a and kv_a norms in one launch (`rms_norm_pair`) where its projection group runs as one
    launch: the q_a norm's call (the forward's first) finds the kv_a output of the group launch that produced
    its input and normalises it too; the kv_a norm's call on that output then returns the result. Either norm
    called on anything else runs alone (`NormRoute`)."""

    Q, KV = DSA_GROUP.index("q_a_proj"), DSA_GROUP.index("kv_a_proj_with_mqa")
    """The q_a and kv_a projections' places in the group."""

    def __init__(self, q_norm: RMSNorm, kv_norm: RMSNorm, group: "GroupRoute", copies: Fp16Copies | None = None,
                 copy: bool = False) -> None:
        self.q_alone, self.kv_alone = NormRoute(q_norm, copies, copy), NormRoute(kv_norm)
        self.group = group
        self._kv_in: torch.Tensor | None = None
        self._kv_out: torch.Tensor | None = None

    def first(self, x: torch.Tensor) -> torch.Tensor:
        outs = self.group.outputs_of(x, self.Q)
        kv = None if outs is None else outs[self.KV]
        if kv is None or not (_rows(x) and _rows(kv)) or kv.dtype != x.dtype:
            return self.q_alone(x)
        q, k = self.q_alone.norm, self.kv_alone.norm
        out16 = self.q_alone.copy_for(x)
        out, self._kv_out = producers.rms_norm_pair(x, q.weight, q.eps, kv, k.weight, k.eps, out16)
        self._kv_in = kv
        return self.q_alone.filed(out, out16)

    def second(self, x: torch.Tensor) -> torch.Tensor:
        if x is self._kv_in:
            out, self._kv_in, self._kv_out = self._kv_out, None, None
            return out
        return self.kv_alone(x)


class CastRoute:
    """The cast of a module's input (`glm5next.model.routing.cast_input`) as one kernel that writes the
    result contiguous, flattened to [T, -1] (the module's input is that view of it), and its fp16 copy,
    filed in `copies` for the module's launch."""

    def __init__(self, copies: Fp16Copies) -> None:
        self.copies = copies

    def __call__(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if x.dim() not in (2, 3) or dtype != torch.bfloat16:
            return x.to(dtype)
        out16 = torch.empty(x.shape[0], math.prod(x.shape[1:]), dtype=torch.float16, device=x.device)
        out = producers.cast(x, dtype, out16)
        self.copies.put(out, out16)
        return out.view(x.shape)


class GroupRoute:
    """Projections of one input in one launch: the first member called with a new input runs them
    all; the others return their share of that launch."""

    def __init__(self, members: list[Linear], copies: Fp16Copies | None = None) -> None:
        self.members = members
        self.copies = copies
        self.projections = [(m.weight, m.weight_scale_inv) for m in members]
        self._x: torch.Tensor | None = None
        self._outs: list[torch.Tensor] = []

    def member(self, i: int, early: bool = False, hold: int = 0):
        return lambda x: self._get(i, x, early, hold)

    def _get(self, i: int, x: torch.Tensor, early: bool = False, hold: int = 0) -> torch.Tensor:
        if self._x is not x:
            x16 = None if self.copies is None else self.copies.get(x)
            self._outs = linear_kernels.skinny_linear_multi(x, self.projections, pdl=True if early else None, x16=x16,
                                                            hold=hold or None)
            self._x = x
        return self._outs[i]

    def outputs_of(self, y: torch.Tensor, i: int) -> list[torch.Tensor] | None:
        """The outputs of this group's last launch, where `y` is its i-th (else None)."""
        return self._outs if self._outs and self._outs[i] is y else None

    def reset(self) -> None:
        self._x, self._outs = None, []


class ProjectionRoutes:
    """Per token count, the routing table of every KDA and DSA projection the policy sends to kernels."""

    def __init__(self, layers, policy, dtype: torch.dtype, copies: Fp16Copies | None = None) -> None:
        self.policy = policy
        self.dtype = dtype
        self.copies = copies
        self.groups: dict[str, list[GroupRoute]] = {"kda_proj": [], "dsa_proj": []}
        self.singles: dict[str, list[Linear]] = {"kda_proj": [], "dsa_proj": []}
        self.members: dict[str, list[Linear]] = {"kda_proj": [], "dsa_proj": []}
        self.grouped_layers: dict[int, tuple[str, GroupRoute]] = {}
        """layer index -> the stage of its routed projection group, and the group."""
        self.dsa_attns = []
        """The attention modules of the DSA layers whose projections the policy may route."""
        self.dsa_groups: dict[int, GroupRoute] = {}
        """id of a DSA attention -> its projection group, where its members can run as one launch."""
        for layer in layers:
            stage = STAGE_OF[layer.layer_kind]
            if not policy.enabled(stage):
                continue
            attn = layer.self_attn
            if stage == "dsa_proj":
                self.dsa_attns.append(attn)
            group_names, single_names = (KDA_GROUP, KDA_SINGLES) if layer.layer_kind == KDA else (DSA_GROUP, DSA_SINGLES)
            group = [_get(attn, n) for n in group_names]
            if all(routable(m, dtype) for m in group) and len({m.weight.dtype for m in group}) == 1:
                self.groups[stage].append(GroupRoute(group, copies))
                self.grouped_layers[layer.layer_idx] = (stage, self.groups[stage][-1])
                if stage == "dsa_proj":
                    self.dsa_groups[id(attn)] = self.groups[stage][-1]
            else:
                self.singles[stage] += [m for m in group if routable(m, dtype)]
            self.singles[stage] += [m for m in (_get(attn, n) for n in single_names) if routable(m, dtype)]
            self.members[stage] += [m for m in group + [_get(attn, n) for n in single_names] if routable(m, dtype)]

    def table(self, tokens: int) -> dict:
        """Module id -> replacement call for a `tokens`-token planned step."""
        table = {}
        for stage in ("kda_proj", "dsa_proj"):
            choice = self.policy(stage, tokens)
            if choice in GROUPED:
                for g in self.groups[stage]:
                    for i, m in enumerate(g.members):
                        table[id(m)] = g.member(i, early=choice in EARLY, hold=GROUP_HOLD.get(choice, 0))
                for m in self.singles[stage]:
                    table[id(m)] = SingleRoute(m, self.copies)
            elif choice == "single":
                for m in self.members[stage]:
                    table[id(m)] = SingleRoute(m, self.copies)
        choice = self.policy("dsa_proj", tokens)
        if choice in GROUPED + ("single",):
            for attn in self.dsa_attns:
                table.update(self._dsa_producers(attn, tokens, table, choice in GROUPED))
        return table

    def _dsa_producers(self, attn, tokens: int, table: dict, grouped: bool) -> dict:
        """The routes of a DSA layer's latent norms (one kernel for both where its group runs as one launch,
        else one each; the q_a norm's writes an fp16 copy where the routed q_b or wq_b reads one) and of the
        cast before its o_proj (where the routed o_proj reads a copy)."""
        def reads(m: Linear) -> bool:
            return id(m) in table and linear_kernels.reads_x16(tokens, [m.weight], self.dtype)

        copy = reads(attn.q_b_proj) or reads(attn.indexer.wq_b)
        group = self.dsa_groups.get(id(attn)) if grouped and NORM_PAIR else None
        if group is not None:
            pair = NormPair(attn.q_a_layernorm, attn.kv_a_layernorm, group, self.copies, copy)
            routes = {id(attn.q_a_layernorm): pair.first, id(attn.kv_a_layernorm): pair.second}
        else:
            routes = {id(attn.q_a_layernorm): NormRoute(attn.q_a_layernorm, self.copies, copy),
                      id(attn.kv_a_layernorm): NormRoute(attn.kv_a_layernorm)}
        if self.copies is not None and reads(attn.o_proj):
            routes[("input", id(attn.o_proj))] = CastRoute(self.copies)
        return routes

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

    def reset(self) -> None:
        """Drop the group outputs of the finished step."""
        for groups in self.groups.values():
            for g in groups:
                g.reset()
