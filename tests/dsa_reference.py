"""An independent float64 reference of one DSA layer over one sequence, written from spec section 6.

Per-token Python loops, non-absorbed MLA (explicit per-head keys and values),
explicit pool lists, an explicit sort for the top-k (higher score first, lower
pool index on ties) and an explicit tail. Shares no code with glm5next.model.
"""

from __future__ import annotations

import math

import torch


def _rms(v: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return v / math.sqrt(float((v * v).mean()) + eps) * w


def _layer_norm(v: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    mean = v.mean()
    var = ((v - mean) ** 2).mean()
    return (v - mean) / math.sqrt(float(var) + eps) * w + b


def reference_dsa(layer, x: torch.Tensor) -> tuple[torch.Tensor, list[list[int]], list[list[float]]]:
    """Outputs `[S, hidden]` float64 of `layer` (a SparseMLA) for one whole sequence `x` `[S, hidden]`,
    the selected pools of every token (best first) and every token's scores of its visible pools."""
    cfg = layer.config
    p = {name: t.detach().double() for name, t in layer.named_parameters()}
    eps, kp = cfg.rms_norm_eps, cfg.index_kpool
    H, nope, vd, R = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    Hi, d = cfg.index_n_heads, cfg.index_head_dim
    kv_b = p["kv_b_proj.weight"].view(H, nope + vd, R)
    w_uk, w_uv = kv_b[:, :nope], kv_b[:, nope:]
    x = x.double()
    S = x.shape[0]

    q, c, k_idx, g_idx, q_idx, w_idx = [], [], [], [], [], []
    for t in range(S):
        cq = _rms(p["q_a_proj.weight"] @ x[t], p["q_a_layernorm.weight"], eps)
        q.append((p["q_b_proj.weight"] @ cq).view(H, nope))
        c.append(_rms(p["kv_a_proj_with_mqa.weight"] @ x[t], p["kv_a_layernorm.weight"], eps))
        k_idx.append(_layer_norm(p["indexer.wk.weight"] @ x[t], p["indexer.k_norm.weight"], p["indexer.k_norm.bias"], 1e-6))
        g_idx.append(p["indexer.index_kpool_compress_gate"] @ x[t])
        q_idx.append((p["indexer.wq_b.weight"] @ cq).view(Hi, d))
        w_idx.append((p["indexer.weights_proj.weight"] @ x[t]) * (d**-0.5 * Hi**-0.5))

    ape = p["indexer.index_kpool_compress_ape"]
    pooled = {}
    for pool in range(S // kp):
        key = torch.zeros(d, dtype=torch.float64)
        for ch in range(d):
            logits = [float(g_idx[kp * pool + r][ch] + ape[r, ch]) for r in range(kp)]
            top = max(logits)
            e = [math.exp(v - top) for v in logits]
            key[ch] = sum(e[r] / sum(e) * float(k_idx[kp * pool + r][ch]) for r in range(kp))
        pooled[pool] = key

    out, chosen, all_scores = [], [], []
    for t in range(S):
        visible = [pool for pool in range(S // kp) if kp * pool + kp - 1 <= t]
        scores = {}
        for pool in visible:
            scores[pool] = sum(
                float(w_idx[t][h]) * max(0.0, float(q_idx[t][h] @ pooled[pool])) for h in range(Hi)
            )
        k_sel = min(cfg.index_topk // kp, len(visible))
        best = sorted(visible, key=lambda pool: (-scores[pool], pool))[:k_sel]
        tail = list(range(kp * ((t + 1) // kp), t + 1))
        tokens = sorted([kp * pool + r for pool in best for r in range(kp)] + tail)
        heads = []
        for h in range(H):
            keys = [w_uk[h] @ c[j] for j in tokens]
            vals = [w_uv[h] @ c[j] for j in tokens]
            logits = torch.tensor([float(q[t][h] @ kj) / math.sqrt(nope) for kj in keys], dtype=torch.float64)
            probs = torch.softmax(logits, dim=0)
            heads.append(sum(pr * vj for pr, vj in zip(probs, vals)))
        out.append(p["o_proj.weight"] @ torch.cat(heads))
        chosen.append(best)
        all_scores.append([scores[pool] for pool in visible])
    return torch.stack(out), chosen, all_scores
