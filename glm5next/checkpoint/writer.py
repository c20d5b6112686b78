"""Small random GLM-5.3-Flash checkpoints written in exactly the official Hugging Face layout.

Multimodal-wrapper config.json with an FP8 quantization_config, sharded
safetensors with an index, FP8 block-scaled weights beside their
`weight_scale_inv`, the MTP layer, a few vision tensors, a generation config and
a byte-level tokenizer with a chat template.
"""

from __future__ import annotations

import json
import math
import os

import torch
from safetensors.torch import save_file

from ..config import Glm5NextConfig
from .fp8 import quantize_fp8_blocks
from .inventory import BF16, FP8, FP32, LM_HEAD, SCALE_SUFFIX, VISUAL_PREFIX, Expected, checkpoint_key, expected_tensors
from .tiny_tokenizer import write_tokenizer

TINY_TEXT_CONFIG = {
    "vocab_size": 320,
    "hidden_size": 128,
    "num_hidden_layers": 8,
    "first_k_dense_replace": 3,
    "intermediate_size": 192,
    "moe_intermediate_size": 64,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_shared_experts": 1,
    "num_attention_heads": 4,
    "q_lora_rank": 96,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 0,
    "v_head_dim": 32,
    "index_n_heads": 4,
    "index_head_dim": 32,
    "index_topk": 32,
    "index_kpool": 4,
    "linear_attn_config": {"num_heads": 4, "head_dim": 32, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0},
    "routed_scaling_factor": 2.5,
    "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-5,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "num_nextn_predict_layers": 1,
    "max_position_embeddings": 4096,
    "pad_token_id": 260,
    "eos_token_id": 256,
}
"""Text sizes of the tiny model (checkpoint spelling). Layer kinds follow the
official rule (DSA where i % 4 == 3), MLPs are dense for layers 0-2, then MoE."""

TP_READY_OVERRIDES = {
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "intermediate_size": 1024,
    "moe_intermediate_size": 1024,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "num_attention_heads": 8,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "index_n_heads": 8,
    "index_head_dim": 128,
    "linear_attn_config": {"num_heads": 8, "head_dim": 32, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0},
}
"""The tiny model resized so 2, 4 and 8 ranks split it, every FP8 weight on 128-wide scale-block boundaries
(8 heads of each kind, head widths and MLP shards of 128): KDA layers 0-2, a DSA layer 3, a dense layer
0, MoE layers 1-3 (`glm5next make-tiny --tp-ready`)."""

TINY_VISION_CONFIG = {
    "model_type": "glm5_next_vision",
    "depth": 1,
    "hidden_size": 32,
    "num_heads": 2,
    "intermediate_size": 64,
    "projection_intermediate_size": 64,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
"""A vision tower small enough to instantiate; `out_hidden_size` is set to the text width."""

_VISUAL_TENSORS = {
    "blocks.0.norm1.weight": lambda v, d: (v["hidden_size"],),
    "post_layernorm.weight": lambda v, d: (v["hidden_size"],),
    "merger.post_projection_norm.weight": lambda v, d: (d,),
}
"""A few real vision-tower tensor names and shapes, so text loaders must skip them."""

_TORCH_DTYPE = {BF16: torch.bfloat16, FP32: torch.float32}


def make_tiny_checkpoint(
    out_dir: str,
    seed: int = 0,
    text_overrides: dict | None = None,
    num_shards: int = 3,
    with_mtp: bool = True,
) -> str:
    """The folder `out_dir`, filled with a seeded random checkpoint of the tiny
    config (updated by `text_overrides`, in checkpoint spelling)."""
    text = {**TINY_TEXT_CONFIG, **(text_overrides or {})}
    config = Glm5NextConfig.from_dict(text)
    expected = expected_tensors(config, include_mtp=with_mtp)
    os.makedirs(out_dir, exist_ok=True)
    _write_json(os.path.join(out_dir, "config.json"), wrapper_config(config, expected))
    _write_json(os.path.join(out_dir, "generation_config.json"), _generation_config(config))
    tensors = random_tensors(config, expected, seed)
    write_shards(out_dir, tensors, num_shards)
    write_tokenizer(out_dir, eos_token_id=config.eos_token_ids[0], pad_token_id=config.pad_token_id)
    return out_dir


def wrapper_config(config: Glm5NextConfig, expected: dict[str, Expected]) -> dict:
    """The multimodal config.json of `config`, with FP8 quantization of the fp8 tensors in `expected`."""
    return {
        "architectures": ["Glm5NextForConditionalGeneration"],
        "model_type": "glm5_next",
        "text_config": config.to_text_dict(),
        "vision_config": {**TINY_VISION_CONFIG, "out_hidden_size": config.hidden_size},
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": _modules_to_not_convert(expected),
        },
        "eos_token_id": list(config.eos_token_ids),
        "pad_token_id": config.pad_token_id,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }


def _modules_to_not_convert(expected: dict[str, Expected]) -> list[str]:
    """Module paths of every linear layer kept in high precision (matrix `.weight`s not stored FP8)."""
    names = [
        checkpoint_key(n)[: -len(".weight")]
        for n, e in expected.items()
        if n.endswith(".weight") and len(e.shape) == 2 and e.official_dtype != FP8 and n != "embed_tokens.weight"
    ]
    return sorted(names) + ["model.visual"]


def _generation_config(config: Glm5NextConfig) -> dict:
    return {"eos_token_id": list(config.eos_token_ids), "pad_token_id": config.pad_token_id}


def random_tensors(config: Glm5NextConfig, expected: dict[str, Expected], seed: int) -> dict[str, torch.Tensor]:
    """Every safetensors key of the checkpoint and its stored tensor (FP8 with scale siblings,
    bf16 or fp32 as the official release stores it), seeded and deterministic."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, exp in expected.items():
        w = random_value(name, exp.shape, config, g)
        key = checkpoint_key(name)
        if exp.official_dtype == FP8:
            out[key], out[key + SCALE_SUFFIX] = quantize_fp8_blocks(w)
        else:
            out[key] = w.to(_TORCH_DTYPE[exp.official_dtype])
    for name, shape_of in _VISUAL_TENSORS.items():
        shape = shape_of(TINY_VISION_CONFIG, config.hidden_size)
        out[VISUAL_PREFIX + name] = (1 + 0.1 * torch.randn(shape, generator=g)).to(torch.bfloat16)
    return out


def random_value(name: str, shape: tuple[int, ...], config: Glm5NextConfig, g: torch.Generator) -> torch.Tensor:
    """An fp32 random value for tensor `name` that keeps the model well conditioned:
    activations neither explode nor vanish, mHC mixing and routing are non-trivial."""
    d = config.hidden_size

    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return mean + std * torch.randn(shape, generator=g)

    def uniform(lo: float, hi: float) -> torch.Tensor:
        return lo + (hi - lo) * torch.rand(shape, generator=g)

    if name == "embed_tokens.weight":
        return normal(1.0)
    if name.endswith(("hc_attn_fn", "hc_ffn_fn")):
        # The mix is fn @ (RMS-normalised 4D-wide streams): std 0.5 per entry.
        return normal(0.5 / math.sqrt(shape[1]))
    if name.endswith(("hc_attn_base", "hc_ffn_base")):
        return normal(0.1)
    if name.endswith(("hc_attn_scale", "hc_ffn_scale")):
        return normal(0.1, mean=1.0)
    if name.endswith("mlp.gate.weight"):
        # Router logits of std 2 keep the top-k well separated from the rest.
        return normal(2.0 / math.sqrt(d))
    if name.endswith("e_score_correction_bias"):
        return normal(0.01)
    if name.endswith("A_log"):
        return uniform(1.0, 16.0).log()
    if name.endswith("dt_bias"):
        dt = uniform(math.log(1e-3), math.log(1e-1)).exp()
        return dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    if name.endswith("_conv1d.weight"):
        return normal(0.3)
    if name.endswith("index_kpool_compress_ape"):
        return normal(0.5)
    if name.endswith("index_kpool_compress_gate"):
        return normal(1.0 / math.sqrt(d))
    if name.endswith("indexer.wq_b.weight"):
        # Indexer heads in pairs (h, h+1) with opposite queries: exactly one of each pair has a
        # positive ReLU, so no pool scores exactly 0. With few heads, exact-zero scores would
        # otherwise tie at the top-k boundary, where implementations break ties differently.
        w = normal(1.0 / math.sqrt(shape[-1])).view(config.index_n_heads, -1, shape[-1])
        pairs = config.index_n_heads // 2 * 2
        w[1:pairs:2] = -w[0:pairs:2]
        return w.view(shape)
    if name.endswith(".bias"):
        return normal(0.1)
    if len(shape) == 1:
        return normal(0.1, mean=1.0)  # norm weights
    return normal(1.0 / math.sqrt(shape[-1]))  # linear weights [out, in]


def write_shards(out_dir: str, tensors: dict[str, torch.Tensor], num_shards: int) -> None:
    """`tensors` split in key order over `num_shards` safetensors files plus `model.safetensors.index.json`."""
    keys = sorted(tensors, key=_shard_order)
    num_shards = max(1, min(num_shards, len(keys)))
    per = -(-len(keys) // num_shards)
    weight_map = {}
    total = 0
    for s in range(num_shards):
        fname = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        chunk = {k: tensors[k].contiguous() for k in keys[s * per : (s + 1) * per]}
        save_file(chunk, os.path.join(out_dir, fname), metadata={"format": "pt"})
        for k, t in chunk.items():
            weight_map[k] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(os.path.join(out_dir, "model.safetensors.index.json"), index)


def _shard_order(key: str) -> tuple:
    """Layer-major order (as the official shards run), visual tensors last."""
    parts = key.split(".")
    if key.startswith(VISUAL_PREFIX):
        return (2, 0, key)
    if key == LM_HEAD:
        return (1, 0, key)
    layer = int(parts[3]) if len(parts) > 3 and parts[2] == "layers" else -1
    return (0, layer, key)


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
