"""The time floor of a decode step: the bytes it must move over the measured read bandwidth.

The bandwidth is measured in the benchmark's own process with a reduction
kernel (a bf16 sum over a buffer far larger than L2, several per CUDA graph,
median of graph replays timed with CUDA events), not with a captured memcpy,
which runs on the copy engines at a lower rate. The bytes are counted from the
model's and the cache's own tensors: every non-expert weight once, the routed
experts the step actually chose, the KDA states of its sequences (read and
written) and the DSA cache rows its tokens read and write. Activations, which
stay in L2 or are tiny, are not counted.
"""

from __future__ import annotations

import statistics
import time

import torch

from ..config import DSA, KDA
from ..model.backbone import Glm5NextModel
from ..model.moe import RoutedExperts
from ..forward import ModelCache


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def capture(fn, warmups: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `fn`, after `warmups` eager calls on a side stream (kernels compile and
    allocations settle outside the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def time_replays(graph, replays: int, warmup: int) -> list[float]:
    """Milliseconds of each of `replays` back-to-back replays of `graph` after `warmup`, by CUDA events."""
    for _ in range(warmup):
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]


def measure_read_bandwidth(device: torch.device | str, gib: float = 1.0, replays: int = 20, per_graph: int = 4) -> dict:
    """Read bandwidth (bytes/s) of a bf16 sum over a `gib` GiB random buffer.

    On CUDA: `per_graph` sums captured in one graph, median over `replays`
    replays timed with CUDA events. On the CPU: wall-clock median of a few sums
    over a smaller buffer (for tests; the number means little there).
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    if not cuda:
        gib = min(gib, 1 / 16)
    n = int(gib * 2**30) // 2
    buf = torch.empty(n, dtype=torch.bfloat16, device=device)
    gen = torch.Generator(device=device).manual_seed(1)
    step = 1 << 26
    for a in range(0, n, step):
        buf[a : a + step] = torch.randn(min(step, n - a), generator=gen, device=device)
    if not cuda:
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            buf.sum(dtype=torch.float32).item()
            times.append(time.perf_counter() - t0)
        sec = statistics.median(times)
        return {"method": "cpu wall clock, bf16 sum", "buffer_bytes": _nbytes(buf), "seconds": sec,
                "bytes_per_s": _nbytes(buf) / sec}
    sums: list[torch.Tensor] = []

    def probe() -> None:
        sums.extend(buf.sum(dtype=torch.float32) for _ in range(per_graph))

    graph = capture(probe, warmups=2)
    sec = statistics.median(time_replays(graph, replays, 3)) / 1e3 / per_graph
    if not all(torch.isfinite(s).item() for s in sums):
        raise RuntimeError("the bandwidth probe summed to a non-finite value")
    out = {"method": f"bf16 sum kernel, {per_graph} per CUDA graph, median of {replays} replays",
           "buffer_bytes": _nbytes(buf), "seconds": sec, "bytes_per_s": _nbytes(buf) / sec}
    del graph, probe
    sums.clear()
    buf = None  # the probe's closure shares this cell: the buffer is free now
    torch.cuda.empty_cache()
    return out


def record_routing(model: Glm5NextModel, run) -> dict[int, torch.Tensor]:
    """The expert ids [T, k] each MoE layer's router chose while `run()` ran (eagerly), by layer index."""
    routing: dict[int, torch.Tensor] = {}
    handles = []
    for layer in model.layers:
        if layer.mlp_is_moe:
            def hook(module, inputs, output, idx=layer.layer_idx):
                routing[idx] = output[0].detach().clone()
            handles.append(layer.mlp.gate.register_forward_hook(hook))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return routing


def expert_bytes(experts: RoutedExperts) -> int:
    """Bytes of one routed expert's weights and block scales."""
    return sum(_nbytes(p) for p in experts.parameters()) // experts.num_experts


def step_bytes(
    model: Glm5NextModel, cache: ModelCache, routing: dict[int, torch.Tensor], num_tokens: int, context: int,
    tokens_per_seq: int = 1,
) -> dict:
    """The bytes one step of `num_tokens` tokens must read and write, by part: `tokens_per_seq` tokens
    (1 for a decode, q for a speculative verify) of each of `num_tokens // tokens_per_seq` sequences,
    at positions `context` onwards. `routing`: the expert ids [num_tokens, k] of each MoE layer.

    The tokens of one sequence share their reads: its KDA states are read and written once, its
    pooled keys read once, and its latents counted for one token's selection (a lower bound on the
    union of its tokens' selections)."""
    config = model.config
    q = tokens_per_seq
    if q < 1 or num_tokens % q:
        raise ValueError(f"{num_tokens} tokens are not whole sequences of {q} tokens")
    seqs = num_tokens // q
    routed = {id(p) for m in model.modules() if isinstance(m, RoutedExperts) for p in m.parameters()}
    weights = lm_head = 0
    for name, p in model.named_parameters():
        if id(p) in routed or name == "embed_tokens" or name.startswith("mtp."):  # the draft layer is not the step's
            continue
        weights += _nbytes(p)
        if name.startswith("lm_head."):
            lm_head += _nbytes(p)
    embedding = num_tokens * model.embed_tokens.shape[1] * model.embed_tokens.element_size()

    experts, distinct = 0, {}
    for layer in model.layers:
        if not layer.mlp_is_moe:
            continue
        if layer.layer_idx not in routing:
            raise ValueError(f"no routing recorded for MoE layer {layer.layer_idx}")
        ids = routing[layer.layer_idx]
        if ids.shape[0] != num_tokens:
            raise ValueError(f"layer {layer.layer_idx}: routing has {ids.shape[0]} rows, expected {num_tokens}")
        n = int(torch.unique(ids).numel())
        distinct[layer.layer_idx] = n
        experts += n * expert_bytes(layer.mlp.experts)

    kda = 0
    for i, kind in enumerate(config.layer_kinds):
        if kind == KDA:
            s = cache.kda[i]
            kda += 2 * seqs * (_nbytes(s.conv[0]) + _nbytes(s.recurrent[0]))  # read + write

    kp = config.index_kpool
    positions = range(context, context + q)  # a sequence's tokens; the first sits at position `context`
    visible = (positions[-1] + 1) // kp  # complete pools its last token sees
    latents_read = max(min(config.index_topk_pools, (p + 1) // kp) * kp + (p + 1) % kp for p in positions)
    completes = sum(1 for p in positions if p % kp == kp - 1)
    dsa = 0
    for i, kind in enumerate(config.layer_kinds):
        if kind == DSA:
            c = cache.dsa[i]
            lat, key, gate, pooled = (_nbytes(t[0, 0]) for t in (c.latent, c.index_key, c.index_gate, c.pooled_key))
            per_seq = visible * pooled + latents_read * lat  # indexer scores, attention over the selection
            per_seq += q * (lat + key + gate)  # the tokens' own rows
            per_seq += completes * (kp * (key + gate) + pooled)  # the pools they complete
            dsa += seqs * per_seq

    total = weights + embedding + experts + kda + dsa
    return {"total": total, "weights": weights, "lm_head": lm_head, "embedding": embedding, "experts": experts,
            "kda_state": kda, "dsa_cache": dsa, "distinct_experts": distinct}


def floor_seconds(num_bytes: int, bytes_per_s: float) -> float:
    """The time floor of moving `num_bytes` at `bytes_per_s`."""
    return num_bytes / bytes_per_s
