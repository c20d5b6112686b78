"""The slice benchmark on the CPU: slice config, random weights in the checkpoint's dtypes, byte
accounting against a hand count, and `glm5next bench --mode stock --small` end to end."""

import argparse
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from glm5next.bench.cli import add_bench_parser
from glm5next.bench.floor import record_routing, step_bytes
from glm5next.bench.slice import build_slice_model, fill_context, make_cache, slice_config
from glm5next.checkpoint.inventory import BF16, FP8, FP32, expected_tensors
from glm5next.config import DSA, KDA
from glm5next.model.backbone import Glm5NextModel
from glm5next.checkpoint.fp8 import FP8_DTYPE, scale_shape
from glm5next.runtime.host_times import PARTS
from glm5next.runtime.runner import Runner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def assert_plots(result_json, png) -> None:
    """bench/plot.py turns the result file into a PNG."""
    pytest.importorskip("matplotlib")
    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "plot.py"), str(result_json), "-o", str(png)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def small():
    return slice_config(small=True)


@pytest.fixture(scope="module")
def installed(small):
    """The small slice model and, per checkpoint name, the (dtype, scale shape or None) it was installed with."""
    seen = {}
    original = Glm5NextModel.tensor_specs

    def recording(self):
        specs = original(self)
        for name, spec in specs.items():
            def install(t, s, name=name, inner=spec.install):
                seen[name] = (t.dtype, tuple(t.shape), None if s is None else (s.dtype, tuple(s.shape)))
                inner(t, s)
            specs[name] = type(spec)(spec.shape, install, spec.fp8_ok, spec.keep_fp32)
        return specs

    Glm5NextModel.tensor_specs = recording
    try:
        model = build_slice_model(small, "cpu", seed=0)
    finally:
        Glm5NextModel.tensor_specs = original
    return model, seen


def test_slice_configs(small):
    real = slice_config()
    for c in (real, small):
        assert c.num_hidden_layers == 8
        assert c.layer_kinds == (KDA, KDA, KDA, DSA, KDA, KDA, KDA, DSA)
        assert c.moe_layers == (False,) * 3 + (True,) * 5
        assert c.num_nextn_predict_layers == 0
    assert (real.hidden_size, real.vocab_size, real.intermediate_size) == (4096, 154880, 12288)
    assert (real.n_routed_experts, real.num_experts_per_tok, real.n_shared_experts) == (288, 8, 1)
    assert (real.moe_intermediate_size, real.linear_num_heads, real.linear_head_dim) == (2048, 64, 128)
    assert (real.q_lora_rank, real.kv_lora_rank, real.index_topk, real.index_kpool) == (1536, 512, 2048, 4)
    assert small.hidden_size < 1024 and small.vocab_size < 4096
    assert slice_config(num_layers=4).layer_kinds == (KDA, KDA, KDA, DSA)


def test_weights_in_checkpoint_dtypes(small, installed):
    model, seen = installed
    expected = expected_tensors(small, include_mtp=False)
    assert set(seen) == set(expected)
    specs = model.tensor_specs()
    for name, exp in expected.items():
        dtype, shape, scale = seen[name]
        assert shape == exp.shape, name
        if exp.official_dtype == FP8:
            assert dtype == FP8_DTYPE and scale == (torch.float32, scale_shape(exp.shape)), name
        elif exp.official_dtype == FP32 or specs[name].keep_fp32:
            assert dtype == torch.float32 and scale is None, name
        else:
            assert exp.official_dtype == BF16 and dtype == torch.bfloat16 and scale is None, name
    assert seen["layers.3.mlp.experts.0.gate_proj.weight"][0] == FP8_DTYPE
    assert seen["layers.0.self_attn.q_proj.weight"][0] == torch.bfloat16
    assert seen["layers.3.mlp.gate.weight"][0] == torch.float32
    assert seen["lm_head.weight"][0] == torch.bfloat16
    for name, p in model.named_parameters():
        assert not p.is_meta, name
        assert torch.isfinite(p.float()).all(), name
        assert p.float().abs().max() > 0, name
    experts = model.layers[3].mlp.experts
    assert experts.gate_proj.dtype == FP8_DTYPE and experts.gate_proj_scale_inv.shape[0] == small.n_routed_experts


def _step(model, config, num_seqs, context, block_size=16):
    cache = make_cache(config, num_seqs, context, block_size, torch.bfloat16, "cpu")
    blocks = fill_context(cache, num_seqs, context, seed=1)
    runner = Runner(model, cache, max_model_len=len(blocks[0]) * block_size, capture_sizes=(num_seqs,))
    items = [([5] * context + [11 + i], context, 1, i, blocks[i]) for i in range(num_seqs)]
    return cache, blocks, runner, items


def test_context_and_eager_step_are_finite(small, installed):
    model, _ = installed
    cache, blocks, runner, items = _step(model, small, 3, 64)
    assert [len(b) for b in blocks] == [5, 5, 5] and blocks[1][0] == 5
    for c in cache.dsa.values():
        used = c.latent[:15]
        assert torch.isfinite(used.float()).all() and used.float().std() > 0.5
    for s in cache.kda.values():
        assert s.recurrent[:3].abs().sum() > 0
    logits = []
    routing = record_routing(model, lambda: logits.append(runner.execute(items, 3)))
    assert logits[0].shape == (3, small.vocab_size) and torch.isfinite(logits[0]).all()
    assert logits[0].std() > 0.1
    assert sorted(routing) == [3, 4, 5, 6, 7]
    for ids in routing.values():
        assert ids.shape == (3, small.num_experts_per_tok)
    nbytes = step_bytes(model, cache, routing, 3, 64)
    assert nbytes["distinct_experts"] == {i: int(torch.unique(r).numel()) for i, r in routing.items()}
    # Random routing of 3 tokens over 16 experts spreads: more than one token's worth of experts.
    assert sum(nbytes["distinct_experts"].values()) > 5 * small.num_experts_per_tok


def _hand_weight_bytes(config, num_tokens):
    """Non-expert weight bytes from the inventory: FP8 = 1 B + fp32 128x128 scales, fp32 tensors 4 B,
    the rest bf16; the indexer's pooling gate is bf16 in the checkpoint but held in fp32 by the model;
    the embedding counts only the rows the step looks up."""
    total = 0
    for name, e in expected_tensors(config, include_mtp=False).items():
        n = math.prod(e.shape)
        if ".experts." in name:
            continue
        if name == "embed_tokens.weight":
            total += num_tokens * config.hidden_size * 2
        elif e.official_dtype == FP8:
            total += n + 4 * math.prod(scale_shape(e.shape))
        elif e.official_dtype == FP32 or name.endswith("index_kpool_compress_gate"):
            total += 4 * n
        else:
            total += 2 * n
    return total


@pytest.mark.parametrize("context", [64, 63])
def test_step_bytes_hand_count(small, installed, context):
    model, _ = installed
    cache = make_cache(small, 2, context, 16, torch.bfloat16, "cpu")
    routing = {3: [[0, 1, 2, 3], [0, 1, 4, 5]], 4: [[0, 1, 2, 3], [3, 2, 1, 0]], 5: [[7, 8, 9, 10], [11, 12, 13, 14]],
               6: [[15, 0, 1, 2], [15, 0, 1, 3]], 7: [[5, 6, 7, 8], [5, 6, 7, 8]]}
    routing = {k: torch.tensor(v) for k, v in routing.items()}
    got = step_bytes(model, cache, routing, 2, context)
    assert got["distinct_experts"] == {3: 6, 4: 4, 5: 8, 6: 5, 7: 4}
    d, i = small.hidden_size, small.moe_intermediate_size  # 256, 128
    per_expert = 3 * d * i + 3 * 2 * 1 * 4  # FP8 gate/up/down + three 2x1 (or 1x2) fp32 scale grids
    assert got["experts"] == 27 * per_expert
    h, k = small.linear_num_heads, small.linear_head_dim  # 4 x 32
    per_seq_layer = h * k * k * 4 + 3 * h * k * 3 * 2  # recurrent fp32 + conv window (3 rows of q|k|v) bf16
    assert got["kda_state"] == 6 * 2 * 2 * per_seq_layer  # KDA layers x sequences x (read + write)
    pos = context  # the decoded token's position
    visible = (pos + 1) // 4  # complete pools
    latents = min(32 // 4, visible) * 4 + (pos + 1) % 4  # top-8 pools of 4 tokens + the incomplete tail
    per_token = visible * 32 * 2 + latents * 64 * 2 + (64 + 32 + 32) * 2
    if pos % 4 == 3:
        per_token += 4 * (32 + 32) * 2 + 32 * 2  # the pool this token completes
    assert got["dsa_cache"] == 2 * 2 * per_token  # DSA layers x tokens
    assert got["weights"] + got["embedding"] == _hand_weight_bytes(small, 2)
    assert got["lm_head"] == small.vocab_size * d * 2
    assert got["total"] == got["weights"] + got["embedding"] + got["experts"] + got["kda_state"] + got["dsa_cache"]


def test_cli_small_end_to_end(tmp_path):
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "result.json"
    args = parser.parse_args([
        "bench", "--mode", "stock", "--small", "--device", "cpu", "--tokens", "1,2", "--context", "40",
        "--eager-iters", "2", "--eager-warmup", "1", "--replays", "2", "--concurrency", "1,2",
        "--prompt-len", "8", "--gen-len", "3", "--prefill-lens", "16,24", "--prefill-requests", "1,2",
        "--mixed-budgets", "8,40", "--mixed-decodes", "3", "--mixed-prompt", "30", "--bw-gib", "0.01",
        "--out", str(out),
    ])
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    for key in ("mode", "slice", "device", "torch", "triton", "date", "context", "config", "bandwidth", "steps",
                "e2e", "notes", "build_s", "total_s"):
        assert key in result, key
    assert result["mode"] == "stock" and result["slice"] == "small" and result["device"] == "cpu"
    assert result["bandwidth"]["bytes_per_s"] > 0
    assert [r["tokens"] for r in result["steps"]] == [1, 2]
    for r in result["steps"]:
        assert r["floor_ms"] > 0 and r["eager_ms"] > 0 and r["logits_finite"]
        assert r["eager_over_floor"] == pytest.approx(r["eager_ms"] / r["floor_ms"])
        assert "graph_ms" not in r  # no CUDA here
        assert r["bytes"]["total"] > r["bytes"]["lm_head"] > 0
    assert any("CUDA graphs skipped" in n for n in result["notes"])
    decode = [r for r in result["e2e"] if not r.get("prefill") and not r.get("mixed")]
    assert [r["concurrency"] for r in decode] == [1, 2]
    for r in decode:
        assert r["output_tokens"] == 3 * r["concurrency"] and r["output_tokens_per_s"] > 0
        # Steady decode: the two steps after every request's first token, the host time split by part.
        assert r["decode_steps"] == 2 and r["decode_tokens_per_s"] > 0 and r["cold_ttft_ms"] > 0
        host = r["host_ms_per_step"]
        assert list(host) == list(PARTS) and all(v > 0 for v in host.values())
        assert r["host_work_ms_per_step"] == pytest.approx(sum(v for k, v in host.items() if k != "sample"))
        assert "engine_over_step" not in r  # no captured step on the CPU
    prefill = [r for r in result["e2e"] if r.get("prefill")]
    assert [(r["prompt_len"], r["concurrency"]) for r in prefill] == [(16, 1), (16, 2), (24, 1), (24, 2)]
    for r in prefill:
        assert r["output_tokens"] == r["concurrency"] and r["ttft_ms"] > 0 and r["cold_ttft_ms"] > 0
        assert r["prefill_tokens_per_s"] == pytest.approx(r["concurrency"] * r["prompt_len"] / r["seconds"])
    # A 30-token prompt beside 3 decodes: 5 prompt tokens a step under a budget of 8 (6 chunks), all 30 under 40
    # (1 chunk); the step that returns the prompt's token may come one later (asynchronous scheduling).
    mixed = [r for r in result["e2e"] if r.get("mixed")]
    assert [(r["budget"], r["decodes"], r["prompt_len"]) for r in mixed] == [(8, 3, 30), (40, 3, 30)]
    assert mixed[0]["steps"] - mixed[1]["steps"] == 5 and mixed[1]["steps"] in (1, 2)
    for r in mixed:
        assert r["prefill_tokens_per_s"] == pytest.approx(30 / (r["ttft_ms"] / 1e3))
        assert r["decode_tokens_per_s"] > 0 and r["max_step_ms"] > 0 and r["steady_step_ms"] > 0
        assert r["cold_ttft_ms"] > 0  # the same prompt's first run, untimed but for its first token

    assert_plots(out, tmp_path / "result.png")


def test_cli_refuses_a_mixed_budget_that_cannot_hold_the_decodes(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--small", "--device", "cpu", "--mixed-budgets", "16,4", "--mixed-decodes", "4",
                              "--out", str(tmp_path / "r.json")])
    assert args.func(args) == 2
    assert "--mixed-budgets" in capsys.readouterr().err


def test_cli_small_under_tensor_parallelism(tmp_path):
    """`--tensor-parallel-size 2`: the CLI starts two ranks (gloo on the CPU), each builds its shards and
    runs the steps; rank 0 writes a per-rank floor — half the LM head, between half and all the weights."""
    out = tmp_path / "tp2.json"
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run([sys.executable, "-m", "glm5next.cli", "bench", "--mode", "stock", "--small", "--device",
                           "cpu", "--layers", "4", "--tokens", "1,2", "--context", "40", "--eager-iters", "1",
                           "--eager-warmup", "0", "--skip-e2e", "--bw-gib", "0.01", "--tensor-parallel-size", "2",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    config = slice_config(4, small=True, tensor_parallel=True)
    assert result["tensor_parallel_size"] == 2
    for row in result["steps"]:
        whole = _hand_weight_bytes(config, row["tokens"]) - config.vocab_size * config.hidden_size * 2
        got = row["bytes"]
        assert got["lm_head"] == config.vocab_size // 2 * config.hidden_size * 2
        assert whole / 2 < got["weights"] + got["embedding"] - got["lm_head"] < whole, (got, whole)
        assert row["logits_finite"] and row["eager_ms"] > 0


def test_step_bytes_verify_hand_count(small):
    """Verify steps: q tokens per sequence share their KDA states and cache reads; the MTP layer's weights
    are not the trunk step's."""
    model = build_slice_model(slice_config(small=True, with_mtp=True), "cpu", seed=0, with_mtp=True)
    cache = make_cache(small, 2, 62, 16, torch.bfloat16, "cpu", extra_tokens=3, include_mtp=True, verify_tokens=3)
    gen = torch.Generator().manual_seed(0)
    routing = {i: torch.randint(0, 16, (6, 4), generator=gen) for i in (3, 4, 5, 6, 7)}
    got = step_bytes(model, cache, routing, 6, 62, tokens_per_seq=3)
    h, k = small.linear_num_heads, small.linear_head_dim
    per_seq_layer = h * k * k * 4 + 3 * h * k * 3 * 2
    assert got["kda_state"] == 6 * 2 * 2 * per_seq_layer  # once per sequence, not per token
    # Positions 62, 63, 64: the last sees 16 pools; token 62's selection is the largest (8 pools + a
    # 3-token tail); token 63 completes a pool.
    per_seq = 16 * 32 * 2 + 35 * 64 * 2 + 3 * (64 + 32 + 32) * 2 + 4 * (32 + 32) * 2 + 32 * 2
    assert got["dsa_cache"] == 2 * 2 * per_seq
    assert got["weights"] + got["embedding"] == _hand_weight_bytes(small, 6)
    assert got["distinct_experts"] == {i: int(torch.unique(r).numel()) for i, r in routing.items()}
    with pytest.raises(ValueError, match="whole sequences"):
        step_bytes(model, cache, routing, 6, 62, tokens_per_seq=4)


def _interp(catch_up, length):
    lo, hi = math.floor(length), math.ceil(length)
    return catch_up[str(lo)] + (length - lo) * (catch_up[str(hi)] - catch_up[str(lo)])


def test_cli_speculative_small(tmp_path):
    """`--mode speculative` on the CPU: every (q, R) row, floors, drafting at the catch-ups around each
    assumed length, tokens/s from the recorded times, the assumption flagged; stock vs a policy without
    stages (the executor's planned loop over stock modules)."""
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"tables": {}}))
    out = tmp_path / "spec.json"
    common = ["bench", "--mode", "speculative", "--small", "--device", "cpu", "--context", "40", "--eager-iters",
              "1", "--eager-warmup", "0", "--bw-gib", "0.01"]
    args = parser.parse_args(common + ["--requests", "1,2", "--num-speculative-tokens", "1,2",
                                       "--accepted-lengths", "1.5,2.5", "--policy", str(policy), "--out", str(out)])
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    assert result["mode"] == "speculative" and result["slice"] == "small" and result["graphs"] is False
    assert "eager" in result["timing"] and any("CUDA graphs skipped" in n for n in result["notes"])
    assert result["assumed_acceptance"] == {"accepted_lengths": [1.5, 2.5], "assumed": True,
                                            "note": result["assumed_acceptance"]["note"]}
    assert "random weights accept no draft" in result["assumed_acceptance"]["note"]
    assert any("assumed" in n for n in result["notes"])

    base = {b["requests"]: b for b in result["baseline"]}
    assert sorted(base) == [1, 2]
    for r, b in base.items():
        assert b["q"] == 1 and b["tokens"] == r and b["floor_ms"] > 0
        for path in ("stock", "specialized"):
            assert b[f"{path}_tokens_per_s"] == pytest.approx(r / b[f"{path}_ms"] * 1e3)
    verify = {(v["q"], v["requests"]): v for v in result["verify"]}
    assert sorted(verify) == [(2, 1), (2, 2), (3, 1), (3, 2)]
    for (q, r), v in verify.items():
        assert v["k"] == q - 1 and v["tokens"] == q * r
        assert v["floor_ms"] > 0 and v["bytes"]["total"] > v["bytes"]["lm_head"] > 0
        assert min(v["bytes"]["distinct_experts"].values()) >= result["config"]["top_k"]
        assert v["stock_ms"] > 0 and v["specialized_ms"] > 0 and "specialized_declined" not in v
        assert v["stock_logits_finite"] and v["specialized_logits_finite"]
        assert v["top1_agree"] == 1.0 and v["specialized_vs_stock_rel_err"] < 1e-3
        assert set(v["policy_choices"].values()) == {"stock"}
        assert v["full_model_stock_ms"] > v["stock_ms"] and v["full_model_specialized_ms"] > v["specialized_ms"]
        assert sorted(v["draft"]["catch_up"]) == (["1", "2"] if q == 2 else ["1", "2", "3"])
        for d in v["draft"]["catch_up"].values():
            assert d["stock_ms"] > 0 and d["specialized_ms"] > 0

    assert len(result["throughput"]) == len(verify) * 2
    for t in result["throughput"]:
        v = verify[(t["q"], t["requests"])]
        assert t["accepted_length_assumed"] is True
        assert t["capped_at_q"] == (t["accepted_length"] > t["q"])
        used = min(t["accepted_length"], t["q"])
        assert t["accepted_length_used"] == used
        assert t["floor_tokens_per_s"] == pytest.approx(t["requests"] * used / v["floor_ms"] * 1e3)
        for path in ("stock", "specialized"):
            draft = _interp({n: d[f"{path}_ms"] for n, d in v["draft"]["catch_up"].items()}, used)
            assert t[f"{path}_draft_ms"] == pytest.approx(draft)
            assert t[f"{path}_tokens_per_s"] == pytest.approx(t["requests"] * used / (v[f"{path}_ms"] + draft) * 1e3)
            assert t[f"full_model_{path}_tokens_per_s"] == pytest.approx(
                t["requests"] * used / (v[f"full_model_{path}_ms"] + draft) * 1e3)
    for b in result["best"]:
        reachable = [t for t in result["throughput"] if t["requests"] == b["requests"]
                     and t["accepted_length"] == b["accepted_length"] and not t["capped_at_q"]]
        for path in ("stock", "specialized"):
            assert b[path]["tokens_per_s"] == max(t[f"{path}_tokens_per_s"] for t in reachable)

    # Without a policy the specialized path is declined, and says why.
    bare = tmp_path / "bare.json"
    args = parser.parse_args(common + ["--requests", "1", "--num-speculative-tokens", "1", "--out", str(bare)])
    assert args.func(args) == 0
    result = json.loads(bare.read_text())
    assert "policy" in result["verify"][0]["specialized_declined"] and "specialized_ms" not in result["verify"][0]
    assert result["throughput"][0]["stock_tokens_per_s"] > 0 and "specialized_tokens_per_s" not in result["throughput"][0]

    assert_plots(out, tmp_path / "spec.png")


@pytest.mark.parametrize("tma", [False, True], ids=["loads", "descriptors"])
@pytest.mark.parametrize("widen", [False, True], ids=["bytes", "widened"])
def test_read_probe_sums_its_tiles(tma, widen):
    """The sweep's read probe (interpreter): each program's sum of its [BN, K range] share of the
    weight, as raw bytes or as widened e4m3 values, through thread loads or tensor descriptors."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from benchmarks.sweep import _read_probe

    n, k, bn, bk, split = 64, 512, 32, 128, 2
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(n, k, generator=g) * 8).to(torch.float8_e4m3fn)
    src = w if widen else w.view(torch.uint8)
    vals = w.float() if widen else w.view(torch.uint8).double()
    want = vals.view(n // bn, bn, split, k // split).sum((1, 3)).flatten().float()
    if tma:
        src = TensorDescriptor.from_tensor(src, [bn, bk])
    out = torch.full((n // bn * split,), float("nan"))
    _read_probe[(n // bn, split)](src, out, k, k // bk // split, split, BN=bn, BK=bk, WIDEN=widen, TMA=tma, STAGES=2)
    assert torch.allclose(out, want, rtol=1e-5)


def test_boundary_sweep_sets_each_tiling_during_its_launches(monkeypatch):
    """The boundary tiling sweep: each warp count, block sizes above T skipped, and the warp count in force
    while its tiling launches and restored afterwards."""
    import benchmarks.sweep as sweep

    seen = []
    monkeypatch.setattr(sweep, "_time", lambda fn, calls, replays: fn() or 1.0)
    monkeypatch.setattr(sweep, "boundary_mixer", lambda device: (None, None, None))
    monkeypatch.setattr(sweep, "boundary_state", lambda T, device: (None,) * 4)
    monkeypatch.setattr(sweep, "mhc_boundary", lambda *a, **k: seen.append(
        (k["block_t"], k["chunk"], sweep.boundary_kernels.NUM_WARPS)))
    rows = sweep.sweep_boundary("cpu", [2], 1, block_ts=(1, 2, 4), chunks=(32,), warps=(4, 8))
    assert [r["variant"] for r in rows] == ["bt1-c32", "bt1-c32-w8", "bt2-c32", "bt2-c32-w8"]
    assert sorted(set(seen)) == [(1, 32, 4), (1, 32, 8), (2, 32, 4), (2, 32, 8)]
    assert sweep.boundary_kernels.NUM_WARPS == 4


def test_boundary_sweep_times_deferral_when_asked(monkeypatch):
    """`deferred` (True, False): each tiling once as it is and once taking and leaving its comb
    pending; the default times only the plain launch."""
    import benchmarks.sweep as sweep

    seen = []
    monkeypatch.setattr(sweep, "_time", lambda fn, calls, replays: fn() or 1.0)
    monkeypatch.setattr(sweep, "boundary_mixer", lambda device: (None, None, None))
    monkeypatch.setattr(sweep, "boundary_state", lambda T, device: (None,) * 4)
    monkeypatch.setattr(sweep, "mhc_boundary", lambda *a, **k: seen.append(
        (k["chunk"], k["defer_sinkhorn"], k["comb_pending"])))
    rows = sweep.sweep_boundary("cpu", [1], 1, block_ts=(1,), chunks=(32, 64), deferred=(False, True))
    assert [r["variant"] for r in rows] == ["bt1-c32", "bt1-c32-deferred", "bt1-c64", "bt1-c64-deferred"]
    assert sorted(set(seen)) == [(32, False, False), (32, True, True), (64, False, False), (64, True, True)]
    seen.clear()
    assert [r["variant"] for r in sweep.sweep_boundary("cpu", [1], 1, block_ts=(1,), chunks=(32,))] == ["bt1-c32"]
    assert set(seen) == {(32, False, False)}


def test_linear_sweep_hands_the_x16_variant_an_fp16_copy(monkeypatch):
    """"x16": the entry point gets x in fp16 (made once per row count, outside the timed calls); the
    other variants get their keywords unchanged; BF16 cases skip the x16 variant."""
    import benchmarks.sweep as sweep

    seen = []
    monkeypatch.setattr(sweep, "_time", lambda fn, calls, replays: fn() or 1.0)
    monkeypatch.setattr(sweep, "ROTATE_BYTES", 1)  # one copy of each case's weights
    monkeypatch.setattr(sweep, "shape_weights", lambda name, device: ([(None, None)], None))
    monkeypatch.setattr(sweep, "project", lambda x, ws, ups, **kw: seen.append((x, kw)))
    rows = sweep.sweep_linear("cpu", [3], 1e12, 1, variants=["heuristic", "x16", "split-2x"],
                              cases=["dsa_o_proj", "kda_o_proj"])
    assert [(r["case"], r["variant"]) for r in rows] == [
        ("kda_o_proj", "heuristic"), ("kda_o_proj", "split-2x"), ("dsa_o_proj", "heuristic"),
        ("dsa_o_proj", "split-2x"), ("dsa_o_proj", "x16")]
    (x0, kw0), (_, kw_t), _, (_, kw2), (x1, kw1) = seen
    assert kw0 == {} and kw_t == {"split_factor": 2} and kw2 == {"split_factor": 2} and set(kw1) == {"x16"}
    assert kw1["x16"].dtype == torch.float16 and torch.equal(kw1["x16"], x1.to(torch.float16))
    seen.clear()
    rows = sweep.sweep_linear("cpu", [3], 1e12, 1, variants=["fp16-convert"], cases=["dsa_o_proj"])
    ((x2, kw3),) = seen  # the copy made inside the timed call
    assert set(kw3) == {"half", "x16"} and kw3["half"] is True
    assert kw3["x16"].dtype == torch.float16 and torch.equal(kw3["x16"], x2.to(torch.float16))


def test_linear_sweep_resident_calls_one_instance(monkeypatch):
    """`resident`: every call of a case's graph uses the same weights (which then stay in L2), as many
    calls as the rotated run makes over its distinct instances; rows say which they were."""
    import benchmarks.sweep as sweep

    made, seen = [], []
    monkeypatch.setattr(sweep, "_time", lambda fn, calls, replays: fn() or 1.0)
    monkeypatch.setattr(sweep, "ROTATE_BYTES", 48 << 20)  # several instances of the 9 MB group when rotated
    monkeypatch.setattr(sweep, "shape_weights", lambda name, device: made.append(object()) or ([(made[-1], None)], None))
    monkeypatch.setattr(sweep, "project", lambda x, ws, ups, **kw: seen.append(ws[0][0]))
    for resident in (False, True):
        made.clear()
        seen.clear()
        rows = sweep.sweep_linear("cpu", [1], 1e12, 1, variants=["heuristic"], cases=["dsa_group"], resident=resident)
        assert [r["resident"] for r in rows] == [resident]
        assert len(seen) > 1 and len(set(map(id, seen))) == (1 if resident else len(seen))
        assert len(made) == (1 if resident else len(seen))



def test_tune_merge_keeps_the_sizes_not_measured():
    """`tune-policy --merge`: the new run's token counts win, the file's others stay (tables and times,
    in token order); another GPU's file or an unknown choice is refused, naming it."""
    from glm5next.bench.cli import merge_policy_docs
    from glm5next.specialized_decode.policy import PolicyError

    old = {"gpu": "NVIDIA H200", "measured": "day 1",
           "tables": {"boundary": {"1": "fused", "16": "fused", "64": "stock"}, "kda_proj": {"64": "single"}},
           "times_us": {"boundary": {"1": {"fused": 9.0}, "16": {"fused": 15.0}, "64": {"fused": 30.0}}}}
    new = {"gpu": "NVIDIA H200", "measured": "day 2", "tables": {"boundary": {"1": "fused", "2": "fused"}},
           "times_us": {"boundary": {"1": {"fused": 7.5}, "2": {"fused": 8.0}}}}
    merged = merge_policy_docs(old, new)
    assert merged["tables"] == {"boundary": {"1": "fused", "2": "fused", "16": "fused", "64": "stock"},
                                "kda_proj": {"64": "single"}}
    assert list(merged["tables"]["boundary"]) == ["1", "2", "16", "64"]
    times = merged["times_us"]["boundary"]
    assert times["1"] == {"fused": 7.5} and times["16"] == {"fused": 15.0}
    assert "day 2" in merged["measured"] and "day 1" in merged["measured"]
    # A run of one stage (`--stages moe`) keeps every other stage's entries, at the same token counts too.
    only = merge_policy_docs(old, {"gpu": "NVIDIA H200", "measured": "day 3", "tables": {"moe": {"1": "grouped"}}})
    assert only["tables"] == {**old["tables"], "moe": {"1": "grouped"}}
    with pytest.raises(PolicyError, match="H100"):
        merge_policy_docs(dict(old, gpu="NVIDIA H100"), new)
    with pytest.raises(PolicyError, match="warp"):
        merge_policy_docs(dict(old, tables={"boundary": {"8": "warp"}}), new)


def _load_bench_script(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_triton_cache_round_trip_keeps_what_a_hit_reads(tmp_path):
    """benchmarks/triton_cache.py: pack keeps each complete kernel entry's binary, metadata and group (no IR,
    no interrupted compile), and launchers; unpack points the groups at the files' new place; an archive
    over the size cap keeps the newest entries."""
    tc = _load_bench_script("triton_cache")
    src = tmp_path / "cache"
    for i, name in enumerate(["K1", "K2"]):
        d = src / f"HASH{i}"
        d.mkdir(parents=True)
        for ext in ("cubin", "json", "ttir", "ptx", "source"):
            (d / f"{name}.{ext}").write_bytes(os.urandom(2000) if ext == "cubin" else b"{}")
        group = {c: str(d / c) for c in os.listdir(d)}
        (d / f"__grp__{name}.json").write_text(json.dumps({"child_paths": group}))
        os.utime(d / f"{name}.cubin", (1000 + i, 1000 + i))
        for f in os.listdir(d):
            os.utime(d / f, (1000 + i, 1000 + i))
    (src / "LAUNCH").mkdir()
    (src / "LAUNCH" / "launcher.so").write_bytes(b"\x7fELF")
    (src / "BROKEN").mkdir()  # a compile that never finished: IR only
    (src / "BROKEN" / "K3.ttir").write_text("")
    archive = tmp_path / "a.tar.xz"
    kept, found, size = tc.pack(str(src), str(archive), 1.0)
    assert (kept, found) == (3, 3) and size == os.path.getsize(archive)
    dst = tmp_path / "elsewhere"
    assert tc.unpack(str(archive), str(dst)) == 3
    assert sorted(os.listdir(dst)) == ["HASH0", "HASH1", "LAUNCH"]
    assert sorted(os.listdir(dst / "HASH1")) == ["K2.cubin", "K2.json", "__grp__K2.json"]
    group = json.loads((dst / "HASH1" / "__grp__K2.json").read_text())["child_paths"]
    assert group == {"K2.cubin": str(os.path.realpath(dst / "HASH1" / "K2.cubin")),
                     "K2.json": str(os.path.realpath(dst / "HASH1" / "K2.json"))}
    assert (dst / "HASH0" / "K1.cubin").read_bytes() == (src / "HASH0" / "K1.cubin").read_bytes()
    # The random cubins do not compress: a cap of about one entry keeps the newest one only.
    kept, found, size = tc.pack(str(src), str(archive), 2500 / 2**20)
    assert kept < found and size <= 2500
    small = tmp_path / "small"
    tc.unpack(str(archive), str(small))
    assert "HASH0" not in os.listdir(small)


def test_stage_targets_report_each_token_count_against_its_goal():
    """The step benchmark's target report: the boundary at up to 8 tokens against 8 µs, the KDA stage against
    stock (cuBLAS) in the same graph, the dense MLP against 80 %; stages that ran stock are left out."""
    from glm5next.bench.cli import format_table
    from glm5next.bench.specialized import format_targets, stage_targets

    def step(m, boundary_us, kda_us, mlp_frac):
        return {"tokens": m, "stages": [
            {"stage": "boundary", "choice": "fused", "us": boundary_us, "stock_us": 250.0},
            {"stage": "kda_proj", "choice": "grouped", "us": kda_us, "stock_us": 100.0},
            {"stage": "dense_mlp", "choice": "fused", "us": 50.0, "bw_fraction": mlp_frac, "stock_us": 1500.0},
            {"stage": "logits_head", "choice": "stock", "stock_us": 300.0}]}

    steps = [step(1, 7.9, 99.0, 0.81), step(8, 10.4, 101.0, 0.79), step(16, 12.0, 90.0, 0.5)]
    got = stage_targets(steps)
    by = {(t["stage"], t["tokens"]): t for t in got}
    assert set(by) == {("boundary", 1), ("boundary", 8), ("kda_proj", 1), ("kda_proj", 8), ("kda_proj", 16),
                       ("dense_mlp", 1), ("dense_mlp", 8), ("dense_mlp", 16)}
    assert by["boundary", 1]["met"] and not by["boundary", 8]["met"] and by["boundary", 8]["goal"] == 8.0
    assert by["kda_proj", 1]["met"] and not by["kda_proj", 8]["met"] and by["kda_proj", 8]["goal"] == 100.0
    assert by["dense_mlp", 1]["met"] and not by["dense_mlp", 8]["met"] and not by["dense_mlp", 16]["met"]
    lines = format_targets(got)
    assert len(lines) == 3
    assert "met at 1; not at 8 (10.4 us against 8.0 us)" in lines[0]
    assert "met at 1, 16; not at 8 (101.0 us against 100.0 us)" in lines[1]
    assert "met at 1; not at 8 (79.0 % against 80.0 %), 16 (50.0 % against 80.0 %)" in lines[2]
    result = {"mode": "specialized", "slice": "real", "device": "GPU", "torch": "t", "triton": "t", "date": "d",
              "context": 0, "bandwidth": {"bytes_per_s": 4e12}, "steps": [], "targets": got}
    assert format_table(result).splitlines()[-3:] == lines


def test_sweep_launch_targets_take_the_default_launch_of_groups_and_fp8_weights():
    """The sweep's target report: the default launch ("heuristic", weights rotated past L2) of the one-launch
    groups and of every FP8 case against 85 %; other variants, resident timings, BF16 singles and boundary rows
    are not targets."""
    from glm5next.bench.specialized import format_targets
    from benchmarks.sweep import launch_targets

    rows = [dict(case="dsa_group", m=1, variant="heuristic", bw_fraction=0.25, resident=False),
            dict(case="kda_group", m=1, variant="heuristic", bw_fraction=0.9, resident=False),
            dict(case="dense_gate_up", m=1, variant="heuristic", bw_fraction=0.78, resident=False),
            dict(case="dense_gate_up", m=1, variant="pdl", bw_fraction=0.99, resident=False),
            dict(case="dense_down", m=16, variant="heuristic", bw_fraction=0.9, resident=True),
            dict(case="kda_o_proj", m=1, variant="heuristic", bw_fraction=0.7, resident=False),
            dict(case="boundary", t=1, variant="heuristic", us=8.0)]
    got = launch_targets(rows)
    assert [(t["case"], t["met"]) for t in got] == [("dsa_group", False), ("kda_group", True),
                                                     ("dense_gate_up", False)]
    lines = format_targets(got, key="at")
    assert lines[0].endswith("met at kda_group M=1; not at dsa_group M=1 (25.0 % against 85.0 %)")
    assert lines[1].endswith("met nowhere; not at dense_gate_up M=1 (78.0 % against 85.0 %)")


def test_stage_rows_subtract_and_report_the_boundary_alone(monkeypatch):
    """A stage row is the time of the boundary + stage graph less the boundaries alone (the case's `before`),
    and the row keeps what it subtracted (`before_us`), so a change in either part can be told apart."""
    from glm5next.bench import specialized, stages
    from glm5next.specialized_decode import Policy

    timed = {"pair": 30.0, "stock": 250.0, "alone": 7.5}
    run = {"fused": lambda: "pair", "stock": lambda: "stock"}
    case = stages.Case("dense_mlp", 4, 10**6, run, calls=2, before=lambda: "alone")
    monkeypatch.setattr(stages, "_median_us", lambda fn, calls, replays: timed[fn()])
    monkeypatch.setattr(specialized, "stage_cases", lambda model, m: [case])
    (row,) = specialized._stage_rows(None, 4, Policy({"dense_mlp": {"4": "fused"}}), 1e12)
    assert row["us"] == 22.5 and row["stock_us"] == 242.5 and row["before_us"] == 7.5
    assert row["bw_fraction"] == pytest.approx(1e6 / 22.5e-6 / 1e12)


def test_dsa_case_runs_the_stage_and_the_stock_attention_alike(installed):
    """The DSA stage case on the small slice (interpreted kernels): both choices give the same values for
    every instance, and its bytes count the weights and each row's pooled keys and selected rows."""
    from glm5next.bench.stages import dsa_case, stage_cases

    model, _ = installed
    case = dsa_case(model, 2, context=40, copies=1)
    assert case.stage == "dsa" and case.calls == 2 and set(case.runs) == {"sparse", "stock"}
    got, want = case.runs["sparse"](), case.runs["stock"]()
    for a, b in zip(got, want):
        assert float((a - b).abs().max() / b.abs().max()) < 1e-2
    weights = sum(t.numel() * t.element_size() for layer in model.layers if layer.layer_kind == DSA
                  for t in (layer.self_attn.kv_b_proj.weight,)) // 2  # one layer's, as a lower bound
    assert case.bytes_per_call > weights > 0
    assert "dsa" in [c.stage for c in stage_cases(model, 1, stages=["dsa"])]
