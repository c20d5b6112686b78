"""The DSA decode launches' fp32 references: plain, self-contained PyTorch of the same signatures as
`indexer_inputs`, `index_scores`, `select_pools`, `sparse_attention` and `dsa_decode`, one token at a time, with explicit
pool and row lists and a stable sort for the top-k (higher score first, the lower pool on ties)."""

from __future__ import annotations

import torch


def _visible(position: int, slot: int, kpool: int, n_pools: int) -> int:
    return 0 if slot < 0 else min((position + 1) // kpool, n_pools)


def indexer_inputs_reference(x, ki, w, scratch=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See `glm5next.kernels.dsa.indexer_inputs`: the stock formulas, in fp32."""
    prod = x.float() @ w.weight.float().t()
    wi = prod[:, : w.heads] * w.scale
    gi = prod[:, w.heads:].to(x.dtype)
    ko = torch.nn.functional.layer_norm(ki.float(), (ki.shape[1],), w.norm_weight.float(), w.norm_bias.float(), w.eps)
    return wi, gi, ko.to(ki.dtype)


def index_scores_reference(qi, wi, positions, slots, token_to_seq, block_tables, pooled_key, kpool, scale, plan=None,
                           out=None) -> torch.Tensor:
    """See `glm5next.kernels.dsa.index_scores`."""
    t = qi.shape[0]
    per_block = pooled_key.shape[1]
    n_pools = block_tables.shape[1] * per_block
    out = torch.full((t, n_pools), float("nan"), dtype=torch.float32, device=qi.device) if out is None else out
    flat = pooled_key.reshape(-1, pooled_key.shape[-1]).float()
    for i in range(t):
        n = _visible(int(positions[i]), int(slots[i]), kpool, n_pools)
        if n == 0:
            continue
        pools = torch.arange(n, device=qi.device)
        table = block_tables[int(token_to_seq[i])]
        keys = flat[table[pools // per_block] * per_block + pools % per_block]  # [n, d]
        dots = torch.relu((qi[i].float() @ keys.t()) * scale)  # [Hi, n]
        out[i, :n] = (wi[i].float()[:, None] * dots).sum(0)
    return out


def select_pools_reference(scores, positions, slots, kpool, k, plan=None, out=None,
                           count=None) -> tuple[torch.Tensor, torch.Tensor]:
    """See `glm5next.kernels.dsa.select_pools`."""
    t, n_pools = scores.shape
    out = torch.full((t, k), -1, dtype=torch.int64, device=scores.device) if out is None else out.fill_(-1)
    count = torch.zeros(t, dtype=torch.int32, device=scores.device) if count is None else count
    for i in range(t):
        n = _visible(int(positions[i]), int(slots[i]), kpool, n_pools)
        kept = min(k, n)
        s = scores[i, :n].float() + 0.0
        order = torch.sort(-s, stable=True).indices[:kept]  # stable: equal scores keep the lower pool first
        out[i, :kept] = order.sort().values
        count[i] = kept
    return out, count


def sparse_attention_reference(q, selection, count, positions, slots, token_to_seq, block_tables, latent, w,
                               plan=None, out=None, scratch=None) -> torch.Tensor:
    """See `glm5next.kernels.dsa.sparse_attention`."""
    t, h, _ = q.shape
    kp, bs = w.kpool, latent.shape[1]
    n_pools = block_tables.shape[1] * bs // kp
    v = w.w_uv_t.shape[2]
    out = torch.empty(t, h, v, dtype=torch.float32, device=q.device) if out is None else out
    flat = latent.reshape(-1, latent.shape[-1]).float()
    w_uk, w_uv_t = w.dense()
    for i in range(t):
        if int(slots[i]) < 0:
            out[i] = 0
            continue
        pos = int(positions[i])
        rows = []
        for p in selection[i, : int(count[i])].tolist():
            if 0 <= p < n_pools and kp * p + kp - 1 <= pos:
                rows += [kp * p + r for r in range(kp)]
        rows += list(range((pos + 1) // kp * kp, pos + 1))
        rows = rows or [0]  # no row left (a reused selection): the sequence's first, as the stock softmax does
        tok = torch.tensor(rows, dtype=torch.int64, device=q.device)
        table = block_tables[int(token_to_seq[i])]
        lat = flat[table[tok // bs] * bs + tok % bs]  # [rows, R]
        q_lat = torch.einsum("hn,hnr->hr", q[i].float(), w_uk)
        probs = torch.softmax(q_lat @ lat.t() * w.scale, dim=-1)
        out[i] = torch.einsum("hr,hrv->hv", probs @ lat, w_uv_t)
    return out


def dsa_decode_reference(q, qi, wi, positions, slots, token_to_seq, block_tables, latent, pooled_key, w, plan=None,
                         selection=None, scratch=None) -> tuple[torch.Tensor, torch.Tensor]:
    """See `glm5next.kernels.dsa.dsa_decode`."""
    t = q.shape[0]
    if selection is None:
        scores = index_scores_reference(qi, wi, positions, slots, token_to_seq, block_tables, pooled_key, w.kpool,
                                        w.index_scale)
        selection, count = select_pools_reference(scores, positions, slots, w.kpool, w.topk_pools)
    else:
        count = torch.full((t,), selection.shape[1], dtype=torch.int32, device=q.device)
    values = sparse_attention_reference(q, selection, count, positions, slots, token_to_seq, block_tables, latent, w)
    return values, selection
