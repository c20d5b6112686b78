"""The MoE kernels against their fp32 reference and the stock module: routing (tie rule, grouping,
padded tokens), the whole layer at odd sizes with NaN-filled outputs, the stage inside the executor.
CPU cases run the Triton interpreter in fp32; GPU cases (marked `gpu`) run real shapes in bf16 and
replay a captured graph."""

import pytest
import torch

from glm5next.config import ROUTER_NORM_EPS
from glm5next.kernels.moe import (ExpertWeights, PrefillPlan, experts_forward, group_rows, moe_forward, moe_prefill,
                                  moe_reference, plan_moe, prefill_experts, prefill_plan, route, route_reference,
                                  shared_expert_beside)
from glm5next.specialized_decode.moe import MoeStage

FP8 = torch.float8_e4m3fn
CUDA = torch.cuda.is_available()


def random_weights(e, d, i, device="cpu", fp8=True, seed=0) -> ExpertWeights:
    """Random experts of one MoE layer (the shared expert allocated apart from the routed ones), drawn on
    `device`."""
    g = torch.Generator(device=device).manual_seed(seed)

    def w(*shape):
        t = torch.randn(*shape, generator=g, device=device) * (0.5 if fp8 else 0.05)
        return t.to(FP8 if fp8 else torch.float32)

    def s(*shape):
        return torch.rand(*shape, generator=g, device=device) * 0.02 + 0.005 if fp8 else None

    bd, bi = -(-d // 128), -(-i // 128)
    return ExpertWeights(
        torch.randn(e, d, generator=g, device=device) / d**0.5, torch.randn(e, generator=g, device=device) * 0.1,
        w(e, i, d), s(e, bi, bd), w(e, i, d), s(e, bi, bd), w(e, d, i), s(e, bd, bi),
        w(i, d), s(bi, bd), w(i, d), s(bi, bd), w(d, i), s(bd, bi))


def rel(got, want):
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


def check_grouping(r, ids, slots=None):
    """The shared expert's slots hold the valid tokens in order; then one slot per touched expert,
    ascending, with exactly the pairs routed to it (token order); padded tokens own no row."""
    t, k = ids.shape
    valid = [i for i in range(t) if slots is None or slots[i] >= 0]
    n = int(r.n_slots)
    experts, start, count = r.slot_expert[:n].tolist(), r.slot_start[:n].tolist(), r.slot_count[:n].tolist()
    rows = r.rows.tolist()
    shared = [s for s in range(n) if experts[s] == -1]
    assert shared == list(range(len(shared)))
    assert [p for s in shared for p in rows[start[s]:start[s] + count[s]]] == [t * k + i for i in valid]
    routed = experts[len(shared):]
    assert routed == sorted({int(e) for e in ids[valid].flatten()})
    for s, e in enumerate(routed, len(shared)):
        assert rows[start[s]:start[s] + count[s]] == [i * k + j for i in valid for j in range(k) if ids[i, j] == e]
    assert sum(count) == len(valid) * (k + 1)


SHAPES = {"odd": (13, 192, 80, 3), "tiny": (16, 128, 64, 4)}


@pytest.mark.parametrize("shape,tokens", [(s, t) for s in SHAPES for t in (1, 5, 16)] + [("odd", 40)])
def test_moe_layer_equals_reference(shape, tokens):
    """40 tokens: the shared expert's rows span three slots of 16."""
    e, d, i, k = SHAPES[shape]
    w = random_weights(e, d, i, seed=tokens)
    x = torch.randn(tokens, d, generator=torch.Generator().manual_seed(tokens))
    slots = torch.arange(tokens)
    if tokens > 1:
        slots[tokens // 2] = -1  # a padded row in the middle: it routes nowhere and outputs 0
    plan = plan_moe(tokens, d, x.device)
    out = torch.full((tokens, d), float("nan"))
    moe_forward(x, w, k, 2.5, True, ROUTER_NORM_EPS, 10.0, plan, slots, out=out)
    want = moe_reference(x, w, k, 2.5, True, ROUTER_NORM_EPS, 10.0, slots)
    assert rel(out, want) < 1e-4
    assert torch.all(out[slots < 0] == 0)
    r = route(x, w, k, 2.5, True, ROUTER_NORM_EPS, plan, slots)
    ids, weights = route_reference(x, w.router, w.bias, k, 2.5, True, ROUTER_NORM_EPS, slots)
    assert torch.equal(r.ids.long(), ids)
    assert rel(r.weights, weights) < 1e-5
    check_grouping(r, ids, slots)


@pytest.mark.parametrize("shape,tokens,block_n", [("odd", 1, 16), ("odd", 7, 32), ("tiny", 2, 16)])
def test_shared_expert_beside_the_routing_equals_reference(shape, tokens, block_n):
    """The shared expert in launches of its own before the routing: the same layer (a padded row writes 0)
    and the routed launches leave its rows alone (they hold its values, not the NaN they were filled with)."""
    e, d, i, k = SHAPES[shape]
    w = random_weights(e, d, i, seed=tokens + 21)
    x = torch.randn(tokens, d, generator=torch.Generator().manual_seed(tokens + 2))
    slots = torch.arange(tokens)
    if tokens > 1:
        slots[1] = -1
    plan = plan_moe(tokens, d, x.device, shared_side=True, side_block_n=block_n)
    assert "the shared expert beside the routing" in plan.describe()
    out = torch.full((tokens, d), float("nan"))
    moe_forward(x, w, k, 2.5, True, ROUTER_NORM_EPS, 10.0, plan, slots, out=out)
    want = moe_reference(x, w, k, 2.5, True, ROUTER_NORM_EPS, 10.0, slots)
    assert rel(out, want) < 1e-4
    assert torch.all(out[slots < 0] == 0)
    h = torch.full((tokens * (k + 1), i), float("nan"))
    y = torch.full((tokens * (k + 1), d), float("nan"))
    shared_expert_beside(x, w, k, 10.0, plan, slots, h, y)
    r = route(x, w, k, 2.5, True, ROUTER_NORM_EPS, plan, slots)
    experts_forward(x, w, r, 10.0, plan, slots, out, shared=(h, y))
    assert rel(out, want) < 1e-4
    shared_rows = tokens * k + torch.nonzero(slots >= 0).flatten()
    assert not y[shared_rows].isnan().any() and not y[:tokens * k][r.weights.flatten() > 0].isnan().any()


def test_shared_expert_beside_the_routing_refuses_steps_past_one_block():
    with pytest.raises(ValueError, match="at most block_m=16"):
        plan_moe(17, 192, torch.device("cpu"), shared_side=True)


@pytest.mark.parametrize("tokens", [1, 6])
def test_topk_and_grouping_in_one_program_equal_two_launches(tokens):
    e, d, i, k = SHAPES["odd"]
    w = random_weights(e, d, i, seed=tokens + 11)
    x = torch.randn(tokens, d, generator=torch.Generator().manual_seed(tokens + 1))
    slots = torch.arange(tokens)
    slots[-1] = -1 if tokens > 1 else 0
    a, b = (route(x, w, k, 2.5, True, ROUTER_NORM_EPS, plan_moe(tokens, d, x.device, topk_group=fused), slots)
            for fused in (False, True))
    n = int(a.n_slots)
    assert int(b.n_slots) == n and torch.equal(a.ids, b.ids) and torch.equal(a.weights, b.weights)
    for name in ("slot_expert", "slot_start", "slot_count"):
        assert torch.equal(getattr(a, name)[:n], getattr(b, name)[:n])
    used = int((slots >= 0).sum()) * (k + 1)  # rows past these are never written
    assert torch.equal(a.rows[:used], b.rows[:used])
    check_grouping(b, route_reference(x, w.router, w.bias, k, 2.5, True, ROUTER_NORM_EPS, slots)[0], slots)


def test_plans_describe_themselves():
    """Each plan's one-line description names its choices (the decode plan's fused top-k included)."""
    assert "top-k and grouping in one program" in plan_moe(1, 192, torch.device("cpu"), topk_group=True).describe()
    assert "top-k" not in plan_moe(1, 192, torch.device("cpu")).describe()
    assert "rows" in prefill_plan(torch.device("cpu")).describe()


def test_grouping_check_fails_on_a_wrong_grouping():
    e, d, i, k = SHAPES["odd"]
    w = random_weights(e, d, i)
    x = torch.randn(6, d, generator=torch.Generator().manual_seed(3))
    r = route(x, w, k, 2.5, True, ROUTER_NORM_EPS, plan_moe(6, d, x.device))
    ids = r.ids.long()
    check_grouping(r, ids)
    n = int(r.n_slots)
    r.rows[r.slot_start[n - 1]] += 1  # one pair filed under the wrong expert (or token)
    with pytest.raises(AssertionError):
        check_grouping(r, ids)


def test_ties_go_to_the_lower_expert_index_in_kernel_reference_and_stock(tiny_fp32):
    """Experts with equal selection scores: the lower index is chosen first, by the kernel, its
    reference and the stock router alike."""
    moe = tiny_fp32.layers[4].mlp
    w = ExpertWeights.of(moe)
    router = w.router.clone()
    router[[3, 9, 12]] = router[5].clone()  # experts 3, 5, 9, 12 score alike on every input
    bias = torch.zeros_like(w.bias)
    bias[[3, 5, 9, 12]] = 10.0  # and lead the selection: top-4 of 4 tied, top-2 must take 3 and 5
    tied = ExpertWeights(router, bias, *[getattr(w, f) for f in list(w.__dataclass_fields__)[2:]])
    x = torch.randn(5, router.shape[1], generator=torch.Generator().manual_seed(4))
    for k in (2, 3):
        r = route(x, tied, k, 2.5, True, ROUTER_NORM_EPS, plan_moe(5, router.shape[1], x.device))
        ids, _ = route_reference(x, router, bias, k, 2.5, True, ROUTER_NORM_EPS)
        assert r.ids.tolist() == [[3, 5, 9][:k]] * 5
        assert ids.tolist() == [[3, 5, 9][:k]] * 5
    gate = moe.gate
    saved = gate.weight.data.clone(), gate.e_score_correction_bias.data.clone()
    try:
        gate.weight.data.copy_(router)
        gate.e_score_correction_bias.data.copy_(bias)
        assert gate(x)[0].tolist() == [[3, 5, 9, 12]] * 5  # stock, top-4
    finally:
        gate.weight.data.copy_(saved[0])
        gate.e_score_correction_bias.data.copy_(saved[1])


@pytest.mark.parametrize("block_m", [16, 64])
def test_prefill_grouping_runs_any_token_count(block_m):
    """The PyTorch grouping of prefill chunks (a slot per row tile) gives the same output as the reference,
    also where an expert's rows span several tiles."""
    e, d, i, k = SHAPES["odd"]
    w = random_weights(e, d, i, seed=9)
    x = torch.randn(70, d, generator=torch.Generator().manual_seed(9))
    ids, weights = route_reference(x, w.router, w.bias, k, 2.5, True, ROUTER_NORM_EPS)
    plan = plan_moe(64, d, x.device, block_m=block_m)
    r = group_rows(ids, weights, e, plan.block_m)
    assert int(r.slot_count[: int(r.n_slots)].max()) <= plan.block_m
    out = torch.full((70, d), float("nan"))
    experts_forward(x, w, r, 10.0, plan, out=out)
    assert rel(out, moe_reference(x, w, k, 2.5, True, ROUTER_NORM_EPS, 10.0)) < 1e-4


@pytest.mark.parametrize("t,k,e,block_m", [(1, 2, 5, 16), (37, 3, 13, 4), (70, 8, 288, 16), (300, 6, 7, 64)])
def test_group_rows_tiles_every_pair_once(t, k, e, block_m):
    """The sync-free prefill grouping: the first n_slots slots tile each expert's pairs (the shared expert's
    first) in order, at most block_m a slot, every pair exactly once; the slots past them hold no rows."""
    g = torch.Generator().manual_seed(t * 7 + e)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    r = group_rows(ids, torch.rand(t, k, generator=g), e, block_m)
    n = int(r.n_slots)
    counts = [t] + torch.bincount(ids.reshape(-1), minlength=e).tolist()
    assert n == sum(-(-c // block_m) for c in counts) <= r.max_slots
    seen = []
    for s in range(n):
        a, c = int(r.slot_start[s]), int(r.slot_count[s])
        assert 0 < c <= block_m
        pairs = r.rows[a : a + c].tolist()
        expert = int(r.slot_expert[s])
        assert all((p >= t * k) if expert < 0 else (p < t * k and int(ids.reshape(-1)[p]) == expert) for p in pairs)
        seen += pairs
    assert sorted(seen) == list(range(t * k + t))
    assert not r.slot_count[n:].any()


@pytest.mark.parametrize("block_m,block_n,block_k", [(16, 32, 64), (64, 64, 128)])
def test_prefill_experts_any_token_count(block_m, block_n, block_k):
    """The prefill kernels (transposed products, a tile of one expert's rows a program) against the reference
    at odd sizes, an expert's rows over several tiles, every output written (NaN-filled)."""
    e, d, i, k = SHAPES["odd"]
    w = random_weights(e, d, i, seed=11)
    x = torch.randn(70, d, generator=torch.Generator().manual_seed(11))
    ids, weights = route_reference(x, w.router, w.bias, k, 2.5, True, ROUTER_NORM_EPS)
    plan = PrefillPlan(block_m, block_n, block_n, block_k, 4, 1, False)
    out = torch.full((70, d), float("nan"))
    prefill_experts(x, w, group_rows(ids, weights, e, block_m), 10.0, plan, out=out)
    assert rel(out, moe_reference(x, w, k, 2.5, True, ROUTER_NORM_EPS, 10.0)) < 1e-4
    assert rel(moe_prefill(x, ids, weights, w, 10.0), moe_reference(x, w, k, 2.5, True, ROUTER_NORM_EPS, 10.0)) < 1e-4


def test_prefill_plan_refuses_tiles_across_scale_blocks():
    """A prefill tile reads one block scale: columns or K steps that do not divide 128 are refused."""
    with pytest.raises(ValueError, match="block_n 256"):
        PrefillPlan(64, 256, 64, 128, 8, 3, True)
    with pytest.raises(ValueError, match="block_k 96"):
        PrefillPlan(64, 64, 64, 96, 4, 3, True)


def test_stage_equals_stock_moe(tiny_fp32):
    for idx in (3, 6):
        moe = tiny_fp32.layers[idx].mlp
        assert MoeStage.supports(moe)
        x = torch.randn(7, tiny_fp32.config.hidden_size, generator=torch.Generator().manual_seed(idx))
        assert rel(MoeStage(moe)(x), moe(x)) < 1e-4


def test_stage_refuses_unshared_storage(tiny_fp32):
    """A shared expert in another storage type than the routed ones is not the stage's."""
    import copy

    moe = copy.deepcopy(tiny_fp32.layers[3].mlp)
    moe.shared_experts.gate_proj.weight_scale_inv = None
    assert not MoeStage.supports(moe)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("tokens,overrides", [(1, {}), (2, {}), (7, {}), (64, {}), (7, {"topk_group": True}),
                                             (1, {"pdl": False}), (7, {"pdl": True}), (64, {"pdl": True})])
def test_real_shapes_bf16_against_fp32_reference(tokens, overrides):
    w = random_weights(288, 4096, 2048, device="cuda", seed=tokens)
    x = torch.randn(tokens, 4096, device="cuda").to(torch.bfloat16)
    slots = torch.arange(tokens, device="cuda")
    plan = plan_moe(tokens, 4096, x.device, **overrides)
    out = torch.full((tokens, 4096), float("nan"), dtype=torch.bfloat16, device="cuda")
    moe_forward(x, w, 8, 2.5, True, ROUTER_NORM_EPS, 10.0, plan, slots, out=out)
    want = moe_reference(x.float(), w, 8, 2.5, True, ROUTER_NORM_EPS, 10.0, slots)
    assert rel(out, want) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("tokens,overrides", [(1, {}), (2, {}), (8, {}), (1, {"pdl": False}), (2, {"side_block_n": 32})])
def test_shared_expert_on_a_second_stream_changes_no_bit(tokens, overrides):
    """The shared expert's launches on a second stream, eager and replayed from a captured graph (a branch of
    it), give the bits they give on one stream, and the layer matches the fp32 reference."""
    w = random_weights(288, 4096, 2048, device="cuda", seed=tokens + 5)
    x = torch.randn(tokens, 4096, device="cuda").to(torch.bfloat16)
    slots = torch.arange(tokens, device="cuda")
    plan = plan_moe(tokens, 4096, x.device, shared_side=True, **overrides)
    one = torch.full((tokens, 4096), float("nan"), dtype=torch.bfloat16, device="cuda")
    moe_forward(x, w, 8, 2.5, True, ROUTER_NORM_EPS, 10.0, plan, slots, out=one)
    assert rel(one, moe_reference(x.float(), w, 8, 2.5, True, ROUTER_NORM_EPS, 10.0, slots)) < 2e-2
    side = torch.cuda.Stream()
    two = torch.full_like(one, float("nan"))
    moe_forward(x, w, 8, 2.5, True, ROUTER_NORM_EPS, 10.0, plan, slots, out=two, side=side)
    torch.cuda.synchronize()
    assert torch.equal(one, two)
    two.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_forward(x, w, 8, 2.5, True, ROUTER_NORM_EPS, 10.0, plan, slots, out=two, side=side)
    two.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(one, two)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("tokens", [1, 333, 2048])
def test_prefill_real_shapes_bf16_against_fp32_reference(tokens):
    """The production prefill plan at real shapes (bf16 activations) against the fp32 reference."""
    w = random_weights(288, 4096, 2048, device="cuda", seed=tokens)
    x = torch.randn(tokens, 4096, device="cuda").to(torch.bfloat16)
    ids, weights = route_reference(x.float(), w.router, w.bias, 8, 2.5, True, ROUTER_NORM_EPS)
    want = moe_reference(x.float(), w, 8, 2.5, True, ROUTER_NORM_EPS, 10.0)
    assert rel(moe_prefill(x, ids, weights, w, 10.0), want) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_prefill_grouping_and_step_inputs_never_sync():
    """The prefill grouping and the step's host values on their way to the GPU queue no synchronisation (the
    GPU would run dry while the host builds the rest of the step)."""
    from glm5next.forward import to_device

    ids = torch.randint(0, 288, (333, 8), device="cuda")
    weights = torch.rand(333, 8, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        r = group_rows(ids, weights, 288, 64)
        staged = to_device(list(range(1000)), torch.int64, "cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert staged.tolist() == list(range(1000))
    assert int(r.n_slots) <= r.max_slots


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_graph_replay_reroutes_new_inputs():
    """A captured layer replayed on new inputs routes them afresh (no routing baked into the graph)."""
    tokens = 16
    w = random_weights(288, 4096, 2048, device="cuda", seed=5)
    plan = plan_moe(tokens, 4096, torch.device("cuda"))
    x = torch.randn(tokens, 4096, device="cuda").to(torch.bfloat16)
    slots = torch.arange(tokens, device="cuda")
    out = torch.empty(tokens, 4096, dtype=torch.bfloat16, device="cuda")
    moe_forward(x, w, 8, 2.5, True, ROUTER_NORM_EPS, 10.0, plan, slots, out=out)  # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_forward(x, w, 8, 2.5, True, ROUTER_NORM_EPS, 10.0, plan, slots, out=out)
    for seed in range(3):
        x.copy_(torch.randn(tokens, 4096, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
        slots[-1] = -1 if seed == 2 else tokens - 1
        graph.replay()
        eager = moe_forward(x, w, 8, 2.5, True, ROUTER_NORM_EPS, 10.0, plan, slots)
        assert torch.equal(out, eager)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("tokens", [1, 8, 33, 64])
def test_programmatic_dependent_launches_change_no_bit(tokens):
    """Captured behind the kernel that writes its input (so each launch's early start races the one before),
    the layer with programmatic-dependent launches gives the plain launches' output bit for bit, replay after
    replay on new inputs."""
    w = random_weights(288, 4096, 2048, device="cuda", seed=tokens)
    src = torch.randn(tokens, 4096, device="cuda").to(torch.bfloat16)
    slots = torch.arange(tokens, device="cuda")
    x = torch.empty_like(src)
    outs = {}
    graphs = {}
    for pdl in (False, True):
        plan = plan_moe(tokens, 4096, torch.device("cuda"), pdl=pdl)
        outs[pdl] = torch.full((tokens, 4096), float("nan"), dtype=torch.bfloat16, device="cuda")
        x.copy_(src)
        moe_forward(x, w, 8, 2.5, True, ROUTER_NORM_EPS, 10.0, plan, slots, out=outs[pdl])  # compiles
        graphs[pdl] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[pdl]):
            torch.mul(src, 1.0, out=x)  # the producer of the layer's input, inside the graph
            moe_forward(x, w, 8, 2.5, True, ROUTER_NORM_EPS, 10.0, plan, slots, out=outs[pdl])
    for seed in range(3):
        src.copy_(torch.randn(tokens, 4096, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
        for pdl in (False, True):
            outs[pdl].fill_(float("nan"))
            graphs[pdl].replay()
        assert torch.equal(outs[True], outs[False])
