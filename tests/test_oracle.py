"""The stock backbone against transformers 5.23 on small random checkpoints."""

import pytest
import torch

from glm5next.checkpoint.writer import make_tiny_checkpoint
from glm5next.model.backbone import Glm5NextModel
from glm5next.runtime.cache import allocate_cache
from glm5next.runtime.runner import Runner, Sequence

from .hf_oracle import HfRunner, import_hf, rel_err

# A second shape: fewer, narrower layers, a DSA layer first, more heads, top-2 of 8 experts.
OTHER_SHAPE = dict(
    hidden_size=96, num_hidden_layers=5, intermediate_size=160, moe_intermediate_size=48,
    n_routed_experts=8, num_experts_per_tok=2, num_attention_heads=3, q_lora_rank=64, kv_lora_rank=48,
    qk_nope_head_dim=24, v_head_dim=16, index_n_heads=3, index_head_dim=16, index_topk=16,
    layer_types=["indexed_attention", "linear_attention", "linear_attention", "indexed_attention",
                 "linear_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse", "sparse"],
    linear_attn_config={"num_heads": 3, "head_dim": 16, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0},
)


def saved_by_transformers(src: str, dst: str) -> str:
    """A checkpoint of `src`'s config written by transformers' own save_pretrained
    (its own random init; no FP8, no MTP layer)."""
    from transformers import Glm5NextConfig

    cfg = Glm5NextConfig.from_pretrained(src)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    torch.manual_seed(1)
    model = import_hf()(cfg).float().eval()
    with torch.no_grad():
        for layer in model.model.language_model.layers:
            indexer = getattr(layer.self_attn, "indexer", None)
            if indexer is not None:
                # Opposite query heads in pairs: no pool can score exactly 0, so no
                # exact ties reach top-k, whose tie order differs between implementations.
                w = indexer.wq_b.weight.view(indexer.n_heads, indexer.head_dim, -1)
                w[1::2] = -w[0::2]
    model.save_pretrained(dst)
    return dst


@pytest.fixture(scope="module", params=["tiny", "other-shape", "saved-by-transformers"])
def checkpoint(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    make_tiny_checkpoint(path, seed=3, text_overrides=OTHER_SHAPE if request.param == "other-shape" else None)
    if request.param == "saved-by-transformers":
        return saved_by_transformers(path, str(tmp_path_factory.mktemp("hf-saved")))
    return path


def run_ours(model, prompt, follow, block_size=8):
    cache = allocate_cache(model.config, 64, block_size, 1, torch.float32, "cpu", include_mtp=False)
    runner = Runner(model, cache)
    seq = Sequence(list(prompt), 0, blocks=list(range(63, -1, -1)))
    logits = [runner.step([seq])]
    for tok in follow:
        seq.token_ids.append(tok)
        logits.append(runner.step([seq]))
    return logits


def test_prefill_and_decode_match_transformers(checkpoint):
    """Prefill logits and 40 one-token decode steps, fp32, rel err <= 1e-4; the
    prompt is long enough that the indexer drops pools."""
    ours = Glm5NextModel.from_pretrained(checkpoint, torch.float32, "cpu", progress=False)
    topk = ours.config.index_topk
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 256, (topk + 23,), generator=g).tolist()
    hf = HfRunner(checkpoint, torch.float32)
    ref = hf.step(prompt)
    follow = []
    refs = [ref[-1:]]
    for _ in range(40):
        tok = int(refs[-1][-1].argmax())
        follow.append(tok)
        refs.append(hf.step([tok]))
    mine = run_ours(ours, prompt, follow)
    errs = [rel_err(a, b) for a, b in zip(mine, refs)]
    assert max(errs) <= 1e-4, errs
    assert len(set(follow)) > 1  # the model is not degenerate


def test_checkpoint_saved_by_transformers_loads_without_mtp(tmp_path):
    make_tiny_checkpoint(str(tmp_path / "src"), seed=5)
    ours = Glm5NextModel.from_pretrained(saved_by_transformers(str(tmp_path / "src"), str(tmp_path / "hf")),
                                         torch.float32, "cpu", progress=False)
    assert ours.mtp is None
    with pytest.raises(RuntimeError, match="no MTP layer"):
        ours.draft(torch.tensor([1]), torch.zeros(1, ours.config.hidden_size), None, None)
