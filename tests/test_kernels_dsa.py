"""The DSA decode kernels against their fp32 references and the stock `SparseMLA.attention`: pool scores,
the top-k selection (forced ties go to the lower pool, as in the stock top-k), the sparse attention with
its value-up, at odd head counts and past the context where pools are dropped, with padded rows, reused
selections and NaN-filled outputs. CPU cases run the Triton interpreter in fp32 at tiny sizes; GPU cases
(marked `gpu`) run real shapes in bf16 up to 128K tokens of context."""

import copy

import pytest
import torch

from glm5next.checkpoint.fp8 import FP8_DTYPE, quantize_fp8_blocks
from glm5next.forward import DsaCache
from glm5next.kernels.dsa import (DsaScratch, DsaWeights, IndexerInputWeights, index_scores, index_scores_reference,
                                  indexer_inputs, indexer_inputs_reference, plan_dsa, select_levels, select_pools,
                                  select_pools_reference, sparse_attention, sparse_attention_reference)
from glm5next.model import indexer as indexer_module
from glm5next.model.backbone import Glm5NextModel
from glm5next.model.indexer import top_pools
from glm5next.runtime.metadata import build_metadata
from glm5next.specialized_decode.dsa import DsaStage

CUDA = torch.cuda.is_available()


def rel(got, want):
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


def random_layer(h, n, r, v, kpool, topk, device="cpu", dtype=torch.float32, seed=0) -> DsaWeights:
    """Random W_UK / W_UV^T in `dtype`; with FP8_DTYPE, random e4m3 codes and random (not power-of-two)
    block scales, as a checkpoint's kv_b_proj may hold them."""
    g = torch.Generator(device=device).manual_seed(seed)
    if dtype == FP8_DTYPE:
        def fp8(*shape):
            codes = (torch.randn(*shape, generator=g, device=device) * 64).clamp(-448, 448).to(FP8_DTYPE)
            grid = (shape[0], -(-shape[1] // 128), -(-shape[2] // 128))
            return codes, (torch.rand(*grid, generator=g, device=device) + 0.5) / (64 * shape[1] ** 0.5)
        (w_uk, s_uk), (w_uv_t, s_uv) = fp8(h, n, r), fp8(h, r, v)
        return DsaWeights(w_uk, w_uv_t, kpool, topk, n**-0.5, 32**-0.5, w_uk_scale=s_uk, w_uv_t_scale=s_uv)
    w_uk = (torch.randn(h, n, r, generator=g, device=device) * n**-0.5).to(dtype)
    w_uv_t = (torch.randn(h, r, v, generator=g, device=device) * r**-0.5).to(dtype)
    return DsaWeights(w_uk, w_uv_t, kpool, topk, n**-0.5, 32**-0.5)


def random_caches(blocks, bs, r, d, kpool, device="cpu", dtype=torch.float32, seed=1):
    """Latent and pooled-key caches [blocks + 1, ...] of random rows (RMS-normalised scale)."""
    g = torch.Generator(device=device).manual_seed(seed)
    latent = torch.randn(blocks + 1, bs, r, generator=g, device=device).to(dtype)
    pooled = (torch.randn(blocks + 1, bs // kpool, d, generator=g, device=device) * 0.5).to(dtype)
    return latent, pooled


def step(positions, seqs, slots, width, blocks, device="cpu", seed=2):
    """Positions, sequence of each token, slots [T] and per-sequence block tables [seqs, width] (distinct
    random blocks)."""
    g = torch.Generator().manual_seed(seed)
    n_seq = max(seqs) + 1
    tables = torch.randperm(blocks, generator=g)[: n_seq * width].view(n_seq, width)
    i64 = dict(dtype=torch.int64, device=device)
    return (torch.tensor(positions, **i64), torch.tensor(seqs, **i64), torch.tensor(slots, **i64),
            tables.to(device))


# ---------------------------------------------------------------- indexer
def nan_outputs(t, w, d, dtype, device="cpu"):
    return (torch.full((t, w.heads), float("nan"), device=device),
            torch.full((t, w.gate_width), float("nan"), dtype=dtype, device=device),
            torch.full((t, d), float("nan"), dtype=dtype, device=device))


@pytest.mark.parametrize("t,dtype", [(1, torch.float32), (5, torch.float32), (67, torch.float32),
                                     (5, torch.bfloat16)])
def test_indexer_inputs_match_reference_at_odd_sizes(t, dtype):
    """Head weights, gate logits and normalised keys at odd widths (a channel block across the head/gate
    border, a hidden size off the tiles, more rows than one tile), twice (the tickets reset); in bf16 the
    gate logits and keys within a bf16 rounding."""
    heads, gate, hidden, d = 3, 24, 72, 24
    g = torch.Generator().manual_seed(t)
    w = IndexerInputWeights(torch.randn(heads + gate, hidden, generator=g).to(dtype), heads, 0.3,
                            torch.randn(d, generator=g), torch.randn(d, generator=g), 1e-6)
    scratch = DsaScratch()
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    for _ in range(2):
        x = torch.randn(t, hidden, generator=g).to(dtype)
        ki = (torch.randn(t, d, generator=g) * 3 + 1).to(dtype)
        got = indexer_inputs(x, ki, w, scratch, out=nan_outputs(t, w, d, dtype))
        for a, b, bound in zip(got, indexer_inputs_reference(x, ki, w), (1e-5, tol, tol)):
            assert not a.isnan().any() and rel(a, b) < bound


def test_indexer_inputs_equal_the_stock_indexer(tiny_fp32):
    """The kernel's outputs against the stock indexer's (`Indexer.outputs`) on the small model's weights."""
    layer = next(layer for layer in tiny_fp32.layers if layer.layer_kind == "dsa")
    ix = layer.self_attn.indexer
    w = IndexerInputWeights.of(ix, torch.float32)
    g = torch.Generator().manual_seed(3)
    t = 6
    x = torch.randn(t, ix.hidden_size, generator=g)
    ki = torch.randn(t, ix.head_dim, generator=g)
    qi = torch.randn(t, ix.n_heads * ix.head_dim, generator=g)
    _, want_w, want_k, want_g = ix.outputs(x, qi, ki)
    wi, gi, ko = indexer_inputs(x, ki, w, DsaScratch(), out=nan_outputs(t, w, ix.head_dim, torch.float32))
    assert rel(wi, want_w) < 1e-5 and rel(gi, want_g) < 1e-5 and rel(ko, want_k) < 1e-5


@pytest.mark.parametrize("hi,d,splits,block_p", [(3, 24, 2, 16), (4, 32, 3, 16), (5, 16, 1, 64)],
                         ids=["odd_heads_and_width", "three_splits", "one_split"])
def test_scores_and_selection_match_reference(hi, d, splits, block_p):
    kp, bs, k, width = 4, 16, 8, 8  # 32 pools a table; 8 kept: pools drop past 35 tokens
    blocks = 26
    pos, seqs, slots, tables = step([127, 3, 40, 90, 17, 60], [0, 1, 0, 1, 2, 2], [5, 9, -1, 11, 2, 7], width, blocks)
    t = pos.shape[0]
    g = torch.Generator().manual_seed(3)
    qi, wi = torch.randn(t, hi, d, generator=g), torch.randn(t, hi, generator=g)
    _, pooled = random_caches(blocks, bs, 16, d, kp, seed=4)
    plan = plan_dsa(t, 4, width * bs // kp, k, kp, 8, on_gpu=False, score_splits=splits, block_p=block_p,
                    select_chunk=16)
    scale = d**-0.5
    got = index_scores(qi, wi, pos, slots, seqs, tables, pooled, kp, scale, plan,
                       out=torch.full((t, width * bs // kp), float("nan")))
    want = index_scores_reference(qi, wi, pos, slots, seqs, tables, pooled, kp, scale)
    assert torch.equal(got.isnan(), want.isnan())  # every visible pool written, nothing else
    assert rel(got.nan_to_num(), want.nan_to_num()) < 1e-6
    sel = torch.full((t, k), 7, dtype=torch.int64)
    got_sel, got_n = select_pools(want, pos, slots, kp, k, plan, out=sel)
    want_sel, want_n = select_pools_reference(want, pos, slots, kp, k)
    assert got_sel is sel and torch.equal(got_sel, want_sel) and torch.equal(got_n, want_n)
    assert got_n.tolist() == [8, 1, 0, 8, 4, 8]  # capped at k, all of few, none for padding
    # The stock top-k keeps the same pools.
    visible = torch.arange(want.shape[1])[None] * kp + kp - 1 <= pos[:, None]
    visible &= (slots >= 0)[:, None]
    stock = top_pools(want.nan_to_num(), visible, k)
    for row in range(t):
        assert set(stock[row].tolist()) - {-1} == set(want_sel[row].tolist()) - {-1}, row


def test_forced_ties_go_to_the_lower_pool():
    """Scores with many exact ties (and -0.0 beside +0.0) at the selection boundary: the kernel, the
    reference and the stock top-k keep the same pools, the lower ones among equals."""
    kp, k = 4, 8
    t, n_pools = 4, 48
    g = torch.Generator().manual_seed(5)
    scores = torch.randint(0, 3, (t, n_pools), generator=g).float()
    scores[0] = 1.0  # all equal: the first k pools
    scores[1, ::2] = -0.0  # signed zeros tie with +0.0
    scores[1, 1::2] = 0.0
    scores[1, 30] = 2.0
    pos = torch.tensor([191, 191, 100, 60])
    slots = torch.tensor([0, 1, 2, 3])
    plan = plan_dsa(t, 4, n_pools, k, kp, 8, on_gpu=False, select_chunk=16)
    got, _ = select_pools(scores, pos, slots, kp, k, plan)
    want, _ = select_pools_reference(scores, pos, slots, kp, k)
    assert torch.equal(got, want)
    assert got[0].tolist() == list(range(k)) and got[1].tolist() == [0, 1, 2, 3, 4, 5, 6, 30]
    visible = torch.arange(n_pools)[None] * kp + kp - 1 <= pos[:, None]
    stock = top_pools(scores, visible, k)
    for row in range(t):
        assert sorted(stock[row].tolist()) == got[row].tolist(), row
    # Counter-example: the higher pools among the tied ones are a different set.
    assert sorted(range(n_pools - k, n_pools)) != got[0].tolist()


def test_select_levels():
    """The launches of the selection: chunks of the table, then of the candidates, until one program per
    token; one launch when the table fits a chunk; the real model's (K 512, chunks of 4096 or 2048) at 8K,
    128K and 1M tokens of context."""
    assert select_levels(32, 8, 16) == [(32, 2, 16), (16, 1, 16)]
    assert select_levels(64, 8, 16) == [(64, 4, 16), (32, 2, 16), (16, 1, 16)]
    assert select_levels(48, 8, 16) == [(48, 3, 16), (24, 2, 16), (16, 1, 16)]
    assert select_levels(16, 8, 16) == [(16, 1, 16)]
    assert select_levels(40, 8, 8) == [(40, 1, 64)]  # a chunk of at most K pools would keep them all
    assert select_levels(17, 15, 16) == [(17, 1, 32)]  # two chunks would leave 30 candidates: no fewer
    assert select_levels(2048, 512, 4096) == [(2048, 1, 2048)]
    assert select_levels(32768, 512, 4096) == [(32768, 8, 4096), (4096, 1, 4096)]
    assert select_levels(262144, 512, 4096) == [(262144, 64, 4096), (32768, 8, 4096), (4096, 1, 4096)]
    assert select_levels(32768, 512, 2048) == [(32768, 16, 2048), (8192, 4, 2048), (2048, 1, 2048)]
    assert plan_dsa(64, 64, 32768, 512, 4, 132).select_chunk == 4096
    assert plan_dsa(8, 64, 32768, 512, 4, 132).select_chunk == 2048  # 128K tables at up to 8 tokens
    assert plan_dsa(1, 64, 262144, 512, 4, 132).select_chunk == 4096
    assert plan_dsa(1, 64, 4096, 512, 4, 132).select_chunk == 4096
    assert plan_dsa(1, 64, 2048, 512, 4, 132).select_chunk == 2048


@pytest.mark.parametrize("chunk", [16, 32, 8, 64], ids=["three_levels", "two_levels", "chunk_at_k", "one_level"])
def test_selection_over_chunks_with_ties_across_them(chunk):
    """Tables of several chunks, tokens seeing more than K pools, with ties at the selection boundary that
    straddle chunks (and one chunk holding more tied pools than K): every level keeps the lower pools
    among equals, so the kernel keeps the reference's pools; padding and short tokens as before."""
    kp, k, n_pools = 4, 8, 64
    g = torch.Generator().manual_seed(11)
    rows = []
    tie = torch.zeros(n_pools)
    tie[[3, 15, 16, 17, 31, 33, 47, 48, 63]] = 1.0  # the kept tied pools: 3, 15, 16, 17, 31 (then 33...)
    tie[[20, 40, 50]] = 2.0
    rows.append(tie)
    rows.append(torch.ones(n_pools))  # all equal: the first k pools, all from the first chunk
    wide = torch.zeros(n_pools)
    wide[:20] = 1.0  # 20 tied pools over two chunks (16 of them in the first), two better ones after
    wide[[45, 60]] = 3.0
    rows.append(wide)
    signed = torch.zeros(n_pools)
    signed[::2] = -0.0
    signed[[5, 18, 37]] = 0.5
    rows.append(signed)  # -0.0 ties with +0.0
    for _ in range(6):
        rows.append(torch.randint(0, 3, (n_pools,), generator=g).float())
    rows.append(torch.randn(n_pools, generator=g))
    rows.append(torch.randn(n_pools, generator=g))
    scores = torch.stack(rows)
    t = scores.shape[0]
    # Whole table, chunk edges, short of K, a partial last chunk, padding.
    pos = torch.tensor([255, 255, 255, 255, 63, 64, 30, 131, 200, 255, 255, 150])
    slots = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, -1, 10, 11])
    plan = plan_dsa(t, 4, n_pools, k, kp, 8, on_gpu=False, select_chunk=chunk)
    scratch = DsaScratch()
    for _ in range(2):  # the scratch's candidates reused
        got, got_n = select_pools(scores, pos, slots, kp, k, plan, scratch=scratch)
        want, want_n = select_pools_reference(scores, pos, slots, kp, k)
        assert torch.equal(got, want) and torch.equal(got_n, want_n)
    assert got[0].tolist() == [3, 15, 16, 17, 20, 31, 40, 50]
    assert got[1].tolist() == list(range(k))
    assert got[2].tolist() == [0, 1, 2, 3, 4, 5, 45, 60]
    assert got[3].tolist() == [0, 1, 2, 3, 4, 5, 18, 37]
    assert got_n.tolist() == [8, 8, 8, 8, 8, 8, 7, 8, 8, 0, 8, 8]
    assert got[6].tolist() == list(range(7)) + [-1] and got[9].tolist() == [-1] * k
    visible = (torch.arange(n_pools)[None] * kp + kp - 1 <= pos[:, None]) & (slots >= 0)[:, None]
    stock = top_pools(scores, visible, k)
    for row in range(t):
        assert set(stock[row].tolist()) - {-1} == set(got[row].tolist()) - {-1}, row


# ---------------------------------------------------------------- attention
@pytest.mark.parametrize("h,splits", [(3, 1), (5, 3), (4, 2)], ids=["odd_heads", "odd_heads_three_splits", "two"])
def test_sparse_attention_matches_reference(h, splits):
    kp, bs, k, width, blocks = 4, 16, 8, 8, 34
    n, r, v = 32, 48, 24  # widths below the tiles: every mask is exercised
    w = random_layer(h, n, r, v, kp, k)
    latent, _ = random_caches(blocks, bs, r, 16, kp, seed=6)
    pos, seqs, slots, tables = step([127, 2, 40, 93, 5, 3], [0, 1, 0, 1, 2, 3], [5, 9, -1, 11, 2, 4], width, blocks,
                                    seed=7)
    t = pos.shape[0]
    q = torch.randn(t, h, n, generator=torch.Generator().manual_seed(8))
    # A selection as the stock top-k leaves it, then a reused one holding -1, pools not yet whole for the
    # token, and pools past the block table: each is skipped. The last token (position 3, no tail) is left
    # with no row by the reused one: it attends its sequence's first row, as the stock module does.
    sel = torch.tensor([[0, 3, 4, 9, 17, 20, 25, 31], [-1] * 8, [-1] * 8, [1, 2, 5, 6, 7, 11, 22, 23],
                        [0, -1, -1, -1, -1, -1, -1, -1], [0, -1, -1, -1, -1, -1, -1, -1]])
    reused = torch.tensor([[31, -1, 5, 40, 2, 2, 6, 7]] * t)
    plan = plan_dsa(t, h, width * bs // kp, k, kp, 8, on_gpu=False, kv_splits=splits, block_n=16)
    for selection, count in ((sel, torch.tensor([8, 0, 0, 8, 1, 1], dtype=torch.int32)),
                             (reused, torch.full((t,), 8, dtype=torch.int32))):
        out = torch.full((t, h, v), float("nan"))
        got = sparse_attention(q, selection, count, pos, slots, seqs, tables, latent, w, plan, out=out)
        want = sparse_attention_reference(q, selection, count, pos, slots, seqs, tables, latent, w)
        assert got is out and not got.isnan().any()
        assert rel(got, want) < 1e-5
        assert not got[2].any()  # the padded row
    first = latent[tables[3, 0], 0]
    assert rel(got[5], torch.einsum("r,hrv->hv", first, w.w_uv_t)) < 1e-5


def test_sparse_attention_fp8_weights_match_reference():
    """W_UK / W_UV^T as FP8 codes with their block scales, at widths past one 128 block and not a multiple of
    it (nope 200, R 136, v 72: K steps and output tiles in both scale blocks, and masked edges): the absorb
    and the value-up apply each tile's scale as the fp32 reference dequantizes them."""
    kp, bs, k, width, blocks, h = 4, 16, 8, 8, 34, 3
    n, r, v = 200, 136, 72
    w = random_layer(h, n, r, v, kp, k, dtype=FP8_DTYPE, seed=11)
    latent, _ = random_caches(blocks, bs, r, 16, kp, seed=12)
    pos, seqs, slots, tables = step([127, 40, 93, 6], [0, 1, 0, 2], [5, -1, 11, 2], width, blocks, seed=13)
    t = pos.shape[0]
    q = torch.randn(t, h, n, generator=torch.Generator().manual_seed(14))
    sel = torch.tensor([[0, 3, 4, 9, 17, 20, 25, 31], [-1] * 8, [1, 2, 5, 6, 7, 11, 22, 23], [0] + [-1] * 7])
    count = torch.tensor([8, 0, 8, 1], dtype=torch.int32)
    plan = plan_dsa(t, h, width * bs // kp, k, kp, 8, on_gpu=False, kv_splits=2, block_n=16)
    out = torch.full((t, h, v), float("nan"))
    got = sparse_attention(q, sel, count, pos, slots, seqs, tables, latent, w, plan, out=out)
    want = sparse_attention_reference(q, sel, count, pos, slots, seqs, tables, latent, w)
    assert not got.isnan().any() and rel(got, want) < 1e-5
    assert not got[1].any()  # the padded row
    # FP8 codes without their scales, and tiles across a scale block, are refused.
    with pytest.raises(ValueError, match="block scales"):
        DsaWeights(w.w_uk, w.w_uv_t, kp, k, w.scale, w.index_scale)
    with pytest.raises(ValueError, match="divide their 128"):
        sparse_attention(q, sel, count, pos, slots, seqs, tables, latent, w,
                         plan_dsa(t, h, width * bs // kp, k, kp, 8, on_gpu=False, block_k=48))


@pytest.mark.parametrize("nope,fp8", [(128, True), (96, False), (128, False)], ids=["fp8", "fp8_unaligned", "bf16"])
def test_weights_of_a_layer_keep_fp8_head_blocks(nope, fp8):
    """`DsaWeights.of`: an FP8 kv_b_proj whose head blocks start on its scale blocks stays FP8 (each head's
    nope rows, and its v rows transposed, with their scales), equal to the widened form once dequantized;
    one whose heads straddle scale blocks, or a 16-bit one, is widened."""
    from types import SimpleNamespace

    from glm5next.checkpoint.fp8 import dequantize_fp8

    h, v, r = 3, 128, 136
    g = torch.Generator().manual_seed(15)
    dense = torch.randn(h * (nope + v), r, generator=g) * 0.05
    w8, s8 = quantize_fp8_blocks(dense)
    s8 = s8 * (1 + torch.rand(s8.shape, generator=g))  # scales of any value, not only powers of two
    kv_b = dequantize_fp8(w8, s8, torch.float32).view(h, nope + v, r)
    proj = SimpleNamespace(is_fp8=fp8, weight=w8 if fp8 else kv_b.reshape(-1, r).to(torch.bfloat16),
                           weight_scale_inv=s8 if fp8 else None)
    ix = SimpleNamespace(topk_pools=8, softmax_scale=0.125, index_kpool_compress_ape=torch.zeros(4, 16))
    stored = proj.weight.float().view(h, nope + v, r) if not fp8 else kv_b
    attn = SimpleNamespace(num_heads=h, nope_dim=nope, v_dim=v, kv_b_proj=proj, kpool=4, indexer=ix, scale=0.1,
                           absorbed_weights=lambda: (stored[:, :nope], stored[:, nope:]))
    w = DsaWeights.of(attn, torch.bfloat16)
    aligned = fp8 and nope % 128 == 0
    assert (w.w_uk.dtype == FP8_DTYPE) == aligned and (w.w_uv_t_scale is not None) == aligned
    uk, uv_t = w.dense()
    want_uk, want_uv_t = stored[:, :nope], stored[:, nope:].transpose(1, 2)
    tol = 0 if aligned else 4e-3  # the widened form rounds to bf16
    assert rel(uk, want_uk) <= tol and rel(uv_t, want_uv_t) <= tol


# ---------------------------------------------------------------- the stage against the stock module
def _stage_inputs(attn, config, rows, q, contexts, pad_rows, bs=16, seed=9):
    """Projections, metadata and a random-context cache for `rows` decode rows of `q` tokens."""
    from glm5next.model.dsa import DsaProjections

    width = -(-(max(contexts) + q) // bs)
    blocks = rows * width + 2
    g = torch.Generator().manual_seed(seed)
    r, d = config.kv_lora_rank, config.index_head_dim
    cache = DsaCache(torch.randn(blocks + 1, bs, r, generator=g), torch.randn(blocks + 1, bs, d, generator=g),
                     torch.randn(blocks + 1, bs, d, generator=g),
                     torch.randn(blocks + 1, bs // 4, d, generator=g) * 0.5)
    perm = torch.randperm(blocks, generator=g).tolist()
    tables = [perm[i * width:(i + 1) * width] for i in range(rows)]
    states = [-1 if i in pad_rows else i for i in range(rows)]
    md = build_metadata([q] * rows, contexts, rows, states, tables, bs, "cpu", max_blocks=width)
    t = rows * q
    x = torch.randn(t, config.hidden_size, generator=g)
    p = attn.project(x)
    return DsaProjections(*p), md, cache


@pytest.mark.parametrize("rows,q,contexts,pad,ties", [(3, 1, [90, 7, 41], [1], False), (2, 3, [66, 37], [], False),
                                                      (2, 1, [70, 50], [], True)],
                         ids=["decode_padded", "verify", "forced_ties"])
def test_stage_equals_stock_attention(tiny_fp32, monkeypatch, rows, q, contexts, pad, ties):
    """On the small model's first DSA layer: the stock scores, the same selected pools, the values within
    1e-4 and the same cache writes (pools are dropped: the contexts pass index_topk + 3 tokens). With
    every pooled key equal (all scores tie), both keep the lowest pools."""
    attn = tiny_fp32.layers[3].self_attn
    config = tiny_fp32.config
    assert max(contexts) + 1 > config.index_topk + 3
    p, md, cache = _stage_inputs(attn, config, rows, q, contexts, pad)
    if ties:
        cache.pooled_key[:] = cache.pooled_key[0, 0]
        # Keys and gates equal too, so the pools this step completes tie with the cached ones.
        cache.index_key[:] = cache.index_key[0, 0]
        cache.index_gate[:] = cache.index_gate[0, 0]
        p = p._replace(ki=cache.index_key[0, :1].expand_as(p.ki).clone(),
                       gi=cache.index_gate[0, :1].expand_as(p.gi).clone())
    seen = []
    real = indexer_module.top_pools
    monkeypatch.setattr(indexer_module, "top_pools", lambda s, v, k: seen.append((s.clone(), v)) or real(s, v, k))
    stock_cache = copy.deepcopy(cache)
    want, want_sel = attn.attention(p, md, stock_cache, return_selection=True, graph_safe=True)
    stage = DsaStage(attn, torch.float32)
    got, got_sel = stage(p, md, cache, return_selection=True)
    live = [i for i in range(rows * q) if md.slot_mapping[i] >= 0]
    assert rel(got[live], want[live]) < 1e-4
    for a, b in zip((cache.latent, cache.index_key, cache.index_gate), (stock_cache.latent, stock_cache.index_key,
                                                                        stock_cache.index_gate)):
        assert torch.equal(a[:-1], b[:-1])  # the scratch block aside
    # The pooled keys within an fp32 ulp: the kernel's exp and PyTorch's vectorised one round differently.
    assert rel(cache.pooled_key[:-1], stock_cache.pooled_key[:-1]) < 1e-6
    (stock_scores, visible), = seen
    mine = stage.scratch.get("scores", tuple(stock_scores.shape), torch.float32, "cpu")
    for i in live:
        vis = visible[i]
        assert rel(mine[i][vis], stock_scores[i][vis]) < 1e-6
        assert set(got_sel[i].tolist()) - {-1} == set(want_sel[i].tolist()) - {-1}, i
    if ties:
        k = config.index_topk_pools
        for i in live:
            assert got_sel[i].tolist() == list(range(k)), i
    # A reused selection (an MTP draft step's) attends the same pools as the stock module does with it.
    again, again_sel = stage(p, md, cache, selection=want_sel, return_selection=True)
    stock_again, _ = attn.attention(p, md, stock_cache, selection=want_sel, graph_safe=True)
    assert rel(again[live], stock_again[live]) < 1e-4 and torch.equal(again_sel, want_sel)


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a GPU")])])
def test_kernels_equal_stock_attention_on_a_prefill_step(tiny_fp32, tiny_dir, monkeypatch, dev):
    """`attention_on_kernels` (what an eager step runs on a GPU over a 16-bit cache) on a mixed step — a
    decode row, a fresh prompt and a continuation past the point where pools are dropped — cut into
    pieces of rows, against the stock attention: values within 1e-4 (bf16 on the GPU, where the eager
    `attention` itself takes the kernels: 2e-2), the same selected pools, the same cache writes (the
    pools completed inside the step pooled from the step's own keys). The bf16 layer is loaded as such:
    casting the fp32 module would turn its FP8 weights into plain ones without their block scales."""
    dtype = torch.float32 if dev == "cpu" else torch.bfloat16
    if dev == "cpu":
        attn = copy.deepcopy(tiny_fp32.layers[3].self_attn)
    else:
        attn = Glm5NextModel.from_pretrained(tiny_dir, dtype, dev, progress=False).layers[3].self_attn
    config = tiny_fp32.config
    bs, g = 16, torch.Generator().manual_seed(5)
    lens, contexts = [1, 23, 30], [90, 0, 70]
    width = -(-(max(c + n for c, n in zip(contexts, lens))) // bs)
    blocks = 3 * width + 1
    r, d = config.kv_lora_rank, config.index_head_dim
    cache = DsaCache(*(x.to(dev, dtype) for x in (
        torch.randn(blocks + 1, bs, r, generator=g), torch.randn(blocks + 1, bs, d, generator=g),
        torch.randn(blocks + 1, bs, d, generator=g), torch.randn(blocks + 1, bs // 4, d, generator=g) * 0.5)))
    perm = torch.randperm(blocks, generator=g).tolist()
    md = build_metadata(lens, contexts, 1, [0, 1, 2], [perm[i * width:(i + 1) * width] for i in range(3)], bs, dev,
                        max_blocks=width)
    with torch.no_grad():
        p = attn.project(torch.randn(sum(lens), config.hidden_size, generator=g).to(dev, dtype))
        stock_cache = copy.deepcopy(cache)
        want, want_sel = attn.attention(p, md, stock_cache, return_selection=True, graph_safe=True)
        monkeypatch.setattr("glm5next.model.dsa.PREFILL_CHUNK_ELEMS", 20 * width * bs // 4)  # pieces of 20 rows
        if dev == "cpu":
            got, got_sel = attn.attention_on_kernels(p, md, cache, DsaWeights.of(attn, dtype), DsaScratch(),
                                                     return_selection=True)
        else:
            got, got_sel = attn.attention(p, md, cache, return_selection=True)
    same = [set(got_sel[i].tolist()) - {-1} == set(want_sel[i].tolist()) - {-1} for i in range(sum(lens))]
    if dev == "cpu":
        assert rel(got, want) < 1e-4 and all(same)
    else:
        # bf16 products can swap pools whose scores tie within rounding: the values are checked against
        # the stock attention over the kernels' own selection, and most rows must select alike.
        with torch.no_grad():
            given, _ = attn.attention(p, md, copy.deepcopy(stock_cache), selection=got_sel, graph_safe=True)
        assert rel(got, given) < 2e-2 and sum(same) >= 0.9 * len(same)
    for a, b in zip((cache.latent, cache.index_key, cache.index_gate), (stock_cache.latent, stock_cache.index_key,
                                                                        stock_cache.index_gate)):
        assert torch.equal(a[:-1], b[:-1])
    assert rel(cache.pooled_key[:-1], stock_cache.pooled_key[:-1]) < (1e-6 if dev == "cpu" else 1e-2)


# ---------------------------------------------------------------- GPU, real shapes
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("rows,q,context,weights", [(1, 1, 8192, "bf16"), (7, 1, 3000, "bf16"), (64, 1, 8192, "bf16"),
                                                    (3, 4, 20000, "bf16"), (2, 1, 131072, "bf16"),
                                                    (1, 1, 8192, "fp8"), (64, 1, 8192, "fp8")])
def test_real_shapes_bf16_against_fp32(rows, q, context, weights):
    """bf16 caches and queries, W_UK / W_UV^T in bf16 or as FP8 with block scales, against the fp32 reference."""
    dev, kp, bs, k = "cuda", 4, 64, 512
    h, n, r, v, hi, d = 64, 256, 512, 256, 32, 128
    width = -(-(context + q) // bs)
    blocks = rows * width + 1
    w = random_layer(h, n, r, v, kp, k, dev, torch.bfloat16 if weights == "bf16" else FP8_DTYPE)
    latent, pooled = random_caches(blocks, bs, r, d, kp, dev, torch.bfloat16)
    positions = [context + j for _ in range(rows) for j in range(q)]
    seqs = [i for i in range(rows) for _ in range(q)]
    slots = [0] * (rows * q)
    pos, seq, slot, tables = step(positions, seqs, slots, width, blocks, dev)
    t = rows * q
    g = torch.Generator(device=dev).manual_seed(10)
    qq = torch.randn(t, h, n, generator=g, device=dev).to(torch.bfloat16)
    qi = torch.randn(t, hi, d, generator=g, device=dev).to(torch.bfloat16)
    wi = torch.randn(t, hi, generator=g, device=dev) * 0.1
    n_pools = width * bs // kp
    plan = plan_dsa(t, h, n_pools, k, kp, torch.cuda.get_device_properties(0).multi_processor_count)
    scores = index_scores(qi, wi, pos, slot, seq, tables, pooled, kp, d**-0.5, plan,
                          out=torch.full((t, n_pools), float("nan"), device=dev))
    want = index_scores_reference(qi.float(), wi, pos, slot, seq, tables, pooled.float(), kp, d**-0.5)
    vis = ~want.isnan()
    assert torch.equal(~scores.isnan() & vis, vis) and rel(scores[vis], want[vis]) < 1e-5
    sel, count = select_pools(scores, pos, slot, kp, k, plan)
    want_sel, want_count = select_pools_reference(scores, pos, slot, kp, k)
    assert torch.equal(sel, want_sel) and torch.equal(count, want_count)  # same scores: same pools
    w32 = DsaWeights(*w.dense(), kp, k, w.scale, w.index_scale)
    ref = sparse_attention_reference(qq.float(), sel, count, pos, slot, seq, tables, latent.float(), w32)
    # The planned attention, and the other forms: one split (the context written by the attention itself)
    # and smaller head groups.
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for p in (plan, plan_dsa(t, h, n_pools, k, kp, sms, kv_splits=1),
              plan_dsa(t, h, n_pools, k, kp, sms, heads_per_program=16, block_n=16)):
        out = torch.full((t, h, v), float("nan"), device=dev)
        got = sparse_attention(qq, sel, count, pos, slot, seq, tables, latent, w, p, out=out)
        torch.cuda.synchronize()
        assert not got.isnan().any() and rel(got, ref) < 2e-2, p


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("t", [1, 7, 64])
def test_real_shapes_indexer_inputs_bf16(t):
    """Real widths in bf16 (the weight kept in bf16: every row exact), against the fp32 reference: the
    head weights within fp32 rounding, the gate logits and keys within a bf16 ulp."""
    dev, heads, hidden, d = "cuda", 32, 4096, 128
    g = torch.Generator(device=dev).manual_seed(t)
    w = IndexerInputWeights(torch.randn(heads + d, hidden, generator=g, device=dev).to(torch.bfloat16) * 0.02,
                            heads, heads**-0.5, torch.randn(d, generator=g, device=dev),
                            torch.randn(d, generator=g, device=dev), 1e-6)
    x = torch.randn(t, hidden, generator=g, device=dev).to(torch.bfloat16)
    ki = torch.randn(t, d, generator=g, device=dev).to(torch.bfloat16)
    got = indexer_inputs(x, ki, w, DsaScratch(), out=nan_outputs(t, w, d, torch.bfloat16, dev))
    want = indexer_inputs_reference(x, ki, w)
    torch.cuda.synchronize()
    assert not any(a.isnan().any() for a in got)
    assert rel(got[0], want[0]) < 1e-5 and rel(got[1], want[1]) < 2**-7 and rel(got[2], want[2]) < 2**-7


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_real_shapes_cache_writes_against_stock():
    """The fused cache writes of a verify step (4 tokens a row, pools completing inside the step and across
    its start) against the stock module's, bf16 at real widths: rows equal, pooled keys within a bf16 ulp."""
    from glm5next.kernels.dsa import write_cache
    from glm5next.model.indexer import compress_pool

    dev, kp, bs, r, d = "cuda", 4, 64, 512, 128
    rows, q, width = 5, 4, 8
    blocks = rows * width + 1
    g = torch.Generator(device=dev).manual_seed(12)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=dev).to(torch.bfloat16)

    cache = DsaCache(rnd(blocks + 1, bs, r), rnd(blocks + 1, bs, d), rnd(blocks + 1, bs, d), rnd(blocks + 1, bs // kp, d))
    contexts = [101, 66, 3, 200, 7]
    positions = [c + j for c in contexts for j in range(q)]
    seqs = [i for i in range(rows) for _ in range(q)]
    pos, seq, _, tables = step(positions, seqs, [0] * len(positions), width, blocks, dev)
    slot = tables[seq, pos // bs] * bs + pos % bs
    slot[4:8] = -1  # a padded row
    t = rows * q
    c, ki, gi = rnd(t, r), rnd(t, d), rnd(t, d)
    ape = torch.randn(kp, d, generator=g, device=dev)
    want = copy.deepcopy(cache)
    rows_ = want.token_rows(slot)
    want.latent.view(-1, r)[rows_] = c
    want.index_key.view(-1, d)[rows_] = ki
    want.index_gate.view(-1, d)[rows_] = gi
    for i in range(t):
        if slot[i] >= 0 and pos[i] % kp == kp - 1:
            first = slot[i] - (kp - 1)
            want.pooled_key.view(-1, d)[slot[i] // kp] = compress_pool(want.index_key.view(-1, d)[first:first + kp],
                                                                       want.index_gate.view(-1, d)[first:first + kp], ape)
    write_cache(c, ki, gi, pos, slot, seq, ape, cache.latent, cache.index_key, cache.index_gate, cache.pooled_key)
    for a, b in ((cache.latent, want.latent), (cache.index_key, want.index_key), (cache.index_gate, want.index_gate)):
        assert torch.equal(a[:-1], b[:-1])
    diff = (cache.pooled_key.float() - want.pooled_key.float()).abs()
    assert float(diff.max()) <= float(want.pooled_key.float().abs().max()) * 2**-7
