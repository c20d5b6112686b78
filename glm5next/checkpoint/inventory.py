"""The text tensors a GLM-5.3-Flash checkpoint holds, derived from its config alone.

Written straight from the checkpoint layout (spec §2), independently of the
model modules, so that the two can check each other. Names are checkpoint keys
without the `model.language_model.` prefix; `lm_head.weight` keeps its name.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import KDA, Glm5NextConfig

TEXT_PREFIX = "model.language_model."
"""Key prefix of every text-tower tensor except the LM head."""
VISUAL_PREFIX = "model.visual."
"""Key prefix of the vision tower, which a text-only load skips."""
LM_HEAD = "lm_head.weight"
"""Key of the untied LM head (no prefix)."""
SCALE_SUFFIX = "_scale_inv"
"""Suffix of the fp32 block-scale sibling of an FP8 weight (`...weight_scale_inv`)."""

FP8 = "fp8"
"""Official dtype of a block-quantized e4m3 weight with a `_scale_inv` sibling."""
BF16 = "bf16"
"""Official dtype of a plain bfloat16 tensor."""
FP32 = "fp32"
"""Official dtype of a float32 tensor (mixers, router, gates, convolutions)."""


@dataclass(frozen=True)
class Expected:
    """One tensor the checkpoint holds: its shape and the dtype the official release stores it in."""

    shape: tuple[int, ...]
    official_dtype: str


def checkpoint_key(name: str) -> str:
    """The safetensors key of text tensor `name` (inventory spelling)."""
    return name if name == LM_HEAD else TEXT_PREFIX + name


def expected_tensors(config: Glm5NextConfig, include_mtp: bool = True) -> dict[str, Expected]:
    """Every text tensor of a checkpoint of `config`, by name without `model.language_model.`.

    The MTP layer (index `num_hidden_layers`) is included when `include_mtp`
    and the config declares one.
    """
    c = config
    d, v = c.hidden_size, c.vocab_size
    out: dict[str, Expected] = {
        "embed_tokens.weight": Expected((v, d), BF16),
        "norm.weight": Expected((d,), BF16),
        LM_HEAD: Expected((v, d), BF16),
    }
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        out.update(_norms(p, d, ("input_layernorm", "post_attention_layernorm")))
        out.update(_hyper_connections(p, c))
        if c.layer_kinds[i] == KDA:
            out.update(_kda(p + "self_attn.", c))
        else:
            out.update(_dsa(p + "self_attn.", c))
        out.update(_moe(p + "mlp.", c) if c.moe_layers[i] else _dense_mlp(p + "mlp.", c))
    if include_mtp and c.num_nextn_predict_layers:
        out.update(_mtp(f"layers.{c.mtp_layer_idx}.", c))
    return out


def _norms(prefix: str, width: int, names: tuple[str, ...]) -> dict[str, Expected]:
    return {f"{prefix}{n}.weight": Expected((width,), BF16) for n in names}


def _hyper_connections(prefix: str, c: Glm5NextConfig) -> dict[str, Expected]:
    n = c.hc_mult
    mix = (2 + n) * n
    out = {}
    for sub in ("attn", "ffn"):
        out[f"{prefix}hc_{sub}_fn"] = Expected((mix, n * c.hidden_size), FP32)
        out[f"{prefix}hc_{sub}_base"] = Expected((mix,), FP32)
        out[f"{prefix}hc_{sub}_scale"] = Expected((3,), FP32)
    return out


def _kda(prefix: str, c: Glm5NextConfig) -> dict[str, Expected]:
    d, h, k, width = c.hidden_size, c.linear_num_heads, c.linear_head_dim, c.kda_dim
    shapes = {
        "q_proj": (width, d), "k_proj": (width, d), "v_proj": (width, d),
        "b_proj": (h, d),
        "f_a_proj": (k, d), "f_b_proj": (width, k),
        "g_a_proj": (k, d), "g_b_proj": (width, k),
        "o_proj": (d, width),
    }
    out = {f"{prefix}{n}.weight": Expected(s, BF16) for n, s in shapes.items()}
    for n in ("q_conv1d", "k_conv1d", "v_conv1d"):
        out[f"{prefix}{n}.weight"] = Expected((width, 1, c.linear_conv_kernel_dim), FP32)
    out[f"{prefix}A_log"] = Expected((h,), FP32)
    out[f"{prefix}dt_bias"] = Expected((width,), FP32)
    out[f"{prefix}o_norm.weight"] = Expected((k,), BF16)
    return out


def _dsa(prefix: str, c: Glm5NextConfig) -> dict[str, Expected]:
    d, heads = c.hidden_size, c.num_attention_heads
    qr, kvr, nope, vd = c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.v_head_dim
    ih, idim = c.index_n_heads, c.index_head_dim
    return {
        f"{prefix}q_a_proj.weight": Expected((qr, d), FP8),
        f"{prefix}q_a_layernorm.weight": Expected((qr,), BF16),
        f"{prefix}q_b_proj.weight": Expected((heads * nope, qr), FP8),
        f"{prefix}kv_a_proj_with_mqa.weight": Expected((kvr, d), FP8),
        f"{prefix}kv_a_layernorm.weight": Expected((kvr,), BF16),
        f"{prefix}kv_b_proj.weight": Expected((heads * (nope + vd), kvr), FP8),
        f"{prefix}o_proj.weight": Expected((d, heads * vd), FP8),
        f"{prefix}indexer.wq_b.weight": Expected((ih * idim, qr), FP8),
        f"{prefix}indexer.wk.weight": Expected((idim, d), FP8),
        f"{prefix}indexer.k_norm.weight": Expected((idim,), BF16),
        f"{prefix}indexer.k_norm.bias": Expected((idim,), BF16),
        f"{prefix}indexer.weights_proj.weight": Expected((ih, d), BF16),
        f"{prefix}indexer.index_kpool_compress_gate": Expected((idim, d), BF16),
        f"{prefix}indexer.index_kpool_compress_ape": Expected((c.index_kpool, idim), FP32),
    }


def _swiglu(prefix: str, d: int, width: int) -> dict[str, Expected]:
    return {
        f"{prefix}gate_proj.weight": Expected((width, d), FP8),
        f"{prefix}up_proj.weight": Expected((width, d), FP8),
        f"{prefix}down_proj.weight": Expected((d, width), FP8),
    }


def _dense_mlp(prefix: str, c: Glm5NextConfig) -> dict[str, Expected]:
    return _swiglu(prefix, c.hidden_size, c.intermediate_size)


def _moe(prefix: str, c: Glm5NextConfig) -> dict[str, Expected]:
    d, e = c.hidden_size, c.n_routed_experts
    out = {
        f"{prefix}gate.weight": Expected((e, d), FP32),
        f"{prefix}gate.e_score_correction_bias": Expected((e,), FP32),
    }
    for j in range(e):
        out.update(_swiglu(f"{prefix}experts.{j}.", d, c.moe_intermediate_size))
    out.update(_swiglu(f"{prefix}shared_experts.", d, c.moe_intermediate_size * c.n_shared_experts))
    return out


def _mtp(prefix: str, c: Glm5NextConfig) -> dict[str, Expected]:
    d = c.hidden_size
    out = _norms(prefix, d, ("enorm", "hnorm", "input_layernorm", "post_attention_layernorm", "shared_head.norm"))
    out[f"{prefix}eh_proj.weight"] = Expected((d, 2 * d), BF16)
    out.update(_dsa(prefix + "self_attn.", c))
    out.update(_moe(prefix + "mlp.", c))
    return out
