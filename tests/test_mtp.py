"""The MTP draft layer against an fp32 reference written from the model spec."""

import torch
import torch.nn.functional as F

from glm5next.forward import ForwardContext
from glm5next.runtime.cache import allocate_cache
from glm5next.runtime.metadata import build_metadata


def dense(w, scale=None):
    """A weight as fp32, FP8 blocks expanded with a Kronecker product."""
    if scale is None:
        return w.float()
    grid = torch.kron(scale.float(), torch.ones(128, 128))[: w.shape[0], : w.shape[1]]
    return w.float() * grid


def lin(x, module):
    return x @ dense(module.weight, module.weight_scale_inv).t()


def rms(x, w, eps=1e-5):
    return w.float() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def swiglu_mlp(x, g, u, d, limit=10.0):
    return (F.silu((x @ g.t()).clamp(max=limit)) * (x @ u.t()).clamp(-limit, limit)) @ d.t()


def reference_mtp(mtp, cfg, emb, hidden, positions):
    e = torch.where((positions == 0)[:, None], torch.zeros_like(emb), emb)
    z = torch.cat([rms(e, mtp.enorm.weight), rms(hidden, mtp.hnorm.weight)], -1) @ dense(mtp.eh_proj.weight).t()
    # Dense causal NoPE MLA (contexts here are shorter than index_topk, so every token is selected).
    a = mtp.self_attn
    x = rms(z, mtp.input_layernorm.weight)
    H, dn, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    q = lin(rms(lin(x, a.q_a_proj), a.q_a_layernorm.weight), a.q_b_proj).view(-1, H, dn)
    c = rms(lin(x, a.kv_a_proj_with_mqa), a.kv_a_layernorm.weight)
    kv = lin(c, a.kv_b_proj).view(-1, H, dn + dv)
    k, v = kv[..., :dn], kv[..., dn:]
    T = x.shape[0]
    out = torch.zeros(T, H, dv)
    for t in range(T):
        for h in range(H):
            p = torch.softmax((k[: t + 1, h] @ q[t, h]) * dn**-0.5, 0)
            out[t, h] = p @ v[: t + 1, h]
    r = lin(out.reshape(T, -1), a.o_proj) + z
    y = rms(r, mtp.post_attention_layernorm.weight)
    moe = mtp.mlp
    ex = moe.experts
    f = torch.zeros_like(y)
    for t in range(T):
        s = torch.sigmoid(y[t] @ moe.gate.weight.float().t())
        chosen = torch.topk(s + moe.gate.e_score_correction_bias.float(), cfg.num_experts_per_tok).indices
        w = s[chosen] / (s[chosen].sum() + 1e-20) * cfg.routed_scaling_factor
        for e, we in zip(chosen.tolist(), w):
            g = dense(ex.gate_proj[e], ex.gate_proj_scale_inv[e])
            u = dense(ex.up_proj[e], ex.up_proj_scale_inv[e])
            d = dense(ex.down_proj[e], ex.down_proj_scale_inv[e])
            f[t] += we * swiglu_mlp(y[t], g, u, d)
    sh = moe.shared_experts
    f = f + swiglu_mlp(y, lin_w(sh.gate_proj), lin_w(sh.up_proj), lin_w(sh.down_proj))
    return rms(f + r, mtp.shared_head_norm.weight)


def lin_w(module):
    return dense(module.weight, module.weight_scale_inv)


def test_mtp_layer_matches_reference(tiny_fp32):
    model, cfg = tiny_fp32, tiny_fp32.config
    assert model.mtp is not None
    T = 11
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, cfg.hidden_size, generator=g)
    next_ids = torch.randint(0, 256, (T,), generator=g)
    cache = allocate_cache(cfg, 4, 8, 1, torch.float32, "cpu")
    md = build_metadata([T], [0], 0, [0], [[0, 1]], 8, "cpu")
    ctx = ForwardContext({model.mtp.self_attn.prefix: md}, md.positions)
    with torch.inference_mode():
        got = model.draft(next_ids, hidden, ctx, cache)
        ref = reference_mtp(model.mtp, cfg, model.embed(next_ids).float(), hidden, md.positions)
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max())
    # Position 0 ignores its embedding: changing that token leaves row 0 unchanged.
    other = next_ids.clone()
    other[0] = (other[0] + 1) % 256
    cache2 = allocate_cache(cfg, 4, 8, 1, torch.float32, "cpu")
    with torch.inference_mode():
        again = model.draft(other, hidden, ctx, cache2)
    assert torch.equal(again[0], got[0])
