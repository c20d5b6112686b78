"""MTP speculative decoding on the small model (fp32, CPU): greedy output with speculation is the
output without it, token for token, for k = 1..5 — with the real draft layer (which a random model
never agrees with) and with an oracle drafter that is right at most positions, so drafts are
accepted, partly accepted and rejected; the KDA rollback invariants; the rejection rule's output
distribution is the target's."""

import pytest
import torch

from glm5next.runtime.kda_commit import commit, commit_rows
from glm5next.runtime.cache import allocate_cache, bytes_per_slot
from glm5next.runtime.engine_core import LLMEngine
from glm5next.runtime.metadata import build_metadata
from glm5next.runtime.sampler import SamplingParams
from glm5next.runtime.batch_sampler import SamplingTensors
from glm5next.runtime.speculative import SpeculativeConfig, accept_rows
from glm5next.tokenizer import Tokenizer


def workload():
    """Mixed prompt lengths and max_tokens, so requests finish at different steps."""
    return [(f"r{i}", [(11 * i + 7 * j) % 250 for j in range(2 + 9 * i)],
             SamplingParams(temperature=0, max_tokens=6 + 7 * i, ignore_eos=True)) for i in range(4)]


def run(model, tiny_dir, spec=None, oracle=None, graph_mode=False, **kw):
    kw.setdefault("max_model_len", 256)
    engine = LLMEngine.from_model(model, Tokenizer.from_dir(tiny_dir), max_num_seqs=8, speculative_config=spec, **kw)
    engine.runner.graph_mode = graph_mode  # pure verify steps through the captured path's static buffers
    if oracle is not None:
        real = engine.drafter.draft

        def draft(rows):  # the real layer runs (its cache writes), then the oracle's tokens replace its own
            out = real(rows)
            for row, res in zip(rows, out):
                if res is not None:
                    # Drafting precedes the scheduler's update: count this step's tokens (a verify row's
                    # accepted ones, or a completed prompt's first) on top of what it had generated.
                    req = engine.scheduler.requests[row.request_id]
                    new = len(row.next_tokens) if row.start == len(req.token_ids) - 1 else 1
                    done = len(req.output_token_ids) + new
                    want = oracle[row.request_id]
                    res[0][:] = [want[done + j] if done + j < len(want) and (done + j) % 5 != 3 else 0
                                 for j in range(len(res[0]))]
            return out

        engine.drafter.draft = draft
        real_graph = engine.draft_graphs.run

        def graph_run(size, hidden, requests):  # the same for drafts from the post-verify graph
            out = real_graph(size, hidden, requests)
            for req, (tokens, _) in zip(requests, out):
                done, want = req.generated + len(req.tokens), oracle[req.request_id]
                tokens[:] = [want[done + j] if done + j < len(want) and (done + j) % 5 != 3 else 0
                             for j in range(len(tokens))]
            return out

        engine.draft_graphs.run = graph_run
    for rid, prompt, params in workload():
        engine.add_request(rid, prompt, params)
    final = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o.outputs[0].token_ids
    bm = engine.scheduler.block_manager
    assert bm.free_blocks == bm.num_blocks and bm.free_slots == bm.num_slots
    return final, engine


@pytest.fixture(scope="module")
def plain(tiny_fp32, tiny_dir):
    return run(tiny_fp32, tiny_dir)[0]


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_greedy_with_speculation_equals_without(tiny_fp32, tiny_dir, plain, k):
    spec = {"method": "mtp", "num_speculative_tokens": k}
    got, engine = run(tiny_fp32, tiny_dir, spec)
    assert got == plain
    assert engine.stats["verify_rows"] > 0
    got, engine = run(tiny_fp32, tiny_dir, spec, oracle=plain)
    assert got == plain
    m = engine.spec_metrics()
    assert 0 < m["acceptance_rate"] < 1 and m["mean_accepted_length"] > 1.3, m


@pytest.mark.parametrize("k", [1, 3])
def test_verify_steps_through_the_captured_path(tiny_fp32, tiny_dir, plain, k):
    """The CPU has no graphs: pure verify steps run the static-buffer path a capture records (whole
    requests of q tokens, padding rows with slot -1), eagerly."""
    got, engine = run(tiny_fp32, tiny_dir, {"method": "mtp", "num_speculative_tokens": k}, oracle=plain,
                      graph_mode=True)
    assert got == plain
    assert engine.stats["graph_steps"] > 0 and all(s % (k + 1) == 0 for s in engine.runner.capture_sizes)
    m = engine.spec_metrics()
    assert 0 < m["acceptance_rate"] < 1, m  # drafts accepted, partly accepted and rejected through commit_rows


def test_sampled_drafts_through_the_captured_path(tiny_fp32, tiny_dir):
    """Sampled requests in graph mode: drafts drawn on the device with their filtered distributions."""
    engine = LLMEngine.from_model(tiny_fp32, Tokenizer.from_dir(tiny_dir), max_num_seqs=8, max_model_len=256,
                                  speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    engine.runner.graph_mode = True
    seen = []
    real = engine.draft_graphs.run

    def spy(size, hidden, requests):
        out = real(size, hidden, requests)
        seen.extend(zip(requests, out))
        return out

    engine.draft_graphs.run = spy
    for i in range(3):
        params = SamplingParams(temperature=0.8 if i else 0.0, top_k=40 if i == 2 else -1, max_tokens=12,
                                ignore_eos=True, seed=i)
        engine.add_request(f"s{i}", [5 + i, 9, 17], params)
    while engine.has_unfinished_requests():
        engine.step()
    assert seen
    for req, (tokens, probs) in seen:
        assert len(tokens) == 2
        if req.params.greedy:
            assert probs is None
        else:
            assert probs.shape == (2, tiny_fp32.config.vocab_size)
            torch.testing.assert_close(probs.sum(-1), torch.ones(2))
            assert all(float(probs[j, t]) > 0 for j, t in enumerate(tokens))
            if req.params.top_k > 0:
                assert int((probs > 0).sum(-1).max()) <= req.params.top_k


def test_speculation_through_preemption(tiny_fp32, tiny_dir, plain):
    got, engine = run(tiny_fp32, tiny_dir, {"method": "mtp", "num_speculative_tokens": 2}, oracle=plain,
                      block_size=4, num_blocks=22, max_model_len=64)
    assert got == plain and engine.stats["preemptions"] > 0


def test_kda_verify_reads_only_and_commit_advances_over_accepted_tokens(tiny_fp32):
    kda, cfg = tiny_fp32.layers[0].self_attn, tiny_fp32.config
    x = torch.randn(12, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    caches = [allocate_cache(cfg, 8, 16, 2, torch.float32, "cpu", include_mtp=False, verify_tokens=4) for _ in range(2)]
    for c in caches:
        kda(x[:8], build_metadata([8], [0], 0, [1], [[0]], 16, "cpu"), c.kda[0])
    seq, ver = caches[0].kda[0], caches[1].kda[0]
    steps = []
    for j in range(3):  # the same tokens one at a time
        steps.append(kda(x[8 + j : 9 + j], build_metadata([1], [8 + j], 1, [1], [[0]], 16, "cpu"), seq))
        steps[-1] = (steps[-1], seq.conv[1].clone(), seq.recurrent[1].clone())
    before = (ver.conv.clone(), ver.recurrent.clone())
    out = kda(x[8:11], build_metadata([3], [8], 1, [1], [[0]], 16, "cpu"), ver)
    assert torch.equal(ver.conv, before[0]) and torch.equal(ver.recurrent, before[1])  # a verify only reads
    torch.testing.assert_close(out, torch.cat([s[0] for s in steps]), rtol=1e-5, atol=1e-6)
    for n in (1, 2, 3):
        commit(ver, [1], [n])
        torch.testing.assert_close(ver.conv[1], steps[n - 1][1], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ver.recurrent[1], steps[n - 1][2], rtol=1e-5, atol=1e-6)
        committed = ver.recurrent[1].clone()
        ver.conv.copy_(before[0])
        ver.recurrent.copy_(before[1])
        commit(ver, [1], [n])
        assert torch.equal(ver.recurrent[1], committed)  # commit is a function of what the verify left
        if n < 3:  # counter-example: advancing over every verified token is not the rollback
            commit(ver, [1], [3])
            assert not torch.equal(ver.recurrent[1], committed)
        ver.conv.copy_(before[0])
        ver.recurrent.copy_(before[1])
    assert torch.equal(ver.recurrent[0], before[1][0])  # another slot is never touched
    for n in (0, 1, 3):  # the graph's commit over device tensors: the same states (0: a padding row)
        if n:
            commit(ver, [1], [n])
        want = (ver.conv[1].clone(), ver.recurrent[1].clone())
        ver.conv.copy_(before[0])
        ver.recurrent.copy_(before[1])
        commit_rows(ver, torch.tensor([1]), torch.tensor([n]))
        assert torch.equal(ver.conv[1], want[0])
        torch.testing.assert_close(ver.recurrent[1], want[1], rtol=1e-6, atol=1e-7)
        ver.conv.copy_(before[0])
        ver.recurrent.copy_(before[1])


def test_rejection_rule_keeps_the_target_distribution():
    """accept_rows over many rows of one verify (each its own seed): the first emitted token follows
    the target's p_0, and the second, where the first draft was kept, p_1; greedy rows take the argmax
    rule; always keeping the drafts would give the draft's distribution instead."""
    g = torch.Generator().manual_seed(0)
    vocab, k, trials = 6, 2, 12000
    target = torch.randn(k + 1, vocab, generator=g) * 1.5
    draft_probs = torch.softmax(torch.randn(k, vocab, generator=g) * 1.5, -1)
    drafts = torch.stack([torch.multinomial(draft_probs[j], trials, replacement=True, generator=g) for j in range(k)], 1)
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(trials)]
    tensors = SamplingTensors.from_params(params, "cpu", vocab)
    tokens, counts = accept_rows(target.expand(trials, -1, -1).contiguous(), drafts,
                                 draft_probs.expand(trials, -1, -1).contiguous(), tensors,
                                 torch.zeros(trials, dtype=torch.int64))
    assert bool(((counts >= 1) & (counts <= k + 1)).all())
    kept = counts > 1
    assert torch.equal(tokens[kept, 0], drafts[kept, 0])  # an accepted draft is emitted as drafted
    first = torch.bincount(tokens[:, 0], minlength=vocab).float()
    second = torch.bincount(tokens[kept & (drafts[:, 0] == tokens[:, 0]), 1], minlength=vocab).float()
    p0 = torch.softmax(target[0], -1)
    p1 = torch.softmax(target[1], -1)
    for observed, p in ((first, p0), (second, p1)):
        n = observed.sum()
        chi2 = float(((observed - n * p) ** 2 / (n * p)).sum())
        assert chi2 < 25.0, (chi2, observed / n, p)  # 5 degrees of freedom: p < 1e-4 under the null
    bad = torch.bincount(drafts[:2000, 0], minlength=vocab).float()  # counter-example: keep every draft
    assert float(((bad - 2000 * p0) ** 2 / (2000 * p0)).sum()) > 25.0
    greedy = SamplingTensors.from_params([SamplingParams(temperature=0.0)] * 3, "cpu", vocab)
    choice = target.argmax(-1)
    rows = torch.stack([choice[:k], torch.tensor([choice[0], (choice[1] + 1) % vocab]),
                        torch.tensor([(choice[0] + 1) % vocab, choice[1]])])
    tokens, counts = accept_rows(target.expand(3, -1, -1).contiguous(), rows, None, greedy, torch.zeros(3, dtype=torch.int64))
    assert counts.tolist() == [3, 2, 1] and all(torch.equal(t, choice) for t in tokens)


def _sampled_outputs(model, tiny_dir, spec, n=240, accept=None):
    """The 3-token outputs of n seeded top-3 requests of one prompt, through the engine (graph mode)."""
    engine = LLMEngine.from_model(model, Tokenizer.from_dir(tiny_dir), max_num_seqs=64, max_model_len=64,
                                  speculative_config=spec)
    engine.runner.graph_mode = True
    if accept is not None:
        import glm5next.runtime.spec_step as spec_step

        saved, spec_step.accept_rows = spec_step.accept_rows, accept
    try:
        for i in range(n):
            engine.add_request(f"r{i}", [5, 9, 17], SamplingParams(temperature=1.0, top_k=3, max_tokens=3,
                                                                  ignore_eos=True, seed=1000 + i))
        out = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    out[o.request_id] = tuple(o.outputs[0].token_ids)
    finally:
        if accept is not None:
            spec_step.accept_rows = saved
    return list(out.values()), engine


def _homogeneity_p(a: list, b: list) -> float:
    """The chi-square test's p-value that samples a and b come from one distribution."""
    cells = sorted(set(a) | set(b))
    counts = torch.tensor([[a.count(c) for c in cells], [b.count(c) for c in cells]], dtype=torch.float64)
    expected = counts.sum(1, keepdim=True) * counts.sum(0, keepdim=True) / counts.sum()
    chi2 = ((counts - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(len(cells) - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, chi2 / 2))


def test_sampled_outputs_with_speculation_are_distributed_as_without(tiny_fp32, tiny_dir):
    """Whole 3-token continuations (up to 27 sequences under top-3) of seeded requests: with MTP
    speculation (drafts eager after a prefill, from the post-verify graph path after a verify) the
    same distribution as without; a rule that keeps every draft is told apart."""
    plain, _ = _sampled_outputs(tiny_fp32, tiny_dir, None)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    got, engine = _sampled_outputs(tiny_fp32, tiny_dir, spec)
    assert engine.stats["verify_rows"] > 0 and 0 < engine.spec_metrics()["acceptance_rate"] < 1
    assert _homogeneity_p(plain, got) > 1e-3, _homogeneity_p(plain, got)

    def keep_drafts(logits, drafts, draft_probs, tensors, generated):  # counter-example: every draft kept
        tokens, _ = accept_rows(logits, drafts, draft_probs, tensors, generated)
        tokens[:, : drafts.shape[1]] = drafts
        return tokens, torch.full_like(generated, logits.shape[1])

    bad, _ = _sampled_outputs(tiny_fp32, tiny_dir, spec, accept=keep_drafts)
    assert _homogeneity_p(plain, bad) < 1e-3, _homogeneity_p(plain, bad)


@pytest.mark.parametrize(
    "value,match",
    [({"method": "eagle", "num_speculative_tokens": 2}, "only 'mtp'"), ({"method": "mtp", "num_speculative_tokens": 9},
     "num_speculative_tokens"), ({"method": "mtp", "k": 2}, "unknown keys"), ("{bad", "not valid JSON")],
    ids=["method", "too-many-tokens", "unknown-key", "bad-json"],
)
def test_speculative_config_is_validated(value, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.parse(value)


def test_speculation_needs_an_mtp_layer(tmp_path):
    from glm5next.checkpoint.writer import make_tiny_checkpoint

    make_tiny_checkpoint(str(tmp_path), with_mtp=False)
    with pytest.raises(ValueError, match="MTP layer"):
        LLMEngine(str(tmp_path), dtype="float32", device="cpu", max_model_len=64, progress=False,
                  speculative_config='{"method": "mtp", "num_speculative_tokens": 1}')


def test_cli_generate_prints_the_acceptance(tiny_dir, capsys):
    from glm5next.cli import main

    assert main(["generate", "--model", tiny_dir, "--prompt", "hi", "--max-tokens", "4", "--dtype", "float32",
                 "--device", "cpu", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}']) == 0
    assert "speculative (mtp, k=3): acceptance" in capsys.readouterr().out


def test_bench_end_to_end_with_speculation(tmp_path):
    import json

    from glm5next.cli import main

    out = tmp_path / "b.json"
    assert main(["bench", "--small", "--device", "cpu", "--tokens", "1", "--concurrency", "2", "--gen-len", "6",
                 "--prompt-len", "8", "--context", "32", "--eager-iters", "1", "--skip-eager",
                 "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}', "--out", str(out)]) == 0
    row = json.loads(out.read_text())["e2e"][0]
    assert row["output_tokens"] == 12 and row["speculative"]["num_speculative_tokens"] == 2


def test_verify_scratch_is_counted_in_the_cache_budget(tiny_fp32):
    cfg = tiny_fp32.config
    cache = allocate_cache(cfg, 4, 16, 3, torch.float32, "cpu", include_mtp=True, verify_tokens=3)
    kda_bytes = sum(t.numel() * t.element_size() for s in cache.kda.values()
                    for t in [s.conv, s.recurrent, *s.verify.values()])
    assert kda_bytes == 4 * bytes_per_slot(cfg, torch.float32, verify_tokens=3)


def test_draft_layer_runs_through_the_executor_stages(tiny_fp32, tiny_dir, plain, tmp_path):
    """LayerStages serves the MTP layer too: its DSA projections and shared expert go through the
    kernels (Triton interpreter here) at the policy's token counts; the output is unchanged."""
    import json

    from glm5next.specialized_decode import STAGES

    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"tables": {s: {str(m): c[0] for m in range(1, 17)} for s, c in STAGES.items()}}))
    got, engine = run(tiny_fp32, tiny_dir, {"method": "mtp", "num_speculative_tokens": 2}, oracle=plain,
                      decode_backend="specialized", policy=str(path))
    assert got == plain
    stages = engine.executor.draft_stages
    assert stages.calls > 0 and stages.shared and stages.projections.groups["dsa_proj"]


def test_drafts_through_stages_equal_stock_drafts(tiny_fp32):
    from glm5next.runtime.speculative import DraftRow, MtpDrafter
    from glm5next.specialized_decode import STAGES, Policy, SpecializedDecode

    policy = Policy({s: {str(m): c[0] for m in range(1, 17)} for s, c in STAGES.items()})
    stages = SpecializedDecode(tiny_fp32, policy, (1, 2, 4, 8, 16), q=3).draft_stages
    cfg = tiny_fp32.config
    outs, caches = [], []
    for st in (None, stages):
        cache = allocate_cache(cfg, 8, 16, 2, torch.float32, "cpu", verify_tokens=3)
        rows = [DraftRow(0, [0, 1], 0, torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(1)),
                         [3, 9, 27, 81, 243], SamplingParams(temperature=0), None, "a"),
                DraftRow(1, [2, 3], 0, torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(2)),
                         [5, 6, 7], SamplingParams(temperature=0), None, "b")]
        outs.append(MtpDrafter(tiny_fp32, cache, 3, st).draft(rows))
        caches.append(cache.dsa[cfg.mtp_layer_idx].latent)
    assert [o[0] for o in outs[0]] == [o[0] for o in outs[1]]
    torch.testing.assert_close(caches[0], caches[1], rtol=1e-4, atol=1e-5)
    assert stages.calls == 3  # the catch-up and two more draft steps
