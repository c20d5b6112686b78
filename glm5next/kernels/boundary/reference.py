"""PyTorch references of the fused mHC boundary: the stock module's numerics, fp32 math.

Same signatures as the kernels in `glm5next.kernels.boundary` (without the buffer and tuning
arguments). Self-contained PyTorch: the stock `hc_post`, `hc_expand`, `hc_contract` and `rms_norm`
are restated below (same numerics, no code shared with the model); the mixer weights mirror
`HyperConnection.weights` line by line with `post_mult` made explicit.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * cast(x * rsqrt(mean(x^2) + eps))` over the last dimension: fp32 statistics, x's dtype out."""
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed).to(x.dtype)


def hc_post(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams [T, n, D]: `post[j] * out + sum_i comb[i, j] * streams[i]` in fp32, in streams' dtype."""
    mixed = torch.einsum("tij,tid->tjd", comb, streams.float())
    return (post.unsqueeze(-1) * out.float().unsqueeze(1) + mixed).to(streams.dtype)


def hc_expand(embedded: torch.Tensor, n: int) -> torch.Tensor:
    """Streams [T, n, D]: `n` copies of the embeddings [T, D]."""
    return embedded.unsqueeze(1).expand(-1, n, -1).contiguous()


def hc_contract(streams: torch.Tensor) -> torch.Tensor:
    """The mean [T, D] of the streams [T, n, D]."""
    return streams.mean(dim=1)


def hc_weights(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    hc_eps: float,
    rms_eps: float,
    sinkhorn_iters: int,
    post_mult: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (pre [T, n], post [T, n], comb [T, n, n]) fp32 weights of `streams` [T, n, D]."""
    n = streams.shape[1]
    x = streams.reshape(streams.shape[0], -1).float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + rms_eps)
    mix = x @ fn.float().t()
    scale, base = scale.float(), base.float()
    pre = torch.sigmoid(mix[:, :n] * scale[0] + base[:n]) + hc_eps
    post = post_mult * torch.sigmoid(mix[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    logits = mix[:, 2 * n :].view(-1, n, n) * scale[2] + base[2 * n :].view(n, n)
    comb = torch.softmax(logits, dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, finish_sinkhorn(comb, hc_eps, sinkhorn_iters)


def finish_sinkhorn(comb: torch.Tensor, hc_eps: float, sinkhorn_iters: int) -> torch.Tensor:
    """The Sinkhorn iterations after the first: what a pending comb (a boundary's output under
    `defer_sinkhorn`) still needs before hc_post can apply it."""
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return comb


def _pre_and_norm(streams, fn, base, scale, norm_weight, hc_eps, rms_eps, norm_eps, sinkhorn_iters, post_mult,
                  defer_sinkhorn=False):
    pre, post, comb = hc_weights(
        streams, fn, base, scale,
        hc_eps=hc_eps, rms_eps=rms_eps, sinkhorn_iters=1 if defer_sinkhorn else sinkhorn_iters, post_mult=post_mult,
    )
    collapsed = (pre.unsqueeze(-1) * streams.float()).sum(dim=1).to(streams.dtype)
    return streams, post, comb, rms_norm(collapsed, norm_weight, norm_eps)


def mhc_boundary(
    out: torch.Tensor,
    streams: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    hc_eps: float,
    rms_eps: float,
    norm_eps: float,
    sinkhorn_iters: int,
    post_mult: float,
    defer_sinkhorn: bool = False,
    comb_pending: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(new_streams, new_post, new_comb, x): the previous sublayer's mHC post, then the next pre + norm.
    `defer_sinkhorn`: new_comb is pending (one Sinkhorn iteration done); `comb_pending`: so is `comb`."""
    if comb_pending:
        comb = finish_sinkhorn(comb, hc_eps, sinkhorn_iters)
    new_streams = hc_post(out, streams, post, comb)
    return _pre_and_norm(
        new_streams, fn, base, scale, norm_weight, hc_eps, rms_eps, norm_eps, sinkhorn_iters, post_mult,
        defer_sinkhorn,
    )


def mhc_first(
    embedded: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    hc_eps: float,
    rms_eps: float,
    norm_eps: float,
    sinkhorn_iters: int,
    post_mult: float,
    defer_sinkhorn: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(streams, post, comb, x) of the first layer: n copies of `embedded` [T, D], then pre + norm."""
    n = fn.shape[1] // embedded.shape[1]
    streams = hc_expand(embedded, n)
    return _pre_and_norm(streams, fn, base, scale, norm_weight, hc_eps, rms_eps, norm_eps, sinkhorn_iters, post_mult,
                         defer_sinkhorn)


def mhc_last(
    out: torch.Tensor,
    streams: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    final_norm_weight: torch.Tensor,
    *,
    norm_eps: float,
    comb_pending: bool = False,
    hc_eps: float = 0.0,
    sinkhorn_iters: int = 1,
) -> torch.Tensor:
    """The post-final-norm hidden states [T, D]: the last mHC post, the mean of the streams, RMSNorm
    (`comb_pending`: `comb` still needs its Sinkhorn iterations after the first)."""
    if comb_pending:
        comb = finish_sinkhorn(comb, hc_eps, sinkhorn_iters)
    return rms_norm(hc_contract(hc_post(out, streams, post, comb)), final_norm_weight, norm_eps)
