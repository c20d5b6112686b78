"""The validated text configuration of a GLM-5.3-Flash checkpoint."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

KDA = "kda"
"""Layer kind of a Kimi-delta-attention (linear attention) layer."""
DSA = "dsa"
"""Layer kind of a DeepSeek-sparse-attention (indexed MLA) layer."""

_LAYER_TYPE_KINDS = {
    "linear_attention": KDA,
    "deepseek_sparse_attention": DSA,
    "indexed_attention": DSA,
    "full_attention": DSA,
}

MHC_POST_MULT = 2.0
"""Multiplier of the mHC post weights (`post = 2 * sigmoid(...)`)."""
KDA_L2_EPS = 1e-6
"""Epsilon inside the square root of the KDA query/key L2 norms."""
INDEXER_KEY_NORM_EPS = 1e-6
"""Epsilon of the indexer key LayerNorm."""
ROUTER_NORM_EPS = 1e-20
"""Added to the sum of the selected router weights before renormalising."""


class ConfigError(ValueError):
    """A config.json this package cannot run, naming the field and its value."""


def _refuse(field_name: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"config field {field_name}={value!r}: {why}")


@dataclass(frozen=True)
class QuantConfig:
    """The checkpoint's FP8 quantization: e4m3 weights with block scales."""

    fmt: str = "e4m3"
    weight_block_size: tuple[int, int] = (128, 128)
    scale_fmt: str | None = None


@dataclass(frozen=True)
class Glm5NextConfig:
    """The text tower of GLM-5.3-Flash, read from a checkpoint's config.json."""

    vocab_size: int = 154880
    hidden_size: int = 4096
    num_hidden_layers: int = 45
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_attention_heads: int = 64
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 256
    v_head_dim: int = 256
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 2048
    index_kpool: int = 4
    linear_num_heads: int = 64
    linear_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float = -5.0
    n_routed_experts: int = 288
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-5
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    num_nextn_predict_layers: int = 1
    max_position_embeddings: int = 1048576
    pad_token_id: int | None = 154820
    eos_token_ids: tuple[int, ...] = ()
    layer_kinds: tuple[str, ...] = ()
    moe_layers: tuple[bool, ...] = ()
    quant: QuantConfig | None = None
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if n < 1:
            raise _refuse("num_hidden_layers", n, "must be at least 1")
        if len(self.layer_kinds) != n:
            raise _refuse("layer_types", self.layer_kinds, f"needs {n} entries")
        if len(self.moe_layers) != n:
            raise _refuse("mlp_layer_types", self.moe_layers, f"needs {n} entries")
        if self.index_topk % self.index_kpool:
            raise _refuse("index_topk", self.index_topk, f"must be a multiple of index_kpool={self.index_kpool}")
        if self.hc_mult < 1 or self.hc_sinkhorn_iters < 1:
            raise _refuse("hc_mult/hc_sinkhorn_iters", (self.hc_mult, self.hc_sinkhorn_iters), "must be positive")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise _refuse("num_experts_per_tok", self.num_experts_per_tok, "exceeds n_routed_experts")
        if self.linear_conv_kernel_dim < 1:
            raise _refuse("linear_conv_kernel_dim", self.linear_conv_kernel_dim, "must be positive")

    # ---------------------------------------------------------------- derived
    @property
    def kda_dim(self) -> int:
        """Width of the KDA q, k and v projections (heads x head_dim)."""
        return self.linear_num_heads * self.linear_head_dim

    @property
    def mtp_layer_idx(self) -> int:
        """Checkpoint index of the MTP draft layer."""
        return self.num_hidden_layers

    @property
    def index_topk_pools(self) -> int:
        """How many pools the indexer selects per query."""
        return self.index_topk // self.index_kpool

    @property
    def mla_softmax_scale(self) -> float:
        """Softmax scale of the NoPE MLA attention."""
        return self.qk_nope_head_dim**-0.5

    # ---------------------------------------------------------------- loading
    @classmethod
    def from_dict(cls, raw: dict) -> "Glm5NextConfig":
        """The config of a config.json dict, wrapper or flat text form."""
        if not isinstance(raw, dict):
            raise ConfigError(f"config must be a JSON object, got {type(raw).__name__}")
        top = raw
        text = raw.get("text_config", raw)
        if not isinstance(text, dict):
            raise _refuse("text_config", text, "must be a JSON object")
        return cls._from_text(text, top)

    @classmethod
    def from_file(cls, path: str) -> "Glm5NextConfig":
        """The config stored in `path` (a config.json or a checkpoint folder)."""
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path) as f:
                raw = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(raw)

    @classmethod
    def _from_text(cls, t: dict, top: dict) -> "Glm5NextConfig":
        def get(name, default):
            return t.get(name, top.get(name, default)) if t is not top else t.get(name, default)

        _check_supported(t, get)
        n = int(get("num_hidden_layers", 45))
        layer_types = get("layer_types", None)
        if layer_types is None:
            layer_types = ["linear_attention" if i % 4 != 3 else "deepseek_sparse_attention" for i in range(n)]
        kinds = []
        for i, lt in enumerate(layer_types):
            if lt not in _LAYER_TYPE_KINDS:
                raise _refuse(f"layer_types[{i}]", lt, f"unknown layer type (known: {sorted(_LAYER_TYPE_KINDS)})")
            kinds.append(_LAYER_TYPE_KINDS[lt])
        mlp_types = get("mlp_layer_types", None)
        if mlp_types is None:
            k = int(get("first_k_dense_replace", 3))
            mlp_types = ["dense"] * min(k, n) + ["sparse"] * max(n - k, 0)
        moe = []
        for i, mt in enumerate(mlp_types):
            if mt not in ("dense", "sparse"):
                raise _refuse(f"mlp_layer_types[{i}]", mt, "unknown MLP type (known: 'dense', 'sparse')")
            moe.append(mt == "sparse")

        lin = get("linear_attn_config", None) or {}
        lower = lin.get("gate_lower_bound", get("linear_lower_bound", -5.0))
        if lower is None:
            raise _refuse("linear_attn_config.gate_lower_bound", None, "only the bounded (safe) KDA gate is implemented")

        eos = top.get("eos_token_id", t.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))

        quant = None
        qc = top.get("quantization_config", t.get("quantization_config"))
        if qc is not None:
            quant = _quant_config(qc)

        kwargs = dict(
            vocab_size=int(get("vocab_size", 154880)),
            hidden_size=int(get("hidden_size", 4096)),
            num_hidden_layers=n,
            intermediate_size=int(get("intermediate_size", 12288)),
            moe_intermediate_size=int(get("moe_intermediate_size", 2048)),
            num_attention_heads=int(get("num_attention_heads", 64)),
            q_lora_rank=int(get("q_lora_rank", 1536)),
            kv_lora_rank=int(get("kv_lora_rank", 512)),
            qk_nope_head_dim=int(get("qk_nope_head_dim", 256)),
            v_head_dim=int(get("v_head_dim", 256)),
            index_n_heads=int(get("index_n_heads", 32)),
            index_head_dim=int(get("index_head_dim", 128)),
            index_topk=int(get("index_topk", 2048)),
            index_kpool=int(get("index_kpool", 16)),
            linear_num_heads=int(lin.get("num_heads", get("linear_num_heads", 64))),
            linear_head_dim=int(lin.get("head_dim", get("linear_head_dim", 128))),
            linear_conv_kernel_dim=int(lin.get("short_conv_kernel_size", get("linear_conv_kernel_dim", 4))),
            linear_lower_bound=float(lower),
            n_routed_experts=int(get("n_routed_experts", 288)),
            num_experts_per_tok=int(get("num_experts_per_tok", 8)),
            n_shared_experts=int(get("n_shared_experts", 1)),
            routed_scaling_factor=float(get("routed_scaling_factor", 2.5)),
            norm_topk_prob=bool(get("norm_topk_prob", True)),
            swiglu_limit=float(get("swiglu_limit", 10.0)),
            rms_norm_eps=float(get("rms_norm_eps", 1e-5)),
            hc_mult=int(get("hc_mult", 4)),
            hc_sinkhorn_iters=int(get("hc_sinkhorn_iters", 20)),
            hc_eps=float(get("hc_eps", 1e-6)),
            num_nextn_predict_layers=int(get("num_nextn_predict_layers", 0)),
            max_position_embeddings=int(get("max_position_embeddings", 1048576)),
            pad_token_id=get("pad_token_id", None),
            eos_token_ids=eos_ids,
            layer_kinds=tuple(kinds),
            moe_layers=tuple(moe),
            quant=quant,
            extra={"raw": top},
        )
        return cls(**kwargs)

    def to_text_dict(self) -> dict:
        """The text_config fields in the checkpoint's own spelling."""
        d = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("eos_token_ids", "layer_kinds", "moe_layers", "quant", "extra",
                              "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim", "linear_lower_bound")
        }
        d["model_type"] = "glm5_next_text"
        d["layer_types"] = ["linear_attention" if k == KDA else "indexed_attention" for k in self.layer_kinds]
        d["mlp_layer_types"] = ["sparse" if m else "dense" for m in self.moe_layers]
        d["indexer_types"] = ["full"] * self.num_hidden_layers
        d["index_kpool_compress"] = True
        d["index_kpool_always_select_tail"] = True
        d["qk_rope_head_dim"] = 0
        d["num_key_value_heads"] = self.num_attention_heads
        d["scoring_func"] = "sigmoid"
        d["topk_method"] = "noaux_tc"
        d["n_group"] = 1
        d["topk_group"] = 1
        d["hidden_act"] = "silu"
        d["mhc"] = True
        d["tie_word_embeddings"] = False
        d["attention_bias"] = False
        d["dtype"] = "bfloat16"
        kda = [i for i, k in enumerate(self.layer_kinds) if k == KDA]
        d["linear_attn_config"] = {
            "num_heads": self.linear_num_heads,
            "head_dim": self.linear_head_dim,
            "short_conv_kernel_size": self.linear_conv_kernel_dim,
            "gate_lower_bound": self.linear_lower_bound,
            "kda_layers": kda,
            "full_attn_layers": [i for i in range(self.num_hidden_layers) if i not in kda],
        }
        if self.eos_token_ids:
            d["eos_token_id"] = list(self.eos_token_ids)
        return d


def _quant_config(qc: Any) -> QuantConfig:
    if not isinstance(qc, dict):
        raise _refuse("quantization_config", qc, "must be a JSON object")
    method = qc.get("quant_method")
    if method != "fp8":
        raise _refuse("quantization_config.quant_method", method, "only 'fp8' is implemented")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse("quantization_config.fmt", fmt, "only 'e4m3' is implemented")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise _refuse("quantization_config.activation_scheme", qc.get("activation_scheme"), "only 'dynamic'")
    block = qc.get("weight_block_size", [128, 128])
    if list(block) != [128, 128]:
        raise _refuse("quantization_config.weight_block_size", block, "only [128, 128] is implemented")
    return QuantConfig(fmt=fmt, weight_block_size=(128, 128), scale_fmt=qc.get("scale_fmt"))


def _check_supported(t: dict, get) -> None:
    """Refuse checkpoint options the backbone does not implement."""
    checks = [
        ("qk_rope_head_dim", 0, "only NoPE MLA (qk_rope_head_dim = 0) is implemented"),
        ("scoring_func", "sigmoid", "only sigmoid router scoring is implemented"),
        ("index_kpool_always_select_tail", True, "the incomplete pool tail must always be selected"),
        ("index_kpool_compress", True, "only softmax-gated pool compression is implemented"),
        ("hidden_act", "silu", "only SiLU is implemented"),
        ("attention_bias", False, "attention projections with bias are not implemented"),
        ("mhc", True, "only checkpoints with mHC residual streams are implemented"),
        ("tie_word_embeddings", False, "a tied LM head is not implemented"),
    ]
    for name, want, why in checks:
        value = get(name, want)
        if value != want:
            raise _refuse(name, value, why)
    for name in ("n_group", "topk_group"):
        value = get(name, 1)
        if value != 1:
            raise _refuse(name, value, "only ungrouped routing (one group) is implemented")
    heads, kv_heads = get("num_attention_heads", 64), get("num_key_value_heads", None)
    if kv_heads is not None and kv_heads != heads:
        raise _refuse("num_key_value_heads", kv_heads, f"must equal num_attention_heads={heads}")
    if get("q_lora_rank", 1536) is None:
        raise _refuse("q_lora_rank", None, "the MLA query must be low-rank")
    if get("topk_method", "noaux_tc") not in ("noaux_tc",):
        raise _refuse("topk_method", get("topk_method", None), "only 'noaux_tc' routing is implemented")
    indexer_types = get("indexer_types", None)
    if indexer_types is not None:
        for i, it in enumerate(indexer_types):
            if it != "full":
                raise _refuse(f"indexer_types[{i}]", it, "shared indexer layers are not implemented")
    pattern = t.get("index_topk_pattern")
    if pattern is not None and any(c != "F" for c in pattern):
        raise _refuse("index_topk_pattern", pattern, "shared indexer layers are not implemented")
    if get("num_nextn_predict_layers", 0) not in (0, 1):
        raise _refuse("num_nextn_predict_layers", get("num_nextn_predict_layers", 0), "at most one MTP layer")
