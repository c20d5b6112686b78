"""The stock decode forward under CUDA-graph capture and replay ≡ eager."""

import pytest
import torch

from glm5next.model.backbone import Glm5NextModel
from glm5next.runtime.cache import ModelCache
from glm5next.runtime.metadata import CUDAGraphMode, ForwardContext, build_metadata
from glm5next.runtime.runner import Runner, Sequence

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def model(tiny_dir):
    return Glm5NextModel.from_pretrained(tiny_dir, torch.bfloat16, "cuda", progress=False)


def prefilled(model, lens):
    cache = ModelCache(model.config, 64, 16, len(lens) + 1, torch.bfloat16, "cuda")
    runner = Runner(model, cache)
    g = torch.Generator().manual_seed(0)
    seqs = [Sequence(torch.randint(0, 256, (n,), generator=g).tolist(), i, list(range(8 * i, 8 * i + 8)))
            for i, n in enumerate(lens)]
    runner.step(seqs)
    return runner, seqs


def decode_metadata(seqs, pad_to, device="cuda"):
    n = len(seqs)
    pad = pad_to - n
    return build_metadata(
        [1] * pad_to, [s.num_cached for s in seqs] + [1] * pad, pad_to,
        [s.slot for s in seqs] + [-1] * pad, [s.blocks for s in seqs] + [[0]] * pad, 16, device, max_blocks=8,
    )


@pytest.mark.parametrize("lens", [[5], [40, 3, 70]], ids=["one-seq", "three-seqs"])
def test_graph_replay_equals_eager(model, lens):
    runner, seqs = prefilled(model, lens)
    pad_to = 4
    # Capture with one set of metadata ...
    md = decode_metadata(seqs, pad_to)
    ids = torch.zeros(pad_to, dtype=torch.int64, device="cuda")
    ctx = ForwardContext({p: md for p in runner.prefixes}, md.positions, CUDAGraphMode.FULL)
    snap = [t.clone() for t in runner.cache.tensors()]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.inference_mode():
        model(ids, ctx, runner.cache)  # warm-up
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.inference_mode():
        hidden = model(ids, ctx, runner.cache)
    for t, v in zip(runner.cache.tensors(), snap):
        t.copy_(v)
    # ... then replay several steps, re-planning the metadata in place each time, against eager.
    eager_runner, eager_seqs = prefilled(model, lens)
    for step in range(3):
        toks = [7 + step + i for i in range(len(seqs))]
        for seq, tok in zip(seqs, toks):
            seq.token_ids.append(tok)
        new = decode_metadata(seqs, pad_to)
        for name in ("positions", "token_to_seq", "slot_mapping", "state_indices", "block_tables", "seq_lens"):
            getattr(md, name).copy_(getattr(new, name))
        ids.copy_(torch.tensor(toks + [0] * (pad_to - len(toks)), device="cuda"))
        graph.replay()
        got = model.compute_logits(hidden[: len(seqs)])
        for seq in seqs:
            seq.num_cached += 1
        for seq, tok in zip(eager_seqs, toks):
            seq.token_ids.append(tok)
        want = eager_runner.step(eager_seqs)
        err = (got - want).abs().max() / want.abs().max()
        assert err < 2e-2, (step, float(err))
