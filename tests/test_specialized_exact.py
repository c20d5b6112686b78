"""The executor against the stock backbone on the small model, fp32, through the Triton interpreter:
each stage against the stock module it replaces, a planned step against the stock step (logits and
every cache write), and greedy tokens over 64 planned steps identical to the stock ones. The CPU
has no graphs, so planned steps run eagerly with the step declared as captured."""

import pytest
import torch

from glm5next.model.mhc import hc_post
from glm5next.runtime.cache import allocate_cache
from glm5next.runtime.runner import Runner, Sequence
from glm5next.specialized_decode import STAGES, Policy, SpecializedDecode
from glm5next.specialized_decode.boundary import BoundaryStage

SIZES = (1, 2, 4, 8)


SLOW_IN_THE_INTERPRETER = {"kda"}
"""Stages whose interpreted kernels cost ~1 s a layer call here: on only where a test asks for them (the
kernel's own tests cover it in depth)."""


def policy(**choices):
    """Every stage on at every size (those in SLOW_IN_THE_INTERPRETER only when asked), with `choices`
    overriding a stage's choice (None: stock)."""
    tables = {}
    for stage, options in STAGES.items():
        choice = choices.get(stage, None if stage in SLOW_IN_THE_INTERPRETER else options[0])
        if choice is not None:
            tables[stage] = {str(m): choice for m in SIZES}
    return Policy(tables)


def close(got, want, tol=1e-4):
    err = float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))
    assert err < tol, err


def test_boundary_stage_equals_stock(tiny_fp32):
    ex = SpecializedDecode(tiny_fp32, policy(), SIZES)
    layer, cfg = tiny_fp32.layers[2], tiny_fp32.config
    g = torch.Generator().manual_seed(0)
    streams = torch.randn(3, cfg.hc_mult, cfg.hidden_size, generator=g)
    out = torch.randn(3, cfg.hidden_size, generator=g)
    _, post, comb = layer.attn_hc.pre(streams)
    got = ex.boundary_stage(out, streams, post, comb, layer.ffn_hc, layer.post_attention_layernorm)
    new = hc_post(out, streams, post, comb)
    x, p2, c2 = layer.ffn_hc.pre(new)
    for a, b in zip(got, (new, p2, c2, layer.post_attention_layernorm(x))):
        close(a, b, 1e-5)


def _count_linear_launches(monkeypatch) -> list:
    import glm5next.kernels.linear as linear_kernels

    launches = []
    for name in ("skinny_linear", "skinny_linear_multi"):
        real = getattr(linear_kernels, name)
        monkeypatch.setattr(linear_kernels, name, lambda *a, _n=name, _f=real, **k: launches.append(_n) or _f(*a, **k))
    return launches


@pytest.mark.parametrize("choice", STAGES["kda_proj"])
def test_projection_stage_equals_stock_pieces(tiny_fp32, monkeypatch, choice):
    """The projection stage's calls against the stock pieces they replace: a KDA layer's and a DSA layer's
    projections (every output), and their o_proj (DSA: the values' cast included), all on the kernels."""
    launches = _count_linear_launches(monkeypatch)
    ex = SpecializedDecode(tiny_fp32, policy(kda_proj=choice, dsa_proj=choice), SIZES)
    g = torch.Generator().manual_seed(1)
    grouped = choice != "single"
    for idx in (0, 3):  # a KDA layer and a DSA layer
        layer = tiny_fp32.layers[idx]
        attn = layer.self_attn
        assert ex.projections.runs(layer, 4)
        x = torch.randn(4, tiny_fp32.config.hidden_size, generator=g)
        launches.clear()
        if layer.layer_kind == "kda":
            got, want = ex.projections.kda(attn, x, 4), attn.project(x)
            y = torch.randn(4, attn.o_proj.in_features, generator=g)
            got_out, want_out = ex.projections.kda_output(attn, y, 4), attn.o_proj(y)
            # q|k|v|b|f_a|g_a in one launch, then f_b, g_b and o_proj; or all nine alone.
            assert launches == (["skinny_linear_multi"] + ["skinny_linear"] * 3 if grouped else ["skinny_linear"] * 9)
        else:
            got, want = ex.projections.dsa(attn, x, 4), attn.project(x)
            values = torch.randn(attn.num_heads, 4, attn.v_dim, generator=g).permute(1, 0, 2)
            got_out, want_out = ex.projections.dsa_output(attn, values, x.dtype, 4), attn.output(values, x.dtype)
            # q_a|kv_a|wk in one launch, then q_b, wq_b and o_proj; or all six alone.
            assert launches == (["skinny_linear_multi"] + ["skinny_linear"] * 3 if grouped else ["skinny_linear"] * 6)
        assert type(got) is type(want)
        for name, a, b in zip(want._fields, got, want):
            assert a.shape == b.shape, name
            close(a, b)
        close(got_out, want_out)
    # Counter-example: where the policy says stock, the stage does not run the layer's projections.
    stock = SpecializedDecode(tiny_fp32, policy(kda_proj=None, dsa_proj=None), SIZES)
    assert not any(stock.projections.runs(tiny_fp32.layers[i], 4) for i in (0, 3))


def test_dense_and_shared_expert_stages_equal_stock(tiny_fp32, monkeypatch):
    from types import SimpleNamespace

    from glm5next.forward import CUDAGraphMode
    from glm5next.specialized_decode.dense_mlp import DenseMlpStage

    ex = SpecializedDecode(tiny_fp32, policy(), SIZES)
    x = torch.randn(5, tiny_fp32.config.hidden_size, generator=torch.Generator().manual_seed(2))
    assert sorted(ex.dense) == [0, 1, 2] and sorted(ex.shared) == [3, 4, 5, 6, 7]
    close(ex.dense[1](x), tiny_fp32.layers[1].mlp(x))
    close(ex.shared[5](x), tiny_fp32.layers[5].mlp.shared_experts(x))
    # With the MoE stage off, "fused-overlap" runs the shared expert's stage (launches overlapped) first,
    # then the stock router and routed experts, summed as the stock MoE sums them.
    layer = tiny_fp32.layers[5]
    order, stage_call, gate_forward = [], DenseMlpStage.__call__, layer.mlp.gate.forward
    monkeypatch.setattr(DenseMlpStage, "__call__",
                        lambda self, x, overlap=False: order.append(("shared", overlap)) or stage_call(self, x, overlap))
    monkeypatch.setattr(layer.mlp.gate, "forward", lambda x: order.append("router") or gate_forward(x))
    ex = SpecializedDecode(tiny_fp32, policy(shared_expert="fused-overlap", moe=None), SIZES)
    got = ex.ffn_stages(layer, x, SimpleNamespace(cudagraph_mode=CUDAGraphMode.FULL), None)
    assert order == [("shared", True), "router"]
    close(got, layer.mlp(x, graph_safe=True))
    # Counter-example: with the shared expert stock too, no stage runs the MoE layer's FFN.
    ex = SpecializedDecode(tiny_fp32, policy(shared_expert=None, moe=None), SIZES)
    assert ex.ffn_stages(layer, x, SimpleNamespace(cudagraph_mode=CUDAGraphMode.FULL), None) is None


def test_dsa_norms_and_value_cast_run_as_kernels_where_the_projection_stage_runs(tiny_dir, tiny_fp32, monkeypatch):
    """Where the projection stage runs a DSA layer, its latent norms run as kernels, one each; in bf16 the q_a
    norm's writes and files the fp16 copy the q_b and the wq_b read, and the cast before the o_proj runs as a
    kernel that writes the o_proj's copy. All equal the stock pieces' results (in fp32 within 1e-5; in bf16
    the cast bit for bit up to the interpreter's truncating casts)."""
    import glm5next.kernels.producers as producers
    from glm5next.model.backbone import Glm5NextModel
    from glm5next.specialized_decode.linear import CastKernel, NormKernel

    launches = []
    for name in ("rms_norm",):
        real = getattr(producers, name)
        monkeypatch.setattr(producers, name, lambda *a, _n=name, _f=real, **k: launches.append(_n) or _f(*a, **k))
    norms, casts = [], []
    norm_call, cast_call = NormKernel.__call__, CastKernel.__call__

    def record_norm(self, x):
        out = norm_call(self, x)
        norms.append((self, out, None if self.copies is None else self.copies.get(out)))
        return out

    def record_cast(self, x, dtype):
        out = cast_call(self, x, dtype)
        casts.append((out, self.copies.get(out.reshape(x.shape[0], -1))))
        return out

    monkeypatch.setattr(NormKernel, "__call__", record_norm)
    monkeypatch.setattr(CastKernel, "__call__", record_cast)
    bf16 = Glm5NextModel.from_pretrained(tiny_dir, torch.bfloat16, "cpu", progress=False)
    g = torch.Generator().manual_seed(3)
    for model in (tiny_fp32, bf16):
        layer = next(layer for layer in model.layers if layer.layer_kind == "dsa")
        attn = layer.self_attn
        dtype = torch.bfloat16 if model is bf16 else torch.float32
        tol = 1e-5 if model is tiny_fp32 else 2e-2
        h = torch.randn(4, model.config.hidden_size, generator=g).to(dtype)
        want_q = attn.q_a_layernorm(attn.q_a_proj(h))
        want_kv = attn.kv_a_layernorm(attn.kv_a_proj_with_mqa(h))
        want = attn.project(h)
        for choice in ("grouped", "single"):
            ex = SpecializedDecode(model, policy(dsa_proj=choice), SIZES)
            launches.clear()
            norms.clear()
            got = ex.projections.dsa(attn, h, 4)
            assert launches == ["rms_norm", "rms_norm"]
            (q_norm, got_q, copy), (kv_norm, got_kv, _) = norms
            assert q_norm.norm is attn.q_a_layernorm and kv_norm.norm is attn.kv_a_layernorm
            assert kv_norm.copies is None and (q_norm.copies is ex.copies) == (model is bf16)
            close(got_q, want_q, tol)
            close(got_kv, want_kv, tol)
            for a, b in zip(got, want):
                close(a, b, tol)
            if model is bf16:
                assert torch.equal(copy, got_q.to(torch.float16))
            else:
                assert copy is None
            ex.copies.clear()
        # Counter-example: with the DSA projections stock, the stage does not run the layer.
        assert not SpecializedDecode(model, policy(dsa_proj=None), SIZES).projections.runs(layer, 4)
        # A norm kernel called on anything but its group's output runs alone.
        ex = SpecializedDecode(model, policy(), SIZES)
        x = torch.randn(4, attn.q_a_layernorm.dim, generator=g).to(dtype)
        launches.clear()
        alone = NormKernel(attn.q_a_layernorm, ex.copies, True)(x)
        assert launches == ["rms_norm"]
        close(alone, _stock_norm(attn.q_a_layernorm, x), tol)
        o = torch.randn(attn.num_heads, 4, attn.v_dim, generator=g).permute(1, 0, 2)  # as the einsum leaves it
        casts.clear()
        out = ex.projections.dsa_output(attn, o, dtype, 4)
        close(out, attn.output(o, dtype), tol)
        flat = o.reshape(4, -1)
        if model is bf16:  # the cast ran as a kernel and filed the o_proj's copy
            ((cast, cast_copy),) = casts
            cast = cast.reshape(4, -1)
            assert ((cast.float() - flat.to(dtype).float()).abs() <= flat.abs() * 2.0**-7).all()
            assert torch.equal(cast_copy, cast.to(torch.float16))
        else:  # no launch reads a copy: the stock cast
            assert casts == []
        ex.copies.clear()


def _stock_norm(norm, x):
    from glm5next.model.norm import rms_norm

    return rms_norm(x, norm.weight, norm.eps)


def prefilled(model, lens, executor=None):
    cache = allocate_cache(model.config, 80, 16, 8, torch.float32, "cpu", include_mtp=False)
    runner = Runner(model, cache, max_model_len=320, capture_sizes=SIZES, executor=executor)
    runner.graph_mode = executor is not None
    g = torch.Generator().manual_seed(7)
    seqs = [Sequence(torch.randint(0, 256, (n,), generator=g).tolist(), i, list(range(10 * i, 10 * i + 10)))
            for i, n in enumerate(lens)]
    runner.step(seqs)  # the prefill runs stock (a prompt row is never planned)
    return runner, seqs


def decode_alike(model, lens, executor, steps):
    """Prefill `lens`, then `steps` decode steps planned by `executor` and stock, each step's logits
    equal; returns the two runners."""
    planned, p_seqs = prefilled(model, lens, executor)
    stock, s_seqs = prefilled(model, lens)
    for step in range(steps):
        for seqs in (p_seqs, s_seqs):
            for i, s in enumerate(seqs):
                s.token_ids.append(3 * step + 11 * i)
        close(planned.step(p_seqs), stock.step(s_seqs))
    return planned, stock


@pytest.mark.parametrize("choice", STAGES["kda_proj"])
def test_planned_step_equals_stock_step(tiny_fp32, choice):
    lens = [5, 40, 70]  # the long ones make the indexer drop pools
    mlp = "fused-overlap" if choice == "grouped-overlap" else "fused"  # overlapped forms together
    kda = "fused" if choice == "grouped" else None  # the KDA stage behind one projection form
    ex = SpecializedDecode(tiny_fp32, policy(kda_proj=choice, dsa_proj=choice, dense_mlp=mlp, shared_expert=mlp,
                                             kda=kda), SIZES)
    planned, stock = decode_alike(tiny_fp32, lens, ex, 3)
    for a, b in zip(planned.cache.tensors(), stock.cache.tensors()):
        close(a[:-1], b[:-1])  # every cache write but the padding row's scratch


@pytest.mark.parametrize("registers", [False, True])
def test_planned_step_with_deferred_sinkhorn_equals_stock_step(tiny_fp32, registers):
    """"fused-deferred" boundaries (each comb finished by the next boundary): the planned step equals
    the stock one, on the interpreter's tile path and on the GPU's register path (a boundary stage whose
    launch plans ask for it)."""
    ex = SpecializedDecode(tiny_fp32, policy(boundary="fused-deferred"), SIZES)
    ex.boundary_stage = BoundaryStage(tiny_fp32.config, ex.copies, sinkhorn_in_registers=registers)
    decode_alike(tiny_fp32, [5, 40], ex, 2)
    assert ex.planned_steps == 2


@pytest.mark.parametrize("shared", ["fused", "fused-overlap"])
def test_only_boundaries_before_overlapped_groups_release_late(tiny_fp32, monkeypatch, shared):
    """With "grouped-overlap" for the KDA projections only, the boundary in front of each KDA
    attention (layer 0's first boundary included) is asked to release late, and with "fused-overlap"
    for the dense MLP the one in front of each dense layer's MLP (whose gate|up and down then launch as
    programmatic dependents, the gate|up releasing late); with "fused-overlap" for the shared expert
    also the one in front of each MoE layer's MLP, whose first launch is then the shared expert's
    gate|up (it runs before the router); the others are not."""
    import glm5next.kernels.linear as linear_kernels
    from glm5next.config import KDA

    asked = {}
    call, first = BoundaryStage.__call__, BoundaryStage.first

    def record_call(self, out, streams, post, comb, hc, norm, release_late=False, deferred=False, x16=False):
        asked[id(hc)] = release_late
        if id(hc) in moe_ffn:
            after_boundary.append(None)
        return call(self, out, streams, post, comb, hc, norm, release_late, deferred, x16)

    def record_first(self, embedded, hc, norm, release_late=False, deferred=False, x16=False):
        asked[id(hc)] = release_late
        return first(self, embedded, hc, norm, release_late, deferred, x16)

    launches = []
    gate_up, down = linear_kernels.gate_up_swiglu, linear_kernels.skinny_linear
    after_boundary = []  # per MoE layer: what ran first after its ffn boundary

    def record_gate_up(*a, **k):
        launches.append(("gate_up", k.get("pdl")))
        if after_boundary and after_boundary[-1] is None:
            after_boundary[-1] = "shared gate|up"
        return gate_up(*a, **k)

    def record_down(*a, **k):
        launches.append(("down", k.get("pdl")))
        return down(*a, **k)

    moe_ffn = {id(layer.ffn_hc) for layer in tiny_fp32.layers if layer.mlp_is_moe}

    def recording_router(route):
        def forward(x):
            if after_boundary and after_boundary[-1] is None:
                after_boundary[-1] = "router"
            return route(x)
        return forward

    for layer in tiny_fp32.layers:
        if layer.mlp_is_moe:
            monkeypatch.setattr(layer.mlp.gate, "forward", recording_router(layer.mlp.gate.forward))
    monkeypatch.setattr(BoundaryStage, "__call__", record_call)
    monkeypatch.setattr(BoundaryStage, "first", record_first)
    monkeypatch.setattr(linear_kernels, "gate_up_swiglu", record_gate_up)
    monkeypatch.setattr(linear_kernels, "skinny_linear", record_down)
    ex = SpecializedDecode(tiny_fp32, policy(kda_proj="grouped-overlap", dsa_proj="grouped",
                                             dense_mlp="fused-overlap", shared_expert=shared, moe=None),
                           SIZES)  # the MoE stage off: the shared expert's stage, then the stock router
    runner, seqs = prefilled(tiny_fp32, [5, 9], ex)
    for i, s in enumerate(seqs):
        s.token_ids.append(4 + i)
    asked.clear()
    runner.step(seqs)
    assert ex.planned_steps == 1
    overlap = shared == "fused-overlap"
    for layer in tiny_fp32.layers:
        assert asked[id(layer.attn_hc)] == (layer.layer_kind == KDA), layer.layer_idx
        assert asked[id(layer.ffn_hc)] == (not layer.mlp_is_moe or overlap), layer.layer_idx
    dense = sum(not layer.mlp_is_moe for layer in tiny_fp32.layers)
    moe = len(tiny_fp32.layers) - dense
    assert after_boundary == ["shared gate|up"] * moe
    if overlap:
        assert launches.count(("gate_up", "late")) == dense + moe and launches.count(("down", True)) == dense + moe
    else:
        assert launches.count(("gate_up", "late")) == dense and launches.count(("gate_up", None)) == moe
        assert launches.count(("down", True)) == dense and launches.count(("down", None)) >= moe


def greedy_tokens_alike(model, ex, steps: int) -> None:
    """Greedy tokens of `steps` planned decode steps (3 rows padded to 4) equal to the stock ones."""
    lens = [9, 33, 2]
    runs = []
    for runner, seqs in (prefilled(model, lens, ex), prefilled(model, lens)):
        nxt, out = [7, 8, 9], []
        for _ in range(steps):
            for s, t in zip(seqs, nxt):
                s.token_ids.append(t)
            nxt = runner.step(seqs).argmax(-1).tolist()
            out.append(nxt)
        runs.append(out)
    assert ex.planned_steps == steps  # every decode step ran the planned path
    assert runs[0] == runs[1]


@pytest.mark.slow
def test_greedy_tokens_identical_over_64_planned_steps(tiny_fp32):
    greedy_tokens_alike(tiny_fp32, SpecializedDecode(tiny_fp32, policy(), SIZES), 64)


def test_greedy_tokens_identical_with_the_kda_stage(tiny_fp32):
    """The KDA stage on top of every other stage, over 4 planned steps (64 in the test above without it: the
    interpreted KDA kernel costs ~1 s a layer call here)."""
    ex = SpecializedDecode(tiny_fp32, policy(kda="fused"), SIZES)
    assert sorted(ex.kda) == [i for i, layer in enumerate(tiny_fp32.layers) if layer.layer_kind == "kda"]
    greedy_tokens_alike(tiny_fp32, ex, 4)


def test_projection_case_runs_every_choice_after_its_boundary(tiny_fp32, monkeypatch):
    """The tuning case of a sublayer's projections runs each choice behind the boundary that feeds
    it (the group reads the boundary's output) and has the boundaries alone as its `before`;
    "grouped-early" and "grouped-overlap" ask for the programmatic launch of the group (the latter behind a
    boundary that releases it late), "grouped" leaves it to the default."""
    import glm5next.kernels.linear as linear_kernels
    from glm5next.bench import stages
    from glm5next.config import KDA

    monkeypatch.setattr(stages, "ROTATE_BYTES", 1)  # one copy of each layer
    case = stages._projection_case(tiny_fp32, 2, KDA, "kda_proj")
    assert set(case.runs) == set(STAGES["kda_proj"]) | {"stock"} and case.before is not None
    seen = []
    boundary_outputs = []
    multi, stage_call = linear_kernels.skinny_linear_multi, BoundaryStage.__call__

    releases = []

    def record_multi(x, projections, *a, **k):
        seen.append((choice, k.get("pdl"), any(x is b for b in boundary_outputs)))
        return multi(x, projections, *a, **k)

    def record_boundary(self, *a, **k):
        out = stage_call(self, *a, **k)
        boundary_outputs.append(out[3])
        releases.append((choice, len(a) > 6 and a[6]))
        return out

    monkeypatch.setattr(linear_kernels, "skinny_linear_multi", record_multi)
    monkeypatch.setattr(BoundaryStage, "__call__", record_boundary)
    for choice, run in case.runs.items():
        run()
    kda_layers = sum(layer.layer_kind == KDA for layer in tiny_fp32.layers)
    assert sorted(set(seen)) == [("grouped", None, True), ("grouped-early", True, True),
                                 ("grouped-overlap", True, True)]
    assert len(seen) == 3 * kda_layers
    assert {c for c, late in releases if late} == {"grouped-overlap"}  # only its boundary releases late
    n = len(boundary_outputs)
    choice = "before"
    case.before()
    assert len(boundary_outputs) - n == kda_layers and not any(late for _, late in releases[-kda_layers:])
    # The DSA case runs a layer's projections as its forward does: the latent norms (as kernels where the stage runs the
    # projections, one each) between the group and the q_b, the values' cast before the o_proj.
    import glm5next.kernels.producers as producers
    from glm5next.config import DSA

    dsa_case = stages._projection_case(tiny_fp32, 2, DSA, "dsa_proj")
    norms = []
    real = producers.rms_norm
    monkeypatch.setattr(producers, "rms_norm", lambda *a, **k: norms.append((choice, "rms_norm")) or real(*a, **k))
    for choice, run in dsa_case.runs.items():
        run()
    dsa_layers = sum(layer.layer_kind == DSA for layer in tiny_fp32.layers)
    for c in STAGES["dsa_proj"]:
        launched = [n for k, n in norms if k == c]
        assert launched == ["rms_norm", "rms_norm"] * dsa_layers, c
    assert not [n for k, n in norms if k == "stock"]


def test_fp16_copies_leave_planned_bf16_steps_bit_for_bit(tiny_dir, monkeypatch):
    """In bf16 the boundaries in front of the DSA projection groups and of the dense and shared-expert
    MLPs write fp16 copies of their outputs, which those FP8 launches read (and the gate|up writes one
    for the down; in a DSA layer the q_a norm one for the q_b and the indexer's wq_b, the cast of the
    attention's values one for the o_proj): two planned steps give the same logits and cache bits with
    the copies as without."""
    from glm5next.model.backbone import Glm5NextModel
    from glm5next.specialized_decode.copies import Fp16Copies

    model = Glm5NextModel.from_pretrained(tiny_dir, torch.bfloat16, "cpu", progress=False)
    lens = [5, 9, 3]
    hits = []
    get = Fp16Copies.get

    def counted(self, x):
        found = get(self, x)
        hits.append(found is not None)
        return found

    def decode(copies: bool):
        monkeypatch.setattr(Fp16Copies, "get", counted if copies else lambda self, x: None)
        ex = SpecializedDecode(model, policy(), SIZES)
        cache = allocate_cache(model.config, 80, 16, 8, torch.bfloat16, "cpu", include_mtp=False)
        runner = Runner(model, cache, max_model_len=320, capture_sizes=SIZES, executor=ex)
        runner.graph_mode = True
        g = torch.Generator().manual_seed(7)
        seqs = [Sequence(torch.randint(0, 256, (n,), generator=g).tolist(), i, list(range(10 * i, 10 * i + 10)))
                for i, n in enumerate(lens)]
        runner.step(seqs)
        logits = []
        for step in range(2):
            for i, s in enumerate(seqs):
                s.token_ids.append(3 * step + 11 * i)
            logits.append(runner.step(seqs))
        assert ex.planned_steps == 2
        return logits, [t.clone() for t in cache.tensors()]

    with_copies, cache_with = decode(True)
    dsa = sum(layer.layer_kind == "dsa" for layer in model.layers)
    # Each step: a hit per DSA group, q_b, wq_b and o_proj, and per dense gate|up (the MoE layers run the
    # MoE stage, which reads no copy).
    dense = sum(not layer.mlp_is_moe for layer in model.layers)
    assert sum(hits) == 2 * (4 * dsa + dense), (sum(hits), dsa, dense)
    without, cache_without = decode(False)
    for a, b in zip(with_copies, without):
        assert torch.equal(a, b)
    for a, b in zip(cache_with, cache_without):
        assert torch.equal(a, b)


@pytest.mark.parametrize("stage", ["dense_mlp", "shared_expert"])
def test_mlp_case_runs_every_choice_after_its_boundary(tiny_fp32, monkeypatch, stage):
    """The tuning case of the dense MLP (of the shared expert) runs each choice (stock included) behind
    the boundary that feeds it, with the boundaries alone as its `before`; "fused-overlap" behind a
    boundary that releases late, with its gate|up and down as programmatic dependents; each choice's
    result is the stock MLP's."""
    import glm5next.kernels.linear as linear_kernels
    from glm5next.bench import stages
    from glm5next.specialized_decode.dense_mlp import DenseMlpStage

    monkeypatch.setattr(stages, "ROTATE_BYTES", 1)  # one copy of each layer
    case = stages._mlp_case(tiny_fp32, 2, stage)
    assert set(case.runs) == set(STAGES[stage]) | {"stock"} and case.before is not None
    shared = stage == "shared_expert"
    dense = [layer for layer in tiny_fp32.layers if layer.mlp_is_moe == shared]
    mlps = [layer.mlp.shared_experts if shared else layer.mlp for layer in dense]
    assert case.calls == len(dense)
    seen, outs = [], {}
    stage_call, mlp_call, gate_up = BoundaryStage.__call__, DenseMlpStage.__call__, linear_kernels.gate_up_swiglu

    def record_boundary(self, *a, **k):
        out = stage_call(self, *a, **k)
        seen.append((choice, "boundary", len(a) > 6 and a[6]))
        return out

    def record_mlp(self, x, overlap=False):
        y = mlp_call(self, x, overlap)
        outs.setdefault(choice, []).append((x, y))
        return y

    def record_gate_up(*a, **k):
        seen.append((choice, "gate_up", k.get("pdl")))
        return gate_up(*a, **k)

    monkeypatch.setattr(BoundaryStage, "__call__", record_boundary)
    monkeypatch.setattr(DenseMlpStage, "__call__", record_mlp)
    monkeypatch.setattr(linear_kernels, "gate_up_swiglu", record_gate_up)
    for choice, run in case.runs.items():
        run()
    assert seen.count(("fused-overlap", "boundary", True)) == len(dense)
    assert seen.count(("fused-overlap", "gate_up", "late")) == len(dense)
    assert seen.count(("fused", "boundary", False)) == seen.count(("stock", "boundary", False)) == len(dense)
    assert seen.count(("fused", "gate_up", None)) == len(dense)
    for choice in STAGES[stage]:
        for mlp, (x, y) in zip(mlps, outs[choice]):
            close(y, mlp(x))
    choice = "before"
    case.before()
    assert seen[-len(dense):] == [("before", "boundary", False)] * len(dense)
