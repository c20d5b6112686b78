"""The DSA lightning indexer: per-token indexer keys, KPool-compressed pool keys and top-k pool selection.

Pools are `index_kpool` consecutive tokens aligned to absolute positions; pool
`p` holds positions `kpool*p .. kpool*p + kpool-1` and exists once its last
token is cached. A query scores every complete, causal pool and keeps the best
`index_topk / index_kpool` of them (spec section 6.2-6.3). Under tensor parallelism each rank
scores with its own heads and the pool scores are summed over the ranks before the top-k, so
every rank selects the same pools.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint.specs import TensorSpec, set_param
from ..config import INDEXER_KEY_NORM_EPS, Glm5NextConfig
from ..forward import DsaCache
from ..parallel.collectives import all_reduce
from ..parallel.group import SINGLE, TensorParallel
from ..parallel.layers import ColumnParallelLinear, Linear

_TIE_BITS = 32
"""Low bits of the top-k sort key that hold the (reversed) pool index, so ties go to the lower pool."""


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias over the last dimension, statistics and affine map in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, device="meta"), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(dim, device="meta"), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x.float(), (self.dim,), self.weight.float(), self.bias.float(), self.eps)
        return y.to(x.dtype)

    def tensor_specs(self, prefix: str) -> dict[str, TensorSpec]:
        """The checkpoint tensors `prefix.weight` and `prefix.bias`."""
        return {
            f"{prefix}.weight": TensorSpec((self.dim,), lambda t, s: set_param(self, "weight", t)),
            f"{prefix}.bias": TensorSpec((self.dim,), lambda t, s: set_param(self, "bias", t)),
        }


def compress_pool(keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """Pooled keys `[..., d]` in keys' dtype: a per-channel softmax over the pool slots of `gates + ape`
    weighting `keys`.

    `keys`, `gates`: `[..., kpool, d]` (cache dtype); `ape`: `[kpool, d]` fp32. The probabilities are
    cast to the key dtype before the weighted sum, as transformers does.
    """
    probs = torch.softmax(gates.float() + ape.float(), dim=-2).to(keys.dtype)
    return (probs * keys).sum(dim=-2)


def top_pools(scores: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """`[T, k]` int64 indices of the `k` best valid pools per row, best first, -1 where fewer are valid.

    `scores`: `[T, P]` fp32; `valid`: `[T, P]` bool. Equal scores rank the lower pool index first
    (torch.topk leaves ties unspecified, which would make batched and one-by-one runs disagree):
    each score becomes an order-preserving integer with the reversed pool index in its low bits.
    """
    s = scores.masked_fill(~valid, torch.finfo(torch.float32).min) + 0.0  # + 0.0 turns -0.0 into +0.0
    bits = s.contiguous().view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    index = torch.arange(s.shape[-1], device=s.device, dtype=torch.int64)
    key = ordered * (1 << _TIE_BITS) + ((1 << _TIE_BITS) - 1 - index)
    best = key.topk(k, dim=-1).indices
    return best.masked_fill(~valid.gather(-1, best), -1)


class Indexer(nn.Module):
    """The indexer of one DSA layer: query/key/weight projections, the KPool gate and the pool selection."""

    def __init__(self, config: Glm5NextConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        heads, what = config.index_n_heads, "index_n_heads"
        self.n_heads = tp.split(heads, what)
        """This rank's indexer heads (all of them on one process)."""
        self.head_dim = config.index_head_dim
        self.kpool = config.index_kpool
        self.topk_pools = config.index_topk_pools
        self.hidden_size = config.hidden_size
        self.tp = tp
        self.softmax_scale = self.head_dim**-0.5
        self.head_weight_scale = heads**-0.5
        # Queries and head weights split by heads; the one key per token (wk, k_norm, the KPool gate)
        # is shared by every head, so it is replicated.
        self.wq_b = ColumnParallelLinear(config.q_lora_rank, heads * self.head_dim, tp, what)
        self.wk = Linear(config.hidden_size, self.head_dim)
        self.k_norm = LayerNorm(self.head_dim, INDEXER_KEY_NORM_EPS)
        self.weights_proj = ColumnParallelLinear(config.hidden_size, heads, tp, what)
        meta = dict(device="meta")
        self.index_kpool_compress_gate = nn.Parameter(torch.empty(self.head_dim, self.hidden_size, **meta), False)
        self.index_kpool_compress_ape = nn.Parameter(torch.empty(self.kpool, self.head_dim, **meta), False)

    def tensor_specs(self, prefix: str) -> dict[str, TensorSpec]:
        """Every checkpoint tensor of the indexer under `prefix` (e.g. `layers.3.self_attn.indexer`)."""
        gate, ape = "index_kpool_compress_gate", "index_kpool_compress_ape"
        return {
            **self.wq_b.tensor_specs(f"{prefix}.wq_b"),
            **self.wk.tensor_specs(f"{prefix}.wk"),
            **self.k_norm.tensor_specs(f"{prefix}.k_norm"),
            **self.weights_proj.tensor_specs(f"{prefix}.weights_proj"),
            f"{prefix}.{gate}": TensorSpec(
                (self.head_dim, self.hidden_size), lambda t, s: set_param(self, gate, t), keep_fp32=True
            ),
            f"{prefix}.{ape}": TensorSpec((self.kpool, self.head_dim), lambda t, s: set_param(self, ape, t), keep_fp32=True),
        }

    def project(
        self, x: torch.Tensor, cq: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The indexer query `[T, H, d]`, fp32 head weights `[T, H]` (scale folded in), key `[T, d]` and
        KPool gate logits `[T, d]` of tokens `x` `[T, hidden]` with normalised query latent `cq` `[T, q_lora]`."""
        return self.outputs(x, self.wq_b(cq), self.wk(x))

    def outputs(
        self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`project`'s results from the outputs of its linears: `q` of wq_b [T, H * d], `k` of wk [T, d]
        (before the key norm)."""
        q = q.view(-1, self.n_heads, self.head_dim)
        k = self.k_norm(k)
        w = F.linear(x.float(), self.weights_proj.dense_weight(torch.float32)) * self.head_weight_scale
        g = F.linear(x, self.index_kpool_compress_gate.to(x.dtype))
        return q, w, k, g

    def write_pools(self, positions: torch.Tensor, slot_mapping: torch.Tensor, cache: DsaCache) -> None:
        """Build and store the pooled key of every pool a token of this step completes.

        `positions`, `slot_mapping`: `[T]` int64. A token at position p with p % kpool == kpool-1 reads
        the cached keys and gates of slots `slot-kpool+1 .. slot` (one block: blocks are kpool-aligned)
        and writes pool row `slot // kpool`; every other token (and padding) computes on the scratch
        block and writes there, so the write keeps a static shape.
        """
        kp, bs, d = self.kpool, cache.block_size, self.head_dim
        done = (positions % kp == kp - 1) & (slot_mapping >= 0)
        first = torch.where(done, slot_mapping - (kp - 1), torch.full_like(slot_mapping, cache.num_blocks * bs))
        rows = first[:, None] + torch.arange(kp, device=first.device)
        keys = cache.index_key.view(-1, d)[rows]
        gates = cache.index_gate.view(-1, d)[rows]
        pooled = compress_pool(keys, gates, self.index_kpool_compress_ape)
        scratch_pool = cache.num_blocks * (bs // kp)
        dest = torch.where(done, slot_mapping // kp, torch.full_like(slot_mapping, scratch_pool))
        cache.pooled_key.view(-1, d).index_copy_(0, dest, pooled.to(cache.pooled_key.dtype))

    def select(
        self, q: torch.Tensor, w: torch.Tensor, pool_keys: torch.Tensor, visible: torch.Tensor, k: int
    ) -> torch.Tensor:
        """`[T, k]` int64 selected pools per query (-1 = none): top-k of `sum_h w_h * relu(q_h . K_p * d^-0.5)`.

        `q`: `[T, H, d]`; `w`: `[T, H]` fp32; `pool_keys`: `[T or 1, P, d]`; `visible`: `[T, P]` bool.
        """
        scores = torch.matmul(q.float(), pool_keys.float().transpose(-1, -2))
        scores = torch.relu(scores * self.softmax_scale)
        index_scores = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)
        # A sum over heads: with the heads split over the ranks, every rank ranks the same full sum.
        return top_pools(all_reduce(index_scores, self.tp), visible, k)
