"""mHC: the four residual streams, mixed around every sublayer.

Each sublayer reads a collapse of the streams (pre weights), and its output is
spread back over them (post weights) on top of a doubly-stochastic mix of the
old streams (comb, from Sinkhorn normalisation).
"""

from __future__ import annotations

import torch
from torch import nn

from ..checkpoint.specs import TensorSpec, set_param
from ..config import MHC_POST_MULT, Glm5NextConfig


class HyperConnection(nn.Module):
    """The mixer of one sublayer: `fn` [(2+n)n, n*D], `base` [(2+n)n], `scale` [3], all fp32."""

    def __init__(self, config: Glm5NextConfig) -> None:
        super().__init__()
        n, d = config.hc_mult, config.hidden_size
        self.n = n
        self.hidden_size = d
        self.eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps
        self.sinkhorn_iters = config.hc_sinkhorn_iters
        width = (2 + n) * n
        self.fn = nn.Parameter(torch.empty(width, n * d, device="meta"), requires_grad=False)
        self.base = nn.Parameter(torch.empty(width, device="meta"), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(3, device="meta"), requires_grad=False)

    def tensor_specs(self, prefix: str) -> dict[str, TensorSpec]:
        """The checkpoint tensors `{prefix}_fn`, `{prefix}_base`, `{prefix}_scale` (e.g. `layers.0.hc_attn`)."""
        n, d = self.n, self.hidden_size
        w = (2 + n) * n
        return {
            f"{prefix}_fn": TensorSpec((w, n * d), lambda t, s: set_param(self, "fn", t), keep_fp32=True),
            f"{prefix}_base": TensorSpec((w,), lambda t, s: set_param(self, "base", t), keep_fp32=True),
            f"{prefix}_scale": TensorSpec((3,), lambda t, s: set_param(self, "scale", t), keep_fp32=True),
        }

    def weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The (pre [T, n], post [T, n], comb [T, n, n]) fp32 weights for `streams` [T, n, D]."""
        n = self.n
        x = streams.reshape(streams.shape[0], -1).float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        mix = x @ self.fn.float().t()
        scale, base = self.scale.float(), self.base.float()
        pre = torch.sigmoid(mix[:, :n] * scale[0] + base[:n]) + self.eps
        post = MHC_POST_MULT * torch.sigmoid(mix[:, n : 2 * n] * scale[1] + base[n : 2 * n])
        logits = mix[:, 2 * n :].view(-1, n, n) * scale[2] + base[2 * n :].view(n, n)
        comb = torch.softmax(logits, dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        return pre, post, comb

    def pre(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The sublayer input [T, D] (streams' dtype) and the (post, comb) weights to apply after it."""
        pre, post, comb = self.weights(streams)
        collapsed = (pre.unsqueeze(-1) * streams.float()).sum(dim=1).to(streams.dtype)
        return collapsed, post, comb


def hc_post(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams [T, n, D]: `post[j] * out + sum_i comb[i, j] * streams[i]`, fp32 math, streams' dtype."""
    mixed = torch.einsum("tij,tid->tjd", comb, streams.float())
    return (post.unsqueeze(-1) * out.float().unsqueeze(1) + mixed).to(streams.dtype)


def hc_expand(embedded: torch.Tensor, n: int) -> torch.Tensor:
    """Streams [T, n, D]: `n` copies of the embeddings [T, D]."""
    return embedded.unsqueeze(1).expand(-1, n, -1).contiguous()


def hc_contract(streams: torch.Tensor) -> torch.Tensor:
    """The plain mean of the streams [T, n, D] -> [T, D] (no learned head)."""
    return streams.mean(dim=1)
