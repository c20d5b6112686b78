"""On a GPU: every captured decode size replayed ≡ eager, with the metadata re-planned between
replays; and the engine serving concurrent requests through the graphs."""

import pytest
import torch

from glm5next.model.backbone import Glm5NextModel
from glm5next.runtime.cache import allocate_cache
from glm5next.runtime.runner import DEFAULT_CAPTURE_SIZES, Runner, Sequence

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NUM_SEQS = 64


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def captured(tiny_dir, request):
    """A runner with every default size captured, over 64 prefilled sequences."""
    model = Glm5NextModel.from_pretrained(tiny_dir, request.param, "cuda", progress=False)
    cache = allocate_cache(model.config, NUM_SEQS * 8, 16, NUM_SEQS, request.param, "cuda", include_mtp=False)
    runner = Runner(model, cache, max_model_len=128)
    runner.capture()
    g = torch.Generator().manual_seed(0)
    # In bf16 the small random model is chaotic where the indexer drops pools (an ulp flips a
    # selection), so there contexts stay within index_topk; fp32 covers long contexts.
    longest = 90 if request.param == torch.float32 else model.config.index_topk - 18
    lens = torch.randint(1, longest, (NUM_SEQS,), generator=g).tolist()
    seqs = [Sequence(torch.randint(0, 256, (n,), generator=g).tolist(), i, list(range(8 * i, 8 * i + 8)))
            for i, n in enumerate(lens)]
    for a in range(0, NUM_SEQS, 16):
        runner.step(seqs[a : a + 16])
    return runner, seqs, request.param


def eager_step(runner: Runner, items: list, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The step of `items` run eagerly in the form the graphs captured. In fp32 that is the eager step itself;
    an eager bf16 step runs the fused boundary and grouped expert kernels instead of the captured PyTorch
    form (other roundings, which the small random model amplifies), so in bf16 the captured form runs
    eagerly: graph mode without the graphs."""
    if dtype == torch.float32:
        return runner.execute(items, n, allow_graph=False)
    graphs, runner.graphs, runner.graph_mode = runner.graphs, {}, True
    try:
        return runner.execute(items, n)
    finally:
        runner.graphs, runner.graph_mode = graphs, False


def test_every_capture_size_replays_like_eager(captured):
    """From the same cache state, each replay gives the eager step's logits and cache writes."""
    runner, seqs, dtype = captured
    assert sorted(runner.graphs) == list(DEFAULT_CAPTURE_SIZES)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    # Exact sizes and sizes that pad up to the next graph, in an order that re-plans every replay.
    counts = [1, 2, 3, 4, 5, 8, 7, 16, 9, 24, 20, 32, 31, 48, 40, 64, 63]
    for step, n in enumerate(counts):
        for i in range(n):
            seqs[i].token_ids.append((37 * step + 5 * i) % 256)
        items = [(s.token_ids, s.num_cached, 1, s.slot, s.blocks) for s in seqs[:n]]
        before = [t.clone() for t in runner.cache.tensors()]
        want = eager_step(runner, items, n, dtype).clone()
        want_cache = [t[:-1].clone() for t in runner.cache.tensors()]
        for t, b in zip(runner.cache.tensors(), before):
            t.copy_(b)
        replays = runner.num_replays
        got = runner.execute(items, n)
        assert runner.num_replays == replays + 1, f"{n} decodes did not replay a graph"
        err = float((got - want).abs().max() / want.abs().max())
        assert err < tol, (n, err)
        for t, w in zip(runner.cache.tensors(), want_cache):
            cerr = float((t[:-1].float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-30))
            assert cerr < tol, (n, cerr)
        for s in seqs[:n]:
            s.num_cached += 1


def test_engine_through_graphs_equals_alone_in_fp32(tiny_dir):
    from glm5next import LLM, SamplingParams

    llm = LLM(tiny_dir, dtype="float32", device="cuda", max_model_len=256, max_num_seqs=16, num_blocks=256,
              decode_backend="stock", progress=False)
    assert llm.engine.runner.graphs
    prompts = [f"request {i} " * (1 + i % 4) for i in range(12)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=8, ignore_eos=True)
              for i in range(12)]
    together = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.stats["graph_steps"] > 0 and llm.engine.overlap
    for p, sp, t in zip(prompts, params, together):
        assert llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids == t.outputs[0].token_ids
    # One step at a time (each step planned after the last one's tokens came back): the same tokens.
    serial = LLM(tiny_dir, dtype="float32", device="cuda", max_model_len=256, max_num_seqs=16, num_blocks=256,
                 decode_backend="stock", progress=False, async_scheduling=False)
    for s, t in zip(serial.generate(prompts, params, use_tqdm=False), together):
        assert s.outputs[0].token_ids == t.outputs[0].token_ids


def test_speculative_verify_graphs_equal_plain_decoding_in_fp32(tiny_dir):
    from glm5next import LLM, SamplingParams

    prompts = [f"spec {i} " * (1 + i % 3) for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    plain = LLM(tiny_dir, dtype="float32", device="cuda", max_model_len=256, max_num_seqs=8, num_blocks=128,
                decode_backend="stock", progress=False)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    del plain
    spec = LLM(tiny_dir, dtype="float32", device="cuda", max_model_len=256, max_num_seqs=8, num_blocks=128,
               decode_backend="stock", progress=False,
               speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert spec.engine.runner.graphs and all(s % 3 == 0 for s in spec.engine.runner.graphs)
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == want and spec.engine.stats["graph_steps"] > 0
