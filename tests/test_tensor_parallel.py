"""Tensor parallelism on the CPU, through gloo with 2 and 4 processes: every rank reads only its
slices of the checkpoint and their shards rebuild the whole weights; the sharded forward equals
the single-process one (fp32 logits over a prefill and decode steps, the caches each rank holds);
greedy tokens through the engine (rank 0 driving) are identical; the executor plans alike on
every rank; and bad sizes are refused with errors naming what is wrong."""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request

import pytest
import torch

from glm5next.checkpoint.loader import CheckpointError
from glm5next.checkpoint.writer import make_tiny_checkpoint
from glm5next.cli import main
from glm5next.model.backbone import Glm5NextModel
from glm5next.parallel import TensorParallel, all_gather_object, init_tensor_parallel
from glm5next.runtime.cache import allocate_cache
from glm5next.runtime.runner import Runner, Sequence
from glm5next.specialized_decode import Policy, SpecializedDecode

from .tp_spawn import TP_TEXT_OVERRIDES, run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT_LENS = (45, 7)
"""Two sequences; the first is longer than the 32 tokens the indexer selects, so selection matters."""
DECODE_STEPS = 4
REPLICATED = ("norm", "_hc.", "mlp.gate.", "f_a_proj", "g_a_proj", "q_a_proj", "kv_a_proj", "indexer.wk.",
              "index_kpool", "eh_proj")
"""Parameter names every rank holds whole: norms, mHC mixers, the router, the shared latents and keys."""


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


@pytest.fixture(scope="module")
def tp_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tp"))
    make_tiny_checkpoint(path, seed=1, text_overrides=TP_TEXT_OVERRIDES)
    return path


@pytest.fixture(scope="module")
def tp_single(tp_dir):
    return Glm5NextModel.from_pretrained(tp_dir, torch.float32, "cpu", progress=False)


# ----------------------------------------------------------------------------- loading
def test_a_size_that_does_not_divide_is_refused_naming_the_dimensions(tp_single):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide num_attention_heads=4, "
                                         r"linear_attn_config.num_heads=4, index_n_heads=4"):
        Glm5NextModel(tp_single.config, tp=TensorParallel(0, 3))
    Glm5NextModel(tp_single.config, tp=TensorParallel(1, 4))  # the counter-example builds


def test_the_command_refuses_a_size_before_starting_ranks(tiny_dir, capsys, monkeypatch):
    import glm5next.parallel.launch as launch

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(launch, "relaunch", lambda *a: pytest.fail("ranks were started"))
    assert main(["generate", "--model", tiny_dir, "--prompt", "hi", "--tensor-parallel-size", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tensor_parallel_size=3 does not divide" in err[0]


def test_fp8_weights_must_split_on_scale_blocks(tiny_dir):
    with pytest.raises(CheckpointError, match=r"layers\.0\.mlp\.gate_proj\.weight is FP8 with 128x128 scale blocks, "
                                              r"but tensor_parallel_size=2 splits its dimension 0 \(192\) into "
                                              r"parts of 96") as err:
        Glm5NextModel.from_pretrained(tiny_dir, torch.float32, "cpu", progress=False, tp=TensorParallel(0, 2))
    lines = str(err.value).splitlines()  # every expert is cut alike: a few examples, then the count
    assert len(lines) == 5 and lines[-1].endswith("more FP8 weights split the same way"), lines


@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_reads_only_its_slices_and_the_shards_rebuild_the_weights(tp_dir, tp_single, size):
    ranks = [Glm5NextModel.from_pretrained(tp_dir, torch.float32, "cpu", progress=False, tp=TensorParallel(r, size))
             for r in range(size)]
    whole = dict(tp_single.named_parameters())
    sharded = 0
    for name, full in whole.items():
        parts = [dict(m.named_parameters())[name] for m in ranks]
        differ = [d for d in range(full.dim()) if parts[0].shape[d] != full.shape[d]]
        replicated = any(k in name for k in REPLICATED)
        assert (not differ) == replicated, f"{name}: split along {differ}"
        if replicated:
            assert all(torch.equal(p, full) for p in parts), name
            continue
        assert len(differ) == 1 and parts[0].shape[differ[0]] * size == full.shape[differ[0]], name
        assert torch.equal(torch.cat(parts, differ[0]), full), name
        sharded += 1
    assert sharded > 60
    full_bytes = tp_single.load_report.bytes_by_key
    for key, n in full_bytes.items():
        read = [m.load_report.bytes_by_key[key] for m in ranks]
        assert read == [n] * size or (sum(read) == n and max(read) < n), (key, read, n)
    total = tp_single.load_report.bytes_read
    assert all(m.load_report.bytes_read < 0.6 * total for m in ranks)


# ----------------------------------------------------------------------------- forward
def run_steps(model: Glm5NextModel):
    """fp32 logits [1 + DECODE_STEPS, 2, vocab] of a prefill of two sequences and decode steps fed
    fixed tokens, and the cache."""
    cache = allocate_cache(model.config, 16, 16, 2, torch.float32, "cpu", include_mtp=False, tp_size=model.tp.size)
    runner = Runner(model, cache, 256)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    seqs = [Sequence(torch.randint(0, vocab, (n,), generator=g).tolist(), i, list(range(8 * i, 8 * i + 8)))
            for i, n in enumerate(PROMPT_LENS)]
    logits = [runner.step(seqs)]
    for _ in range(DECODE_STEPS):
        for s in seqs:
            s.token_ids.append(int(torch.randint(0, vocab, (), generator=g)))
        logits.append(runner.step(seqs))
    return torch.stack(logits), cache


def _sharded_steps(rank: int, size: int, model_dir: str):
    tp = init_tensor_parallel(size, "cpu")
    model = Glm5NextModel.from_pretrained(model_dir, torch.float32, "cpu", progress=False, tp=tp)
    logits, cache = run_steps(model)
    return logits, cache.kda[0].recurrent[:2].clone(), cache.kda[0].conv[:2].clone(), cache.dsa[3].latent.clone()


@pytest.mark.parametrize("size", [2, 4])
def test_sharded_forward_equals_single_process(tp_dir, tp_single, size):
    want, cache = run_steps(tp_single)
    results = run_ranks(size, _sharded_steps, tp_dir)
    heads = tp_single.config.linear_num_heads // size
    conv = cache.kda[0].conv[:2].view(2, 3, tp_single.config.linear_num_heads, -1, cache.kda[0].conv.shape[-1])
    for rank, (logits, recurrent, conv_state, latent) in enumerate(results):
        assert rel_err(logits, want) <= 1e-4, rank
        # Each rank's KDA states are its heads' share of the whole; the DSA latent cache is replicated.
        mine = slice(rank * heads, (rank + 1) * heads)
        assert recurrent.shape[1] == heads
        assert rel_err(recurrent, cache.kda[0].recurrent[:2, mine]) <= 1e-4, rank
        assert rel_err(conv_state, conv[:, :, mine].reshape(conv_state.shape)) <= 1e-4, rank
        assert rel_err(latent, cache.dsa[3].latent) <= 1e-4, rank
        assert torch.equal(latent, results[0][3]), rank
    # Counter-example: a rank's state is not another rank's share.
    assert rel_err(results[1][1], cache.kda[0].recurrent[:2, :heads]) > 1e-2


# ----------------------------------------------------------------------------- engine
PROMPTS = [list(range(3, 43)), [7, 11, 13, 17, 19, 23, 29, 31, 37], [5, 6, 7]]
ENGINE_ARGS = dict(dtype="float32", device="cpu", max_model_len=128, num_blocks=40, max_num_seqs=4,
                   max_num_batched_tokens=32, progress=False)


def _greedy(llm, prompts):
    from glm5next import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _engine_ranks(rank: int, size: int, model_dir: str):
    from glm5next import LLM, SamplingParams
    from glm5next.runtime.async_engine import AsyncLLM

    llm = LLM(model_dir, tensor_parallel_size=size, warmup=True, **ENGINE_ARGS)  # rank 0 drives it too
    tokens = _greedy(llm, PROMPTS)
    if llm.engine.tp.is_driver:  # as `serve` runs it: the async engine on rank 0, the others follow

        async def serve_one():
            engine = AsyncLLM(llm.engine)
            last = None
            async for out in engine.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=10,
                                                                         ignore_eos=True)):
                last = out
            await engine.shutdown()
            return last.outputs[0].token_ids

        served = asyncio.run(serve_one())
    else:
        served = llm.engine.follow()
    return tokens, served


def test_engine_greedy_tokens_identical_with_rank_zero_driving(tp_dir):
    """Every rank returns the tokens of one process (which does not warm up; the ranks do)."""
    from glm5next import LLM

    want = _greedy(LLM(tp_dir, **ENGINE_ARGS), PROMPTS)
    results = run_ranks(2, _engine_ranks, tp_dir)
    for rank, (tokens, served) in enumerate(results):
        assert tokens == want, rank  # every rank returns rank 0's outputs
    assert results[0][1] == want[1]
    assert results[1][1] is None  # the follower left its loop when rank 0 shut down


SPEC = {"method": "mtp", "num_speculative_tokens": 2}


def _speculative(llm):
    from glm5next import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    sampled = [SamplingParams(temperature=0.9, top_k=20, max_tokens=10, ignore_eos=True, seed=s) for s in (1, 2)]
    outs = llm.generate(PROMPTS + PROMPTS[:2], [greedy] * len(PROMPTS) + sampled, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.engine.spec_metrics() if llm.engine.tp.is_driver else None


def _speculative_ranks(rank: int, size: int, model_dir: str, graph_mode: bool):
    from glm5next import LLM

    # One run of the two warms up first: under gloo its steps cost about 1.5 s a run.
    llm = LLM(model_dir, tensor_parallel_size=size, speculative_config=SPEC, warmup=not graph_mode, **ENGINE_ARGS)
    getattr(llm.engine.runner, "runner", llm.engine.runner).graph_mode = graph_mode  # the captured paths, eagerly
    return _speculative(llm)


def test_speculative_decoding_under_tensor_parallelism(tp_dir):
    """Rank 0 broadcasts each speculative step's plan; every rank verifies, accepts and drafts alike. Greedy
    rows equal plain decoding, sampled rows (seeded) equal one process with speculation (the ranks of one run
    warmed up, the one process did not)."""
    from glm5next import LLM

    want = _greedy(LLM(tp_dir, **ENGINE_ARGS), PROMPTS)
    single, _ = _speculative(LLM(tp_dir, speculative_config=SPEC, **ENGINE_ARGS))
    assert single[: len(PROMPTS)] == want
    for graph_mode in (False, True):
        results = run_ranks(2, _speculative_ranks, tp_dir, graph_mode)
        for rank, (tokens, _) in enumerate(results):
            assert tokens == single, (rank, graph_mode)
        assert results[0][1]["verify_rows"] > 0


def test_tensor_parallel_engine_needs_its_processes(tp_dir, monkeypatch):
    from glm5next.runtime.engine_core import LLMEngine

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 needs 2 processes.*torchrun --nproc-per-node 2"):
        LLMEngine(tp_dir, tensor_parallel_size=2, **ENGINE_ARGS)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2, but torchrun started WORLD_SIZE=4"):
        LLMEngine(tp_dir, tensor_parallel_size=2, **ENGINE_ARGS)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=0 must be a positive integer"):
        LLMEngine(tp_dir, tensor_parallel_size=0, **ENGINE_ARGS)


def test_cli_generate_under_torchrun_prints_once_and_matches(tp_dir, capsys):

    args = ["generate", "--model", tp_dir, "--prompt", "Hello, GLM!", "--device", "cpu", "--dtype", "float32",
            "--max-tokens", "8", "--ignore-eos", "--max-model-len", "64", "--num-blocks", "8", "--max-num-seqs", "2"]
    assert main(args) == 0
    want = re.findall(r"token ids: (\[.*\])", capsys.readouterr().out)
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "glm5next.cli", *args, "--tensor-parallel-size", "2"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = re.findall(r"token ids: (\[.*\])", run.stdout)
    assert len(want) == 1 and got == want, (run.stdout, want)


PLAIN_PROCESS_SCRIPT = """
import json, sys
from glm5next import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=int(sys.argv[2]), **json.loads(sys.argv[3]))
params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
runs = [[o.outputs[0].token_ids for o in llm.generate(p, params, use_tqdm=False)] for p in json.loads(sys.argv[4])]
llm.shutdown()
print("TOKENS", json.dumps(runs))
"""


def test_llm_refuses_a_size_before_starting_ranks(tiny_dir, monkeypatch):
    from glm5next import LLM
    from glm5next.runtime import tp_workers

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(tp_workers.subprocess, "Popen", lambda *a, **k: pytest.fail("a worker was started"))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide num_attention_heads=4"):
        LLM(tiny_dir, tensor_parallel_size=3, **ENGINE_ARGS)


def test_llm_starts_its_own_ranks_in_a_plain_process(tmp_path):
    """`LLM(dir, tensor_parallel_size=2)` in an ordinary Python process (no torchrun) starts its other rank,
    answers two `generate` calls token for token like one process, and `shutdown()` ends the worker so
    the script exits. The model is `make-tiny --tp-ready`'s."""
    model_dir = str(tmp_path / "tp-ready")
    assert main(["make-tiny", model_dir, "--tp-ready", "--no-mtp"]) == 0
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")}
    env.update(PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    calls = json.dumps([PROMPTS, PROMPTS[1:2]])
    out = {}
    for size in (1, 2):
        run = subprocess.run([sys.executable, "-c", PLAIN_PROCESS_SCRIPT, model_dir, str(size), json.dumps(ENGINE_ARGS),
                              calls], env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        out[size] = re.findall(r"^TOKENS (.*)$", run.stdout, re.M)
    assert len(out[1]) == 1 and out[2] == out[1], out


def test_serve_relaunches_itself_answers_like_one_process_and_stops(tp_dir):
    from glm5next import LLM, SamplingParams

    want = LLM(tp_dir, **ENGINE_ARGS).generate("Hello", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                                               use_tqdm=False)[0].outputs[0].text
    cmd = [sys.executable, "-m", "glm5next.cli", "serve", "--model", tp_dir, "--port", "0", "--dtype", "float32",
           "--device", "cpu", "--max-model-len", "64", "--num-blocks", "8", "--served-model-name", "tiny",
           "--tensor-parallel-size", "2"]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(PYTHONUNBUFFERED="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        m = re.search(r"http://[^/\s]+:(\d+)/v1", line)
        assert m, (line, proc.stderr.read() if proc.poll() is not None else "")
        req = urllib.request.Request(f"http://127.0.0.1:{m.group(1)}/v1/completions", method="POST",
                                     headers={"Content-Type": "application/json"},
                                     data=json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 6,
                                                      "temperature": 0, "ignore_eos": True}).encode())
        body = json.loads(urllib.request.urlopen(req, timeout=120).read())
        assert body["choices"][0]["text"] == want
        proc.send_signal(signal.SIGTERM)  # rank 0 shuts down, then releases rank 1
        assert proc.wait(timeout=60) == 0, proc.stderr.read()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ----------------------------------------------------------------------------- executor
EXECUTOR_POLICY = {"dense_mlp": {"2": "fused"}, "shared_expert": {"2": "fused"}, "kda_proj": {"2": "grouped"},
                   "dsa_proj": {"2": "single"}, "boundary": {"2": "fused"}}
"""Stages at 2-token steps (the Triton interpreter on the CPU), stock at the other planned size."""


def run_planned(model: Glm5NextModel, policy: dict | None):
    """fp32 logits of decode steps planned by the executor under `policy` (graph mode, as captured
    steps run; None: no executor, stock), the steps it planned and what it logged."""
    ex = SpecializedDecode(model, Policy(policy), (1, 2, 4)) if policy is not None else None
    cache = allocate_cache(model.config, 16, 16, 3, torch.float32, "cpu", include_mtp=False, tp_size=model.tp.size)
    runner = Runner(model, cache, 256, capture_sizes=(1, 2, 4), executor=ex)
    g = torch.Generator().manual_seed(2)
    vocab = model.config.vocab_size
    seqs = [Sequence(torch.randint(0, vocab, (n,), generator=g).tolist(), i, list(range(5 * i, 5 * i + 5)))
            for i, n in enumerate((9, 38, 5))]
    runner.step(seqs)  # the prefill runs stock
    runner.graph_mode = True
    logits = []
    for live in (seqs[:2], seqs, seqs[:1]):  # 2 tokens (stages), 3 padded to 4 (stock), 1 (stock)
        for s in live:
            s.token_ids.append(int(torch.randint(0, vocab, (), generator=g)))
        logits.append(runner.step(live))
    return (logits, ex.planned_steps, sorted(ex._log.seen)) if ex is not None else (logits, 0, [])


def _planned_ranks(rank: int, size: int, model_dir: str):
    from glm5next.specialized_decode.decode import LayerStages

    tp = init_tensor_parallel(size, "cpu")
    model = Glm5NextModel.from_pretrained(model_dir, torch.float32, "cpu", progress=False, tp=tp)
    reduced = []
    original = LayerStages.reduced_boundary

    def counting(self, *args, **kwargs):  # sublayer outputs left TP-partial, summed by the boundary
        reduced.append(args[2].shape[0])
        return original(self, *args, **kwargs)

    LayerStages.reduced_boundary = counting
    logits, planned, log = run_planned(model, EXECUTOR_POLICY)
    return logits, all_gather_object((planned, log, sorted(set(reduced)), len(reduced)), tp)


def test_executor_plans_alike_on_every_rank_and_equals_stock(tp_dir, tp_single):
    want, _, _ = run_planned(tp_single, None)
    results = run_ranks(2, _planned_ranks, tp_dir)
    for rank, (logits, views) in enumerate(results):
        assert all(v == views[0] for v in views), views  # the same plans and skips on every rank
        assert views[0][0] == 3, views[0]
        # 1 and 2 tokens (at or below the boundary table's largest count) leave every sublayer partial
        assert views[0][2] == [1, 2] and views[0][3] == 2 * 2 * 4 - 2, views[0]
        for got, exp in zip(logits, want):
            assert rel_err(got, exp) <= 1e-4, rank
