"""The runner's captured-decode path, run eagerly on the CPU: static buffers (written straight from the
step's items, equal to the step metadata), padding rows with slot -1, the full-graph forward context and graph-safe MoE give the logits and caches of the
plain eager step, re-planned step after step; and the graph-safe MoE equals the eager one."""

import random

import pytest
import torch

from glm5next.runtime.cache import allocate_cache
from glm5next.runtime.metadata import build_metadata
from glm5next.runtime.runner import Runner, Sequence, _StaticInputs, check_capture_sizes


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


def _reference_buffer(items, size, q, block_size, max_blocks):
    """The static inputs of `items` as `build_metadata` makes them (the buffer layout of `_StaticInputs`)."""
    rows = size // q
    pad = rows - len(items)
    md = build_metadata([q] * rows, [c for _, c, _, _, _ in items] + [0] * pad, rows,
                        [st for *_, st, _ in items] + [-1] * pad, [b for *_, b in items] + [[]] * pad,
                        block_size, "cpu", max_blocks=max_blocks)
    ids = [t for toks, c, _, _, _ in items for t in toks[c:c + q]]
    return {"input_ids": torch.tensor(ids + [0] * (size - len(ids))), "positions": md.positions,
            "token_to_seq": md.token_to_seq, "slot_mapping": md.slot_mapping, "state_indices": md.state_indices,
            "seq_lens": md.seq_lens, "block_tables": md.block_tables}


@pytest.mark.parametrize("q", [1, 3])
def test_static_inputs_equal_the_step_metadata(q):
    """The static buffers written straight from the items hold what `build_metadata` gives, over steps whose
    rows gain blocks, change order, shrink and turn to padding (the table rows rewritten from where they
    differ from what the buffer held); a row without a block for its position or with too many is refused."""
    bs, max_blocks, size = 16, 6, 4 * q
    st = _StaticInputs(size, max_blocks, torch.device("cpu"))
    g = random.Random(q)
    lens = [5, 40, 17, 70]
    tables = [g.sample(range(100), 6) for _ in lens]
    for step in range(12):
        live = [i for i in range(4) if (i + step) % 5]  # rows drop out and come back
        g.shuffle(live)
        items = []
        for i in live:
            n = lens[i] + step
            items.append(([g.randrange(50) for _ in range(n + q)], n, q, 10 + i, tables[i][: (n + q - 1) // bs + 1]))
        st.load(items, size, q, bs)
        want = _reference_buffer(items, size, q, bs, max_blocks)
        for name, value in want.items():
            n = value.shape[0]
            assert torch.equal(st.views[name][:n], value), (step, name)
    big = [([1] * 200, 100, q, 0, list(range(7)))]
    with pytest.raises(ValueError, match="more than max_blocks=6"):
        st.load(big, size, q, bs)
    with pytest.raises(ValueError, match="has no cache block"):
        st.load([([1] * 80, 40, q, 0, [1, 2])], size, q, bs)


def test_static_inputs_follow_a_reused_state_slot_across_sizes():
    """A KDA state slot reused by a new sequence with as many blocks, while a smaller step leaves a row of
    the buffer untouched: the row is rewritten when the slot comes back to it."""
    bs, max_blocks = 16, 4
    st = _StaticInputs(2, max_blocks, torch.device("cpu"))
    toks = list(range(40))
    steps = [(2, [(toks, 33, 1, 6, [4, 5, 6]), (toks, 33, 1, 5, [1, 2, 3])]),
             (1, [(toks, 33, 1, 5, [7, 8, 9])]),
             (2, [(toks, 33, 1, 6, [4, 5, 6]), (toks, 33, 1, 5, [7, 8, 9])])]
    for size, items in steps:
        st.load(items, size, 1, bs)
        want = _reference_buffer(items, size, 1, bs, max_blocks)
        assert torch.equal(st.views["block_tables"][:size], want["block_tables"]), size
