"""Invariants of the stock backbone over the paged caches."""

import pytest
import torch

from glm5next.checkpoint.fp8 import dequantize_fp8
from glm5next.forward import CUDAGraphMode, ForwardContext
from glm5next.runtime.cache import allocate_cache
from glm5next.runtime.metadata import build_metadata
from glm5next.runtime.runner import Runner, Sequence


def new_runner(model, blocks=96, slots=4, block_size=8):
    cache = allocate_cache(model.config, blocks, block_size, slots, torch.float32, "cpu")
    return Runner(model, cache)


def prompt(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def generate_logits(runner, seq, follow, chunk=None):
    out = [runner.step([seq], chunk)]
    while seq.num_cached < len(seq.token_ids):
        out = [runner.step([seq], chunk)]
    for tok in follow:
        seq.token_ids.append(tok)
        out.append(runner.step([seq]))
    return torch.cat(out)


def test_incremental_decode_equals_full_recompute(tiny_fp32):
    p, follow = prompt(30, 1), prompt(14, 2)
    inc = generate_logits(new_runner(tiny_fp32), Sequence(list(p), 0, list(range(12))), follow)
    full = []
    for n in range(len(p), len(p) + len(follow) + 1):
        seq = Sequence((p + follow)[:n], 0, list(range(12)))
        full.append(new_runner(tiny_fp32).step([seq]))
    full = torch.cat(full)
    assert torch.allclose(inc, full, rtol=1e-4, atol=1e-4 * full.abs().max())


@pytest.mark.parametrize("chunk", [5, 13, 32], ids=lambda c: f"chunk{c}")
def test_chunked_prefill_equals_one_shot(tiny_fp32, chunk):
    p = prompt(61, 3)
    one = generate_logits(new_runner(tiny_fp32), Sequence(list(p), 0, list(range(10))), [7, 9])
    chunked = generate_logits(new_runner(tiny_fp32), Sequence(list(p), 0, list(range(10))), [7, 9], chunk)
    assert torch.allclose(one, chunked, rtol=1e-4, atol=1e-4 * one.abs().max())


def test_fused_boundaries_equal_the_stock_layers(tiny_fp32):
    """`forward_fused` (the mHC on the boundary kernels: what an eager 16-bit step on a GPU runs) on a mixed
    step — a decode row and two prompts — equals `forward_stock` and writes the same caches."""
    model = tiny_fp32
    lens, contexts = [1, 17, 30], [12, 0, 0]
    runs = []
    for forward in (model.forward_stock, model.forward_fused):
        cache = allocate_cache(model.config, 24, 8, 4, torch.float32, "cpu")
        r = Runner(model, cache)
        md = build_metadata(lens, contexts, 1, [0, 1, 2], [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], 8, "cpu")
        ctx = ForwardContext({p: md for p in r.prefixes}, md.positions, CUDAGraphMode.NONE)
        ids = torch.randint(0, 256, (sum(lens),), generator=torch.Generator().manual_seed(8))
        with torch.no_grad():
            runs.append((forward(model.embed(ids), ctx, cache), cache))
    (want, want_cache), (got, got_cache) = runs
    assert not model.runs_fused_boundaries(want, ctx)  # the CPU's eager steps stay on the stock layers
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max())
    for i, b in want_cache.kda.items():
        a = got_cache.kda[i]
        assert torch.allclose(a.recurrent, b.recurrent, rtol=1e-4, atol=1e-4 * b.recurrent.abs().max())
    for i, b in want_cache.dsa.items():
        a = got_cache.dsa[i]
        assert torch.allclose(a.latent, b.latent, rtol=1e-4, atol=1e-4 * b.latent.abs().max())


def test_a_cast_fp8_weight_is_refused(tiny_fp32):
    """Module.to(dtype) turns an FP8 weight into a plain one beside its block scales; the layer says so rather
    than computing with the unscaled codes."""
    import copy

    layer = copy.deepcopy(tiny_fp32.layers[3].self_attn.q_b_proj)
    assert layer.is_fp8
    layer.to(torch.bfloat16)
    with pytest.raises(ValueError, match="an FP8 weight was cast"):
        layer(torch.zeros(2, layer.in_features, dtype=torch.bfloat16))


def test_mixed_batch_equals_each_alone(tiny_fp32):
    """Two sequences decode while two others prefill in the same step."""
    prompts = [prompt(n, 10 + n) for n in (40, 9, 23, 50)]
    follows = [[11, 12, 13], [11, 12, 13], [12, 13], [12, 13]]
    blocks = [list(range(3 + 10 * i, 13 + 10 * i)) for i in range(4)]
    alone = [
        generate_logits(new_runner(tiny_fp32), Sequence(list(p), 0, list(b)), f)
        for p, b, f in zip(prompts, blocks, follows)
    ]
    r = new_runner(tiny_fp32)
    seqs = [Sequence(list(p), i, list(b)) for i, (p, b) in enumerate(zip(prompts, blocks))]
    got = [[] for _ in seqs]
    logits = r.step(seqs[:2])
    got[0].append(logits[0:1])
    got[1].append(logits[1:2])
    for s in seqs[:2]:
        s.token_ids.append(11)
    for tok in (None, 12, 13):
        if tok is not None:
            for s in seqs:
                s.token_ids.append(tok)
        logits = r.step(seqs)
        for i in range(4):
            got[i].append(logits[i : i + 1])
    for mine, ref in zip(got, alone):
        assert torch.allclose(torch.cat(mine), ref, rtol=1e-4, atol=1e-4 * ref.abs().max())


def snapshot(cache, skip_slot=0, skip_row=None):
    """Every real (non-scratch) cache row except the KDA slot `skip_slot` and the
    paged token row `skip_row` (the real sequence's own state)."""
    rows = []
    for c in cache.dsa.values():
        for t in (c.latent, c.index_key, c.index_gate, c.pooled_key):
            flat = t[:-1].reshape(-1, t.shape[-1]).clone()
            if skip_row is not None and t is not c.pooled_key:
                flat[skip_row] = 0
            rows.append(flat)
    for s in cache.kda.values():
        for t in (s.conv, s.recurrent):
            rows.append(torch.cat([t[:skip_slot], t[skip_slot + 1 : -1]]).clone())
    return rows


def decode_with_padding(model, pad_slot, pad_block):
    """Caches before and after one decode step of a real sequence (slot 0, position 12,
    paged row 8 + 4) beside a padding row given `pad_slot` / `pad_block`."""
    r = new_runner(model)
    seq = Sequence(prompt(12, 4), 0, [0, 1, 2])
    r.step([seq])
    before = snapshot(r.cache, skip_row=12)
    md = build_metadata([1, 1], [12, 12], 2, [0, pad_slot], [[0, 1, 2], [pad_block, 4, 5]], 8, "cpu")
    if pad_slot < 0:
        md.slot_mapping[1] = -1
    ctx = ForwardContext({p: md for p in r.prefixes}, md.positions, CUDAGraphMode.FULL)
    with torch.inference_mode():
        model(torch.tensor([5, 77]), ctx, r.cache)
    return before, snapshot(r.cache, skip_row=12)


def test_padded_rows_leave_caches_untouched(tiny_fp32):
    before, after = decode_with_padding(tiny_fp32, -1, 3)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_padding_check_catches_a_writing_row(tiny_fp32):
    """Counter-example: a 'padding' row given real slot 1 and block 3 does write."""
    before, after = decode_with_padding(tiny_fp32, 1, 3)
    assert not all(torch.equal(a, b) for a, b in zip(before, after))


def test_graph_safe_moe_equals_sparse_moe(tiny_fp32):
    moe = next(layer.mlp for layer in tiny_fp32.layers if layer.mlp_is_moe)
    x = torch.randn(7, tiny_fp32.config.hidden_size, generator=torch.Generator().manual_seed(0))
    ids, _ = moe.gate(x)
    assert len(torch.unique(ids)) < tiny_fp32.config.n_routed_experts  # a strict subset is chosen
    a, b = moe(x, graph_safe=False), moe(x, graph_safe=True)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * b.abs().max())


def test_fp8_linear_equals_blockwise_dequantize_then_matmul(tiny_fp32):
    lin = tiny_fp32.layers[0].mlp.gate_proj
    assert lin.is_fp8
    w8, s = lin.weight, lin.weight_scale_inv
    dense = torch.empty(w8.shape)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = (slice(128 * i, 128 * i + 128), slice(128 * j, 128 * j + 128))
            dense[blk] = w8[blk].float() * s[i, j]
    x = torch.randn(5, lin.in_features)
    assert torch.allclose(lin(x), x @ dense.t(), rtol=1e-6, atol=1e-6)
    assert torch.equal(dequantize_fp8(w8, s, torch.float32), dense)
