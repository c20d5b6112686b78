"""Running a test function on N CPU processes joined by gloo, as torchrun would start them."""

from __future__ import annotations

import io
import os
import queue
import socket
import traceback

import torch
import torch.multiprocessing as mp

TP_TEXT_OVERRIDES = {
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "intermediate_size": 512,
    "moe_intermediate_size": 512,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "index_head_dim": 128,
}
"""The small model resized so 2 and 4 ranks split every FP8 weight on 128-wide scale-block boundaries
(4 heads of each kind, widths of 512): KDA layers 0-2, a DSA layer 3, a dense layer 0, MoE 1-3."""

TIMEOUT_S = 600
"""How long the parent waits for every rank before it calls the run hung."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, size: int, port: int, fn, args: tuple, results) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), LOCAL_WORLD_SIZE=str(size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        # By value: tensors sent as themselves are fetched from the sender, which may have exited by then.
        buf = io.BytesIO()
        torch.save(fn(rank, size, *args), buf)
        results.put((rank, "ok", buf.getvalue()))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(size: int, fn, *args) -> list:
    """`fn(rank, size, *args)` on `size` spawned processes with torchrun's environment; the results
    in rank order. A rank's exception fails the call with its traceback."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, size, port, fn, args, results), daemon=True) for r in range(size)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    try:
        for _ in range(size):
            rank, status, value = results.get(timeout=TIMEOUT_S)
            if status == "error":
                raise AssertionError(f"rank {rank} of {size} failed:\n{value}")
            out[rank] = torch.load(io.BytesIO(value), weights_only=False)
    except queue.Empty:
        raise AssertionError(f"ranks {sorted(set(range(size)) - set(out))} of {size} hung") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(size)]
