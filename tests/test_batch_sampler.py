"""Invariants of the device-side batch sampler, checked against the per-request sampler's probabilities."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from glm5next.runtime.batch_sampler import BatchSampler, row_keys, uniforms
from glm5next.runtime.sampler import GREEDY_TEMPERATURE, SamplingParams, filtered_probs, sample

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
CHI2_LIMIT = 35.0
"""Chi-square bound for at most 7 degrees of freedom; a true fit exceeds it with p < 1e-5."""


@dataclass
class MinPParams(SamplingParams):
    """SamplingParams with the optional min-p field the batch sampler reads."""

    min_p: float = 0.0


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Probabilities [vocab] from the per-request sampler, then min-p (twin of the batched filter)."""
    probs = filtered_probs(logits, p)
    min_p = getattr(p, "min_p", 0.0)
    probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
    return probs / probs.sum()


def mixed_params() -> list[SamplingParams]:
    """Rows of every kind: greedy, plain, top-k, top-p, min-p, combined, unseeded-but-fixed."""
    return [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.7, top_k=3, seed=2),
        SamplingParams(temperature=1.3, top_p=0.6, seed=3),
        MinPParams(temperature=1.0, min_p=0.2, seed=4),
        MinPParams(temperature=0.9, top_k=5, top_p=0.8, min_p=0.05, seed=5),
        SamplingParams(temperature=2.0, top_k=1, seed=6),
    ]


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of observed counts against expected probabilities (zero-prob bins must be empty)."""
    n = counts.sum()
    keep = probs > 0
    if (counts[~keep] > 0).any():
        return float("inf")
    expected = probs[keep] * n
    return float(((counts[keep] - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax(device):
    torch.manual_seed(0)
    logits = torch.randn(5, 33, device=device)
    s = BatchSampler(33)
    t = s.plan([SamplingParams(temperature=0.0)] * 5, device)
    tok, lp = s.sample(logits, t, 0)
    assert torch.equal(tok, logits.argmax(-1))
    assert torch.allclose(lp, torch.log_softmax(logits, -1).gather(1, tok[:, None])[:, 0], atol=1e-6)


@pytest.mark.parametrize("temperature", [1e-40, 9e-6, 0.0])
def test_temperature_below_greedy_bound_is_argmax(temperature):
    """Dividing logits by 1e-40 overflows fp32 (inf - inf is NaN); such temperatures take the argmax."""
    torch.manual_seed(4)
    logits = torch.randn(4, 29) * 10
    params = [SamplingParams(temperature=temperature, seed=i) for i in range(4)]
    assert all(p.greedy for p in params)
    s = BatchSampler(29)
    tok, lp = s.sample(logits, s.plan(params, "cpu"), 0)
    assert torch.equal(tok, logits.argmax(-1)) and torch.isfinite(lp).all()
    assert sample(logits[0], params[0], None) == int(logits[0].argmax())


def test_temperature_at_greedy_bound_still_samples():
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy
    assert not SamplingParams(temperature=1e-3).greedy


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_one_is_greedy(device):
    torch.manual_seed(1)
    logits = torch.randn(6, 50, device=device)
    s = BatchSampler(50)
    t = s.plan([SamplingParams(temperature=1.5, top_k=1, seed=i) for i in range(6)], device)
    for step in range(5):
        tok, _ = s.sample(logits, t, step)
        assert torch.equal(tok, logits.argmax(-1))


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_scaled_unfiltered(device):
    torch.manual_seed(2)
    logits = torch.randn(7, 40, device=device)
    params = mixed_params()
    s = BatchSampler(40)
    tok, lp = s.sample(logits, s.plan(params, device), 3)
    for i, p in enumerate(params):
        temp = p.temperature or 1.0
        want = torch.log_softmax(logits[i] / temp, -1)[tok[i]]
        assert torch.allclose(lp[i], want, atol=1e-5), i
    assert tok.dtype == torch.int64 and lp.dtype == torch.float32


@pytest.mark.parametrize("device", DEVICES)
def test_row_alone_equals_row_in_batch(device):
    torch.manual_seed(3)
    vocab = 37
    params = mixed_params()
    logits = torch.randn(len(params), vocab, device=device)
    s = BatchSampler(vocab)
    batched = s.plan(params, device)
    steps = torch.arange(len(params), device=device) * 11 + 5
    for step in range(20):
        tok, lp = s.sample(logits, batched, steps + step)
        for i, p in enumerate(params):
            alone, alone_lp = s.sample(logits[i : i + 1], s.plan([p], device), steps[i : i + 1] + step)
            assert tok[i] == alone[0], (i, step)
            assert torch.equal(lp[i : i + 1], alone_lp)
    # Reordering the batch moves rows but changes no draw.
    perm = torch.tensor([4, 2, 6, 0, 5, 1, 3], device=device)
    shuffled = s.plan([params[j] for j in perm.tolist()], device)
    tok, _ = s.sample(logits, batched, steps)
    tok_perm, _ = s.sample(logits[perm], shuffled, steps[perm])
    assert torch.equal(tok_perm, tok[perm])


@pytest.mark.parametrize("device", DEVICES)
def test_seed_and_step_reproducible_seeds_differ(device):
    torch.manual_seed(4)
    vocab = 256
    logits = torch.randn(1, vocab, device=device) * 0.1  # near-flat so draws spread out
    s = BatchSampler(vocab)
    steps = torch.arange(64, device=device)

    def draws(seed):
        t = s.plan([SamplingParams(seed=seed)] * 64, device)
        return s.sample(logits.expand(64, vocab).contiguous(), t, steps)[0]

    assert torch.equal(draws(7), draws(7))
    assert (draws(7) != draws(8)).sum() > 50
    assert (draws(7) != draws(7 + 2**32)).sum() > 50  # the seed's high word matters
    assert (draws(-1) != draws(2**64 - 1)).sum() == 0  # seeds are taken mod 2**64
    # Consecutive steps of one seed are not all alike.
    assert draws(7).unique().numel() > 30


def test_unseeded_rows_use_the_given_generator():
    s = BatchSampler(10)
    a = s.plan([SamplingParams()], "cpu", torch.Generator().manual_seed(0))
    b = s.plan([SamplingParams()], "cpu", torch.Generator().manual_seed(0))
    c = s.plan([SamplingParams()], "cpu", torch.Generator().manual_seed(1))
    assert torch.equal(a.seed_lo, b.seed_lo) and torch.equal(a.seed_hi, b.seed_hi)
    assert not (torch.equal(a.seed_lo, c.seed_lo) and torch.equal(a.seed_hi, c.seed_hi))


def test_uniforms_in_open_interval_and_flat():
    k = torch.tensor([0, 12345, 2**32 - 1], dtype=torch.int64)
    u = uniforms(k, k.flip(0), torch.arange(100_000).expand(3, -1))
    assert (u > 0).all() and (u < 1).all()
    counts = torch.histc(u, bins=16, min=0, max=1)
    assert chi2(counts, torch.full((16,), 1 / 16)) < 60.0  # 15 dof, 3 rows of 1e5 draws


def test_uniforms_flat_per_vocab_index_across_steps():
    # Each vocab id's noise over a row's steps must be uniform on its own, not only pooled.
    s = BatchSampler(64)
    t = s.plan([SamplingParams(seed=11)] * 4096, "cpu")
    k1, k2 = row_keys(t, torch.arange(4096))
    u = uniforms(k1, k2, torch.arange(64).expand(4096, -1))
    for v in range(64):
        counts = torch.histc(u[:, v], bins=8, min=0, max=1)
        assert chi2(counts, torch.full((8,), 1 / 8)) < CHI2_LIMIT, v


DIST_CASES = {
    "plain": SamplingParams(temperature=1.0, seed=11),
    "hot": SamplingParams(temperature=1.7, seed=12),
    "top_k3": SamplingParams(temperature=0.8, top_k=3, seed=13),
    "top_p0.7": SamplingParams(temperature=1.0, top_p=0.7, seed=14),
    "min_p0.15": MinPParams(temperature=1.0, min_p=0.15, seed=15),
    "all": MinPParams(temperature=1.2, top_k=6, top_p=0.9, min_p=0.05, seed=16),
}
DIST_LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.6, 0.2, -0.3, -1.0, -2.0])


def empirical(device, p: SamplingParams, draws: int = 20_000) -> torch.Tensor:
    """Counts [8] of one request's tokens over `draws` consecutive step counters."""
    s = BatchSampler(8)
    t = s.plan([p] * draws, device)
    logits = DIST_LOGITS.to(device).expand(draws, 8).contiguous()
    tok, _ = s.sample(logits, t, torch.arange(draws, device=device))
    return torch.bincount(tok, minlength=8).float().cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(DIST_CASES))
def test_distribution_matches_filtered_softmax(device, name):
    p = DIST_CASES[name]
    counts = empirical(device, p)
    assert chi2(counts, reference_probs(DIST_LOGITS, p)) < CHI2_LIMIT


def test_distribution_check_can_fail():
    # Counter-example: the top-p draws judged against the unfiltered softmax must be rejected.
    p = DIST_CASES["top_p0.7"]
    counts = empirical("cpu", p)
    assert chi2(counts, torch.softmax(DIST_LOGITS, -1)) > CHI2_LIMIT
    counts = empirical("cpu", DIST_CASES["plain"])
    assert chi2(counts, reference_probs(DIST_LOGITS, DIST_CASES["hot"])) > CHI2_LIMIT


@pytest.mark.parametrize("device", DEVICES)
def test_filtered_tokens_never_drawn(device):
    torch.manual_seed(5)
    vocab, reps = 64, 400
    params = mixed_params()
    rows = len(params)
    logits = torch.randn(rows, vocab, device=device) * 2
    s = BatchSampler(vocab)
    # Every row repeated over `reps` step counters in one batch.
    t = s.plan([p for p in params for _ in range(reps)], device)
    tok, _ = s.sample(logits.repeat_interleave(reps, 0), t, torch.arange(rows * reps, device=device))
    seen = torch.nn.functional.one_hot(tok.view(rows, reps), vocab).any(1).cpu()
    for i, p in enumerate(params):
        allowed = reference_probs(logits[i].cpu(), p) > 0
        if p.temperature == 0.0:
            allowed = torch.nn.functional.one_hot(logits[i].argmax().cpu(), vocab).bool()
        assert not (seen[i] & ~allowed).any(), i
        assert seen[i].sum() >= 1


def test_invalid_inputs_are_refused():
    s = BatchSampler(8)
    with pytest.raises(ValueError, match="min_p"):
        s.plan([MinPParams(min_p=1.5)], "cpu")
    with pytest.raises(ValueError, match="empty"):
        s.plan([], "cpu")
    t = s.plan([SamplingParams(seed=0)], "cpu")
    with pytest.raises(ValueError, match=r"\[1, 8\]"):
        s.sample(torch.zeros(1, 9), t, 0)
    with pytest.raises(ValueError, match="float32"):
        s.sample(torch.zeros(1, 8, dtype=torch.bfloat16), t, 0)


SYNC_METHODS = ["item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__"]


@pytest.fixture
def no_host_sync(monkeypatch):
    """Tensor methods that read data back to the host, made to raise."""

    def forbid(name):
        def raiser(*args, **kwargs):
            raise AssertionError(f"host sync via Tensor.{name}")

        return raiser

    def install():
        for name in SYNC_METHODS:
            monkeypatch.setattr(torch.Tensor, name, forbid(name))

    return install


def test_no_host_sync_on_cpu(no_host_sync):
    torch.manual_seed(6)
    s = BatchSampler(30)
    t = s.plan(mixed_params(), "cpu")
    logits = torch.randn(7, 30)
    want = s.sample(logits, t, torch.arange(7))
    no_host_sync()
    got = s.sample(logits, t, torch.arange(7))
    got_int_step = s.sample(logits, t, 0)
    assert torch.equal(got[0], want[0]) and got_int_step[0].shape == (7,)


def test_no_host_sync_check_can_fail(no_host_sync):
    no_host_sync()
    with pytest.raises(AssertionError, match="host sync"):
        torch.ones(3).sum().item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU")
@pytest.mark.filterwarnings("ignore:Synchronization debug mode")
def test_cuda_graph_replay_equals_eager():
    torch.manual_seed(7)
    vocab = 1000
    s = BatchSampler(vocab)
    params = mixed_params()
    t = s.plan(params, "cuda")
    logits = torch.randn(7, vocab, device="cuda")
    step = torch.zeros(7, dtype=torch.int64, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        s.sample(logits, t, step)  # warm-up off the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            out_tok, out_lp = s.sample(logits, t, step)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for k in range(5):
        logits.copy_(torch.randn(7, vocab, device="cuda"))
        step.copy_(torch.arange(7, device="cuda") + 100 * k)
        graph.replay()
        tok, lp = s.sample(logits, t, step)
        assert torch.equal(out_tok, tok), k
        assert torch.equal(out_lp, lp), k
