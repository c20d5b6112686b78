import json

import pytest

from glm5next.config import DSA, KDA, ConfigError, Glm5NextConfig


def official_text():
    n = 45
    return {
        "model_type": "glm5_next_text",
        "num_hidden_layers": n,
        "layer_types": ["deepseek_sparse_attention" if i % 4 == 3 else "linear_attention" for i in range(n)],
        "mlp_layer_types": ["dense"] * 3 + ["sparse"] * 42,
        "indexer_types": ["full"] * n,
        "index_kpool": 4,
        "qk_rope_head_dim": 0,
        "scoring_func": "sigmoid",
        "linear_attn_config": {"num_heads": 64, "head_dim": 128, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0},
        "num_nextn_predict_layers": 1,
    }


def test_wrapper_and_flat_forms_agree():
    wrapper = {
        "architectures": ["Glm5NextForConditionalGeneration"],
        "text_config": official_text(),
        "eos_token_id": [154820, 154827],
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": [128, 128]},
    }
    a = Glm5NextConfig.from_dict(wrapper)
    b = Glm5NextConfig.from_dict(official_text())
    assert a.layer_kinds == b.layer_kinds
    assert a.layer_kinds[3] == DSA and a.layer_kinds[0] == KDA
    assert sum(k == DSA for k in a.layer_kinds) == 11
    assert a.moe_layers[:3] == (False,) * 3 and all(a.moe_layers[3:])
    assert a.quant is not None and a.quant.weight_block_size == (128, 128)
    assert a.eos_token_ids == (154820, 154827)
    assert a.index_topk_pools == 512 and a.kda_dim == 8192


@pytest.mark.parametrize(
    "field,value",
    [
        ("qk_rope_head_dim", 64),
        ("scoring_func", "softmax"),
        ("index_kpool_always_select_tail", False),
        ("n_group", 8),
        ("indexer_types", ["shared"] * 45),
        ("layer_types", ["mamba"] * 45),
        ("mlp_layer_types", ["moe"] * 45),
        ("num_key_value_heads", 8),
    ],
    ids=lambda v: str(v)[:20],
)
def test_unsupported_option_is_refused_by_name(field, value):
    t = official_text()
    t[field] = value
    with pytest.raises(ConfigError, match=field):
        Glm5NextConfig.from_dict(t)


def test_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        Glm5NextConfig.from_file(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        Glm5NextConfig.from_file(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "awq"}, **official_text()}))
    with pytest.raises(ConfigError, match="quant_method"):
        Glm5NextConfig.from_file(str(tmp_path))
