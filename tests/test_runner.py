"""The runner's captured-decode path, run eagerly on the CPU: static buffers, padding rows with
slot -1, the full-graph forward context and graph-safe MoE give the logits and caches of the
plain eager step, re-planned step after step; and the graph-safe MoE equals the eager one."""

import pytest
import torch

from glm5next.runtime.cache import allocate_cache
from glm5next.runtime.runner import Runner, Sequence, check_capture_sizes


def prefilled(model, lens, capture_sizes=(1, 2, 4, 8)):
    cache = allocate_cache(model.config, 64, 16, 8, torch.float32, "cpu", include_mtp=False)
    runner = Runner(model, cache, max_model_len=256, capture_sizes=capture_sizes)
    g = torch.Generator().manual_seed(len(lens))
    seqs = [Sequence(torch.randint(0, 256, (n,), generator=g).tolist(), i, list(range(8 * i, 8 * i + 8)))
            for i, n in enumerate(lens)]
    runner.step(seqs)
    return runner, seqs


@pytest.mark.parametrize("lens", [[5], [40, 3, 70], [9, 16, 31, 2, 64]], ids=["1-seq", "3-seqs", "5-seqs"])
def test_static_decode_path_equals_eager(tiny_fp32, lens):
    graph_runner, graph_seqs = prefilled(tiny_fp32, lens)
    graph_runner.graph_mode = True
    eager_runner, eager_seqs = prefilled(tiny_fp32, lens)
    for step in range(4):
        active = max(len(lens) - step % 2, 1)  # the batch shrinks and grows: other sizes, other padding
        for seqs in (graph_seqs, eager_seqs):
            for i in range(active):
                seqs[i].token_ids.append(11 * step + i)
        got = graph_runner.step(graph_seqs[:active])
        want = eager_runner.step(eager_seqs[:active])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # Padding rows wrote nothing: both caches agree everywhere except each one's scratch rows.
    for a, b in zip(graph_runner.cache.tensors(), eager_runner.cache.tensors()):
        torch.testing.assert_close(a[:-1], b[:-1], rtol=1e-4, atol=1e-5)


def test_graph_sizes_and_padding_choice(tiny_fp32):
    runner, _ = prefilled(tiny_fp32, [3], capture_sizes=(8, 2, 4, 1))
    assert runner.capture_sizes == (1, 2, 4, 8)
    assert [runner.graph_size(n, n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    assert runner.graph_size(3, 2) is None  # a prefill row: eager
    with pytest.raises(ValueError, match="capture_sizes"):
        check_capture_sizes([4, 0])
    with pytest.raises(RuntimeError, match="CUDA"):
        runner.capture()


@pytest.mark.parametrize("tokens", [1, 3, 4, 7], ids=lambda t: f"{t}-tokens")
def test_graph_safe_moe_equals_eager(tiny_fp32, tokens):
    """Few (token, expert) pairs gather their experts; many run every expert: both equal eager."""
    moe = tiny_fp32.layers[3].mlp
    x = torch.randn(tokens, tiny_fp32.config.hidden_size, generator=torch.Generator().manual_seed(tokens))
    torch.testing.assert_close(moe(x, graph_safe=True), moe(x, graph_safe=False), rtol=1e-5, atol=1e-5)
