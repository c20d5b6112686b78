"""Invariants of the KDA layer: its delta rule, its cache handling and its maths."""

from __future__ import annotations

import importlib.util
import inspect
import os

import pytest
import torch

from glm5next.config import KDA, Glm5NextConfig
from glm5next.model.kda import KimiDeltaAttention
from glm5next.model.kda_recurrence import kda_chunked, kda_recurrent
from glm5next.checkpoint.specs import install_random, set_param
from glm5next.forward import KdaState
from glm5next.runtime.metadata import build_metadata

from .hf_oracle import import_hf
from .kda_reference import SequenceState, reference_tokens

BLOCK = 1024
"""Paged-cache block size of the metadata (KDA reads no blocks; one block covers every test position)."""


# ---------------------------------------------------------------- helpers
def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make_config(heads: int = 2, head_dim: int = 16, conv: int = 4, hidden: int = 64) -> Glm5NextConfig:
    return Glm5NextConfig(
        hidden_size=hidden,
        num_hidden_layers=1,
        linear_num_heads=heads,
        linear_head_dim=head_dim,
        linear_conv_kernel_dim=conv,
        layer_kinds=(KDA,),
        moe_layers=(False,),
    )


def make_layer(config: Glm5NextConfig | None = None, dtype=torch.float32, seed: int = 0) -> KimiDeltaAttention:
    """A layer with random weights whose gates span strong to weak decay (so history matters)."""
    layer = KimiDeltaAttention(config or make_config(), layer_idx=0)
    install_random(layer.tensor_specs(layer.prefix), dtype, seed=seed, std=0.2)
    g = torch.Generator().manual_seed(seed + 1)
    width = layer.num_heads * layer.head_dim
    set_param(layer, "dt_bias", torch.empty(width).uniform_(-9.0, 1.0, generator=g))
    set_param(layer, "A_log", torch.randn(layer.num_heads, generator=g) * 0.5)
    set_param(layer, "o_norm_weight", (1.0 + 0.3 * torch.randn(layer.head_dim, generator=g)).to(dtype))
    for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
        set_param(layer, name, torch.randn(width, 1, layer.conv_kernel, generator=g) * 0.5)
    return layer


def new_state(layer: KimiDeltaAttention, slots: int, dtype=torch.float32, fill: float | None = 0.0) -> KdaState:
    """A KdaState of `slots` usable slots (+ scratch); `fill=None` fills with random values."""
    width = 3 * layer.num_heads * layer.head_dim
    d = layer.head_dim
    conv = torch.zeros(slots + 1, width, layer.conv_kernel - 1, dtype=dtype)
    rec = torch.zeros(slots + 1, layer.num_heads, d, d)
    if fill is None:
        g = torch.Generator().manual_seed(1234)
        conv.copy_(torch.randn(conv.shape, generator=g))
        rec.copy_(torch.randn(rec.shape, generator=g))
    else:
        conv.fill_(fill)
        rec.fill_(fill)
    return KdaState(conv=conv, recurrent=rec)


def inputs(tokens: int, hidden: int = 64, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)


def run(layer, x, state, query_lens, context_lens, num_decodes, state_indices) -> torch.Tensor:
    """The layer output of one step over sequences described host-side."""
    md = build_metadata(query_lens, context_lens, num_decodes, state_indices, [[0]] * len(query_lens), BLOCK, "cpu")
    with torch.no_grad():
        return layer(x, md, state)


def prefill(layer, x, state, slot: int, context: int = 0) -> torch.Tensor:
    return run(layer, x, state, [x.shape[0]], [context], 0, [slot])


def decode_tokens(layer, x, state, slot: int, context: int) -> torch.Tensor:
    """Outputs of feeding x [L, hidden] one decode step at a time."""
    outs = [run(layer, x[t : t + 1], state, [1], [context + t], 1, [slot]) for t in range(x.shape[0])]
    return torch.cat(outs)


def snapshot(state: KdaState) -> tuple[torch.Tensor, torch.Tensor]:
    return state.conv.clone(), state.recurrent.clone()


def touched_slots(before: tuple[torch.Tensor, torch.Tensor], state: KdaState) -> set[int]:
    """Slots whose conv window or recurrent state differs in any byte from `before`."""
    conv0, rec0 = before
    return {
        s
        for s in range(state.conv.shape[0])
        if not (torch.equal(conv0[s], state.conv[s]) and torch.equal(rec0[s], state.recurrent[s]))
    }


def assert_only_touched(before, state: KdaState, allowed: set[int]) -> None:
    extra = touched_slots(before, state) - allowed - {state.num_slots}  # the scratch slot may change
    assert not extra, f"slots {sorted(extra)} were written but belong to no sequence in the step"


def prepared_inputs(length: int, heads: int, dim: int, seed: int, strong_decay: bool = False):
    """Random delta-rule inputs (scaled unit q, unit k, v, g, beta) and a random initial state."""
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(length, heads, dim, generator=g), dim=-1) * dim**-0.5
    k = torch.nn.functional.normalize(torch.randn(length, heads, dim, generator=g), dim=-1)
    v = torch.randn(length, heads, dim, generator=g)
    if strong_decay:
        gate = torch.full((length, heads, dim), -5.0)
    else:
        gate = -5.0 * torch.sigmoid(torch.randn(length, heads, dim, generator=g) * 3 - 3)
    beta = torch.sigmoid(torch.randn(length, heads, generator=g))
    s0 = torch.randn(heads, dim, dim, generator=g) * 0.3
    return q, k, v, gate, beta, s0


def load_fla_naive():
    """fla-core's `naive_recurrent_kda`, loaded from its file so fla's GPU-oriented package init never runs."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("fla-core is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], "ops", "kda", "naive.py")
    mod_spec = importlib.util.spec_from_file_location("_fla_kda_naive", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod.naive_recurrent_kda


# ---------------------------------------------------------------- checkpoint tensors
def test_tensor_specs_name_every_checkpoint_tensor():
    layer = KimiDeltaAttention(make_config(heads=2, head_dim=16), layer_idx=5)
    assert layer.prefix == "layers.5.self_attn"
    specs = layer.tensor_specs("model.language_model.layers.5.self_attn")
    p = "model.language_model.layers.5.self_attn."
    want = {
        "q_proj.weight": (32, 64), "k_proj.weight": (32, 64), "v_proj.weight": (32, 64),
        "q_conv1d.weight": (32, 1, 4), "k_conv1d.weight": (32, 1, 4), "v_conv1d.weight": (32, 1, 4),
        "b_proj.weight": (2, 64), "f_a_proj.weight": (16, 64), "f_b_proj.weight": (32, 16),
        "g_a_proj.weight": (16, 64), "g_b_proj.weight": (32, 16), "A_log": (2,), "dt_bias": (32,),
        "o_norm.weight": (16,), "o_proj.weight": (64, 32),
    }  # fmt: skip
    assert {k: v.shape for k, v in specs.items()} == {p + k: v for k, v in want.items()}
    fp32 = {k[len(p) :] for k, v in specs.items() if v.keep_fp32}
    assert fp32 == {"q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "A_log", "dt_bias"}


def test_install_replaces_every_meta_parameter_and_keeps_fp32_tensors():
    layer = KimiDeltaAttention(make_config(), layer_idx=0)
    assert all(p.is_meta for p in layer.parameters())
    install_random(layer.tensor_specs(layer.prefix), torch.bfloat16, seed=0)
    assert not any(p.is_meta for p in layer.parameters())
    assert layer.q_conv1d.dtype == layer.A_log.dtype == layer.dt_bias.dtype == torch.float32
    assert layer.q_proj.weight.dtype == layer.o_norm_weight.dtype == torch.bfloat16


# ---------------------------------------------------------------- the delta rule
@pytest.mark.parametrize("length", [1, 5, 70], ids=lambda n: f"len{n}")
def test_recurrent_matches_fla_naive(length):
    naive = load_fla_naive()
    heads, dim = 3, 16
    q, k, v, g, beta, s0 = prepared_inputs(length, heads, dim, seed=length)
    out, state = kda_recurrent(q, k, v, g, beta, s0)
    q_unscaled = q * dim**0.5  # fla applies the query scale itself (and no L2 norm)
    ref_out, ref_state = naive(
        q_unscaled[None], k[None], v[None], g[None], beta[None],
        scale=dim**-0.5, initial_state=s0[None], output_final_state=True,
    )  # fmt: skip
    assert rel_err(out, ref_out[0]) <= 1e-5
    assert rel_err(state, ref_state[0]) <= 1e-5


@pytest.mark.parametrize(
    "length,strong",
    [(1, False), (63, False), (64, False), (65, False), (130, False), (130, True)],
    ids=["len1", "len63", "len64", "len65", "len130", "len130-gates-at-lower-bound"],
)
def test_chunked_matches_recurrent(length, strong):
    q, k, v, g, beta, s0 = prepared_inputs(length, heads=2, dim=32, seed=7 + length, strong_decay=strong)
    out_r, state_r = kda_recurrent(q, k, v, g, beta, s0)
    out_c, state_c = kda_chunked(q, k, v, g, beta, s0)
    assert torch.isfinite(out_c).all() and torch.isfinite(state_c).all()
    assert rel_err(out_c, out_r) <= 1e-5
    assert rel_err(state_c, state_r) <= 1e-5


def test_chunked_does_not_modify_its_initial_state():
    q, k, v, g, beta, s0 = prepared_inputs(70, heads=2, dim=16, seed=3)
    before = s0.clone()
    kda_chunked(q, k, v, g, beta, s0)
    assert torch.equal(s0, before)


# ---------------------------------------------------------------- the layer: cache invariants
def test_prefill_then_token_by_token_decode_matches_one_prefill():
    layer = make_layer()
    x = inputs(82, seed=1)
    full_state = new_state(layer, 2)
    out_full = prefill(layer, x, full_state, slot=1)

    state = new_state(layer, 2)
    out_head = prefill(layer, x[:70], state, slot=1)
    out_tail = decode_tokens(layer, x[70:], state, slot=1, context=70)
    out = torch.cat([out_head, out_tail])
    assert rel_err(out, out_full) <= 1e-4
    assert rel_err(state.recurrent[1], full_state.recurrent[1]) <= 1e-4
    assert rel_err(state.conv[1], full_state.conv[1]) <= 1e-6


@pytest.mark.parametrize(
    "chunks", [[70, 1, 2, 77], [64, 64, 22], [3, 147]], ids=["70+1+2+77", "64+64+22", "3+147"]
)
def test_chunked_prefill_matches_one_shot_prefill(chunks):
    layer = make_layer(seed=2)
    x = inputs(sum(chunks), seed=2)
    one = new_state(layer, 1)
    out_one = prefill(layer, x, one, slot=0)

    state = new_state(layer, 1)
    outs, done = [], 0
    for n in chunks:
        outs.append(prefill(layer, x[done : done + n], state, slot=0, context=done))
        done += n
    assert rel_err(torch.cat(outs), out_one) <= 1e-4
    assert rel_err(state.recurrent[0], one.recurrent[0]) <= 1e-5
    assert rel_err(state.conv[0], one.conv[0]) <= 1e-6


def test_fresh_prefill_ignores_whatever_its_slot_holds():
    layer = make_layer(seed=3)
    x = inputs(20, seed=3)
    clean = new_state(layer, 1)
    dirty = new_state(layer, 1, fill=float("nan"))
    assert torch.equal(prefill(layer, x, dirty, slot=0), prefill(layer, x, clean, slot=0))


def test_mixed_batch_matches_each_sequence_alone():
    layer = make_layer(seed=4)
    histories = {2: 5, 0: 1, 5: 66, 1: 20}  # slot -> tokens already cached
    state = new_state(layer, 6)
    for slot, n in histories.items():
        prefill(layer, inputs(n, seed=100 + slot), state, slot=slot)
    state.conv[3].fill_(float("nan"))  # the fresh prefill's slot holds garbage
    state.recurrent[3].fill_(float("nan"))
    before = snapshot(state)

    # Three decodes (slots 2, 0, 5), a fresh prefill of 9 (slot 3), a continuation of 70 (slot 1).
    decode_slots = [2, 0, 5]
    query_lens = [1, 1, 1, 9, 70]
    context_lens = [histories[2], histories[0], histories[5], 0, histories[1]]
    slots = decode_slots + [3, 1]
    x = inputs(sum(query_lens), seed=5)
    out = run(layer, x, state, query_lens, context_lens, 3, slots)

    starts = [0, 1, 2, 3, 12, 82]
    for i, slot in enumerate(slots):
        alone = KdaState(conv=before[0].clone(), recurrent=before[1].clone())
        xs = x[starts[i] : starts[i + 1]]
        out_alone = run(layer, xs, alone, [query_lens[i]], [context_lens[i]], 1 if i < 3 else 0, [slot])
        assert rel_err(out[starts[i] : starts[i + 1]], out_alone) <= 1e-5, f"sequence {i} (slot {slot})"
        assert rel_err(state.recurrent[slot], alone.recurrent[slot]) <= 1e-5
        assert rel_err(state.conv[slot], alone.conv[slot]) <= 1e-6
    assert_only_touched(before, state, set(slots))


def _decode_with_padding(layer, state):
    """Two real decode rows (slots 1, 4) and two padding rows; returns their outputs [4, hidden]."""
    x = inputs(4, seed=9)
    return run(layer, x, state, [1, 1, 1, 1], [5, 7, 0, 0], 4, [1, -1, 4, -1])


def test_padded_decode_rows_leave_every_real_slot_untouched():
    layer = make_layer(seed=6)
    state = new_state(layer, 6, fill=None)
    before = snapshot(state)
    out = _decode_with_padding(layer, state)

    assert touched_slots(before, state) >= {1, 4}
    assert_only_touched(before, state, {1, 4})
    # The real rows get what they would get without the padding rows.
    plain = KdaState(conv=before[0].clone(), recurrent=before[1].clone())
    x = inputs(4, seed=9)
    ref = run(layer, x[[0, 2]], plain, [1, 1], [5, 0], 2, [1, 4])
    assert rel_err(out[[0, 2]], ref) <= 1e-6
    assert rel_err(state.conv[[1, 4]], plain.conv[[1, 4]]) <= 1e-6  # batch size may change GEMM rounding


def test_counterexample_padding_redirected_to_a_real_slot_is_caught():
    layer = make_layer(seed=6)
    state = new_state(layer, 6, fill=None)
    before = snapshot(state)
    # A broken redirection: padding rows land in real slot 0 instead of the scratch slot.
    state.slots = lambda idx: torch.where(idx < 0, torch.zeros_like(idx), idx)
    _decode_with_padding(layer, state)
    assert 0 in touched_slots(before, state)
    with pytest.raises(AssertionError, match=r"slots \[0\]"):
        assert_only_touched(before, state, {1, 4})


def test_multi_token_verify_needs_its_scratch():
    """A verify step of q tokens per row needs the state's verify scratch (a cache built for it)."""
    layer = make_layer()
    state = new_state(layer, 1)
    with pytest.raises(RuntimeError, match="verify_tokens"):
        run(layer, inputs(2), state, [2], [3], 1, [0])


# ---------------------------------------------------------------- the layer: maths
@pytest.mark.parametrize(
    "heads,head_dim,conv",
    [(2, 16, 4), (3, 8, 2)],
    ids=["h2-k16-conv4", "h3-k8-conv2"],
)
def test_layer_matches_per_token_spec_reference(heads, head_dim, conv):
    layer = make_layer(make_config(heads=heads, head_dim=head_dim, conv=conv), seed=8)
    x = inputs(75, seed=8)
    state = new_state(layer, 2)
    out = torch.cat([prefill(layer, x[:68], state, slot=1), decode_tokens(layer, x[68:], state, slot=1, context=68)])

    seq = SequenceState.zeros(layer)
    ref = reference_tokens(layer, x, seq)
    assert rel_err(out[:68], ref[:68]) <= 1e-4, "prefill"
    assert rel_err(out[68:], ref[68:]) <= 1e-4, "decode"
    assert rel_err(state.recurrent[1], seq.recurrent()) <= 1e-4
    assert rel_err(state.conv[1], seq.conv_window()) <= 1e-6


def test_bf16_layer_stays_close_to_the_fp32_spec_reference():
    layer = make_layer(dtype=torch.bfloat16, seed=10)
    x = inputs(40, seed=10, dtype=torch.bfloat16)
    state = new_state(layer, 1, dtype=torch.bfloat16)
    out = torch.cat([prefill(layer, x[:30], state, slot=0), decode_tokens(layer, x[30:], state, slot=0, context=30)])
    assert out.dtype == torch.bfloat16 and state.conv.dtype == torch.bfloat16
    ref = reference_tokens(layer, x.float(), SequenceState.zeros(layer))
    assert rel_err(out, ref) <= 2e-2


# ---------------------------------------------------------------- the layer vs transformers
def _hf_layer(layer: KimiDeltaAttention, monkeypatch, dtype):
    """transformers' eager KDA module holding `layer`'s weights, forced onto its torch code paths."""
    import_hf()  # imports transformers' modeling code with fla hidden, so KDA stays on torch code paths
    from transformers.models.glm5_next import modeling_glm5_next as hf
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

    # Should the module have been imported elsewhere with fla visible, its Triton routing is undone here.
    for name in ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn", "causal_conv1d_update"):
        monkeypatch.setattr(hf, name, inspect.unwrap(getattr(hf, name)))
    cfg = Glm5NextTextConfig(
        hidden_size=layer.hidden_size, num_hidden_layers=1, linear_num_heads=layer.num_heads,
        linear_head_dim=layer.head_dim, linear_conv_kernel_dim=layer.conv_kernel,
        layer_types=["linear_attention"], mlp_layer_types=["dense"], rms_norm_eps=layer.norm_eps,
    )  # fmt: skip
    ref = hf.Glm5NextTextLinearAttention(cfg, 0).to(dtype)
    sd = {
        "q_proj.weight": layer.q_proj.weight, "k_proj.weight": layer.k_proj.weight,
        "v_proj.weight": layer.v_proj.weight, "b_proj.weight": layer.b_proj.weight,
        "forget_gate.f_a_proj.weight": layer.f_a_proj.weight, "forget_gate.f_b_proj.weight": layer.f_b_proj.weight,
        "g_a_proj.weight": layer.g_a_proj.weight, "g_b_proj.weight": layer.g_b_proj.weight,
        "o_proj.weight": layer.o_proj.weight, "o_norm.weight": layer.o_norm_weight,
    }  # fmt: skip
    with torch.no_grad():
        for k, v in sd.items():
            ref.get_parameter(k).copy_(v)
    # transformers keeps these fp32 in a bf16 model (_keep_in_fp32_modules_strict).
    ref.conv1d.weight = torch.nn.Parameter(torch.cat([layer.q_conv1d, layer.k_conv1d, layer.v_conv1d]).float())
    ref.forget_gate.A_log = torch.nn.Parameter(layer.A_log.float())
    ref.forget_gate.dt_bias = torch.nn.Parameter(layer.dt_bias.float())
    return ref


# The bf16 casting points match transformers', so only op-order rounding may remain (none on CPU);
# moving one cast (e.g. beta's sigmoid or the conv's SiLU into fp32/bf16) costs 3e-3 to 6e-3.
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-3)], ids=["fp32", "bf16"])
def test_prefill_matches_transformers(dtype, tol, monkeypatch):
    layer = make_layer(dtype=dtype, seed=11)
    ref = _hf_layer(layer, monkeypatch, dtype)
    x = inputs(70, seed=11, dtype=dtype)
    out = prefill(layer, x, new_state(layer, 1, dtype=dtype), slot=0)
    with torch.no_grad():
        want = ref(x[None])[0]
    assert out.dtype == want.dtype == dtype
    assert rel_err(out, want) <= tol


# ---------------------------------------------------------------- CUDA prefill (bf16 through the fused chunked kernel)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_prefill_then_decode_matches_decoding_from_the_start_in_bf16():
    """Over 2048 tokens on a bf16 layer at the model's head width: prefill chunks (a fresh one, a
    one-token one, a continuation) through the fused chunked kernel, then decode, against decoding every
    token from the start (the stock decode step): outputs and state within the bf16 bar."""
    dev = torch.device("cuda")
    layer = make_layer(make_config(heads=4, head_dim=128, hidden=256), dtype=torch.bfloat16, seed=5).to(dev)
    x = inputs(2048, hidden=256, seed=5, dtype=torch.bfloat16).to(dev)

    def step(x, state, context, decode):
        md = build_metadata([x.shape[0]], [context], int(decode), [0], [[0]], 4096, dev)
        with torch.no_grad():
            return layer(x, md, state)

    def fresh_state():
        s = new_state(layer, 1, dtype=torch.bfloat16, fill=float("nan"))
        return KdaState(conv=s.conv.to(dev), recurrent=s.recurrent.to(dev))

    want_state = fresh_state()
    want_state.conv.zero_()  # decoding from the start: an empty history
    want_state.recurrent.zero_()
    want = torch.cat([step(x[t : t + 1], want_state, t, True) for t in range(2048)])
    state, outs, done = fresh_state(), [], 0
    for n in (1500, 1, 500):
        outs.append(step(x[done : done + n], state, done, False))
        done += n
    outs += [step(x[t : t + 1], state, t, True) for t in range(done, 2048)]
    assert rel_err(torch.cat(outs), want) <= 2e-2
    assert rel_err(state.recurrent[0], want_state.recurrent[0]) <= 2e-2
    assert torch.equal(state.conv[0], want_state.conv[0])


@pytest.mark.parametrize("head_dim", [16, 24])
def test_prefill_on_the_kernels_equals_the_stock_prefill(monkeypatch, head_dim):
    """`_prefill_on_kernels` (what a 16-bit step with prefill rows runs on a GPU: the inputs launch, one delta-rule
    call over every sequence, the gated-norm launch) on the CPU, fp32, with the delta-rule call played by its
    reference: a mixed step — two decodes, a fresh prompt over a NaN-filled slot, a continuation shorter than
    the conv window and a long one — equals the stock step in outputs, conv windows and recurrent states; a
    head width of 24 pads the kernels' channel tiles."""
    from glm5next.kernels.kda.reference import kda_prefill_reference
    from glm5next.model import kda as kda_module

    layer = make_layer(make_config(head_dim=head_dim), seed=6)
    histories = {2: 5, 0: 1, 4: 3, 1: 20}
    state = new_state(layer, 6)
    for slot, n in histories.items():
        prefill(layer, inputs(n, seed=200 + slot), state, slot=slot)
    state.conv[3].fill_(float("nan"))
    state.recurrent[3].fill_(float("nan"))
    query_lens, slots = [1, 1, 9, 2, 70], [2, 0, 3, 4, 1]
    context_lens = [histories[2], histories[0], 0, histories[4], histories[1]]
    x = inputs(sum(query_lens), seed=7)
    stock_state = KdaState(conv=state.conv.clone(), recurrent=state.recurrent.clone())
    want = run(layer, x, stock_state, query_lens, context_lens, 2, slots)
    calls = []

    def reference(q, k, v, g, beta, initial, cu, cu_host, lower_bound, dtype):
        assert torch.equal(cu_host, cu.cpu()) and not cu_host.is_cuda
        calls.append(cu.tolist())
        return kda_prefill_reference(q, k, v, g, beta, initial, cu, lower_bound)

    monkeypatch.setattr(kda_module, "kda_prefill", reference)
    monkeypatch.setattr(KimiDeltaAttention, "runs_prefill_kernels", staticmethod(lambda x, md: md.num_prefills > 0))
    got = run(layer, x, state, query_lens, context_lens, 2, slots)
    assert calls == [[0, 9, 11, 81]]  # one call over the three prefill sequences
    assert rel_err(got, want) <= 1e-5
    for slot in slots:
        assert rel_err(state.recurrent[slot], stock_state.recurrent[slot]) <= 1e-5
        assert rel_err(state.conv[slot], stock_state.conv[slot]) <= 1e-6
