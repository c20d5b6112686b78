"""The engine over the small model: continuous batching gives every request exactly the tokens it
gets alone, whatever runs beside it, whether it is preempted, and whoever is aborted; nothing leaks."""

import random

import pytest
import torch

from glm5next.runtime.engine_core import LLMEngine
from glm5next.runtime.sampler import SamplingParams
from glm5next.tokenizer import Tokenizer


def make_engine(model, tiny_dir, **kw):
    kw.setdefault("max_model_len", 256)
    kw.setdefault("max_num_seqs", 16)
    return LLMEngine.from_model(model, Tokenizer.from_dir(tiny_dir), **kw)


def run(engine, requests):
    """Add (id, prompt, params) requests, step until done; final outputs by id, and every output seen."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    final, seen = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
            if out.finished:
                final[out.request_id] = out
    return final, seen


def assert_all_free(engine):
    bm = engine.scheduler.block_manager
    assert bm.free_blocks == bm.num_blocks and bm.free_slots == bm.num_slots
    assert not engine.scheduler.requests and not engine.has_unfinished_requests()


def workload(n, seed=0):
    """Requests with different prompt lengths and sampling settings (greedy and seeded)."""
    rng = random.Random(seed)
    settings = [
        dict(temperature=0.0),
        dict(temperature=1.0, seed=7),
        dict(temperature=0.8, top_k=20, seed=11),
        dict(temperature=1.2, top_p=0.8, seed=3),
        dict(temperature=1.0, min_p=0.1, seed=5),
    ]
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(0, 256) for _ in range(rng.choice([1, 3, 9, 17, 40, 75]))]
        params = SamplingParams(max_tokens=rng.randint(3, 9), ignore_eos=True, **settings[i % len(settings)])
        reqs.append((f"r{i}", prompt, params))
    return reqs


@pytest.fixture(scope="module")
def alone(tiny_fp32, tiny_dir):
    """Each request of the workload run by itself in a fresh engine."""
    out = {}
    for rid, prompt, params in workload(12):
        final, _ = run(make_engine(tiny_fp32, tiny_dir), [(rid, prompt, params)])
        out[rid] = final[rid].outputs[0].token_ids
    return out


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(max_num_batched_tokens=16), dict(max_num_seqs=3), dict(block_size=4, num_blocks=34, max_model_len=128)],
    ids=["roomy", "chunked-prefill-budget-16", "max-3-seqs", "tight-cache-preempts"],
)
def test_concurrent_requests_equal_alone(tiny_fp32, tiny_dir, alone, kw):
    engine = make_engine(tiny_fp32, tiny_dir, **kw)
    final, _ = run(engine, workload(12))
    for rid, tokens in alone.items():
        assert final[rid].outputs[0].token_ids == tokens, rid
        assert final[rid].outputs[0].finish_reason == "length"
    if "num_blocks" in kw:
        assert engine.stats["preemptions"] > 0, "the tight cache should have preempted"
    assert_all_free(engine)


def test_abort_leaves_the_rest_intact(tiny_fp32, tiny_dir, alone):
    engine = make_engine(tiny_fp32, tiny_dir, max_num_batched_tokens=16)
    reqs = workload(12)
    for rid, prompt, params in reqs:
        engine.add_request(rid, prompt, params)
    final, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        steps += 1
        if steps == 3:  # one waiting or prefilling, one decoding
            for rid in ("r1", "r6"):
                out = engine.abort_request(rid)
                assert out is not None and out.finished and out.outputs[0].finish_reason == "abort"
            assert engine.abort_request("r1") is None
    for rid, tokens in alone.items():
        if rid not in ("r1", "r6"):
            assert final[rid].outputs[0].token_ids == tokens, rid
    assert "r1" not in final and "r6" not in final
    assert_all_free(engine)


def test_streamed_text_grows_and_equals_the_full_decode(tiny_fp32, tiny_dir):
    engine = make_engine(tiny_fp32, tiny_dir)
    tok = engine.tokenizer
    final, seen = run(engine, [("a", "héllo wörld ✓ ", SamplingParams(temperature=1.0, seed=1, max_tokens=24,
                                                                          ignore_eos=True))])
    texts = [o.outputs[0].text for o in seen["a"]]
    for before, after in zip(texts, texts[1:]):
        assert after.startswith(before)
    out = final["a"].outputs[0]
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)


def test_stop_strings_and_stop_tokens(tiny_fp32, tiny_dir):
    engine = make_engine(tiny_fp32, tiny_dir)
    # 32 tokens of the byte-level tiny model (EOS ignored) decode to far more than the 3 characters needed.
    base, _ = run(engine, [("b", "stop here", SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))])
    out = base["b"].outputs[0]
    text = out.text
    stop = next((text[i : i + 2] for i in range(1, len(text) - 1) if text[i : i + 2].strip()), None)
    assert stop is not None, f"the fixed prompt must produce text to cut: {out.token_ids}"
    cut, seen = run(engine, [("c", "stop here", SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True,
                                                               stop=[stop, "never-there"]))])
    got = cut["c"].outputs[0]
    assert got.finish_reason == "stop" and got.text == text[: text.index(stop)]
    for o in seen["c"][:-1]:
        assert stop[:1] not in o.outputs[0].text[len(got.text):]  # a partial stop string is held back
    tok_stop, _ = run(engine, [("d", "stop here", SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True,
                                                                 stop_token_ids=[out.token_ids[3]]))])
    first = out.token_ids.index(out.token_ids[3])
    assert tok_stop["d"].outputs[0].token_ids == out.token_ids[: first + 1]
    assert tok_stop["d"].outputs[0].finish_reason == "stop"
    assert_all_free(engine)


def test_logprobs_are_the_models(tiny_fp32, tiny_dir):
    engine = make_engine(tiny_fp32, tiny_dir)
    prompt = [5, 77, 130, 9]
    final, _ = run(engine, [("l", prompt, SamplingParams(temperature=0.7, seed=2, max_tokens=4, logprobs=3,
                                                         ignore_eos=True))])
    out = final["l"].outputs[0]
    assert len(out.logprobs) == len(out.top_logprobs) == 4
    from glm5next.runtime.runner import Runner, Sequence
    from glm5next.runtime.cache import allocate_cache

    cache = allocate_cache(tiny_fp32.config, 8, 16, 1, torch.float32, "cpu")
    seq = Sequence(list(prompt), 0, list(range(8)))
    runner = Runner(tiny_fp32, cache)
    for k, token in enumerate(out.token_ids):
        want = torch.log_softmax(runner.step([seq])[0], -1)
        assert abs(out.logprobs[k] - float(want[token])) < 1e-4
        top = torch.topk(want, 3)
        assert [t for t, _ in out.top_logprobs[k]] == top.indices.tolist()
        seq.token_ids.append(token)


def test_engine_refuses_bad_input_and_keeps_what_it_accepted(tiny_fp32, tiny_dir):
    engine = make_engine(tiny_fp32, tiny_dir, max_model_len=32)
    engine.add_request("ok", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    for prompt, match in (([], "empty"), ([1] * 40, "max_model_len"), ([10**6], "vocabulary"), (3.5, "prompt")):
        with pytest.raises(ValueError, match=match):
            engine.add_request("bad", prompt, SamplingParams())
    with pytest.raises(ValueError, match="already live"):
        engine.add_request("ok", [1], SamplingParams())
    final, _ = run(engine, [])
    assert len(final["ok"].outputs[0].token_ids) == 4
    assert_all_free(engine)


def test_cache_sizing(tiny_fp32, tiny_dir):
    from glm5next.runtime.cache import allocate_cache, blocks_for_budget, bytes_per_block, bytes_per_slot

    engine = make_engine(tiny_fp32, tiny_dir, num_blocks=40)
    assert engine.cache.num_blocks == 40 and engine.scheduler.block_manager.num_blocks == 40
    with pytest.raises(ValueError, match="max_model_len=256"):
        make_engine(tiny_fp32, tiny_dir, num_blocks=8)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        make_engine(tiny_fp32, tiny_dir, gpu_memory_utilization=1.5)
    cfg = tiny_fp32.config
    per_block = bytes_per_block(cfg, 16, torch.float32, include_mtp=False)
    per_slot = bytes_per_slot(cfg, torch.float32)
    n = blocks_for_budget(cfg, 100 * per_block + 5 * per_slot, 16, 4, torch.float32, include_mtp=False)
    assert n == 99  # 4 slots + the scratch slot, then the scratch block
    cache = allocate_cache(cfg, n, 16, 4, torch.float32, "cpu", include_mtp=False)
    assert sum(t.numel() * t.element_size() for t in cache.tensors()) <= 100 * per_block + 5 * per_slot


@pytest.mark.parametrize("graph_mode", [False, True], ids=["eager", "graph-mode"])
def test_overlapped_steps_give_the_tokens_of_one_step_at_a_time(tiny_fp32, tiny_dir, graph_mode):
    """Asynchronous scheduling (the next step planned and launched before the last one's tokens reach the host)
    changes nothing a request sees: the same tokens, texts, finish reasons and logprobs as one step at a time,
    with requests stopping on EOS, on stop tokens and stop strings mid-flight, chunked prefills and a cache
    tight enough to preempt; every block is returned. In graph mode decode steps read their in-flight tokens
    through the captured path's static buffers."""
    reqs = workload(10, seed=3)
    first, _ = run(make_engine(tiny_fp32, tiny_dir, async_scheduling=False), reqs)
    stop_tok = first["r0"].outputs[0].token_ids[2]
    text = first["r1"].outputs[0].text
    stop_str = next((text[i : i + 2] for i in range(1, len(text) - 1) if text[i : i + 2].strip()), "zz")
    extra = [("eos", [3, 1, 4, 1, 5], SamplingParams(temperature=1.0, seed=9, max_tokens=12)),
             ("tok", reqs[0][1], SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True,
                                                stop_token_ids=[stop_tok])),
             ("str", reqs[1][1], SamplingParams(temperature=1.0, seed=7, max_tokens=9, ignore_eos=True, stop=[stop_str])),
             ("lp", [9, 8, 7], SamplingParams(temperature=0.9, seed=4, max_tokens=5, logprobs=2, ignore_eos=True)),
             ("one", [4, 4], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)),
             ("ctx", list(range(3, 123)), SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))]
    results = []
    for overlap in (False, True):
        engine = make_engine(tiny_fp32, tiny_dir, async_scheduling=overlap, max_num_batched_tokens=24, block_size=4,
                             num_blocks=40, max_model_len=128)
        assert engine.overlap == overlap
        engine.runner.graph_mode = graph_mode
        final, seen = run(engine, reqs + extra)
        assert_all_free(engine)
        for outs in seen.values():
            assert all(-1 not in o.outputs[0].token_ids for o in outs)
        results.append(final)
    serial, overlapped = results
    assert serial.keys() == overlapped.keys()
    for rid, a in serial.items():
        a, b = a.outputs[0], overlapped[rid].outputs[0]
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason), rid
        # Steps batch requests differently (a stopped request runs one token more), so fp32 sums may round
        # differently: logprobs agree to rounding, their top ids exactly.
        assert (a.logprobs is None) == (b.logprobs is None), rid
        if a.logprobs is not None:
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
            assert [[t for t, _ in row] for row in a.top_logprobs] == [[t for t, _ in row] for row in b.top_logprobs]
    assert serial["tok"].outputs[0].finish_reason == "stop" and serial["tok"].outputs[0].token_ids[-1] == stop_tok
    assert serial["str"].outputs[0].finish_reason == "stop"
    assert len(serial["one"].outputs[0].token_ids) == 1 and len(serial["ctx"].outputs[0].token_ids) == 8


def test_abort_while_a_step_is_in_flight(tiny_fp32, tiny_dir):
    """A request aborted while its next token is still in flight reports only the tokens that landed, and the
    requests beside it are untouched."""
    engine = make_engine(tiny_fp32, tiny_dir)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    alone_final, _ = run(make_engine(tiny_fp32, tiny_dir), [("b", [7, 7, 7], params)])
    engine.add_request("a", [1, 2, 3], params)
    engine.add_request("b", [7, 7, 7], params)
    landed = []
    for _ in range(3):
        landed += [o.outputs[0].token_ids for o in engine.step() if o.request_id == "a"]
    out = engine.abort_request("a")
    assert out.outputs[0].finish_reason == "abort" and out.outputs[0].token_ids == landed[-1]
    final, _ = run(engine, [])
    assert final["b"].outputs[0].token_ids == alone_final["b"].outputs[0].token_ids
    assert_all_free(engine)


def test_step_budget_defaults_as_vllms_and_a_given_one_wins(tiny_fp32, tiny_dir):
    """Off a large GPU an engine (as `LLM`) takes 8192 tokens a step by default; a given budget is the
    scheduler's."""
    assert make_engine(tiny_fp32, tiny_dir).scheduler.max_num_batched_tokens == 8192
    assert make_engine(tiny_fp32, tiny_dir, max_num_batched_tokens=16).scheduler.max_num_batched_tokens == 16


# ---------------------------------------------------------------------------------------------- warm-up
WARM = dict(max_num_seqs=4, max_num_batched_tokens=64)
"""A step budget small enough for the CPU: the warm-up runs 3 prompts of 21 tokens, then 3 decodes beside 61."""


def cache_tensors(engine):
    return engine.cache.tensors() + [t for s in engine.cache.kda.values() for t in (s.verify or {}).values()]


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(async_scheduling=False), dict(block_size=4, num_blocks=34, max_model_len=128),
     dict(speculative_config={"method": "mtp", "num_speculative_tokens": 2})],
    ids=["overlapped", "one-step-at-a-time", "tight-cache", "speculative"],
)
def test_warm_up_changes_no_token_and_leaves_the_engine_as_built(tiny_fp32, tiny_dir, kw):
    """An engine that warmed up holds what a fresh one holds (cache contents, the allocator's free lists in
    order, no requests, counters, the seed stream of unseeded requests) and gives every request the same
    tokens, greedy, seeded and unseeded."""
    cold = make_engine(tiny_fp32, tiny_dir, **WARM, **kw)
    warm = make_engine(tiny_fp32, tiny_dir, warmup=True, **WARM, **kw)
    for a, b in zip(cache_tensors(cold), cache_tensors(warm), strict=True):
        assert torch.equal(a, b)
    cbm, wbm = cold.scheduler.block_manager, warm.scheduler.block_manager
    assert (wbm._free_blocks, wbm._free_slots) == (cbm._free_blocks, cbm._free_slots)
    assert not warm.scheduler.requests and not warm.scheduler.waiting and not warm.scheduler.running
    assert warm.stats == cold.stats and warm.runner.num_replays == cold.runner.num_replays
    assert (warm.host_times.seconds, warm.host_times.steps) == (cold.host_times.seconds, cold.host_times.steps)
    assert torch.equal(warm._seeds.get_state(), cold._seeds.get_state())
    reqs = workload(5) + [("unseeded", [3, 1, 4], SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True))]
    want, _ = run(cold, reqs)
    got, _ = run(warm, reqs)
    assert {rid: (o.outputs[0].token_ids, o.outputs[0].finish_reason) for rid, o in got.items()} == \
        {rid: (o.outputs[0].token_ids, o.outputs[0].finish_reason) for rid, o in want.items()}
    assert warm.stats == cold.stats
    assert_all_free(warm)


def test_warm_up_runs_a_full_prefill_step_the_sampler_and_a_mixed_step(tiny_fp32, tiny_dir, monkeypatch, caplog):
    """Off by default on the CPU; asked for, a step of prompts filling the step budget (each sampled), then a
    prompt beside their decodes, through the engine's own runner and sampler; its time is logged."""
    from glm5next.runtime.batch_sampler import BatchSampler
    from glm5next.runtime.runner import Runner

    steps, sampled = [], []
    execute, sample = Runner.execute, BatchSampler.sample

    def spy_execute(self, items, num_decodes, *args, **kwargs):
        steps.append((num_decodes, [n for _, _, n, _, _ in items]))
        return execute(self, items, num_decodes, *args, **kwargs)

    def spy_sample(self, logits, *args, **kwargs):
        sampled.append(logits.shape[0])
        return sample(self, logits, *args, **kwargs)

    monkeypatch.setattr(Runner, "execute", spy_execute)
    monkeypatch.setattr(BatchSampler, "sample", spy_sample)
    make_engine(tiny_fp32, tiny_dir, **WARM)
    assert not steps and not sampled
    with caplog.at_level("INFO", logger="glm5next.runtime.engine_core"):
        make_engine(tiny_fp32, tiny_dir, warmup=True, **WARM)
    assert steps == [(0, [21, 21, 21]), (3, [1, 1, 1, 61])]  # 63 and 64 tokens: the budget is 64
    assert sampled == [3, 4]
    assert "warm-up (3 x 21 prompt tokens, then 3 decodes beside a 61-token prompt) took" in caplog.text
