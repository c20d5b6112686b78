"""The benchmark slice: the first layers of GLM-5.3-Flash at real widths, random weights, random context.

Weights are drawn on the target device in row chunks and stored as the stock
loader stores a real checkpoint: FP8 e4m3 with fp32 128x128 block scales where
the checkpoint is FP8 (experts, dense MLPs, shared experts, MLA and indexer
projections), fp32 for the tensors the model keeps in fp32 (router, mHC
mixers, A_log, dt_bias, convolutions), the model dtype for the rest (KDA
projections, embedding, LM head, norms). Magnitudes keep every activation of
order one through the layers, and the router spreads tokens over the experts.
"""

from __future__ import annotations

import math

import torch

from ..checkpoint.fp8 import FP8_BLOCK, FP8_DTYPE, quantize_fp8_blocks, scale_shape
from ..checkpoint.inventory import FP8, FP32, expected_tensors
from ..config import Glm5NextConfig
from ..forward import ModelCache
from ..model.backbone import Glm5NextModel
from ..parallel.group import SINGLE, TensorParallel
from ..runtime.cache import allocate_cache

CHUNK_ELEMS = 1 << 26
"""Most fp32 random values drawn at once (256 MiB), so the 40 GB slice never needs a full fp32 copy."""

GLM53_FLASH_TEXT = {
    "vocab_size": 154880,
    "hidden_size": 4096,
    "num_hidden_layers": 45,
    "first_k_dense_replace": 3,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 288,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "n_group": 1,
    "topk_group": 1,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 256,
    "qk_rope_head_dim": 0,
    "v_head_dim": 256,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 2048,
    "index_kpool": 4,
    "linear_attn_config": {"num_heads": 64, "head_dim": 128, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0},
    "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-5,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "num_nextn_predict_layers": 1,
    "max_position_embeddings": 1048576,
    "pad_token_id": 154820,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]},
}
"""The text config of GLM-5.3-Flash (checkpoint spelling; values of the official config.json)."""

SMALL_OVERRIDES = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 384,
    "moe_intermediate_size": 128,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 128,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "index_n_heads": 4,
    "index_head_dim": 32,
    "index_topk": 32,
    "linear_attn_config": {"num_heads": 4, "head_dim": 32, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0},
    "max_position_embeddings": 65536,
    "pad_token_id": 500,
}
"""Sizes of the CPU-sized slice: same layer pattern and mechanisms, a few seconds per step on a CPU."""
SMALL_TP_OVERRIDES = {"intermediate_size": 512, "moe_intermediate_size": 256, "qk_nope_head_dim": 128,
                      "v_head_dim": 128, "index_head_dim": 128}
"""Widths of the CPU-sized slice under tensor parallelism: every FP8 weight splits on its 128-wide scale
blocks over 2 ranks."""


def slice_config(num_layers: int = 8, small: bool = False, with_mtp: bool = False,
                 tensor_parallel: bool = False) -> Glm5NextConfig:
    """GLM-5.3-Flash truncated to layers 0..num_layers-1 (DSA where i % 4 == 3, dense MLP in layers 0-2,
    MoE after), with the MTP layer only when asked; `small` shrinks every width for CPU tests (to
    widths that split over 2 ranks with `tensor_parallel`)."""
    if num_layers < 1:
        raise ValueError(f"num_layers={num_layers} must be at least 1")
    small_raw = {**SMALL_OVERRIDES, **(SMALL_TP_OVERRIDES if tensor_parallel else {})} if small else {}
    raw = {**GLM53_FLASH_TEXT, **small_raw}
    raw["num_hidden_layers"] = num_layers
    raw["num_nextn_predict_layers"] = 1 if with_mtp else 0
    raw["layer_types"] = ["deepseek_sparse_attention" if i % 4 == 3 else "linear_attention" for i in range(num_layers)]
    raw["mlp_layer_types"] = ["dense" if i < raw["first_k_dense_replace"] else "sparse" for i in range(num_layers)]
    return Glm5NextConfig.from_dict(raw)


# ------------------------------------------------------------------ random weights
def _law(name: str, shape: tuple[int, ...], config: Glm5NextConfig) -> tuple[str, float, float]:
    """How tensor `name` is drawn: ("normal", mean, std), ("log_uniform", lo, hi) or ("dt_bias", lo, hi)."""
    d = config.hidden_size
    if name == "embed_tokens.weight":
        return ("normal", 0.0, 1.0)
    if name.endswith(("hc_attn_fn", "hc_ffn_fn")):
        return ("normal", 0.0, 0.5 / math.sqrt(shape[-1]))  # mixes of std 0.5 over RMS-normalised streams
    if name.endswith(("hc_attn_base", "hc_ffn_base")):
        return ("normal", 0.0, 0.1)
    if name.endswith(("hc_attn_scale", "hc_ffn_scale")):
        return ("normal", 1.0, 0.1)
    if name.endswith("mlp.gate.weight"):
        return ("normal", 0.0, 2.0 / math.sqrt(d))  # router logits of std 2: distinct top-k per token
    if name.endswith("e_score_correction_bias"):
        return ("normal", 0.0, 0.01)
    if name.endswith("A_log"):
        return ("log_uniform", 1.0, 16.0)
    if name.endswith("dt_bias"):
        return ("dt_bias", math.log(1e-3), math.log(1e-1))
    if name.endswith("_conv1d.weight"):
        return ("normal", 0.0, 0.3)
    if name.endswith("index_kpool_compress_ape"):
        return ("normal", 0.0, 0.5)
    if name.endswith("index_kpool_compress_gate"):
        return ("normal", 0.0, 1.0 / math.sqrt(d))
    if name.endswith(".bias"):
        return ("normal", 0.0, 0.1)
    if len(shape) == 1:
        return ("normal", 1.0, 0.1)  # norm weights
    return ("normal", 0.0, 1.0 / math.sqrt(shape[-1]))  # [out, in] projections: unit-variance outputs


def _draw(law: tuple[str, float, float], shape: tuple[int, ...], gen: torch.Generator, device) -> torch.Tensor:
    """fp32 values of `shape` drawn by `law` on `device`."""
    kind, a, b = law
    if kind == "normal":
        return torch.randn(shape, generator=gen, device=device).mul_(b).add_(a)
    u = torch.rand(shape, generator=gen, device=device).mul_(b - a).add_(a)
    if kind == "log_uniform":
        return u.log_()
    dt = u.exp_()
    return dt + torch.log(-torch.expm1(-dt))  # inverse softplus of dt


def _random_dense(shape, law, gen, device, dtype) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    flat = out.view(shape[0], -1)
    step = max(1, CHUNK_ELEMS // flat.shape[1])
    for a in range(0, flat.shape[0], step):
        b = min(flat.shape[0], a + step)
        flat[a:b] = _draw(law, (b - a, flat.shape[1]), gen, device)
    return out


def _random_fp8(shape, law, gen, device) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = shape
    w = torch.empty(shape, dtype=FP8_DTYPE, device=device)
    s = torch.empty(scale_shape(tuple(shape)), dtype=torch.float32, device=device)
    step = max(FP8_BLOCK, CHUNK_ELEMS // cols // FP8_BLOCK * FP8_BLOCK)
    for a in range(0, rows, step):
        b = min(rows, a + step)
        q, sc = quantize_fp8_blocks(_draw(law, (b - a, cols), gen, device))
        w[a:b] = q
        s[a // FP8_BLOCK : a // FP8_BLOCK + sc.shape[0]] = sc
    return w, s


def build_slice_model(
    config: Glm5NextConfig, device: torch.device | str, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
    with_mtp: bool = False, tp: TensorParallel = SINGLE,
) -> Glm5NextModel:
    """The backbone of `config` (with the MTP layer when asked) with seeded random weights drawn on
    `device` in the checkpoint's dtypes; under tensor parallelism, this rank's shards only."""
    device = torch.device(device)
    model = Glm5NextModel(config, with_mtp=with_mtp, tp=tp)
    specs = model.tensor_specs()
    expected = expected_tensors(config, include_mtp=with_mtp)
    if set(specs) != set(expected):
        raise RuntimeError(f"model and inventory disagree: {sorted(set(specs) ^ set(expected))[:5]}")
    gen = torch.Generator(device=device).manual_seed(seed + 7919 * tp.rank)
    for name, spec in specs.items():
        law = _law(name, spec.shape, config)
        official = expected[name].official_dtype
        if official == FP8 and spec.fp8_ok:
            spec.install(*_random_fp8(spec.local_shape, law, gen, device))
        else:
            keep = spec.keep_fp32 or official == FP32
            spec.install(_random_dense(spec.local_shape, law, gen, device, torch.float32 if keep else dtype), None)
    model.dtype = dtype
    return model.eval()


# ------------------------------------------------------------------ random context
def blocks_per_sequence(context: int, block_size: int, extra_tokens: int = 1) -> int:
    """Paged blocks a sequence needs for `context` cached tokens plus `extra_tokens` decoded ones."""
    return -(-(context + extra_tokens) // block_size)


def make_cache(
    config: Glm5NextConfig, num_seqs: int, context: int, block_size: int, dtype: torch.dtype, device,
    extra_tokens: int = 1, include_mtp: bool = False, verify_tokens: int = 0, tp_size: int = 1,
) -> ModelCache:
    """A cache with room for `num_seqs` sequences of `context` tokens plus `extra_tokens` new ones each
    (with the MTP layer's cache and the KDA verify scratch of `verify_tokens`-token steps when asked)."""
    per = blocks_per_sequence(context, block_size, extra_tokens)
    return allocate_cache(config, num_seqs * per, block_size, num_seqs, dtype, device, include_mtp=include_mtp,
                          verify_tokens=verify_tokens, tp_size=tp_size)


def _fill_normal_(t: torch.Tensor, std: float, gen: torch.Generator) -> None:
    flat = t.view(-1)
    for a in range(0, flat.numel(), CHUNK_ELEMS):
        b = min(flat.numel(), a + CHUNK_ELEMS)
        flat[a:b] = torch.randn(b - a, generator=gen, device=t.device).mul_(std)


def fill_context(cache: ModelCache, seqs: int, context: int, seed: int = 0, extra_tokens: int = 1) -> list[list[int]]:
    """Random prior context of `context` tokens for sequences 0..seqs-1 (KDA slot i, consecutive blocks):
    latents, indexer keys and gates, pooled keys (the MTP layer's too, where the cache has it) and KDA
    conv/recurrent states. Returns each sequence's block list, long enough for `extra_tokens` new tokens
    from position `context`."""
    per = blocks_per_sequence(context, cache.block_size, extra_tokens)
    used = seqs * per
    if used > cache.num_blocks or seqs > cache.num_slots:
        raise ValueError(f"{seqs} sequences of {context} tokens need {used} blocks and {seqs} slots; the cache "
                         f"has {cache.num_blocks} and {cache.num_slots}")
    gen = torch.Generator(device=next(iter(cache.tensors())).device).manual_seed(seed)
    for i in sorted(cache.dsa):
        c = cache.dsa[i]
        _fill_normal_(c.latent[:used], 1.0, gen)  # RMS-normalised latents
        _fill_normal_(c.index_key[:used], 1.0, gen)  # LayerNorm outputs
        _fill_normal_(c.index_gate[:used], 1.0, gen)
        _fill_normal_(c.pooled_key[:used], 0.5, gen)  # softmax-weighted means of the keys
    for i in sorted(cache.kda):
        s = cache.kda[i]
        _fill_normal_(s.conv[:seqs], 1.0, gen)  # pre-conv q|k|v projections
        _fill_normal_(s.recurrent[:seqs], 0.1, gen)
    return [list(range(k * per, (k + 1) * per)) for k in range(seqs)]
