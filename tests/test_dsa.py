"""The DSA layer: spec reference, transformers oracle, and the paged-cache invariants."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from glm5next.config import DSA, Glm5NextConfig
from glm5next.model import dsa
from glm5next.model.dsa import SparseMLA
from glm5next.model.indexer import top_pools
from glm5next.checkpoint.specs import install_random
from glm5next.forward import DsaCache
from glm5next.runtime.metadata import build_metadata
from tests.dsa_reference import reference_dsa
from .hf_oracle import hf_modeling

SIZES = dict(
    hidden_size=64, num_attention_heads=2, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16,
    index_n_heads=2, index_head_dim=16, index_topk=16, index_kpool=4,
)
TOPK_TOKENS = 16 + 3
"""Context length up to which every visible token is selected (index_topk + kpool - 1)."""
BS = 8
"""Paged-cache block size of the tests."""


def small_config() -> Glm5NextConfig:
    """A one-layer config with the test sizes."""
    return Glm5NextConfig(vocab_size=128, num_hidden_layers=1, layer_kinds=(DSA,), moe_layers=(False,), **SIZES)


def make_layer(dtype=torch.float32, seed=0) -> SparseMLA:
    """A SparseMLA with seeded random weights (std 0.3, so indexer scores are far from zero)."""
    layer = SparseMLA(small_config(), 0)
    install_random(layer.tensor_specs(layer.prefix), dtype, seed=seed, std=0.3)
    return layer


def make_cache(num_blocks=16, dtype=torch.float32) -> DsaCache:
    """A NaN-filled DsaCache (so rows read before being written poison the output)."""
    c = small_config()
    shapes = [(BS, c.kv_lora_rank), (BS, c.index_head_dim), (BS, c.index_head_dim), (BS // 4, c.index_head_dim)]
    return DsaCache(*(torch.full((num_blocks + 1, *s), float("nan"), dtype=dtype) for s in shapes))


def inputs(n, seed=1, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(n, SIZES["hidden_size"], generator=torch.Generator().manual_seed(seed)).to(dtype)


def run(layer, cache, x, query_lens, context_lens, tables, num_decodes=0, states=None, **kw):
    """The layer's output for one step over `x` `[sum(query_lens), hidden]`."""
    states = list(range(len(query_lens))) if states is None else states
    md = build_metadata(query_lens, context_lens, num_decodes, states, tables, BS, "cpu", **kw)
    return layer(x, md, cache)


def decode_each(layer, cache, x, table, start=0):
    """Outputs of feeding x's rows one decode step at a time after `start` cached tokens."""
    return torch.cat([run(layer, cache, x[i : i + 1], [1], [start + i], [table], 1) for i in range(len(x))])


def rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


TABLE = [5, 2, 7, 0, 3, 1, 9, 4]
"""A non-contiguous block table for one sequence (up to 64 tokens)."""


@pytest.mark.parametrize("n", [11, 41], ids=["below_topk", "pools_dropped"])
def test_prefill_and_decode_match_spec_reference(n):
    layer, x = make_layer(), inputs(n)
    want, chosen, _ = reference_dsa(layer, x)
    # Pools are really dropped (some token attends to a strict subset of its causal prefix) iff n > topk + 3.
    dropped = any(len(pools) * 4 + (t + 1) % 4 < t + 1 for t, pools in enumerate(chosen))
    assert dropped == (n > TOPK_TOKENS)

    md = build_metadata([n], [0], 0, [0], [TABLE], BS, "cpu")
    out, sel = layer(x, md, make_cache(), return_selection=True)
    assert rel(out, want) <= 1e-4
    for t in range(n):
        assert [int(p) for p in sel[t] if p >= 0] == chosen[t], t
    assert rel(decode_each(layer, make_cache(), x, TABLE), want) <= 1e-4


def _hf_attention(layer: SparseMLA, dtype):
    """transformers' Glm5NextTextAttention with `layer`'s weights, and its config (fla hidden)."""
    hf = hf_modeling()
    Glm5NextTextConfig = hf.Glm5NextTextConfig
    cfg = Glm5NextTextConfig(
        vocab_size=128, pad_token_id=0, num_hidden_layers=1, num_key_value_heads=2, qk_rope_head_dim=0,
        layer_types=["indexed_attention"], mlp_layer_types=["dense"], **SIZES,
    )
    cfg._attn_implementation = "eager"
    attn = hf.Glm5NextTextAttention(cfg, 0).to(dtype).eval()
    attn.load_state_dict({n: p.detach().clone() for n, p in layer.named_parameters()}, strict=True)
    return attn, cfg


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_matches_transformers_prefill_and_cached_decode(dtype, tol):
    from transformers.cache_utils import DynamicCache

    n, n_prefill = 41, 22
    layer = make_layer(dtype, seed=6)
    # transformers' torch.topk breaks equal scores arbitrarily: use positive head weights and a seed whose
    # scores are tie-free at every selection boundary (ReLU zeros would otherwise tie).
    layer.indexer.weights_proj.weight.abs_()
    x = inputs(n, seed=4).abs().to(dtype)
    _, chosen, scores = reference_dsa(layer, x)
    for t, s in enumerate(scores):
        s = sorted(s, reverse=True)
        assert len(s) <= 4 or s[3] - s[4] > 1e-3 * s[0], f"tie at the selection boundary of token {t}"
    hf_attn, hf_cfg = _hf_attention(layer, dtype)
    past = DynamicCache(config=hf_cfg)
    with torch.no_grad():
        want = [hf_attn(x[None, :n_prefill], torch.ones(1, n_prefill, dtype=torch.bool), past)[0][0]]
        for t in range(n_prefill, n):
            want.append(hf_attn(x[None, t : t + 1], torch.ones(1, 1, dtype=torch.bool), past)[0][0])
    want = torch.cat(want)

    cache = make_cache(dtype=dtype)
    got = run(layer, cache, x[:n_prefill], [n_prefill], [0], [TABLE])
    got = torch.cat([got, decode_each(layer, cache, x[n_prefill:], TABLE, start=n_prefill)])
    assert got.dtype == dtype
    assert rel(got, want) <= tol


def test_incremental_decode_equals_full_prefill():
    layer, x = make_layer(seed=4), inputs(37, seed=5)
    full = run(layer, make_cache(), x, [37], [0], [TABLE])
    assert rel(decode_each(layer, make_cache(), x, TABLE), full) <= 1e-5


def test_chunked_prefill_equals_one_shot(monkeypatch):
    layer, x = make_layer(seed=6), inputs(41, seed=7)
    full = run(layer, make_cache(), x, [41], [0], [TABLE])
    monkeypatch.setattr(dsa, "MAX_PREFILL_CHUNK", 3)  # host-side query chunks inside one call
    assert rel(run(layer, make_cache(), x, [41], [0], [TABLE]), full) <= 1e-5
    cache, outs, done = make_cache(), [], 0
    for size in (5, 7, 11, 3, 15):
        outs.append(run(layer, cache, x[done : done + size], [size], [done], [TABLE]))
        done += size
    assert rel(torch.cat(outs), full) <= 1e-5


def test_mixed_batch_equals_each_sequence_alone():
    layer = make_layer(seed=8)
    # (context, query tokens, block table): two decodes then two prefills, one of them a later chunk.
    seqs = [(30, 1, [11, 3, 14, 6]), (9, 1, [2, 9]), (0, 13, [7, 0]), (17, 6, [15, 1, 12, 5])]
    xs = [inputs(c + q, seed=20 + i) for i, (c, q, _) in enumerate(seqs)]
    cache = make_cache(num_blocks=16)
    for (c, _, table), x in zip(seqs, xs):
        if c:
            run(layer, cache, x[:c], [c], [0], [table])
    alone_cache = copy.deepcopy(cache)
    alone = [run(layer, alone_cache, x[c:], [q], [c], [t], 1 if i < 2 else 0) for i, ((c, q, t), x) in enumerate(zip(seqs, xs))]

    step_x = torch.cat([x[c:] for (c, _, _), x in zip(seqs, xs)])
    batched = run(layer, cache, step_x, [q for _, q, _ in seqs], [c for c, _, _ in seqs], [t for _, _, t in seqs], 2, max_blocks=6)
    assert rel(batched, torch.cat(alone)) <= 1e-5
    for name in ("latent", "index_key", "index_gate", "pooled_key"):
        a, b = getattr(cache, name)[:-1], getattr(alone_cache, name)[:-1]
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True), name


def changed_rows(before: DsaCache, after: DsaCache) -> set[tuple[str, int]]:
    """(tensor name, flat row) of every real (non-scratch) cache row whose bytes differ."""
    changed = set()
    for name in ("latent", "index_key", "index_gate", "pooled_key"):
        a, b = (getattr(c, name)[:-1].flatten(0, 1).view(torch.uint8) for c in (before, after))
        changed |= {(name, int(r)) for r in (a != b).any(-1).nonzero().flatten()}
    return changed


REAL_SLOT = TABLE[0] * BS + 6
"""Cache row of the real decode token (position 6) of the padding tests."""


def _padded_step(bad_slot: int | None = None):
    """Changed real cache rows and the real token's output after a decode step of one real sequence
    (context 6) beside one padding row at position 3 (which would complete a pool); `bad_slot` makes
    the padding row write there instead of being skipped."""
    layer, x = make_layer(seed=9), inputs(7, seed=10)
    cache = make_cache()
    run(layer, cache, x[:6], [6], [0], [TABLE])
    before = copy.deepcopy(cache)
    md = build_metadata([1, 1], [6, 3], 2, [0, -1], [TABLE, []], BS, "cpu")
    if bad_slot is not None:
        md = dataclasses.replace(md, slot_mapping=torch.tensor([REAL_SLOT, bad_slot]))
    out = layer(torch.cat([x[6:], inputs(1, seed=11)]), md, cache)
    alone = run(layer, before, x[6:], [1], [6], [TABLE], 1)
    return changed_rows(before, cache), out[0], alone[0]


def test_padded_rows_leave_real_cache_rows_byte_identical():
    changed, out, alone = _padded_step()
    assert changed == {("latent", REAL_SLOT), ("index_key", REAL_SLOT), ("index_gate", REAL_SLOT)}
    assert rel(out, alone) <= 1e-6


def test_padded_row_writing_a_real_slot_is_caught():
    changed, _, _ = _padded_step(bad_slot=TABLE[0] * BS + 7)
    assert changed != {("latent", REAL_SLOT), ("index_key", REAL_SLOT), ("index_gate", REAL_SLOT)}
    assert ("pooled_key", (TABLE[0] * BS + 7) // 4) in changed


def test_reused_selection_reproduces_the_step():
    layer, x = make_layer(seed=12), inputs(30, seed=13)
    cache = make_cache()
    run(layer, cache, x[:29], [29], [0], [TABLE])
    md = build_metadata([1], [29], 1, [0], [TABLE], BS, "cpu")
    again = copy.deepcopy(cache)
    out, sel = layer(x[29:], md, cache, return_selection=True)
    assert sel.shape == (1, 4) and (sel >= 0).all()
    assert torch.equal(layer(x[29:], md, copy.deepcopy(again), selection=sel), out)
    other = torch.tensor([[p for p in range(7) if p not in sel[0].tolist()][:4]])
    assert not torch.allclose(layer(x[29:], md, again, selection=other), out)


def test_top_pools_breaks_ties_towards_lower_pools():
    scores = torch.tensor([[0.0, 2.0, -0.0, 0.0, 2.0, 1.0, 0.0]])
    valid = torch.tensor([[True, True, True, True, True, True, False]])
    assert top_pools(scores, valid, 4).tolist() == [[1, 4, 5, 0]]
    assert top_pools(scores, torch.zeros_like(valid), 2).tolist() == [[-1, -1]]
