"""The executor's decisions: the policy file's validation, `plan()`'s rules for which steps run
planned, and the degradations that switch stages off instead of failing."""

import json
import logging
import types

import pytest
import torch

from glm5next.forward import CUDAGraphMode, ForwardContext
from glm5next.runtime.metadata import build_metadata
from glm5next.specialized_decode import STAGES, Policy, PolicyError, SpecializedDecode, build_executor, is_decode

SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80)


def ctx_for(query_lens, num_decodes, capturing=True, mode=CUDAGraphMode.FULL, spec=0):
    n = len(query_lens)
    md = build_metadata(query_lens, [3] * n, num_decodes, list(range(n)), [[i] for i in range(n)], 16, "cpu")
    md.num_spec_decodes = spec
    md.num_spec_decode_tokens = spec * (query_lens[0] if query_lens else 0)
    return ForwardContext({"layers.0.self_attn": md, "layers.3.self_attn": md}, md.positions, mode, capturing)


@pytest.mark.parametrize(
    "tables,match",
    [
        ({"moe_mega": {"1": "per_route"}}, "unknown stage 'moe_mega'"),
        ({"boundary": {"1": "cute"}}, "unknown choice 'cute'"),
        ({"boundary": {"65": "fused"}}, "token count '65'"),
        ({"boundary": {"two": "fused"}}, "token count 'two'"),
        ({"boundary": ["fused"]}, "must map token counts"),
    ],
    ids=["unknown-stage", "unknown-choice", "tokens-above-64", "tokens-not-integer", "table-not-object"],
)
def test_policy_refuses_what_does_not_exist(tables, match):
    with pytest.raises(PolicyError, match=match):
        Policy(tables)


def test_policy_lookup_and_files(tmp_path):
    p = Policy({"boundary": {"1": "fused", "2": "stock", "8": "fused"}, "logits_head": {"64": "splitk"}})
    assert p("boundary", 1) == "fused" and p("boundary", 2) is None
    assert p("boundary", 3) == "fused" and p("boundary", 4) == "fused"  # between 2 and 8: the entry at 8
    assert p("boundary", 9) is None and p("logits_head", 3) == "splitk"  # past the table: stock
    assert p.enabled("boundary") and not p.enabled("dense_mlp")
    assert p.tokens("boundary", "fused") == {1, 8} and p.tokens("logits_head", "splitk") == {64}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(p.to_dict(gpu="test")))
    assert Policy.from_file(str(path)).tables == p.tables
    path.write_text("{not json")
    with pytest.raises(PolicyError, match="not valid JSON"):
        Policy.from_file(str(path))
    with pytest.raises(PolicyError, match="cannot read"):
        Policy.from_file(str(tmp_path / "missing.json"))


def test_is_decode_forms():
    md = ctx_for([1, 1, 1, 1], 4).metadata("layers.0.self_attn")
    assert is_decode(md, 1, 4) and not is_decode(md, 1, 3)
    md = ctx_for([2, 2, 2], 3, spec=3).metadata("layers.0.self_attn")
    assert is_decode(md, 2, 6) and not is_decode(md, 1, 6)
    md = ctx_for([2, 2, 2], 0).metadata("layers.0.self_attn")  # verify rows filed as short prefills
    assert is_decode(md, 2, 6) and not is_decode(md, 1, 6) and not is_decode(md, 3, 6)
    md = ctx_for([1, 1, 5], 2).metadata("layers.0.self_attn")
    assert not is_decode(md, 1, 7)


def test_plan_rules(tiny_fp32, caplog):
    ex = SpecializedDecode(tiny_fp32, Policy({}), SIZES)
    assert ex.batches == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert ex.plan(ctx_for([1] * 4, 4), 4) is not None
    with caplog.at_level(logging.INFO, logger="glm5next.specialized_decode.decode"):
        assert ex.plan(ctx_for([1] * 4, 4, capturing=False), 4) is None  # a warm-up: stock
        assert ex.plan(ctx_for([1] * 4, 4, mode=CUDAGraphMode.NONE), 4) is None
        assert ex.plan(ctx_for([1] * 3, 3), 3) is None  # not a planned size
        assert ex.plan(ctx_for([1] * 3, 3), 3) is None
        assert ex.plan(ctx_for([1, 1, 2], 2), 4) is None  # a prompt row
        assert ex.plan(ctx_for([1] * 80, 80), 80) is None  # above 64
    skips = [r.getMessage() for r in caplog.records if "skips" in r.getMessage()]
    assert len(skips) == len(set(skips)) == 4, skips  # each reason logged once
    spec = SpecializedDecode(tiny_fp32, Policy({}), SIZES, q=2)
    assert spec.batches == [2, 4, 8, 16, 24, 32, 48, 64]
    assert spec.plan(ctx_for([2, 2], 2, spec=2), 4) is not None
    assert spec.plan(ctx_for([2, 2], 0), 4) is None  # no speculative rows anywhere: plain decode, q = 1
    assert spec.plan(ctx_for([1, 1, 1, 1], 4), 4) is not None


def test_plan_skips_backbones_with_aux_layers(tiny_dir):
    from glm5next.model.backbone import Glm5NextModel

    model = Glm5NextModel.from_pretrained(tiny_dir, torch.float32, "cpu", progress=False)
    model.aux_hidden_state_layers = (1, 4)
    assert SpecializedDecode(model, Policy({}), SIZES).plan(ctx_for([1, 1], 2), 2) is None


def test_unsupported_backbones_degrade_with_one_warning(tiny_dir, caplog):
    from glm5next.model.backbone import Glm5NextModel

    model = Glm5NextModel.from_pretrained(tiny_dir, torch.float32, "cpu", progress=False)
    model.layers[2].post_attention_layernorm.eps = 1e-3
    every = {s: {"1": c[0]} for s, c in STAGES.items()}
    with caplog.at_level(logging.WARNING):
        ex = SpecializedDecode(model, Policy(every), SIZES)
    assert ex.boundary_stage is None and ex.head is None  # mixed eps; an fp32 (not BF16) head
    assert ex.projections.runs(model.layers[0], 1) and ex.dense  # the rest still runs
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("mixed norm eps" in w for w in warnings) and any("not BF16" in w for w in warnings)


def test_build_executor_choices(tiny_fp32, tmp_path):
    assert build_executor(tiny_fp32, "stock", None, SIZES, False) is None
    assert build_executor(tiny_fp32, "auto", None, SIZES, False) is None  # no policy for the CPU
    with pytest.raises(ValueError, match="no measured policy"):
        build_executor(tiny_fp32, "specialized", None, SIZES, False)
    with pytest.raises(ValueError, match="decode_backend"):
        build_executor(tiny_fp32, "fast", None, SIZES, False)
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"tables": {"boundary": {"1": "fused"}}}))
    assert isinstance(build_executor(tiny_fp32, "specialized", str(path), SIZES, False), SpecializedDecode)
    assert isinstance(build_executor(tiny_fp32, "auto", str(path), SIZES, False), SpecializedDecode)


def test_auto_stays_stock_under_tensor_parallelism(tiny_fp32, tmp_path, monkeypatch):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"tables": {"boundary": {"1": "fused"}}}))
    monkeypatch.setattr(tiny_fp32, "tp", types.SimpleNamespace(size=2, rank=0))
    assert build_executor(tiny_fp32, "auto", str(path), SIZES, False) is None
    assert isinstance(build_executor(tiny_fp32, "specialized", str(path), SIZES, False), SpecializedDecode)


def test_the_shipped_h200_policy_covers_every_captured_size():
    from glm5next.runtime.runner import DEFAULT_CAPTURE_SIZES

    own = Policy.for_gpu("NVIDIA H200")
    assert own is not None and Policy.for_gpu("NVIDIA A100-SXM4-80GB", (8, 0)) is None
    assert own.source == "glm5next/specialized_decode/policies/nvidia-h200.json"
    # The H200's own entries win over the Hopper default stage by stage; a stage its table lacks (the KDA
    # stage, measured on an H100) comes from the default.
    policy = Policy.for_gpu("NVIDIA H200", (9, 0))
    assert policy.source == ("glm5next/specialized_decode/policies/nvidia-h200.json over "
                             "glm5next/specialized_decode/policies/sm90.json")
    assert all(policy.tables[s] == t for s, t in own.tables.items()) and "kda" not in own.tables
    # Any other Hopper GPU runs the default table.
    default = Policy.for_gpu("NVIDIA H800", (9, 0))
    assert default.source == "glm5next/specialized_decode/policies/sm90.json" and default.tables == policy.tables
    # The H100's own table (the MoE, KDA and DSA stages measured on it) over the default.
    h100 = Policy.for_gpu("NVIDIA H100 80GB HBM3", (9, 0))
    assert h100.tables["moe"] == {m: "grouped" for m in (1, 2, 4, 8, 16, 32, 64)} and h100("moe", 24) == "grouped"
    assert h100.tables["boundary"] == policy.tables["boundary"]
    for stage in STAGES:
        # Every captured size was measured (a measured "stock" is an entry too)...
        assert set(DEFAULT_CAPTURE_SIZES) <= set(policy.tables[stage]), stage
        # ...and the tuned stages win somewhere.
        assert any(policy(stage, m) is not None for m in DEFAULT_CAPTURE_SIZES), stage


def test_fp16_copies_are_found_by_the_tensor_they_copy():
    """A filed copy is found for its tensor and for views of the same storage, shape and strides, not for
    another tensor, a slice, or (outside inference mode) the tensor after an in-place change; inference
    tensors are found without a version counter; `clear` forgets it."""
    from glm5next.specialized_decode.copies import Fp16Copies

    copies = Fp16Copies()
    x = torch.randn(3, 8).to(torch.bfloat16)
    x16 = x.to(torch.float16)
    assert copies.get(x) is None
    copies.put(x, x16)
    assert copies.get(x) is x16 and copies.get(x.view(3, 8)) is x16
    assert copies.get(x.clone()) is None and copies.get(x[:2]) is None and copies.get(x.view(8, 3)) is None
    x.add_(1)
    assert copies.get(x) is None
    with torch.inference_mode():
        y = torch.randn(2, 4).to(torch.bfloat16)
        copies.put(y, y.to(torch.float16))
        assert copies.get(y) is not None
    copies.clear()
    assert copies.get(y) is None


def test_a_gpu_table_takes_the_default_for_the_stages_it_lacks(tmp_path, monkeypatch):
    """`Policy.for_gpu`: the GPU's own table over its architecture's default, stage by stage; another
    architecture without a file gets none."""
    import glm5next.specialized_decode.policy as policy_module

    (tmp_path / "sm90.json").write_text(json.dumps({"tables": {"moe": {"1": "grouped"}, "boundary": {"1": "fused"}}}))
    (tmp_path / "nvidia-h200.json").write_text(json.dumps({"tables": {"boundary": {"1": "stock"}}}))
    monkeypatch.setattr(policy_module, "POLICY_DIR", str(tmp_path))
    p = Policy.for_gpu("NVIDIA H200", (9, 0))
    assert p("moe", 1) == "grouped" and p("boundary", 1) is None
    assert "nvidia-h200.json over" in p.source and "sm90.json" in p.source
    assert Policy.for_gpu("NVIDIA H100 80GB HBM3", (9, 0))("boundary", 1) == "fused"
    assert Policy.for_gpu("NVIDIA B200", (10, 0)) is None
